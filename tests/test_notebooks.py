"""Executes every notebook in notebooks/ on the CPU and checks that it tells its whole story.

Each notebook checks its own claims with `assert`s (kernels against NumPy references, greedy
speculative output against plain greedy), so a wrong kernel or a broken serving path fails
here. The kernel runs the interpreter of this test run (the `python3` kernel spec of the
virtualenv's ipykernel) with the repository on its path; nothing is written back to the
notebooks.
"""

import os
import sys
import time
from pathlib import Path

import ipykernel  # noqa: F401  (the notebooks' kernel; part of the `notebooks` extra)
import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 240
NOTEBOOK_BUDGET_S = 120  # each runs in well under a minute on a 2-core CPU; margin for load

# Text each notebook must print: the results of its key cells.
EXPECTED_OUTPUT = {
  "01_packed_row_decode_attention": [
    "G * q_len = 48 rows of the 64-row tile",
    "both implementations agree with the reference on every element",
    "B64 L32k q_len 7: ours",
  ],
  "02_sparse_index_conversion": [
    "jaxspec (xla) agrees with the table above",
    "pallas, table in SMEM: all 3072 entries",
    "pallas, table in GMEM: all 3072 entries",
    "78 layers -> 21 index groups -> 21 conversions per step",
  ],
  "03_mtp_draft_row_pruning": [
    "last_token_indices: [ 0  7  9 14]",
    "first grouped-MoE GEMM rows: pruned 8, unpruned 32",
    "first draft step: moe_policy_tokens = 16 -> grouped",
    "B = 64: first step",
    "Mosaic GPU MoE (",
  ],
  "04_speculative_decoding_default_model": [
    "def fibonacci(n):",
    *(f"k={k}: identical to plain greedy" for k in range(1, 6)),
  ],
}


def _outputs(cell) -> tuple[str, int]:
  """(all text the cell printed, number of images it drew)."""
  text, images = [], 0
  for output in cell.get("outputs", []):
    if output.output_type == "stream":
      text.append(output.text)
    elif output.output_type in ("display_data", "execute_result"):
      images += "image/png" in output.data
      text.append(output.data.get("text/plain", ""))
  return "".join(text), images


def test_every_notebook_has_expectations():
  assert {path.stem for path in NOTEBOOKS} == set(EXPECTED_OUTPUT)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, monkeypatch):
  # The kernel is a child process: it inherits the environment, so the repository is importable
  # even without an editable install.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:  # execute from scratch, not on top of committed outputs
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  client = nbclient.NotebookClient(
    notebook,
    timeout=CELL_TIMEOUT_S,
    kernel_name="python3",
    resources={"metadata": {"path": str(path.parent)}},
  )
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError on any failing cell or assert
  elapsed = time.perf_counter() - start

  code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
  printed = "".join(_outputs(cell)[0] for cell in code_cells)
  for expected in EXPECTED_OUTPUT[path.stem]:
    assert expected in printed, f"{path.name} did not print {expected!r}"
  assert sum(_outputs(cell)[1] for cell in code_cells) >= 1, f"{path.name} drew no plot"
  assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s"


def test_notebooks_run_on_this_interpreter():
  """The `python3` kernel spec must start this interpreter (the virtualenv's ipykernel)."""
  from jupyter_client.kernelspec import KernelSpecManager

  spec = KernelSpecManager().get_kernel_spec("python3")
  assert spec.argv[0] in ("python", "python3", "{python}", sys.executable), spec.argv
