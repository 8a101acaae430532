"""The step-floor probe's command line: its options, and a clear refusal of anything else."""

import importlib.util
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def probe(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))  # the probe imports its bench as a sibling
  path = BENCHMARKS / "probe_step_floor.py"
  spec = importlib.util.spec_from_file_location("probe_step_floor", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_probe_options_and_their_defaults(probe, monkeypatch, tmp_path):
  monkeypatch.setenv("OUT", str(tmp_path))
  assert vars(probe.parse_args([])) == {"no_flashinfer": False, "out": str(tmp_path)}
  args = probe.parse_args(["--no-flashinfer", "--out", "elsewhere"])
  assert (args.no_flashinfer, args.out) == (True, "elsewhere")


def test_probe_refuses_an_unknown_option(probe, capsys):
  with pytest.raises(SystemExit) as exit_info:
    probe.parse_args(["--pool", "128"])
  assert exit_info.value.code == 2
  assert "unrecognized arguments: --pool 128" in capsys.readouterr().err
