"""What the benchmarks share in writing their results: the command as run, and the files."""

import json
import sys
from pathlib import Path


def command_line(script: str, path_options: tuple[str, ...] = ("--out",)) -> str:
  """`python benchmarks/<script> ...` as run, the value of each of `path_options` shortened to its
  last part (no machine's paths in committed results)."""
  argv = [
    Path(a).name if i and sys.argv[i - 1] in path_options else a for i, a in enumerate(sys.argv)
  ]
  return " ".join([f"python benchmarks/{script}", *argv[1:]])


def write_results(results: dict, markdown: str, out: Path) -> None:
  """`out`.json (the results) and `out`.md (`markdown`, also printed)."""
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(results, indent=1))
  out.with_suffix(".md").write_text(markdown)
  print(markdown)
