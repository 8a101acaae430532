"""The contract every kernel op follows, and the one rule that picks its implementation.

An op (``decode_attention``, ``sparse_index``, ``routed_experts``, ...) is a folder with

* ``reference.py``: the float32 jnp implementation, the op's semantics and its ``"xla"`` path;
* ``mosaic_gpu.py``: the Pallas Mosaic GPU kernel, a frozen validated ``TuningConfig``,
  ``default_config(...)`` (the heuristic used when ``config=None``) and
  ``unsupported_reason(..., config) -> str | None`` (why the kernel cannot serve these inputs);
* ``api.py``: the public function. It checks the host-side arguments (shapes, dtypes, Python
  numbers) with a ``ValueError`` naming the argument, then calls ``KernelOp.__call__``. The
  implementations it dispatches to are ``jax.jit``-compiled with their static arguments; the
  public function itself is not, so its checks run eagerly and before any compilation.

Backends are named ``<op>_reference`` and ``<op>_mosaic_gpu``. The choice rule (``KernelOp``):

* ``impl="xla"``: the reference;
* ``impl="pallas"``: the kernel, or a ``ValueError`` saying why it cannot serve the inputs;
* ``impl="auto"``: the kernel on a Hopper GPU (compute capability 9.x) or with
  ``interpret=True`` when it can serve the inputs, the reference otherwise.

``interpret=True`` runs the kernel through Pallas' GPU interpreter on any backend, with an
``InterpretPoolWarning`` where XLA's CPU thread pool may be too small for it
(``interpret_pool_threads``).
Kernels that size their grid from the GPU read the SM count through ``num_sms``: a
``TuningConfig.num_sms`` when given (tests use small ones), else the device's.
"""

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax

Impl = Literal["auto", "pallas", "xla"]
IMPLS = ("auto", "pallas", "xla")
# The SM count of an H100 / H200 SXM, used where no GPU can be asked (GPU interpret mode).
HOPPER_NUM_SMS = 132
# GPU interpret mode runs each simulated warpgroup (and each warp of a warp region) as a host
# thread executing its own XLA program, whose callbacks, barrier waits among them, run on the CPU
# client's intra-op thread pool. When waiting threads hold every pool thread, the one that would
# release them gets none and the kernel hangs. The pool has one thread per core unless
# `PJRT_NPROC` sizes it (`interpret_pool_threads`): pinned to one core, two of the
# decode-attention two-warpgroup cases hung in 7 of 8 runs, and in none of 8 with 8 threads. Our
# kernels block at most 8 at once (the launching callback, two consumer warpgroups, a producer and
# its four warps).
INTERPRET_POOL_THREADS = 16


class InterpretPoolWarning(UserWarning):
  """GPU interpret mode with fewer CPU pool threads than ``INTERPRET_POOL_THREADS``."""


@functools.cache
def is_hopper_gpu() -> bool:
  """True when the default device is an NVIDIA GPU of compute capability 9.x."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", "")
  return str(capability).startswith("9")


@functools.cache
def device_num_sms() -> int:
  """Streaming multiprocessors of the default GPU; an H100/H200's 132 on other backends."""
  device = jax.devices()[0]
  if device.platform == "gpu":
    return int(device.core_count)
  return HOPPER_NUM_SMS


@functools.cache
def gpu_device_kind() -> str | None:
  """The default GPU's ``device_kind`` (e.g. "NVIDIA H100 80GB HBM3"); None on other backends."""
  device = jax.devices()[0]
  return device.device_kind if device.platform == "gpu" else None


def num_sms(config_value: int | None) -> int:
  """A config's ``num_sms`` when set, else the device's (see ``device_num_sms``)."""
  return device_num_sms() if config_value is None else config_value


def interpret_pool_threads() -> int:
  """The threads of XLA's CPU intra-op pool as XLA sizes it when the CPU backend starts:
  ``PJRT_NPROC``, else ``NPROC``, when set to an integer, else the cores this process may use.
  Read from the environment now, so a variable changed after jax started is not seen."""
  for name in ("PJRT_NPROC", "NPROC"):
    try:
      return max(0, int(os.environ[name]))
    except (KeyError, ValueError):
      continue
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def warn_if_interpret_pool_small() -> None:
  """``InterpretPoolWarning`` when ``interpret_pool_threads`` is below
  ``INTERPRET_POOL_THREADS``, saying how to raise it."""
  threads = interpret_pool_threads()
  if threads < INTERPRET_POOL_THREADS:
    warnings.warn(
      f"GPU interpret mode with {threads} threads in XLA's CPU pool: a kernel whose simulated "
      "warpgroups wait at barriers can hold them all and hang. Start Python with "
      f"PJRT_NPROC={INTERPRET_POOL_THREADS} (read when jax starts its CPU backend).",
      InterpretPoolWarning,
      stacklevel=4,
    )


def check_impl(impl: str, interpret: bool) -> None:
  """``ValueError`` for an ``impl`` name or ``interpret`` flag of the wrong kind."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if not isinstance(interpret, bool):
    raise ValueError(f"interpret must be a bool, got {interpret!r}")


def resolve_impl(impl: str, interpret: bool) -> Literal["pallas", "xla"]:
  """The backend ``impl`` asks for before looking at the inputs: "pallas" or "xla"."""
  check_impl(impl, interpret)
  if impl == "auto":
    return "pallas" if (interpret or is_hopper_gpu()) else "xla"
  return impl


def validate_config_fields(config: Any, positive: tuple[str, ...] = ()) -> None:
  """Shared ``TuningConfig`` checks: ``num_sms`` (when the config has it) and the fields named
  in ``positive`` are positive ints (``None`` allowed where the field defaults to ``None``)."""
  names = positive + (("num_sms",) if hasattr(config, "num_sms") else ())
  for name in names:
    value = getattr(config, name)
    default = next(f.default for f in dataclasses.fields(config) if f.name == name)
    if value is None and default is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KernelOp:
  """One op's implementations and the rule that chooses between them.

  Attributes:
    name: the public function's name, used in error messages.
    reference: ``reference(*arrays, **static)``, the float32 jnp implementation (jitted).
    kernel: ``kernel(*arrays, config=..., interpret=..., **static)``, the Mosaic GPU one (jitted).
    default_config: ``default_config(*arrays, **static) -> TuningConfig`` for ``config=None``.
    unsupported_reason: ``unsupported_reason(*arrays, config=..., **static) -> str | None``.
  """

  name: str
  reference: Callable[..., Any]
  kernel: Callable[..., Any]
  default_config: Callable[..., Any]
  unsupported_reason: Callable[..., str | None]

  @property
  def backend_names(self) -> tuple[str, str]:
    """The names the two jitted implementations carry in a traced program."""
    return (self.reference.__name__, self.kernel.__name__)

  def __call__(self, *arrays, impl: str, interpret: bool, config=None, **static):
    if resolve_impl(impl, interpret) == "pallas":
      if config is None:
        config = self.default_config(*arrays, **static)
      reason = self.unsupported_reason(*arrays, config=config, **static)
      if reason is None:
        if interpret:
          warn_if_interpret_pool_small()
        return self.kernel(*arrays, config=config, interpret=interpret, **static)
      if impl == "pallas":
        raise ValueError(f"{self.name}: impl='pallas' cannot serve these inputs: {reason}")
    return self.reference(*arrays, **static)
