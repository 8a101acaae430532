"""KernelOp's warning for GPU interpret mode on a small CPU thread pool."""

import warnings

import pytest

from jaxspec.kernels import dispatch
from jaxspec.kernels.dispatch import InterpretPoolWarning, KernelOp


def _op(unsupported: str | None = None) -> tuple[KernelOp, list[str]]:
  """A KernelOp whose implementations record which one ran."""
  ran = []
  op = KernelOp(
    name="stub",
    reference=lambda x: ran.append("reference") or x,
    kernel=lambda x, *, config, interpret: ran.append("kernel") or x,
    default_config=lambda x: "config",
    unsupported_reason=lambda x, *, config: unsupported,
  )
  return op, ran


@pytest.fixture
def pool(monkeypatch):
  """`pool(n)`: the environment XLA would size its CPU pool from says `n` threads."""

  def set_threads(threads):
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", str(threads))

  return set_threads


def test_pool_threads_follow_xlas_precedence(monkeypatch):
  monkeypatch.setenv("PJRT_NPROC", "3")
  monkeypatch.setenv("NPROC", "5")
  assert dispatch.interpret_pool_threads() == 3
  monkeypatch.setenv("PJRT_NPROC", "many")  # not an integer: XLA goes on to NPROC
  assert dispatch.interpret_pool_threads() == 5
  monkeypatch.delenv("PJRT_NPROC")
  monkeypatch.delenv("NPROC")
  monkeypatch.setattr(dispatch.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
  assert dispatch.interpret_pool_threads() == 2


def test_interpreted_kernel_on_a_small_pool_warns_how_to_size_it(pool):
  pool(dispatch.INTERPRET_POOL_THREADS - 1)
  op, ran = _op()
  with pytest.warns(InterpretPoolWarning, match=f"PJRT_NPROC={dispatch.INTERPRET_POOL_THREADS}"):
    op(1, impl="pallas", interpret=True)
  assert ran == ["kernel"]


@pytest.mark.parametrize(
  "threads, impl, interpret, unsupported, runs",
  [
    (dispatch.INTERPRET_POOL_THREADS, "pallas", True, None, "kernel"),  # pool large enough
    (2, "xla", False, None, "reference"),  # nothing interpreted
    (2, "auto", True, "shape", "reference"),  # the kernel cannot serve: nothing interpreted
  ],
)
def test_no_warning_unless_an_interpreted_kernel_runs_on_a_small_pool(
  pool, threads, impl, interpret, unsupported, runs
):
  pool(threads)
  op, ran = _op(unsupported)
  with warnings.catch_warnings():
    warnings.simplefilter("error", InterpretPoolWarning)
    op(1, impl=impl, interpret=interpret)
  assert ran == [runs]
