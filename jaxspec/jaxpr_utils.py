"""Reading traced programs: counting calls of a jitted function inside a step's jaxpr."""

from jax.extend.core import Jaxpr


def count_calls(jaxpr: Jaxpr, names: str | tuple[str, ...]) -> int:
  """Calls of the jitted function(s) `names` anywhere in `jaxpr`, nested jaxprs included.

  A `jax.jit` function called inside a traced step shows up as one `jit` (`pjit`) equation named
  after it, whatever its body lowers to; e.g. the index conversions of a decode step, counted
  through the names of the op's backends (`KernelOp.backend_names`).
  """
  names = (names,) if isinstance(names, str) else tuple(names)
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in names:
      count += 1
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, Jaxpr):
          count += count_calls(item, names)
  return count
