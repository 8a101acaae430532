"""Speculative against plain decoding at batch 1 on the six demo prompts, for one or more models.

`python -m jaxspec generate --compare` measures one prompt, and the README's prompt alone can
mislead: a model that answers it in 40 tokens pays the prefill and the first steps over few
tokens (a candidate default model measured 1.57x on its 40-token answer and 2.03-2.31x where
others ran 128 tokens; benchmarks/results/default_model_8_layers_draft_phases.md). This runs
`generate --compare` itself (greedy, token healing, the median of `--repeats` alternating timed
runs after a compiling one) on each of `jaxspec.training.demos.DEMO_PROMPTS`, the README's
first, for each `--model`, `--rounds` times with the models alternating, all in one process.

Reports per prompt the tokens, tokens per verify step and speed-up (rounds' median), and per
model the speed-up over all prompts: plain seconds over speculative seconds, each summed over
the prompts' median runs (a prompt weighs by its length), beside the README prompt's own.
Results: `--out`.json / .md.
"""

import argparse
import datetime
import statistics
from pathlib import Path

import jax

from benchmarks._results import command_line, write_results
from jaxspec.__main__ import _build_parser, generate
from jaxspec.training.demos import DEMO_PROMPTS

RESULTS = Path(__file__).resolve().parent / "results"


def compare(model: str | None, prompt: str, args) -> dict:
  """One `generate --compare` on `prompt` (model None: the embedded one)."""
  argv = ["generate", "--prompt", prompt, "--temperature", "0", "--compare", "--json"]
  argv += ["--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
  argv += ["--spec-tokens", str(args.spec_tokens)] + (["--model", model] if model else [])
  result = generate(_build_parser().parse_args(argv))
  return {
    "tokens": len(result["tokens"]),
    "text": result["text"],
    "tokens_per_verify_step": result["mean_accepted_length"],
    "speculative_tokens_per_s": result["tokens_per_s"],
    "plain_tokens_per_s": result["baseline"]["tokens_per_s"],
    "same_tokens": result["baseline"]["same_tokens"],
  }


def summarise(runs: list[dict]) -> dict:
  """runs: one prompt's or one model's `compare` results -> speed-up and tokens.

  A prompt's runs (one per round) give the median of their speed-ups; over prompts, the plain
  seconds over the speculative seconds, each summed over the runs (tokens / tokens_per_s).
  """
  if not runs:
    raise ValueError("no runs to summarise")
  plain_s = sum(run["tokens"] / run["plain_tokens_per_s"] for run in runs)
  speculative_s = sum(run["tokens"] / run["speculative_tokens_per_s"] for run in runs)
  ratios = [run["speculative_tokens_per_s"] / run["plain_tokens_per_s"] for run in runs]
  return {
    "tokens": sum(run["tokens"] for run in runs),
    "speed_up_median": statistics.median(ratios),
    "speed_up_time_weighted": plain_s / speculative_s,
  }


def render(results: dict) -> str:
  meta = results["meta"]
  lines = [
    f"`{meta['command']}` on {meta['device']}, jax {meta['jax']}, {meta['date']}: greedy, "
    f"k = {meta['spec_tokens']}, {meta['max_new_tokens']} new tokens at most; per prompt the "
    f"median of {meta['rounds']} rounds, each the median of {meta['repeats']} timed runs.",
    "",
    "| model | prompt | tokens | tokens / verify step | speed-up | plain's tokens the same |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for model, entry in results["models"].items():
    for prompt, runs in entry["prompts"].items():
      summary = summarise(runs)
      first_line = prompt.splitlines()[0]
      tokens_per_step = statistics.median(run["tokens_per_verify_step"] for run in runs)
      lines.append(
        f"| {model} | `{first_line}` | {runs[0]['tokens']} | {tokens_per_step:.2f} | "
        f"{summary['speed_up_median']:.2f}x | {all(run['same_tokens'] for run in runs)} |"
      )
  lines += ["", "| model | all prompts (time-weighted) | README prompt |", "| --- | --- | --- |"]
  for model, entry in results["models"].items():
    every = summarise([run for runs in entry["prompts"].values() for run in runs])
    readme = summarise(entry["prompts"][DEMO_PROMPTS[0]])
    lines.append(
      f"| {model} | {every['speed_up_time_weighted']:.2f}x | {readme['speed_up_median']:.2f}x |"
    )
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--model", nargs="+", default=[None], help="checkpoint directories; default: the embedded model"
  )
  parser.add_argument("--spec-tokens", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=7, help="timed runs per generate --compare")
  parser.add_argument("--rounds", type=int, default=2, help="passes over the models and prompts")
  parser.add_argument("--smoke", action="store_true", help="one round of 8 tokens, for a CPU check")
  parser.add_argument("--out", type=Path, default=RESULTS / "default_model_prompts")
  args = parser.parse_args()
  if args.smoke:
    args.rounds, args.repeats, args.max_new_tokens = 1, 1, 8
  names = [Path(model).name if model else "embedded" for model in args.model]
  if len(set(names)) != len(names):
    parser.error(f"--model: the directories' names must differ, got {names}")
  models = {name: {"prompts": {prompt: [] for prompt in DEMO_PROMPTS}} for name in names}
  for round_ in range(args.rounds):
    for name, model in zip(names, args.model, strict=True):
      for prompt in DEMO_PROMPTS:
        run = compare(model, prompt, args)
        models[name]["prompts"][prompt].append(run)
        print(
          f"round {round_} {name} {prompt.splitlines()[0]!r}: {run['tokens']} tokens, "
          f"{run['speculative_tokens_per_s'] / run['plain_tokens_per_s']:.2f}x",
          flush=True,
        )
  results = {
    "meta": {
      "device": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
      "command": command_line("bench_default_model_prompts.py", path_options=("--out", "--model")),
      **{k: getattr(args, k) for k in ("spec_tokens", "max_new_tokens", "repeats", "rounds")},
    },
    "models": models,
  }
  write_results(results, render(results), args.out)


if __name__ == "__main__":
  main()
