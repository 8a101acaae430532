"""A model split for the step functions' `jit` boundary, cheap to pass on every call.

`jit` hashes its static arguments and flattens its array arguments on every call, before it
finds the compiled program. A flax `nnx.GraphDef` hashes its whole node tree each time and an
`nnx.State` flattens with its keys sorted; measured on one CPU core for GLM-4.5-Air's module
tree (random weights never needed: `nnx.eval_shape`):

| layers | hash(GraphDef) | flatten(State) |
|---|---|---|
| 4 (the embedded default model) | 0.81 ms | 0.17 ms |
| 8 | 0.71 ms | 0.16 ms |
| 46 | 4.17 ms | 0.83 ms |

That is per step and per jit call, on the host, more than an H200 takes for a batch-1 decode
step of the small models. `split_model` pays both once: the static half, `ModelGraph`, hashes
once and compares by identity first, and the params travel as a flat list of arrays, which
`jit` flattens in C++.
"""

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True, eq=False)
class ModelGraph:
  """The static half of a split model: the module graph and its params' tree structure.

  Hashable and comparable at the cost of one attribute read (the hash is computed once), so it
  can be a static `jit` argument of every step. `merge(params)` rebuilds the module from the
  flat params list that `split_model` returned (or any list of arrays of the same structure,
  abstract ones included).
  """

  graphdef: nnx.GraphDef
  treedef: Any  # jax PyTreeDef of the params' nnx.State

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.graphdef, self.treedef))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    if self is other:
      return True
    if not isinstance(other, ModelGraph) or hash(self) != hash(other):
      return False
    return self.treedef == other.treedef and self.graphdef == other.graphdef

  @property
  def num_params(self) -> int:
    """Length of the flat params list."""
    return self.treedef.num_leaves

  def merge(self, params) -> nnx.Module:
    """The module with `params` (a list of `num_params` arrays) as its state."""
    if len(params) != self.num_params:
      raise ValueError(f"params must be a list of {self.num_params} arrays, got {len(params)}")
    return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))


def split_model(model: nnx.Module) -> tuple[ModelGraph, list[jax.Array]]:
  """`(graph, params)`: `nnx.split` with the state flattened once; `graph.merge(params)` undoes
  it. Array shardings are kept."""
  graphdef, state = nnx.split(model)
  params, treedef = jax.tree.flatten(state)
  return ModelGraph(graphdef, treedef), params
