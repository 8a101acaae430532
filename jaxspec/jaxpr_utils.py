"""Reading traced programs: counting calls of a jitted function inside a step's jaxpr."""

from jax.extend.core import Jaxpr


def count_calls(jaxpr: Jaxpr, name: str) -> int:
  """Calls of the jitted function `name` anywhere in `jaxpr`, nested jaxprs included.

  A `jax.jit` function called inside a traced step shows up as one `jit` (`pjit`) equation named
  after it, whatever its body lowers to; e.g. the index conversions of a decode step.
  """
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == name:
      count += 1
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, Jaxpr):
          count += count_calls(item, name)
  return count
