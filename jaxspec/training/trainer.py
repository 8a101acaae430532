"""Joint training of a GLM-4.5-style MoE target and its MTP draft head, DeepSeek-V3 style.

Loss (arXiv:2412.19437, section 2.2): `L = CE(next token) + mtp_weight / D * sum_d CE_d`.
Row t of the MTP layer takes the target's hidden state of position t (after the final norm) and
the true token of position t + 1, at RoPE position t + 1, and predicts the token of position t + 2
(depth 1). Gradients of both terms flow into the shared trunk, embedding and lm head (DeepSeek-V3
uses a weight of 0.3 early and 0.1 later; one constant weight is used here).

`mtp_labels="target"` trains the MTP layer on the target's own next-token distribution at the
position it drafts instead of the corpus's token (self-distillation, as Medusa-2 and EAGLE train
their draft heads, arXiv:2401.10774, arXiv:2401.15077): what drafting needs is agreement with the
target, not with the data. `draft_head_only` freezes everything but the MTP layer (the trunk, the
embedding and the LM head it shares stay bit for bit), so a phase run that way changes the drafts
and nothing the target generates. With `draft_text="greedy"` such a phase trains on the target's
own greedy continuations of corpus prefixes, decoded in each step, instead of the corpus (Medusa-2's
self-distillation on the model's own generations): greedy decoding verifies drafts against that
text, not the corpus's.

GLM ships one MTP layer and the draft loop applies it again to its own output for the later draft
positions. DeepSeek-V3 trains D separate modules; here the one layer is trained at depths
1..`mtp_depth` by applying it recurrently (depth d: the MTP hidden state of depth d - 1 and the
true token t + d, at position t + d, predict token t + d + 1), so that it learns to consume its own
hidden state as the draft loop feeds it.

Numerics: float32 master parameters and AdamW moments; the forward pass runs on a bfloat16 copy
of the parameters (the router's correction bias stays float32, as the model keeps it), logits and
losses in float32. Learning rate: linear warm-up, then cosine decay to `min_lr_ratio * lr`. The
whole update is one jitted function over the split NNX state; the training stream lives on the
device and windows are sampled there, so the host only feeds a key and the learning rate.
"""

import collections
import dataclasses
import functools
import hashlib
import json
import math
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jaxspec.model.config import GlmConfig, read_config
from jaxspec.model.metadata import KernelChoices, StepMetadata
from jaxspec.model.transformer import GlmForCausalLM
from jaxspec.model.weights import load_pretrained, save_pretrained
from jaxspec.tokenizer import HfTokenizer
from jaxspec.training import bpe, corpus, decoding, repetition, staging, unlikelihood
from jaxspec.training import resume as resume_state
from jaxspec.training.demos import (
  DEMO_NEW_TOKENS,
  DEMO_PROMPTS,
  VALIDATION_PROMPTS,
  healed_demo_quality,
  meets_bar,
  worst_of,
)


def training_kernels(backend: str) -> KernelChoices:
  """The training forward's kernels: every token through every expert (`moe="dense"`: the
  default model's 8 narrow experts cost three plain matmuls, no sort), the embedding's gradient
  as a one-hot matmul (`Embedding`: on real code the scatter-add step was 2.6-3x slower than on
  random ids), and on a GPU cuDNN's flash attention. One train step of the default model on an
  H200 (batch 64 x 512 tokens, random ids, scatter-add): 46 ms with the grouped GEMM and the
  float32-softmax attention, 33 ms with dense experts, 17 ms with dense experts and cuDNN."""
  return KernelChoices(
    moe="dense",
    causal_attention="cudnn" if backend == "gpu" else "xla",
    embedding_grad="one_hot",
  )


def default_model_config(vocab_size: int) -> GlmConfig:
  """The embedded default model: 6.61M parameters (vocabulary 2048), 13.2 MB in bf16.

  8 layers (first dense, then MoE), hidden 256, GQA 8 query / 2 KV heads of 32 (attention width
  256), partial RoPE 0.5, q/k norm and q/k/v bias as GLM-4.5, 8 routed experts of 64 (top-2) plus
  1 shared, one MTP layer. Deep and narrow rather than wide: at batch 1 a step of a model this
  small costs its kernel launches, and a k = 3 cycle (a verify pass through the target, then three
  passes through the one-layer MTP head) launches 1.41x the kernels of a plain step with 8 target
  layers against 1.85x with 4 layers of hidden 320 at the same size (GLM-4.5 has 46 or 92 layers
  per MTP layer): benchmarks/NOTES_default_model_speed.md. It stays under the 15 MB the
  repository allows for the embedded model.
  """
  return GlmConfig(
    vocab_size=vocab_size,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    moe_intermediate_size=64,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
  )


def smoke_model_config(vocab_size: int) -> GlmConfig:
  """A model of a few hundred kilobytes with the same structure, for CPU smoke runs."""
  return default_model_config(vocab_size).replace(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
  )


MODEL_PRESETS = {"default": default_model_config, "smoke": smoke_model_config}
MTP_LABELS = ("data", "target")
DRAFT_TEXTS = ("corpus", "greedy")
KEEP_CHOICES = ("last", "validation")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that defines a training run; written into `training_log.json`.

  `time_budget_s`, when set, caps the number of steps: the step time is measured during the
  warm-up (before the cosine decay starts, so the schedule stays consistent) and the total is cut
  to what fits, evaluations included.
  """

  model_preset: str = "default"
  vocab_size: int = 2048
  steps: int = 4000
  batch_size: int = 128
  seq_len: int = 512
  learning_rate: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 200
  weight_decay: float = 0.1
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  grad_clip: float = 1.0
  mtp_weight: float = 0.3
  mtp_depth: int = 2
  # What the MTP loss teaches the draft head: "data" the corpus's tokens (DeepSeek-V3), "target"
  # the target's own next-token distribution at the drafted position (self-distillation).
  mtp_labels: str = "data"
  # Train the MTP layer alone: the target (trunk, embedding, LM head) is frozen and the loss is
  # the MTP term; for a phase started from a checkpoint (`init_from`).
  draft_head_only: bool = False
  # The text a draft-head-only phase trains on: "corpus" windows, or "greedy": each step decodes
  # its windows from the frozen target, the greedy continuations of `greedy_prefix_tokens`
  # corpus tokens (the text the draft loop meets when decoding greedily), and the MTP loss
  # covers the rows that draft the continuation.
  draft_text: str = "corpus"
  greedy_prefix_tokens: int = 64
  # Windows per batch that repeat one span, trained with DITTO's loss (`repetition`); 0: off.
  # 16 of 128 took the default model's demos from a line repeated 13 times to 4 at a held-out
  # CE of 2.01; 32 in a shorter run did worse (CE 2.07, 10): benchmarks/train_default_model.sh.
  repetition_rows: int = 16
  repetition_lambda: float = 0.5
  # Copies of each top-level function and class added to the stream as documents of their own
  # (`corpus.definition_documents`), so the model sees where a definition ends when nothing
  # follows it; 0: whole files only.
  definition_documents: int = 0
  # Continuations per step decoded greedily from real prefixes by the model itself and trained
  # with sequence-level unlikelihood on tokens that repeat an n-gram (`unlikelihood`); 0: off.
  unlikelihood_rows: int = 0
  unlikelihood_ngram: int = 8
  unlikelihood_weight: float = 1.0
  unlikelihood_prefix_tokens: int = 64
  unlikelihood_new_tokens: int = 96
  eval_draft_depth: int = 3
  # Tokens of each demo and validation continuation (greedy, `demos`): issue 16's bar is 96; the
  # smoke preset continues fewer, since each token re-runs the whole forward.
  demo_new_tokens: int = DEMO_NEW_TOKENS
  eval_every: int = 250
  eval_batch_size: int = 32
  max_eval_windows: int | None = None
  log_every: int = 10
  max_train_files: int | None = None
  seed: int = 0
  time_budget_s: float | None = None
  # A checkpoint written by `train` to start from (its parameters, tokenizer and shape; the Adam
  # moments start afresh): a second phase run after the first, e.g. one with more repeated rows.
  init_from: str | None = None
  # The checkpoint saved: the "last", or of those evaluated (the start, every `eval_every` steps,
  # the end) the one whose greedy continuations of `demos.VALIDATION_PROMPTS` read best
  # (`_validation_key`), scored on the weights as saved, the worse of bf16 and float32:
  # "validation". A few hundred steps move the demos' most repeated
  # line between 2 and 4 while the held-out losses barely move
  # (benchmarks/results/default_model_8_layers_draft_phases.md); choosing on other prompts keeps
  # the demo prompts an unseen test of the kept checkpoint.
  keep: str = "last"

  def __post_init__(self):
    if self.model_preset not in MODEL_PRESETS:
      raise ValueError(f"model_preset must be one of {sorted(MODEL_PRESETS)}")
    positive = ("steps", "batch_size", "seq_len", "warmup_steps", "eval_every", "log_every")
    for name in positive + ("mtp_depth", "eval_draft_depth", "demo_new_tokens"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.warmup_steps >= self.steps:
      raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")
    if self.vocab_size < 257:
      raise ValueError(
        f"vocab_size must cover the 256 bytes and <|endoftext|>, got {self.vocab_size}"
      )
    if not (self.learning_rate > 0 and 0 <= self.min_lr_ratio <= 1):
      raise ValueError(
        f"learning_rate must be positive and min_lr_ratio in [0, 1], got {self.learning_rate} "
        f"and {self.min_lr_ratio}"
      )
    if not 0 <= self.repetition_rows < self.batch_size:
      raise ValueError(
        f"repetition_rows must be in [0, batch_size) = [0, {self.batch_size}), "
        f"got {self.repetition_rows}"
      )
    for name in ("unlikelihood_rows", "unlikelihood_weight", "definition_documents"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
    for name in ("unlikelihood_ngram", "unlikelihood_prefix_tokens", "unlikelihood_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if not 0 <= self.repetition_lambda <= 1:
      raise ValueError(f"repetition_lambda must be in [0, 1], got {self.repetition_lambda}")
    if self.time_budget_s is not None and not self.time_budget_s > 0:
      raise ValueError(f"time_budget_s must be positive, got {self.time_budget_s}")
    if self.time_budget_s is not None and self.warmup_steps < 3:
      raise ValueError("time_budget_s times the warm-up steps: warmup_steps must be at least 3")
    if self.mtp_labels not in MTP_LABELS:
      raise ValueError(f"mtp_labels must be one of {MTP_LABELS}, got {self.mtp_labels!r}")
    if self.keep not in KEEP_CHOICES:
      raise ValueError(f"keep must be one of {KEEP_CHOICES}, got {self.keep!r}")
    if self.draft_text not in DRAFT_TEXTS:
      raise ValueError(f"draft_text must be one of {DRAFT_TEXTS}, got {self.draft_text!r}")
    if self.draft_text == "greedy":
      if not self.draft_head_only:
        raise ValueError(
          "draft_text='greedy' decodes from a frozen target: set draft_head_only (each step "
          "would otherwise decode from the target it is training)"
        )
      if not 1 <= self.greedy_prefix_tokens <= self.seq_len - self.mtp_depth:
        raise ValueError(
          f"greedy_prefix_tokens must be in [1, seq_len - mtp_depth] = "
          f"[1, {self.seq_len - self.mtp_depth}] (the MTP rows after it are the trained ones), "
          f"got {self.greedy_prefix_tokens}"
        )
    if self.draft_head_only:
      if self.init_from is None:
        raise ValueError("draft_head_only trains the MTP layer of a trained target: set init_from")
      for name in ("repetition_rows", "unlikelihood_rows"):
        if getattr(self, name):
          raise ValueError(
            f"{name} trains the target, which draft_head_only freezes: set it to 0, got "
            f"{getattr(self, name)}"
          )


def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
  """Linear warm-up to `learning_rate`, then cosine decay to `min_lr_ratio * learning_rate`."""
  if step < config.warmup_steps:
    return config.learning_rate * (step + 1) / config.warmup_steps
  progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
  cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
  return config.learning_rate * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


# Seconds a time-budgeted run keeps for its end: demo samples (one compile, 6 x 96 forwards),
# saving, the plot.
TAIL_RESERVE_S = 20.0

# How `python -m jaxspec generate` decodes this model unless told otherwise (Hugging Face's
# generation_config.json): greedy. Sampling at 0.7 (top-p 0.95) read no better on the demo
# prompts for either default model (benchmarks/results/default_model_definition_documents.md);
# `--temperature 0.7 --top-p 0.95` samples.
RECOMMENDED_SAMPLING = {"do_sample": False}


def generation_config(model_config: GlmConfig) -> dict:
  """`generation_config.json`: the recommended sampling and the special tokens."""
  return RECOMMENDED_SAMPLING | {
    "eos_token_id": model_config.eos_token_id,
    "pad_token_id": model_config.pad_token_id,
  }


def steps_within_budget(
  config: TrainConfig, step: int, elapsed_s: float, per_step_s: float, eval_s: float
) -> int:
  """The total step count that fits `config.time_budget_s`, `elapsed_s` into the run at `step`.

  Left for training: the budget less the time spent, the final evaluation and `TAIL_RESERVE_S`
  (demo samples, saving, plotting); each step also carries its share of the periodic
  evaluations, and 3% of the rest is kept as a margin. Never more than `config.steps`, never less
  than the warm-up plus one step.
  """
  left = config.time_budget_s - elapsed_s - eval_s - TAIL_RESERVE_S
  per_step_with_eval = per_step_s + eval_s / config.eval_every
  total = min(config.steps, step + int(0.97 * max(0.0, left) / per_step_with_eval))
  return max(total, config.warmup_steps + 1)


# --------------------------------------------------------------------------------------------------
# Data.


def encode_files(tokenizer, files: list[corpus.SourceFile]) -> np.ndarray:
  """One int32 stream: each file's tokens followed by `<|endoftext|>`."""
  eos = tokenizer.token_to_id(bpe.END_OF_TEXT)
  pieces = []
  for encoding in tokenizer.encode_batch_fast([f.text for f in files], add_special_tokens=False):
    pieces.append(np.asarray(encoding.ids, np.int32))
    pieces.append(np.asarray([eos], np.int32))
  return np.concatenate(pieces)


def training_stream(
  tokenizer, train_files: list[corpus.SourceFile], definition_copies: int
) -> tuple[np.ndarray, int, int]:
  """(the training stream, int32 [N]; the tokens of its whole files; its definition documents).

  The files' tokens (`encode_files`), then `definition_copies` times those of every top-level
  function and class of the files as a document of its own (`corpus.definition_documents`).
  """
  stream = encode_files(tokenizer, train_files)
  file_tokens = int(stream.size)
  if not definition_copies:
    return stream, file_tokens, 0
  definitions = corpus.definition_documents(train_files)
  copies = [encode_files(tokenizer, definitions)] * definition_copies
  return np.concatenate([stream, *copies]), file_tokens, len(definitions)


def eval_windows(
  stream: np.ndarray, seq_len: int, depth: int, max_windows: int | None
) -> np.ndarray:
  """Non-overlapping windows (inputs advance by `seq_len`) of `seq_len + 1 + depth` tokens."""
  window = seq_len + 1 + depth
  count = (len(stream) - window) // seq_len + 1 if len(stream) >= window else 0
  if max_windows is not None:
    count = min(count, max_windows)
  if count == 0:
    raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than a window ({window})")
  starts = np.arange(count) * seq_len
  return stream[starts[:, None] + np.arange(window)]


# --------------------------------------------------------------------------------------------------
# Model pieces used by the loss and the evaluation.


def _compute_params(params):
  """bf16 copy of the float32 master parameters; the router correction bias stays float32."""

  def cast(path, value):
    if "e_score_correction_bias" in jax.tree_util.keystr(path):
      return value
    return value.astype(jnp.bfloat16)

  return jax.tree_util.tree_map_with_path(cast, params)


def _saved_params(params, dtype):
  """The parameters as the checkpoint stores them (`_compute_params`: bf16, the router's
  correction bias float32) and as `load_pretrained(dtype=dtype)` reads them back."""
  stored = _compute_params(params)
  return jax.tree.map(lambda v: v.astype(dtype) if v.dtype == jnp.bfloat16 else v, stored)


def _joint_logits(
  model: GlmForCausalLM,
  windows: jax.Array,
  depth: int,
  kernels: KernelChoices,
  mtp_rows: int | None = None,
):
  """windows: int32 [B, T + 1 + depth] -> (target logits [B, T, V], [MTP logits [M, T, V]] * depth)
  with M = `mtp_rows` (default B): the MTP layer runs on the first M windows only.

  Target row t predicts token t + 1. The MTP layer is applied `depth` times, as the draft loop
  applies it: at depth d, row t takes the hidden state of depth d - 1 (the target's for d = 1,
  else the MTP layer's own output before `shared_head.norm`) and the true token t + d, at RoPE
  position t + d, and predicts token t + d + 1. Teacher forcing: true tokens replace the drafts.
  """
  seq_len = windows.shape[1] - 1 - depth
  inputs = windows[:, :seq_len]  # [B, T]
  step = StepMetadata.plain(inputs, kernels)
  hidden, _ = model.forward(inputs, step)  # [B, T, H]
  mtp_logits = []
  previous = hidden[:mtp_rows]  # [M, T, H]
  mtp_step = StepMetadata.plain(inputs[:mtp_rows], kernels)
  for d in range(1, depth + 1):
    # Depth d consumes the state of position t + d - 1 (its RoPE position is t + d).
    shifted = mtp_step.replace(positions=mtp_step.positions + d - 1)
    previous, _ = model.mtp_forward(windows[:mtp_rows, d : seq_len + d], previous, shifted)
    mtp_logits.append(model.mtp_logits(previous))
  return model.logits(hidden), mtp_logits


def draft_teacher(target_logits: jax.Array, depth: int) -> jax.Array:
  """The target's next-token distribution for each row of MTP depth `depth`, for self-distillation.

  target_logits: [B, T, V] (row t predicts token t + 1) -> float32 [B, T - depth, V]. MTP row t at
  depth d predicts token t + d + 1, which the target predicts at row t + d from the true prefix
  up to t + d: the drafted position's verification. The last d rows have no such target row.
  """
  teacher = jax.lax.stop_gradient(target_logits[:, depth:].astype(jnp.float32))
  return jax.nn.softmax(teacher, axis=-1)


def _trained_labels(params, draft_head_only: bool):
  """Each parameter's optimizer label: "train", or "frozen" outside the MTP layer with
  `draft_head_only`."""

  def label(path, _):
    return "train" if not draft_head_only or path[0] == jax.tree_util.DictKey("mtp") else "frozen"

  return jax.tree_util.tree_map_with_path(label, params)


def _decay_mask(params):
  """Weight decay on matrices and embeddings only (not on norms, biases, router bias)."""
  return jax.tree.map(lambda value: value.ndim >= 2, params)


class Trainer:
  """Holds the split model state and the jitted train / eval steps."""

  def __init__(
    self, model_config: GlmConfig, config: TrainConfig, model=None, malformed_tokens=None
  ):
    """`model`: a float32 `GlmForCausalLM` of `model_config` to start from (default: freshly
    initialised from `config.seed`). `malformed_tokens`: bool [V], the tokens that are not UTF-8
    on their own (`unlikelihood.malformed_tokens`), penalised in the unlikelihood rollouts
    (default: none)."""
    self.config = config
    if malformed_tokens is None:
      malformed_tokens = np.zeros(model_config.vocab_size, bool)
    if np.shape(malformed_tokens) != (model_config.vocab_size,):
      raise ValueError(f"malformed_tokens must be bool [{model_config.vocab_size}]")
    self.malformed_tokens = jnp.asarray(malformed_tokens, bool)
    self.kernels = training_kernels(jax.default_backend())
    if model is None:
      model = GlmForCausalLM(model_config, dtype=jnp.float32, rngs=nnx.Rngs(config.seed))
    elif model.config != model_config:
      raise ValueError("the starting model's config differs from model_config")
    self.graphdef, self.params = nnx.split(model, nnx.Param)
    adamw = optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.scale_by_adam(b1=config.adam_b1, b2=config.adam_b2),
      optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
    )
    self.labels = _trained_labels(self.params, config.draft_head_only)
    # Frozen parameters get zero updates (no weight decay either), so they stay bit for bit.
    self.optimizer = optax.multi_transform(
      {"train": adamw, "frozen": optax.set_to_zero()}, self.labels
    )
    self.opt_state = self.optimizer.init(self.params)
    self._train_step = jax.jit(self._step, donate_argnums=(0, 1))
    self._eval_step = jax.jit(self._eval)

  @property
  def num_params(self) -> int:
    """Parameters of the model, trained and frozen."""
    return sum(x.size for x in jax.tree.leaves(self.params))

  def model(self) -> GlmForCausalLM:
    """The model with the current parameters."""
    return nnx.merge(self.graphdef, self.params)

  def _loss(self, params, windows, repeats, rollouts):
    """`CE(next) + mtp_weight * mean_d CE(depth d)`, as DeepSeek-V3's `lambda / D * sum_d L_d`,
    over the plain windows; with `repetition_rows` R of B windows repeating a span (the last R
    rows; `repeats` = their (spans, prefixes), int32 [R] each, from
    `repetition.repeated_windows`), `(1 - R / B) * that + (R / B) * DITTO's loss` over them; with
    `rollouts` (int32 [U, P + N], the model's greedy continuations), plus `unlikelihood_weight`
    times their unlikelihood loss."""
    cfg = self.config
    # Frozen parameters are constants of the loss: no gradient, and no backward pass through
    # the trunk, is computed for them.
    params = jax.tree.map(
      lambda value, label: value if label == "train" else jax.lax.stop_gradient(value),
      params,
      self.labels,
    )
    model = nnx.merge(self.graphdef, _compute_params(params))
    depth = cfg.mtp_depth
    seq_len = windows.shape[1] - 1 - depth
    plain = cfg.batch_size - cfg.repetition_rows
    # The repeated windows train the target only: the MTP layer runs on the plain ones.
    logits, mtp_logits = _joint_logits(model, windows, depth, self.kernels, mtp_rows=plain)
    lm_loss = optax.softmax_cross_entropy_with_integer_labels(
      logits[:plain], windows[:plain, 1 : seq_len + 1]
    ).mean()
    # On greedy windows the first draft comes from the prefix's last row (P - 1), as after a
    # prefill; the rows before it draft corpus text, which the draft loop does not meet.
    first = cfg.greedy_prefix_tokens - 1 if cfg.draft_text == "greedy" else 0

    def mtp_loss(d):  # depth d's row t predicts token t + d + 1; rows from `first` on
      if cfg.mtp_labels == "target":
        teacher = draft_teacher(logits[:plain], d)[:, first:]  # [B, T - d - first, V]
        drafts = mtp_logits[d - 1][:, first : seq_len - d]
        return optax.softmax_cross_entropy(drafts, teacher).mean()
      labels = windows[:plain, first + d + 1 : seq_len + d + 1]
      drafts = mtp_logits[d - 1][:, first:]
      return optax.softmax_cross_entropy_with_integer_labels(drafts, labels).mean()

    mtp_losses = jnp.stack([mtp_loss(d) for d in range(1, depth + 1)])
    if cfg.draft_head_only:  # the frozen target's loss is logged, not trained
      loss = jnp.mean(mtp_losses)
      return loss, (loss, lm_loss, mtp_losses, {})
    loss = lm_loss + cfg.mtp_weight * jnp.mean(mtp_losses)
    extra = {}
    total = loss
    if cfg.repetition_rows:
      extra["repetition_loss"] = repetition.self_reinforcement_loss(
        logits[plain:], windows[plain:], *repeats, cfg.repetition_lambda
      )
      share = cfg.repetition_rows / cfg.batch_size
      total = (1 - share) * total + share * extra["repetition_loss"]
    if cfg.unlikelihood_rows:
      start = cfg.unlikelihood_prefix_tokens
      mask = unlikelihood.penalised_mask(
        rollouts, start, cfg.unlikelihood_ngram, self.malformed_tokens
      )
      inputs = decoding.padded(rollouts)  # [U, >= P + N]
      hidden, _ = model.forward(inputs, StepMetadata.plain(inputs, self.kernels))
      logits = model.logits(hidden[:, : rollouts.shape[1] - 1])  # [U, P + N - 1, V]
      extra["unlikelihood_loss"] = unlikelihood.unlikelihood_loss(logits, rollouts, mask, start)
      # The share of the model's own greedy tokens that the loss penalises, and of them the
      # malformed ones.
      extra["rollout_penalised_share"] = jnp.mean(mask[:, start:])
      extra["rollout_malformed_share"] = jnp.mean(self.malformed_tokens[rollouts[:, start:]])
      total = total + cfg.unlikelihood_weight * extra["unlikelihood_loss"]
    return total, (loss, lm_loss, mtp_losses, extra)

  def sample_batch(self, params, stream, key):
    """A train step's inputs, from the on-device token stream (int32 [N]): (windows [B, T + 1 +
    depth], repeats, rollouts) as `_loss` takes them. `batch_size` windows sampled from the
    stream, the last `repetition_rows` of them repeating one span each; with
    `draft_text="greedy"`, decoded by the target (`params`) from prefixes sampled there."""
    cfg = self.config
    window = cfg.seq_len + 1 + cfg.mtp_depth
    plain = cfg.batch_size - cfg.repetition_rows
    if cfg.draft_text == "greedy":  # [B, T + 1 + depth]: P corpus tokens, then greedy ones
      prefix = cfg.greedy_prefix_tokens
      windows = self._greedy_rollouts(params, stream, key, plain, prefix, window - prefix)
    else:
      starts = jax.random.randint(key, (plain,), 0, stream.shape[0] - window + 1)
      windows = stream[starts[:, None] + jnp.arange(window)]  # [B - R, T + 1 + depth]
    repeats = None
    if cfg.repetition_rows:
      repeated, spans, prefixes = repetition.repeated_windows(
        stream, jax.random.fold_in(key, 1), cfg.repetition_rows, window
      )
      repeats = (spans, prefixes)
      windows = jnp.concatenate([windows, repeated])  # [B, T + 1 + depth]
    rollouts = None
    if cfg.unlikelihood_rows:
      rollouts = self._greedy_rollouts(  # [U, P + N]
        params,
        stream,
        jax.random.fold_in(key, 2),
        cfg.unlikelihood_rows,
        cfg.unlikelihood_prefix_tokens,
        cfg.unlikelihood_new_tokens,
      )
    return windows, repeats, rollouts

  def _greedy_rollouts(self, params, stream, key, rows, prefix, new_tokens):
    """int32 [rows, prefix + new_tokens]: `rows` prefixes of `prefix` tokens sampled from the
    stream with `key`, each continued greedily by the target (the bf16 compute copy of
    `params`)."""
    starts = jax.random.randint(key, (rows,), 0, stream.shape[0] - prefix + 1)
    return decoding.greedy_rollouts(
      nnx.merge(self.graphdef, _compute_params(params)),
      stream[starts[:, None] + jnp.arange(prefix)],
      new_tokens,
      self.kernels,
    )

  def _step(self, params, opt_state, stream, key, lr):
    """One AdamW update on the batch `sample_batch` draws with `key`."""
    cfg = self.config
    windows, repeats, rollouts = self.sample_batch(params, stream, key)
    grads, (loss, lm_loss, mtp_losses, extra) = jax.grad(self._loss, has_aux=True)(
      params, windows, repeats, rollouts
    )
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    metrics = {
      "loss": loss,
      "lm_loss": lm_loss,
      "mtp_loss": mtp_losses[0],
      "grad_norm": optax.tree.norm(grads),
    } | {f"mtp_loss_depth{d + 1}": mtp_losses[d] for d in range(1, cfg.mtp_depth)}
    return params, opt_state, metrics | extra

  def _eval(self, params, windows, weights):
    """Per-window means summed over a batch of held-out windows; `weights` [B] is 0 for padding.

    `mtp_agreement`: rows where argmax of the (depth-1) MTP logits equals argmax of the target's
    logits at t + 1, the first draft position's greedy acceptance under teacher forcing.
    `chain_acceptance_d`: rows where drafts 1..d all agree with the target's argmax at t + 1..d;
    `1 + sum_d chain_acceptance_d` estimates the tokens per verify step with k = eval depth.
    """
    model = nnx.merge(self.graphdef, _compute_params(params))
    depth = self.config.eval_draft_depth
    seq_len = windows.shape[1] - 1 - depth
    logits, mtp_logits = _joint_logits(model, windows, depth, self.kernels)
    next_tokens = windows[:, 1 : seq_len + 1]
    target_argmax = jnp.argmax(logits, axis=-1)  # [B, T]
    mtp_argmax = [jnp.argmax(x, axis=-1) for x in mtp_logits]  # depth x [B, T]

    def window_mean(values):  # [B, rows] -> weighted sum over the batch of per-window means
      return jnp.sum(jnp.mean(values.astype(jnp.float32), axis=-1) * weights)

    sums = {
      "lm_loss": window_mean(optax.softmax_cross_entropy_with_integer_labels(logits, next_tokens)),
      "next_token_accuracy": window_mean(target_argmax == next_tokens),
      "mtp_loss": window_mean(
        optax.softmax_cross_entropy_with_integer_labels(mtp_logits[0], windows[:, 2 : seq_len + 2])
      ),
      "mtp_accuracy": window_mean(mtp_argmax[0] == windows[:, 2 : seq_len + 2]),
      "mtp_agreement": window_mean(mtp_argmax[0][:, :-1] == target_argmax[:, 1:]),
    }
    # Chains use rows t < T - depth, where the target's argmax at t + depth exists.
    rows = seq_len - depth
    accepted = jnp.ones((windows.shape[0], rows), bool)
    for d in range(1, depth + 1):
      accepted &= mtp_argmax[d - 1][:, :rows] == target_argmax[:, d : rows + d]
      sums[f"chain_acceptance_{d}"] = window_mean(accepted)
    return sums

  def train_step(self, stream, key, lr: float) -> dict:
    """One AdamW step on a batch sampled from `stream` (int32 [N], on the device) with
    `key`, at learning rate `lr`; the parameters and optimizer state are updated in place and
    the step's metrics returned (device values)."""
    self.params, self.opt_state, metrics = self._train_step(
      self.params, self.opt_state, stream, key, jnp.float32(lr)
    )
    return metrics

  def evaluate(self, windows: np.ndarray) -> dict[str, float]:
    """Means over all rows of the held-out windows."""
    batch = self.config.eval_batch_size
    padded = -(-len(windows) // batch) * batch
    weights = np.zeros(padded, np.float32)
    weights[: len(windows)] = 1.0
    windows = np.concatenate(
      [windows, np.zeros((padded - len(windows), windows.shape[1]), np.int32)]
    )
    totals = None
    for start in range(0, padded, batch):
      sums = self._eval_step(
        self.params,
        jnp.asarray(windows[start : start + batch]),
        jnp.asarray(weights[start:][:batch]),
      )
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    metrics = {name: float(value) / len(weights[weights > 0]) for name, value in totals.items()}
    depth = self.config.eval_draft_depth
    metrics[f"tokens_per_step_k{depth}"] = 1.0 + sum(
      metrics[f"chain_acceptance_{d}"] for d in range(1, depth + 1)
    )
    return metrics


# --------------------------------------------------------------------------------------------------
# Greedy samples for the log (plain full forward over one fixed-size buffer: one compile).


@functools.partial(jax.jit, static_argnums=0)
def _greedy_next_tokens(graphdef, state, ids, positions, allowed):
  """Each row's argmax next token at its own position, among its allowed tokens.

  ids int32 [N, length], positions int32 [N], allowed bool [N, V] -> int32 [N]. The parameters
  are an argument, not a constant, so that one compile serves every checkpoint of a run.
  """
  logits = nnx.merge(graphdef, state)(ids)  # [N, length, V]
  logits = jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0]  # [N, V]
  return jnp.argmax(jnp.where(allowed, logits, -jnp.inf), axis=-1).astype(jnp.int32)


def greedy_continuations(
  model: GlmForCausalLM,
  prompts: list[list[int]],
  first_token_masks: list[np.ndarray | None],
  new_tokens: int,
  stop_token_ids: Collection[int] = (),
) -> list[list[int]]:
  """Greedy decoding of the prompts, all at once, by re-running the causal forward (no cache).

  The prompts share one `[N, length]` buffer (the longest prompt plus `new_tokens`, rounded up to
  64), each from its row's start; the tokens after a row's current position do not affect it
  (causal mask), so one forward per new token gives every row its next token, read at that row's
  own position. A prompt's first token is the argmax over its first-token mask (bool [V], None:
  every token), as `Generator.generate(first_token_masks=...)` takes it for token healing. A
  continuation stops after a token of `stop_token_ids`, which it then ends with, as
  `Generator.generate`'s do.
  """
  length = -(-(max(len(p) for p in prompts) + new_tokens) // 64) * 64
  buffer = np.zeros((len(prompts), length), np.int32)  # [N, length]
  every_token = np.ones((len(prompts), model.config.vocab_size), bool)  # [N, V]
  allowed = every_token.copy()
  for row, (prompt_ids, mask) in enumerate(zip(prompts, first_token_masks, strict=True)):
    buffer[row, : len(prompt_ids)] = prompt_ids
    if mask is not None:
      allowed[row] = mask
  positions = np.array([len(p) - 1 for p in prompts])  # [N]: each row's last token
  graphdef, state = nnx.split(model)
  continuations = [[] for _ in prompts]
  active = np.ones(len(prompts), bool)
  for _ in range(new_tokens):
    tokens = np.asarray(
      _greedy_next_tokens(graphdef, state, jnp.asarray(buffer), jnp.asarray(positions), allowed)
    )
    allowed = every_token  # only the first new token is constrained
    positions = positions + 1
    for row in np.flatnonzero(active):
      token = int(tokens[row])
      buffer[row, positions[row]] = token
      continuations[row].append(token)
      active[row] = token not in stop_token_ids
    if not active.any():
      break
  return continuations


# --------------------------------------------------------------------------------------------------
# The run.


def plot_losses(log: dict[str, Any], path: Path) -> None:
  """Training losses (smoothed), held-out losses and the teacher-forced MTP agreement."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  history, evals = log["history"], log["evals"]
  steps = [h["step"] for h in history]
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
  ax_loss.plot(steps, [h["lm_loss"] for h in history], label="train next-token CE", alpha=0.8)
  ax_loss.plot(steps, [h["mtp_loss"] for h in history], label="train MTP CE (t+2)", alpha=0.8)
  eval_steps = [e["step"] for e in evals]
  ax_loss.plot(eval_steps, [e["lm_loss"] for e in evals], "o-", label="held-out next-token CE")
  ax_loss.plot(eval_steps, [e["mtp_loss"] for e in evals], "s-", label="held-out MTP CE")
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel("cross-entropy (nats / token)")
  # Up to the early training loss (a first run's steep start is cut at 8) and every held-out
  # value (a second phase starts near its end).
  early = history[min(len(history) - 1, 5)]["loss"]
  held_out = [e[name] for e in evals for name in ("lm_loss", "mtp_loss")]
  ax_loss.set_ylim(0, 1.05 * max(2.0, min(8.0, early), *held_out))
  ax_loss.legend()
  ax_loss.grid(alpha=0.3)
  ax_acc.plot(eval_steps, [e["next_token_accuracy"] for e in evals], "o-", label="target top-1")
  ax_acc.plot(eval_steps, [e["mtp_accuracy"] for e in evals], "s-", label="MTP top-1 (t+2)")
  ax_acc.plot(
    eval_steps, [e["mtp_agreement"] for e in evals], "^-", label="MTP argmax = target argmax"
  )
  ax_acc.set_xlabel("step")
  ax_acc.set_ylabel("held-out fraction")
  ax_acc.set_ylim(0, 1)
  ax_acc.legend()
  ax_acc.grid(alpha=0.3)
  fig.suptitle("jaxspec default model: joint next-token + MTP training on Python sources")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _validation_key(metrics: dict) -> tuple:
  """The key by which `train --keep validation` picks an evaluation's checkpoint (largest wins).

  From the scores of its continuations of `VALIDATION_PROMPTS`: one that meets the demo bar
  (`demos.meets_bar`) beats one that does not; then the fewer repeats of the most repeated line,
  the larger share that parses, and the later step (more trained, at equal quality).
  """
  repeats = metrics["validation_demo_max_line_repeats"]
  parse_rate = metrics["validation_demo_parse_rate"]
  return (meets_bar(repeats, parse_rate), -repeats, parse_rate, metrics["step"])


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _describe_corpus(source: Path | None, train_files, held_out_files, train_tokens: int) -> dict:
  if source is None:
    description = {"source": "Python standard library .py files of the training interpreter"}
  elif source.is_file():
    manifest, _ = corpus.read_archive(source)
    description = {
      "source": f"corpus archive {source.name} (scripts/build_corpus.py)",
      "archive_sha256": _sha256(source),
      "python": manifest["python"],
      "distributions": {name: d["version"] for name, d in manifest["distributions"].items()},
    }
  else:
    description = {"source": "Python standard library .py files (a copied stdlib folder)"}
  origins = collections.Counter(f.origin for f in train_files)
  return description | {
    "train_files": len(train_files),
    "train_files_by_origin": dict(sorted(origins.items())),
    "train_bytes": sum(len(f.text.encode("utf-8")) for f in train_files),
    "train_tokens": train_tokens,
    "held_out_files": [f.relative_path for f in held_out_files],
  }


def check_initial_checkpoint(config: TrainConfig):
  """`config.init_from`'s tokenizer, once its `config.json` is checked against the run's preset
  and vocabulary (a mismatch is a `ValueError` naming both, not a silently different model). No
  weights are read."""
  import tokenizers

  path = Path(config.init_from)
  if not (path / "tokenizer.json").is_file():
    raise ValueError(f"init_from {path}: no tokenizer.json (not a checkpoint written by train)")
  tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  found = read_config(path / "config.json")
  expected = MODEL_PRESETS[config.model_preset](tokenizer.get_vocab_size())
  if found != expected or config.vocab_size != tokenizer.get_vocab_size():
    raise ValueError(
      f"init_from {path}: a {found.vocab_size}-token model of hidden size "
      f"{found.hidden_size}, not the {config.model_preset!r} preset at vocab_size "
      f"{config.vocab_size}"
    )
  return tokenizer


def train(
  config: TrainConfig,
  output_dir: str | Path,
  *,
  overwrite: bool = False,
  corpus_source: str | Path | None = None,
  tokenizer_path: str | Path | None = None,
  progress: bool = True,
  pause_after_s: float | None = None,
  resume: bool = False,
) -> dict[str, Any]:
  """Trains the tokenizer (unless one is given), the model and its MTP head; writes the checkpoint.

  `corpus_source`: a corpus archive (`scripts/build_corpus.py`) or a standard library folder;
  default: the running interpreter's standard library. With `config.init_from`, training
  continues from that checkpoint's parameters with its tokenizer (`tokenizer_path` must then be
  None). Writes `config.json`, bf16
  `model.safetensors`, `tokenizer.json`, `training_log.json` and `loss.png` into a temporary
  directory beside `output_dir` and swaps it in at the end (`staging.staged_directory`): a
  non-empty `output_dir` is a `FileExistsError` unless `overwrite`, and an interrupted run leaves
  `output_dir` as it was. Returns the log.

  A run can span several processes: with `pause_after_s` it stops once that many seconds of
  training have passed in this call (at a step boundary, and not before a time budget's
  calibration), writes its state to `<output_dir>.resume` and returns the log so far
  with a `paused` entry instead of `final`; the same call with `resume=True` continues it there,
  on the same batches and learning rates as an uninterrupted run (`jaxspec.training.resume`).
  `time_budget_s` then counts the first call's set-up and the training of all calls (the total
  step count is fixed in the first). The tokenizer is the first call's; `tokenizer_path` and
  `init_from` are not read again.
  """
  import tokenizers

  staging.check_output_dir(output_dir, overwrite)  # before any work
  if config.init_from is not None and tokenizer_path is not None:
    raise ValueError("pass init_from or tokenizer_path, not both: init_from brings its tokenizer")
  if pause_after_s is not None and not pause_after_s > 0:
    raise ValueError(f"pause_after_s must be positive, got {pause_after_s}")
  paused_run = None
  if resume:  # read before any other work: a missing or foreign state fails fast
    paused_run = resume_state.load(output_dir, dataclasses.asdict(config))
  elif resume_state.resume_dir(output_dir).exists():
    raise FileExistsError(
      f"{resume_state.resume_dir(output_dir)} holds a paused run of this output directory: "
      "resume it (--resume, resume=True) or remove it"
    )
  wall_start = time.perf_counter()
  initial_model, tokenizer = None, None
  if paused_run is not None:
    tokenizer = paused_run.tokenizer
  elif config.init_from is not None:
    tokenizer = check_initial_checkpoint(config)
    initial_model = load_pretrained(config.init_from, dtype=jnp.float32)
  elif tokenizer_path is not None:
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
  source = Path(corpus_source) if corpus_source is not None else None
  train_files, held_out_files = corpus.split_corpus(source, max_files=config.max_train_files)
  if tokenizer is None:
    tokenizer = bpe.train_bpe((f.text for f in train_files), config.vocab_size)
  train_stream, file_tokens, definitions = training_stream(
    tokenizer, train_files, config.definition_documents
  )
  held_out_stream = encode_files(tokenizer, held_out_files)
  held_out_bytes = sum(len(f.text.encode("utf-8")) for f in held_out_files)
  held_out = eval_windows(
    held_out_stream, config.seq_len, config.eval_draft_depth, config.max_eval_windows
  )
  model_config = MODEL_PRESETS[config.model_preset](tokenizer.get_vocab_size())
  malformed = unlikelihood.malformed_tokens(HfTokenizer(tokenizer).token_bytes())
  trainer = Trainer(model_config, config, initial_model, malformed)
  kept = None  # with keep="validation": (the best evaluation so far, a copy of its parameters)
  if paused_run is not None:
    kept_like = trainer.params if config.keep == "validation" else None
    trainer.params, trainer.opt_state, kept_params = resume_state.restore(
      paused_run.arrays, (trainer.params, trainer.opt_state, kept_like)
    )
    if kept_params is not None:
      kept = paused_run.kept_metrics, kept_params
  stream = jax.device_put(jnp.asarray(train_stream))
  data_s = time.perf_counter() - wall_start

  log: dict[str, Any] = {
    "train_config": dataclasses.asdict(config),
    "model_config": model_config.to_hf_dict(),
    "num_params": trainer.num_params,
    "corpus": _describe_corpus(source, train_files, held_out_files, file_tokens)
    | {
      "definition_documents": definitions,
      "stream_tokens": int(train_stream.size),
      "held_out_windows": len(held_out),
      # Cross-entropy per token depends on the tokenizer; per byte it does not.
      "held_out_bytes_per_token": held_out_bytes / len(held_out_stream),
    },
    "initial_checkpoint": None
    if config.init_from is None
    else {"model_sha256": _sha256(Path(config.init_from) / "model.safetensors")},
    "device": str(jax.devices()[0].device_kind),
    "jax_version": jax.__version__,
    "history": [],
    "evals": [],
  }
  bits_per_nat_byte = len(held_out_stream) / held_out_bytes / math.log(2)

  def demo_report(params, prompt_texts):
    # The weights as saved (bf16), in the two precisions `generate` serves them in (bf16 by
    # default, `--dtype float32`); the worse of the two counts (`demos.worst_of`), the bf16 text
    # is shown.
    reports = {}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
      model = nnx.merge(trainer.graphdef, _saved_params(params, dtype))
      reports[name] = healed_demo_quality(
        HfTokenizer(tokenizer),
        model_config.vocab_size,
        lambda ids, masks, model=model: greedy_continuations(
          model, ids, masks, config.demo_new_tokens, model_config.eos_token_ids
        ),
        prompt_texts,
        stop_token_ids=model_config.eos_token_ids,
      )
    return worst_of(reports, samples_from="bfloat16")

  def evaluation():
    metrics = trainer.evaluate(held_out)
    if config.keep == "validation":
      report = demo_report(trainer.params, VALIDATION_PROMPTS)
      metrics["validation_demo_max_line_repeats"] = report["max_line_repeats"]
      metrics["validation_demo_parse_rate"] = report["parse_rate"]
    return metrics

  if paused_run is not None:
    # Training must go on over the same token stream: another corpus would change the batches.
    if json.loads(json.dumps(log["corpus"])) != paused_run.log["corpus"]:
      raise ValueError(
        "the corpus differs from the paused run's (pass the --corpus, corpus_source, it started "
        "with)"
      )
    log = paused_run.log

  def run_eval(step):
    nonlocal kept
    metrics = {"step": step, **evaluation()}
    metrics["lm_bits_per_byte"] = metrics["lm_loss"] * bits_per_nat_byte
    log["evals"].append(metrics)
    line = (
      f"step {step}: held-out CE {metrics['lm_loss']:.3f} ({metrics['lm_bits_per_byte']:.3f} "
      f"bits/byte), MTP agreement {metrics['mtp_agreement']:.3f}, tokens/step (k=3, teacher-"
      f"forced) {metrics['tokens_per_step_k3']:.2f}"
    )
    if config.keep == "validation":
      line += (
        f", validation demos: line x{metrics['validation_demo_max_line_repeats']}, "
        f"{metrics['validation_demo_parse_rate']:.2f} parse"
      )
      if kept is None or _validation_key(metrics) > _validation_key(kept[0]):
        # The train step donates the parameters' buffers: the kept ones are a copy.
        kept = metrics, jax.tree.map(jnp.copy, trainer.params)
    tqdm.write(f"{line}; {time.perf_counter() - wall_start:.0f} s")
    return metrics

  if paused_run is None:
    run_eval(0)
    eval_start = time.perf_counter()  # a second evaluation, without its compile, times one
    evaluation()
    eval_s = time.perf_counter() - eval_start
    first_step, total_steps, train_s_before, wall_s_before = 0, config.steps, 0.0, 0.0
  else:
    eval_s, train_s_before, wall_s_before = paused_run.eval_s, paused_run.train_s, paused_run.wall_s
    first_step, total_steps = paused_run.next_step, paused_run.total_steps
  key = jax.random.key(config.seed)
  # The step time is measured within the warm-up, whose learning rates do not depend on the total
  # (the cosine's do); step 0 compiles, so the measurement starts later.
  calibrate_to = min(config.warmup_steps, 35)
  calibrate_from = 5 if calibrate_to >= 15 else 1
  calibrated = config.time_budget_s is None or paused_run is not None
  bar = tqdm(
    range(first_step, config.steps),
    desc="train",
    unit="step",
    initial=first_step,
    total=total_steps,
    disable=not progress,
  )
  train_start = time.perf_counter()
  for step in bar:
    if step >= total_steps:
      break
    if not calibrated and step in (calibrate_from, calibrate_to):
      jax.block_until_ready(trainer.params)
      if step == calibrate_from:
        calibrate_start = time.perf_counter()
      else:
        per_step = (time.perf_counter() - calibrate_start) / (calibrate_to - calibrate_from)
        elapsed = time.perf_counter() - wall_start
        total_steps = steps_within_budget(config, step, elapsed, per_step, eval_s)
        bar.total, calibrated = total_steps, True
        tqdm.write(
          f"time budget: {per_step * 1e3:.1f} ms per step, {eval_s:.1f} s per evaluation, "
          f"{elapsed:.0f} s spent: {total_steps} steps"
        )
    lr = learning_rate(step, total_steps, config)
    metrics = trainer.train_step(stream, jax.random.fold_in(key, step), lr)
    if step % config.log_every == 0 or step == total_steps - 1:
      record = {"step": step, "lr": lr, **{k: float(v) for k, v in metrics.items()}}
      record["elapsed_s"] = time.perf_counter() - train_start
      log["history"].append(record)
      bar.set_postfix(loss=f"{record['loss']:.3f}", mtp=f"{record['mtp_loss']:.3f}")
    if (step + 1) % config.eval_every == 0 and step + 1 < total_steps:
      run_eval(step + 1)
    if (
      pause_after_s is not None
      and calibrated
      and step + 1 < total_steps
      and time.perf_counter() - train_start >= pause_after_s
    ):
      bar.close()
      jax.block_until_ready(trainer.params)
      paused = resume_state.PausedRun(
        config=dataclasses.asdict(config),
        tokenizer=tokenizer,
        arrays=(trainer.params, trainer.opt_state, None if kept is None else kept[1]),
        next_step=step + 1,
        total_steps=total_steps,
        eval_s=eval_s,
        train_s=train_s_before + time.perf_counter() - train_start,
        wall_s=wall_s_before + time.perf_counter() - wall_start,
        log=log,
        kept_metrics=None if kept is None else kept[0],
      )
      path = resume_state.save(output_dir, paused)
      tqdm.write(f"paused after step {step + 1} of {total_steps}; state in {path}")
      return log | {
        "paused": {"next_step": step + 1, "total_steps": total_steps, "state": str(path)}
      }
  bar.close()
  jax.block_until_ready(trainer.params)
  train_s = train_s_before + time.perf_counter() - train_start
  final = run_eval(total_steps)

  params = trainer.params
  if kept is not None:
    final, params = kept
    tqdm.write(f"kept the checkpoint of step {final['step']} (--keep validation)")
  model = nnx.merge(trainer.graphdef, params)
  demos = demo_report(params, DEMO_PROMPTS)
  # The train losses logged last at or before the kept step, computed on its parameters when
  # logged at it.
  trained = [h for h in log["history"] if h["step"] <= final["step"]]
  log["final"] = {
    "steps": total_steps,
    "kept_step": final["step"],
    "train_lm_loss": trained[-1]["lm_loss"],
    "train_mtp_loss": trained[-1]["mtp_loss"],
    **{f"held_out_{k}": v for k, v in final.items() if k != "step"},
    "demo_max_line_repeats": demos["max_line_repeats"],
    "demo_parse_rate": demos["parse_rate"],
    "demo_by_precision": demos["by_name"],
  }
  # Occurrences 2, 3, ... of repeated held-out spans: how strongly the model copies a loop, over
  # fewer places when the evaluation is capped (`max_eval_windows`, the smoke runs).
  rows = min(repetition.DIAGNOSTIC_ROWS, config.max_eval_windows or repetition.DIAGNOSTIC_ROWS)
  log["final"]["held_out_repeats"] = repetition.repetition_profiles(
    model, held_out_stream, KernelChoices(), rows=rows
  )
  log["samples"] = demos["samples"]
  with staging.staged_directory(output_dir, overwrite) as directory:
    save_pretrained(model, directory, dtype=jnp.bfloat16)
    bpe.save_tokenizer(tokenizer, directory)
    with open(directory / "generation_config.json", "w") as f:
      json.dump(generation_config(model_config), f, indent=2)
    log["checkpoint_bytes"] = sum(
      (directory / name).stat().st_size
      for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    )
    log["timing"] = {
      "data_and_tokenizer_s": data_s,
      "eval_s": eval_s,
      "train_s": train_s,
      "tokens_per_s": total_steps * config.batch_size * config.seq_len / train_s,
      # With pauses: the wall time of every call (set-up repeated in each), not only this one's.
      "total_s": wall_s_before + time.perf_counter() - wall_start,
    }
    with open(directory / "training_log.json", "w") as f:
      json.dump(log, f, indent=1)
    plot_losses(log, directory / "loss.png")
  resume_state.discard(output_dir)
  return log
