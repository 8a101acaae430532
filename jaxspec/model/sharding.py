"""Tensor and expert parallelism over a `jax.sharding.Mesh` of axes ("ep", "tp").

Every module declares, for each of its parameters, one *logical* axis name per dimension
(`param_axes`: e.g. a query projection kernel is `(None, "heads")`); the attention modules declare
their pages the same way (`GqaPages.axes`). `sharding_rules` maps logical axes to mesh axes for
one model on one mesh, the way vLLM shards GLM:

| logical axis | what | mesh axis |
|---|---|---|
| `heads` | query heads (q/o projections, MLA's per-head expansions) | tp |
| `kv_heads` | key/value heads and the paged KV cache | tp, or replicated when tp > Hkv |
| `mlp` | intermediate dimension of the dense MLP and the shared experts | tp |
| `vocab` | embedding rows and lm-head columns | tp |
| `experts` | routed experts | ep |
| `expert_mlp` | intermediate dimension inside a routed expert | tp |

Everything else (norms, routers, MLA's latent projections, the DSA indexer, the latent cache) is
replicated, as vLLM does for MLA under TP. XLA's SPMD partitioner places the collectives of the
dense layers (an all-reduce after the o projection and after each down projection); the Pallas
kernels, which XLA cannot partition, run per shard under `jax.shard_map` (attention over `tp`,
the routed experts over both axes with one `psum`).
"""

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("ep", "tp")
LOGICAL_AXES = ("heads", "kv_heads", "mlp", "vocab", "experts", "expert_mlp")


def make_mesh(tp: int = 1, ep: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh of axes ("ep", "tp") over the first `tp * ep` devices (or `devices`).

  Devices of one `tp` group are neighbours in the device list, so on one host the tensor
  parallel all-reduces stay between adjacent GPUs.
  """
  for name, value in (("tp", tp), ("ep", ep)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  available = list(jax.devices() if devices is None else devices)
  if tp * ep > len(available):
    raise ValueError(
      f"tp * ep = {tp} * {ep} = {tp * ep} devices needed, but only {len(available)} are available"
    )
  grid = np.array(available[: tp * ep], dtype=object).reshape(ep, tp)
  return Mesh(grid, MESH_AXES)


def axis_size(mesh: Mesh | None, axis: str) -> int:
  """Size of mesh axis `axis`; 1 without a mesh."""
  return 1 if mesh is None else mesh.shape[axis]


def sharding_rules(config, mesh: Mesh) -> dict[str, str | None]:
  """Logical axis -> mesh axis for `config` on `mesh`; a shape the mesh cannot split is a
  `ValueError` naming the field."""
  if tuple(mesh.axis_names) != MESH_AXES:
    raise ValueError(
      f"the mesh must have axes {MESH_AXES} (jaxspec.make_mesh), got {mesh.axis_names}"
    )
  tp, ep = mesh.shape["tp"], mesh.shape["ep"]

  def divides(field: str, size: int, axis: str, count: int) -> None:
    if size % count:
      raise ValueError(
        f"{axis} = {count} does not divide {field} = {size}: choose {axis} among the divisors "
        f"of {size}"
      )

  divides("num_attention_heads", config.num_attention_heads, "tp", tp)
  divides("vocab_size", config.vocab_size, "tp", tp)
  divides("intermediate_size", config.intermediate_size, "tp", tp)
  if config.has_moe:
    divides("n_routed_experts", config.n_routed_experts, "ep", ep)
    divides("moe_intermediate_size", config.moe_intermediate_size, "tp", tp)
  elif ep > 1:
    raise ValueError(f"ep = {ep} needs a model with routed experts")
  kv_heads = getattr(config, "num_key_value_heads", None)
  if config.attention_kind == "gqa" and tp > kv_heads:
    # More ranks than KV heads: every rank keeps all KV heads (vLLM replicates them).
    divides("tp", tp, "num_key_value_heads", kv_heads)
    kv_rule = None
  else:
    divides("num_key_value_heads", kv_heads, "tp", tp)
    kv_rule = "tp"
  return {
    "heads": "tp",
    "kv_heads": kv_rule if config.attention_kind == "gqa" else None,
    "mlp": "tp",
    "vocab": "tp",
    "experts": "ep",
    "expert_mlp": "tp",
  }


def logical_to_spec(axes: Sequence[str | None], rules: dict[str, str | None]) -> PartitionSpec:
  """A parameter's logical axes -> its `PartitionSpec` under `rules`."""
  return PartitionSpec(*(None if name is None else rules[name] for name in axes))


def param_axes(model: nnx.Module) -> dict[tuple, tuple]:
  """Logical axes of every parameter that declares them, by NNX path (others: replicated)."""
  axes = {}
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    for name, names in getattr(node, "param_axes", ()):
      axes[(*path, name)] = names
  return axes


def param_specs(model: nnx.Module, rules: dict[str, str | None]) -> dict[tuple, PartitionSpec]:
  """`PartitionSpec` of every parameter of `model` (concrete or abstract), by NNX path."""
  declared = param_axes(model)
  specs = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = declared.get(path, (None,) * len(variable.shape))
    if len(names) != len(variable.shape):
      raise ValueError(f"parameter {path} declares axes {names} for shape {variable.shape}")
    specs[path] = logical_to_spec(names, rules)
  return specs


def sharding_for(model: nnx.Module, mesh: Mesh):
  """`(param path, shape) -> NamedSharding` for `load_pretrained(..., sharding_for=...)`."""
  specs = param_specs(model, sharding_rules(model.config, mesh))

  def rule(path: tuple, shape: tuple) -> NamedSharding:
    del shape
    return NamedSharding(mesh, specs[tuple(path)])

  return rule


def shard_state(state: nnx.State, specs: dict[tuple, PartitionSpec], mesh: Mesh) -> nnx.State:
  """Places each parameter of `state` on `mesh` by `specs`."""
  flat = []
  for path, variable in nnx.to_flat_state(state):
    sharding = NamedSharding(mesh, specs.get(path, PartitionSpec()))
    flat.append((path, variable.replace(jax.device_put(variable.get_value(), sharding))))
  return nnx.from_flat_state(flat)


def cache_shardings(cache, config, mesh: Mesh):
  """`NamedSharding`s of a `ModelCache` (concrete or abstract): each page pytree's arrays by its
  class's logical `axes` (GQA pages by KV head; MLA latent pages replicated)."""
  rules = sharding_rules(config, mesh)

  def pages_sharding(pages):
    spec = logical_to_spec(getattr(type(pages), "axes", ()), rules)
    return jax.tree.map(lambda _: NamedSharding(mesh, spec), pages)

  return jax.tree.map(
    pages_sharding, cache, is_leaf=lambda node: hasattr(node, "num_pages") and node is not cache
  )


def init_sharded(config, mesh: Mesh, *, dtype, seed: int = 0, **model_kwargs):
  """A `GlmForCausalLM` with random weights created directly in their shards on `mesh`: no
  device ever holds more than its own slices (for models larger than one device)."""
  from jaxspec.model.transformer import GlmForCausalLM  # the model imports this module

  def build():
    return GlmForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed), mesh=mesh, **model_kwargs)

  graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
  specs = param_specs(nnx.merge(graphdef, abstract_state), sharding_rules(config, mesh))
  flat = nnx.to_flat_state(abstract_state)
  out_shardings = nnx.from_flat_state(
    [(path, variable.replace(NamedSharding(mesh, specs[path]))) for path, variable in flat]
  )
  state = jax.jit(lambda: nnx.state(build()), out_shardings=out_shardings)()
  return nnx.merge(graphdef, state)
