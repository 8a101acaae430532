"""The MoE benchmark's markdown report, rendered from a committed GPU run's results."""

import json
import pathlib

import pytest

from benchmarks.bench_moe import render_markdown

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


def test_breakdown_sets_the_timed_programs_kernels_beside_the_tables_time(results):
  (entry,) = [e for e in results["breakdown"] if e["tokens"] == 8192]
  (row,) = [r for r in results["rows"] if (r["shape"], r["tokens"]) == ("GLM-4.5-Air", 8192)]
  # That run predates the timed program's profile: its cell says so.
  assert breakdown_cells(results, entry)[6:] == ["n/a", f"{row['ours']['us']:.0f}"]
  profiled = {**entry, "timed_program": {"calls": 2, "kernels_us_per_call": 4321.4}}
  assert breakdown_cells(results, profiled)[6:] == ["4321", f"{row['ours']['us']:.0f}"]


def breakdown_cells(results, entry) -> list[str]:
  """The cells of ``entry``'s row in the breakdown table rendered beside ``results``' rows."""
  text = render_markdown(results["meta"], results["rows"], [entry], [])
  table = text.split("## Where the time goes", 1)[1]
  prefix = f"| {entry['shape']} | {entry['tokens']} | "
  (line,) = [line for line in table.splitlines() if line.startswith(prefix)]
  return [cell.strip() for cell in line.strip("|").split("|")]
