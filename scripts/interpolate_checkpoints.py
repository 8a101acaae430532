"""Interpolates the weights of two checkpoints of one model (WiSE-FT, Wortsman et al., CVPR 2022).

  python scripts/interpolate_checkpoints.py BASE TUNED --alpha A --out DIR [--dtype bfloat16]

Writes ``(1 - A) * BASE + A * TUNED``, every parameter interpolated in float32 and stored in
``--dtype`` (the parameters transformers keeps in float32 stay float32), with BASE's tokenizer,
as a checkpoint ``load_pretrained`` reads. WiSE-FT showed that weights between a model and its
fine-tuned descendant keep much of both; here TUNED is a second training phase of BASE (``train
--init-from BASE``, e.g. with ``--unlikelihood-rows``), and A trades what that phase bought
(fewer greedy loops) against what it cost (acceptance of the draft head, text that parses).
Both must share the config (shapes) and the tokenizer.
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import jaxspec


def interpolate(base, tuned, alpha: float):
  """``(1 - alpha) * base + alpha * tuned`` parameter by parameter, computed in float32 and cast
  to ``base``'s dtype; a new model, the inputs unchanged."""
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must be in [0, 1], got {alpha}")
  graph, base_state = nnx.split(base)
  tuned_state = nnx.state(tuned)
  base_leaves, treedef = jax.tree.flatten(base_state)
  tuned_leaves = jax.tree.leaves(tuned_state)
  if len(tuned_leaves) != len(base_leaves) or any(
    a.shape != b.shape for a, b in zip(base_leaves, tuned_leaves, strict=True)
  ):
    raise ValueError("the two checkpoints have different parameter shapes")
  mixed = [
    ((1.0 - alpha) * a.astype(jnp.float32) + alpha * b.astype(jnp.float32)).astype(a.dtype)
    for a, b in zip(base_leaves, tuned_leaves, strict=True)
  ]
  return nnx.merge(graph, jax.tree.unflatten(treedef, mixed))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("base", type=Path)
  parser.add_argument("tuned", type=Path)
  parser.add_argument("--alpha", type=float, required=True, help="weight of TUNED, in [0, 1]")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--dtype", default="bfloat16", help="dtype of the written weights")
  args = parser.parse_args(argv)
  if not 0.0 <= args.alpha <= 1.0:
    parser.error(f"--alpha must be in [0, 1], got {args.alpha}")
  for name in ("config.json", "tokenizer.json"):
    base_file, tuned_file = args.base / name, args.tuned / name
    for path in (base_file, tuned_file):
      if not path.is_file():
        parser.error(f"{path} does not exist")
    if name == "config.json":
      same = json.loads(base_file.read_text()) == json.loads(tuned_file.read_text())
    else:
      same = base_file.read_bytes() == tuned_file.read_bytes()
    if not same:
      parser.error(f"{base_file} and {tuned_file} differ: not two checkpoints of one model")
  base = jaxspec.load_pretrained(args.base, dtype=jnp.float32)
  tuned = jaxspec.load_pretrained(args.tuned, dtype=jnp.float32)
  mixed = interpolate(base, tuned, args.alpha)
  extra = {"tokenizer.json": args.base / "tokenizer.json"}
  if (args.base / "generation_config.json").is_file():
    extra["generation_config.json"] = args.base / "generation_config.json"
  jaxspec.save_pretrained(mixed, args.out, dtype=jnp.dtype(args.dtype), extra_files=extra)
  print(f"wrote {args.out}: (1 - {args.alpha}) * {args.base} + {args.alpha} * {args.tuned}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
