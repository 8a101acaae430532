"""Per-step metadata: where a step's tokens sit in the paged cache, and which kernels it runs.

Every forward pass of the model takes one `StepMetadata`. Its arrays describe the batch (device
values: positions, cache slots, block tables, lengths); its static fields say how to run the step
(`mode`) and which implementation each kernel uses (`KernelChoices`). Static fields are part of
the jit cache key, arrays are not, so a step compiles once per shape bucket and kernel choice.

Modes:

- `"plain"`: a causal forward over the given tokens at positions `positions`, nothing cached
  (`slot_mapping`, `block_tables`, `seq_lens` are None);
- `"prefill"`: a request's first tokens; keys/values are written to the cache and attention runs
  densely over the fresh tokens, keys past `seq_lens[b]` masked;
- `"decode"`: 1..8 new rows per request (plain decode, speculative verify, MTP draft); rows are
  written first, then attention reads the whole request from the paged cache.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jaxspec.kernels.dispatch import IMPLS, Impl

StepMode = Literal["plain", "prefill", "decode"]
STEP_MODES = ("plain", "prefill", "decode")
MoeImpl = Literal["per_route", "grouped", "dense", "pallas"]
MOE_IMPLS = ("per_route", "grouped", "dense", "pallas")
MoeChoice = Literal["auto", "xla", "per_route", "grouped", "dense", "pallas"]
MOE_CHOICES = ("auto", "xla") + MOE_IMPLS
IndexSharing = Literal["per_group", "per_layer"]
INDEX_SHARINGS = ("per_group", "per_layer")
CausalAttention = Literal["xla", "cudnn"]
CAUSAL_ATTENTIONS = ("xla", "cudnn")
EmbeddingGrad = Literal["scatter", "one_hot"]
EMBEDDING_GRADS = ("scatter", "one_hot")


@dataclasses.dataclass(frozen=True)
class KernelChoices:
  """The implementation of every kernel a step runs (static; part of the compiled step's key).

  Attributes:
    attention: `paged_decode_attention`'s `impl` in decode steps ("auto", "pallas", "xla").
    index_conversion: `convert_topk_to_physical`'s `impl` (GLM-5 decode steps).
    index_sharing: "per_group" converts an index group's top-k once, in its full layer, and the
      shared layers reuse the physical slots (GLM-5's design); "per_layer" converts in every
      layer (what a stack without sharing does; kept to measure and test the saving).
    moe: the routed experts' implementation ("pallas": the Mosaic GPU kernels; "grouped",
      "per_route", "dense": XLA, see `jaxspec.model.moe`); "auto" lets the model decide from
      the number of rows a forward pass starts with, *before* any row pruning
      (`jaxspec.model.moe.choose_moe_impl`), so pruned and unpruned passes choose alike; "xla"
      decides the same way between the XLA paths only.
    causal_attention: the causal attention of "plain" forward passes (training, evaluation):
      "xla", the float32-softmax reference (`attention.dense_causal_attention`), or "cudnn",
      cuDNN's fused flash attention through `jax.nn.dot_product_attention` (a GPU with cuDNN,
      bf16/fp16 activations; it never materialises the [T, T] scores; GQA attention only).
    embedding_grad: how a gradient of the embedding table is formed (training only; the lookup
      itself is the same gather): "scatter" (XLA scatter-add) or "one_hot" (one matmul, immune
      to the atomics contention of frequent tokens; `jaxspec.model.layers.Embedding`).
    interpret: run every Pallas kernel of the step in GPU interpret mode (tests on the CPU).
  """

  attention: Impl = "auto"
  index_conversion: Impl = "auto"
  index_sharing: IndexSharing = "per_group"
  moe: MoeChoice = "auto"
  causal_attention: CausalAttention = "xla"
  embedding_grad: EmbeddingGrad = "scatter"
  interpret: bool = False

  def __post_init__(self):
    for name, allowed in (
      ("attention", IMPLS),
      ("index_conversion", IMPLS),
      ("index_sharing", INDEX_SHARINGS),
      ("moe", MOE_CHOICES),
      ("causal_attention", CAUSAL_ATTENTIONS),
      ("embedding_grad", EMBEDDING_GRADS),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(
          f"KernelChoices.{name} must be one of {allowed}, got {getattr(self, name)!r}"
        )

  def replace(self, **changes) -> "KernelChoices":
    """A copy with the given fields replaced, checked again."""
    return dataclasses.replace(self, **changes)


DEFAULT_KERNELS = KernelChoices()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """The batch description of one step; all fields are device arrays but `mode` and `kernels`.

  `slot_mapping` holds flat cache slots (`page * page_size + offset`); -1 marks a row whose key
  and value must not be written (padding). `seq_lens[b]` is request b's KV length *after* this
  step's rows are written; 0 marks a padding request.
  """

  positions: jax.Array  # int32 [B, T], RoPE position of every row
  slot_mapping: jax.Array | None = None  # int32 [B, T]
  block_tables: jax.Array | None = None  # int32 [B, max_pages_per_req]
  seq_lens: jax.Array | None = None  # int32 [B]
  mode: StepMode = dataclasses.field(default="plain", metadata=dict(static=True))
  kernels: KernelChoices = dataclasses.field(default=KernelChoices(), metadata=dict(static=True))

  def __post_init__(self):
    if self.mode not in STEP_MODES:
      raise ValueError(f"StepMetadata.mode must be one of {STEP_MODES}, got {self.mode!r}")
    if not isinstance(self.kernels, KernelChoices):
      raise ValueError(f"StepMetadata.kernels must be a KernelChoices, got {self.kernels!r}")

  @classmethod
  def plain(cls, input_ids: jax.Array, kernels: KernelChoices = DEFAULT_KERNELS) -> "StepMetadata":
    """A causal forward over `input_ids` [B, T] at positions 0..T-1."""
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    return cls(positions=positions, kernels=kernels)

  @property
  def cached(self) -> bool:
    """Whether the step reads and writes a paged cache."""
    return self.mode != "plain"

  def replace(self, **changes) -> "StepMetadata":
    """A copy with the given fields replaced."""
    return dataclasses.replace(self, **changes)
