"""Choosing between a kernel's Pallas and XLA implementations.

Every op's ``api.py`` takes ``impl`` in {"auto", "pallas", "xla"}:
``"auto"`` runs the Pallas Mosaic GPU kernel on a Hopper GPU (compute
capability 9.x) and the XLA reference everywhere else; ``interpret=True``
runs the Pallas kernel through the GPU interpreter on any backend.
"""

import functools
from typing import Literal

import jax

Impl = Literal["auto", "pallas", "xla"]
IMPLS = ("auto", "pallas", "xla")


@functools.cache
def is_hopper_gpu() -> bool:
  """True when the default device is an NVIDIA GPU of compute capability 9.x."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", "")
  return str(capability).startswith("9")


def resolve_impl(impl: str, interpret: bool) -> Literal["pallas", "xla"]:
  """Turns ``impl`` into "pallas" or "xla"; a bad name is a ``ValueError``."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl == "auto":
    return "pallas" if (interpret or is_hopper_gpu()) else "xla"
  return impl
