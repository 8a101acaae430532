"""A paused training run: everything `train` needs to continue it as if it had not stopped.

A run that must span several processes (a machine whose commands are cut at a few minutes, a
preempted job) pauses between two steps and writes its state beside the checkpoint directory it
is building, in `<output_dir>.resume` (`resume_dir`):

- `arrays.npz`: the float32 master parameters, the optimizer state (Adam moments and counts) and,
  with `keep="validation"`, the parameters of the best evaluation so far, as the leaves of one
  pytree in `jax.tree.leaves` order;
- `tokenizer.json`: the run's tokenizer (trained in the first process, not again);
- `state.json`: the run's `TrainConfig`, the next step, the total step count (fixed once, by
  the time budget's calibration or `steps`), the time one evaluation took, the training and wall
  seconds spent, the log so far and the kept evaluation's metrics.

The next step's batch comes from `fold_in(key(seed), step)` and its learning rate from the
step and the total, so a resumed run takes the same steps on the same data as an uninterrupted
one: on one device and backend its checkpoint is the same bit for bit (tested on the CPU).
The state is written through `staging.staged_directory`, so an interrupt while saving leaves the
previous state whole; the final checkpoint removes it.
"""

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.training import bpe, staging

STATE_VERSION = 2


def resume_dir(output_dir: str | Path) -> Path:
  """Where a paused run that writes `output_dir` keeps its state: `<output_dir>.resume`."""
  output_dir = Path(output_dir).resolve()
  return output_dir.with_name(output_dir.name + ".resume")


@dataclasses.dataclass
class PausedRun:
  """The state of a paused run (module docstring). `arrays` is the pytree `(params, opt_state,
  kept_params or None)` when saving; `load` gives its leaves (`restore` rebuilds the tree)."""

  config: dict[str, Any]  # dataclasses.asdict(TrainConfig)
  tokenizer: Any  # tokenizers.Tokenizer
  arrays: Any
  next_step: int
  total_steps: int
  eval_s: float
  train_s: float
  wall_s: float  # the wall time of the calls so far, each one's set-up included
  log: dict[str, Any]
  kept_metrics: dict[str, Any] | None


def save(output_dir: str | Path, run: PausedRun) -> Path:
  """Writes `run` into `resume_dir(output_dir)`, replacing an older state; returns the path."""
  target = resume_dir(output_dir)
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(run.arrays)]
  with staging.staged_directory(target, overwrite=True) as directory:
    np.savez(directory / "arrays.npz", *leaves)
    bpe.save_tokenizer(run.tokenizer, directory)
    state = {
      "version": STATE_VERSION,
      "train_config": run.config,
      "next_step": run.next_step,
      "total_steps": run.total_steps,
      "eval_s": run.eval_s,
      "train_s": run.train_s,
      "wall_s": run.wall_s,
      "kept_metrics": run.kept_metrics,
      "log": run.log,
    }
    with open(directory / "state.json", "w") as f:
      json.dump(state, f)
  return target


def load(output_dir: str | Path, config: dict[str, Any]) -> PausedRun:
  """The paused run that writes `output_dir`, checked against this call's `config`
  (`dataclasses.asdict(TrainConfig)`); its `arrays` are the saved leaves, in order.

  Raises `FileNotFoundError` when there is no state and `ValueError` when it belongs to another
  run.
  """
  import tokenizers

  directory = resume_dir(output_dir)
  state = check(output_dir, config)
  with np.load(directory / "arrays.npz") as data:
    leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
  return PausedRun(
    config=state["train_config"],
    tokenizer=tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
    arrays=leaves,
    next_step=state["next_step"],
    total_steps=state["total_steps"],
    eval_s=state["eval_s"],
    train_s=state["train_s"],
    wall_s=state["wall_s"],
    log=state["log"],
    kept_metrics=state["kept_metrics"],
  )


def check(output_dir: str | Path, config: dict[str, Any]) -> dict[str, Any]:
  """`state.json` of the paused run that writes `output_dir`, once checked against this call's
  `config`; raises as `load` does."""
  directory = resume_dir(output_dir)
  if not (directory / "state.json").is_file():
    raise FileNotFoundError(f"no paused run to resume: {directory}/state.json does not exist")
  with open(directory / "state.json") as f:
    state = json.load(f)
  if state.get("version") != STATE_VERSION:
    raise ValueError(f"{directory}: state version {state.get('version')}, not {STATE_VERSION}")
  saved = state["train_config"]
  # JSON turns tuples into lists; compare through it.
  differ = sorted(k for k in config if json.loads(json.dumps(config[k])) != saved.get(k))
  if differ:
    shown = ", ".join(f"{k}: {saved.get(k)!r} then, {config[k]!r} now" for k in differ)
    raise ValueError(f"{directory} is the state of another run ({shown})")
  return state


def restore(leaves: list[np.ndarray], like: Any) -> Any:
  """`leaves` (`PausedRun.arrays` from `load`) in the structure of `like`, a fresh trainer's
  `(params, opt_state, kept_params or None)`, whose shapes and dtypes they must have."""
  expected, treedef = jax.tree.flatten(like)
  if len(leaves) != len(expected):
    raise ValueError(f"the paused state has {len(leaves)} arrays, the run has {len(expected)}")
  for i, (leaf, want) in enumerate(zip(leaves, expected, strict=True)):
    if leaf.shape != want.shape or leaf.dtype != want.dtype:
      raise ValueError(
        f"the paused state's array {i} is {leaf.dtype}{list(leaf.shape)}, the run's is "
        f"{want.dtype}{list(want.shape)}"
      )
  return jax.tree.unflatten(treedef, [jnp.asarray(leaf) for leaf in leaves])


def discard(output_dir: str | Path) -> None:
  """Removes the paused state of the run that writes `output_dir` (once its checkpoint is
  written)."""
  shutil.rmtree(resume_dir(output_dir), ignore_errors=True)
