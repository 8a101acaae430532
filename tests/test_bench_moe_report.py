"""The MoE benchmark's markdown report, rendered from a committed GPU run's results, the clock
log its breakdown keeps, and its A/B of two versions of the kernels' module."""

import dataclasses
import json
import pathlib
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from benchmarks import bench_moe
from benchmarks._modules import load_module
from benchmarks._timing import ClockLog, summarize_clock_samples
from benchmarks.bench_moe import (
  DTYPE,
  SHAPES,
  Layer,
  against,
  estimated_limit,
  layer_flops,
  make_layer,
  render_markdown,
)
from jaxspec.kernels.dispatch import device_num_sms
from jaxspec.kernels.routed_experts import mosaic_gpu

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture
def results():
  """An H100 run of version 10 whose breakdown has four memory parts at 8192 tokens."""
  return json.loads((RESULTS / "moe_h100_2026-12-07_version_10.json").read_text())


def test_breakdown_counts_the_xla_kernels_beside_every_memory_part(results):
  # At 8192 tokens the call runs four memory parts: 4 gate/up and 4 down kernels of ours and 34
  # XLA kernels, 42 in all (an H100 run's CUPTI list).
  (entry,) = [e for e in results["breakdown"] if e["tokens"] == 8192]
  names = [name for name, _ in entry["kernels_us"]]
  assert len(names) == 42
  assert sum(name.startswith("routed_experts_gate_up") for name in names) == 4
  assert sum(name.startswith("routed_experts_down") for name in names) == 4

  cells = breakdown_cells(results, entry)
  gate_up, down, xla, total = float(cells[2]), float(cells[3]), cells[4], float(cells[5])
  xla_us, count = xla.split(" ")
  assert count == "(34)"
  assert abs(gate_up + down + float(xla_us) - total) <= 1.5  # each cell rounded to 1 us
  assert total == round(sum(t for _, t in entry["kernels_us"]))


def test_breakdown_sets_the_timed_programs_kernels_and_clock_beside_the_tables_time(results):
  (entry,) = [e for e in results["breakdown"] if e["tokens"] == 8192]
  (row,) = [r for r in results["rows"] if (r["shape"], r["tokens"]) == ("GLM-4.5-Air", 8192)]
  table_us = f"{row['ours']['us']:.0f}"
  # That run predates the timed program's profile and its clock: the cells say so.
  assert breakdown_cells(results, entry)[6:] == ["n/a", "n/a", table_us]
  program = {"calls": 2, "launches": 47, "kernels_us_per_call": 4321.4, "sm_clock": None}
  profiled = {**entry, "timed_program": program}
  assert breakdown_cells(results, profiled)[6:] == ["4321", "n/a", table_us]
  clock = summarize_clock_samples(["1980, 640.0, 0x0", "1500, 700.0, 0x4", "1110, 699.0, 0x4"])
  clocked = {**entry, "timed_program": {**program, "sm_clock": dataclasses.asdict(clock)}}
  assert breakdown_cells(results, clocked)[6:] == ["4321", "1530 (1110-1980; 67% capped)", table_us]


def test_the_limit_is_the_matmul_rate_at_8192_tokens_and_the_weights_at_2048():
  num_experts, hidden, intermediate = SHAPES["GLM-4.5-Air"]
  shapes = [(num_experts, hidden, intermediate)] * 2 + [(num_experts, intermediate, hidden)]
  layer = Layer("GLM-4.5-Air", *[jax.ShapeDtypeStruct(shape, DTYPE) for shape in shapes])
  ceilings = {"read_tbps": 3.24, "matmul_tflops": 686.0}
  seconds, bound = estimated_limit(layer, 8192, ceilings)
  assert bound == "compute"
  assert seconds == pytest.approx(layer_flops(layer, 8192) / 686e12)  # 3.30 ms
  seconds, bound = estimated_limit(layer, 2048, ceilings)
  assert bound == "memory"  # all 128 experts touched but for a 1e-7 chance
  assert seconds == pytest.approx(128 * layer.expert_bytes / 3.24e12, rel=1e-6)


def test_the_sustained_matmul_is_reported_beside_the_tables_time(results):
  (entry,) = [e for e in results["breakdown"] if e["tokens"] == 8192]
  (row,) = [r for r in results["rows"] if (r["shape"], r["tokens"]) == ("GLM-4.5-Air", 8192)]
  clock = summarize_clock_samples(["1600, 700.0, 0x4", "1700, 690.0, 0x0"])
  matmul = {"matmuls_per_launch": 5, "launches": 47, "tflops": 601.4, "limit_us": 3771.2}
  clocked = {**entry, "sustained_matmul": {**matmul, "sm_clock": dataclasses.asdict(clock)}}
  text = render_markdown(results["meta"], results["rows"], [clocked], [])
  ceiling = results["meta"]["ceilings"]["matmul_tflops"]
  assert (
    "- GLM-4.5-Air, 8192 tokens: bf16 matmuls run as long a load (47 launches of 5) reached "
    "601 TFLOP/s at an SM clock of 1650 (1600-1700; 50% capped) MHz (the table's ceiling: "
    f"{ceiling:.0f}); the limit at that rate is 3771 us; the table's "
    f"{row['ours']['us']:.0f} us is {row['ours']['us'] / 3771.2:.2f}x it."
  ) in text
  unclocked = {**entry, "sustained_matmul": {**matmul, "sm_clock": None}}
  text = render_markdown(results["meta"], results["rows"], [unclocked], [])
  assert "reached 601 TFLOP/s (the table's ceiling" in text
  # No sustained matmul (a row bound by memory, or an older run): no such section.
  plain = render_markdown(results["meta"], results["rows"], [entry], [])
  assert "under a sustained load" not in plain


def test_clock_samples_are_summarised_and_unparsable_lines_skipped():
  lines = [
    "1980, 647.95, 0x0000000000000000",
    "[N/A], 700.1, 0x4",
    "1500, 701.00, 0x000000000000000C",
  ]
  lines += ["Failed to initialize NVML", ""]
  summary = summarize_clock_samples(lines)
  assert summary.samples == 2
  assert (summary.sm_mhz_mean, summary.sm_mhz_min, summary.sm_mhz_max) == (1740, 1500, 1980)
  assert summary.power_w_mean == pytest.approx((647.95 + 701.0) / 2)
  assert summary.power_capped_share == 0.5  # 0xC: power cap and a hardware slowdown
  assert summarize_clock_samples(lines[-2:]) is None


def test_clock_log_reads_what_nvidia_smi_prints_and_stops_it(tmp_path, monkeypatch):
  # A stand-in nvidia-smi: prints two samples, marks that it did, then keeps sampling (sleeping)
  # until terminated. The block waits for the mark, not for a fixed time.
  fake, printed = tmp_path / "nvidia-smi", tmp_path / "printed"
  samples = "echo '1800, 690.5, 0x4'\necho '1980, 600.0, 0x0'\n"
  fake.write_text(f"#!/bin/sh\n{samples}: > {printed}\nexec {shutil.which('sleep')} 60\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  with ClockLog() as clocks:
    deadline = time.monotonic() + 30
    while not printed.exists() and time.monotonic() < deadline:
      time.sleep(0.01)
  assert clocks.summary() == summarize_clock_samples(["1800, 690.5, 0x4", "1980, 600.0, 0x0"])
  assert clocks._process.returncode == -signal.SIGTERM  # still sampling, stopped by the block's end


def test_clock_log_starts_its_block_after_the_first_sample(tmp_path, monkeypatch):
  # A stand-in nvidia-smi that takes a second to print its first sample, then samples (sleeps)
  # until terminated: an empty block still ends with that sample.
  sleep = shutil.which("sleep")
  fake = tmp_path / "nvidia-smi"
  fake.write_text(f"#!/bin/sh\n{sleep} 1\necho '1500, 700.0, 0x4'\nexec {sleep} 60\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  with ClockLog() as clocks:
    pass
  assert clocks.summary() == summarize_clock_samples(["1500, 700.0, 0x4"])


def test_clock_log_gives_up_waiting_for_a_silent_sampler(tmp_path, monkeypatch):
  fake = tmp_path / "nvidia-smi"
  fake.write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 60\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  started = time.monotonic()
  with ClockLog(start_timeout_s=0.3) as clocks:
    pass
  assert time.monotonic() - started < 10
  assert clocks.summary() is None
  assert clocks._process.returncode == -signal.SIGTERM


def test_clock_log_without_nvidia_smi_gives_no_summary(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  with ClockLog() as clocks:
    pass
  assert clocks.summary() is None


def breakdown_cells(results, entry) -> list[str]:
  """The cells of ``entry``'s row in the breakdown table rendered beside ``results``' rows."""
  text = render_markdown(results["meta"], results["rows"], [entry], [])
  table = text.split("## Where the time goes", 1)[1]
  prefix = f"| {entry['shape']} | {entry['tokens']} | "
  (line,) = [line for line in table.splitlines() if line.startswith(prefix)]
  return [cell.strip() for cell in line.strip("|").split("|")]


DOUBLED_MODULE = """
from jaxspec.kernels.routed_experts.mosaic_gpu import *  # noqa: F403
from jaxspec.kernels.routed_experts import mosaic_gpu as installed


def routed_experts_mosaic_gpu(*args, **kwargs):
  return installed.routed_experts_mosaic_gpu(*args, **kwargs) * 2
"""


@pytest.mark.parametrize("doubled", [False, True])
def test_against_tells_equal_modules_from_different_ones_in_interpret_mode(
  tmp_path, results, doubled
):
  path = pathlib.Path(mosaic_gpu.__file__)
  if doubled:  # the installed kernels with every output doubled
    path = tmp_path / "doubled.py"
    path.write_text(DOUBLED_MODULE)
  layer = make_layer("tiny", 8, 128, 128)
  comparisons, saved = [], []
  against(
    np.random.default_rng(0),
    layer,
    load_module(str(path), mosaic_gpu),
    (5,),
    comparisons,
    lambda: saved.append(len(comparisons)),
    smoke=True,
  )
  (entry,) = comparisons
  assert saved == [1]
  assert entry["bitwise_equal"] is not doubled
  assert entry["intermediate"] == 128 and entry["configs"]["baseline"] == entry["configs"]["ours"]
  assert [len(times) for times in entry["layer_us"].values()] == [1, 1]
  meta = {**results["meta"], "against": path.name}
  text = render_markdown(meta, [], [], [], comparisons)
  assert f"| tiny | 5 | 128 | {'NO' if doubled else 'yes'} |" in text


def test_against_refuses_a_shape_the_kernels_cannot_serve_before_compiling():
  layer = make_layer("tiny", 8, 128, 96)  # I = 96: no multiple of the 64-wide K block
  with pytest.raises(ValueError, match=r"the baseline module cannot serve tiny \(I = 96\)"):
    against(np.random.default_rng(0), layer, mosaic_gpu, (5,), [], lambda: None, smoke=True)


@pytest.mark.parametrize(
  ("argv", "message"),
  [
    (["--intermediate", "256"], "--intermediate needs --against"),
    (["--against", "missing.py"], "--against: no file missing.py"),
    (["--against", __file__, "--crossover"], "--against runs alone"),
  ],
)
def test_against_options_are_checked_before_any_work(monkeypatch, capsys, argv, message):
  monkeypatch.setattr("sys.argv", ["bench_moe.py", "--smoke", *argv])
  with pytest.raises(SystemExit):
    bench_moe.main()
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("num_tokens", [64, 2048])
def test_every_tuning_config_serves_glm_4_5_air(num_tokens):
  experts, hidden, intermediate = SHAPES["GLM-4.5-Air"]
  w = jax.ShapeDtypeStruct((experts, hidden, intermediate), DTYPE)
  for config in bench_moe.tuning_configs(num_tokens):
    assert mosaic_gpu.unsupported_reason(None, None, None, w, w, None, config=config) is None


@pytest.mark.parametrize(("num_tokens", "gathers"), [(64, None), (2048, True), (8192, False)])
def test_the_sweep_times_the_default_with_and_without_the_in_kernel_gather(num_tokens, gathers):
  default = mosaic_gpu.default_config(num_tokens, 8, *SHAPES["GLM-4.5-Air"])
  configs = bench_moe.sweep_configs(num_tokens, default)
  assert configs[0] == default and len(configs) == len(set(configs))
  if gathers is None:  # one warpgroup at decode sizes: nothing to toggle
    assert not any(c.gather_in_kernel for c in configs)
  else:
    assert default.gather_in_kernel is gathers
    assert configs[1] == dataclasses.replace(default, gather_in_kernel=not gathers)


def test_the_sweep_tries_one_warpgroup_kernels_at_one_and_two_ctas_an_sm(results):
  pair = [c for c in bench_moe.tuning_configs(2048) if c.num_sms is not None]
  assert [c.num_sms for c in pair] == [device_num_sms(), 2 * device_num_sms()]
  assert dataclasses.replace(pair[0], num_sms=None) == dataclasses.replace(pair[1], num_sms=None)
  entries = [
    {"shape": "GLM-4.5-Air", "tokens": 2048, "config": dataclasses.asdict(c), "us": 1.0}
    for c in pair
  ]
  text = render_markdown(results["meta"], [], [], entries)
  assert f"num_sms={2 * device_num_sms()}" in text and f"num_sms={device_num_sms()}" in text
