"""Writes tiny random Hugging Face GLM checkpoints plus reference outputs as test fixtures.

The jaxspec test suite checks its Flax models against Hugging Face transformers without importing
torch: this script (Python 3.11, torch CPU, transformers==5.23.0; see tests/fixtures/README.md)
writes, for every fixture, a folder `<out>/<name>/` with

  config.json, generation_config.json, model.safetensors   as `save_pretrained` writes them
                                                           (float32, per-expert tensor names as in
                                                           the real GLM checkpoints), plus one MTP
                                                           layer under `model.layers.{L}.*`
  reference.npz                                            reference outputs, see README.md

Every random draw comes from a fixed per-fixture seed, so two runs write identical bytes.

Fixtures whose reference depends on a near-tie (a router or indexer top-k boundary, or a greedy
argmax, closer than `_MIN_MARGIN`) would make a float32 re-implementation flip a discrete choice
for reasons unrelated to correctness; such a seed is rejected and the next one is tried, in a
fixed order, so the output stays deterministic.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import pathlib

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers import (
  Glm4MoeConfig,
  Glm4MoeForCausalLM,
  GlmMoeDsaConfig,
  GlmMoeDsaForCausalLM,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpModel
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as dsa_modeling

_TRANSFORMERS_VERSION = "5.23.0"
_BATCH, _SEQ = 2, 11  # input_ids of the plain forward and of the MTP reference
_PROMPT_LEN, _NEW_TOKENS = 7, 24  # greedy generation
_MIN_MARGIN = 1e-4  # smallest accepted gap at any top-k boundary or greedy argmax
_MAX_SEED_TRIES = 64
_MASKED = -1e30  # scores at or below this are masked-out candidates

# Tiny configs. Keys are Hugging Face config fields; `_legacy_rope` writes config.json with
# top-level `rope_theta` / `partial_rotary_factor` (the form of the GLM-4.5 hub checkpoints)
# instead of `rope_parameters`; `_mtp_shared_copies` also stores the MTP layer's own copies of
# `embed_tokens` and `shared_head.head` (identical to the target's), as some GLM exports do.
GLM4_MOE_FIXTURES = {
  "glm4_moe_a": dict(
    seed=1000,
    vocab_size=160,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,  # G = 3
    head_dim=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    use_qk_norm=True,
    attention_bias=False,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
  ),
  "glm4_moe_b": dict(
    seed=2000,
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # G = 1
    head_dim=16,  # != hidden_size / num_attention_heads = 8
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 1.0},
    _legacy_rope=True,
    use_qk_norm=False,
    attention_bias=True,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=0,
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
    tie_word_embeddings=True,
  ),
  "glm4_moe_c": dict(
    seed=3000,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,  # G = 4
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25},
    _mtp_shared_copies=True,
    use_qk_norm=True,
    attention_bias=True,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.0,
    tie_word_embeddings=False,
  ),
}

GLM_MOE_DSA_FIXTURES = {
  "glm_moe_dsa_a": dict(
    seed=4000,
    vocab_size=160,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,  # < input length 11: the indexer really prunes
    index_topk_freq=2,  # with offset 1: full, shared, full
    index_skip_topk_offset=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attention_bias=False,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    tie_word_embeddings=False,
  ),
  "glm_moe_dsa_b": dict(
    seed=5000,
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=16,  # > input length 11 (dense there), < 31 tokens at the end of generation
    indexer_types=["full", "shared", "shared"],
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=True,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=0,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    tie_word_embeddings=False,
  ),
}

_INIT_STD = 0.1  # initializer_range: large enough that logits and attention are far from flat


class NearTieError(Exception):
  """A discrete choice of the reference (top-k or argmax) is closer than _MIN_MARGIN to a tie."""


def _check_gap(sorted_desc, k, what):
  """Raises NearTieError if the k-th and (k+1)-th of finite, descending values are too close."""
  # sorted_desc: [..., n] descending. Masked candidates hold -inf (router) or about
  # finfo(float32).min (indexer: the additive causal mask); they never compete with live ones.
  if k >= sorted_desc.shape[-1]:
    return
  kth, next_ = sorted_desc[..., k - 1], sorted_desc[..., k]
  live = next_ > _MASKED
  gap = (kth - next_)[live]
  if gap.numel() and float(gap.min()) < _MIN_MARGIN:
    raise NearTieError(f"{what}: top-{k} boundary gap {float(gap.min()):.2e}")


class _TieMonitor:
  """Checks every router, indexer and greedy decision made by a model for near-ties."""

  def __init__(self, model, router_cls, indexer_cls=None):
    self._handles = []
    self._in_indexer = False
    for module in model.modules():
      if isinstance(module, router_cls):
        self._handles.append(module.register_forward_hook(self._router_hook))
      if indexer_cls is not None and isinstance(module, indexer_cls):
        self._handles.append(module.register_forward_pre_hook(self._enter_indexer))
        self._handles.append(module.register_forward_hook(self._leave_indexer))

  @staticmethod
  def _router_hook(router, inputs, outputs):
    # Mirrors the selection of Glm4MoeTopkRouter.forward on its own output logits.
    router_logits = outputs[0]
    scores = router_logits.sigmoid() + router.e_score_correction_bias
    per_group = scores.view(-1, router.num_group, router.num_experts // router.num_group)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
    if router.topk_group < router.num_group:
      _check_gap(group_scores.sort(dim=-1, descending=True)[0], router.topk_group, "group choice")
      group_idx = group_scores.topk(router.topk_group, dim=-1)[1]
      keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
      scores = scores.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1), -torch.inf)
    _check_gap(scores.sort(dim=-1, descending=True)[0], router.top_k, "expert choice")

  def _enter_indexer(self, module, inputs):
    self._in_indexer = True

  def _leave_indexer(self, module, inputs, outputs):
    self._in_indexer = False

  @contextlib.contextmanager
  def active(self):
    """Wraps Tensor.topk so the indexer's own index_scores are checked where it takes its top-k."""
    original_topk = torch.Tensor.topk

    def checked_topk(tensor, k, *args, **kwargs):
      if self._in_indexer:
        _check_gap(tensor.sort(dim=-1, descending=True)[0], k, "indexer top-k")
      return original_topk(tensor, k, *args, **kwargs)

    torch.Tensor.topk = checked_topk
    try:
      yield
    finally:
      torch.Tensor.topk = original_topk

  def remove(self):
    for handle in self._handles:
      handle.remove()


def _check_argmax(logits, what):
  # logits: [..., V]; the greedy choice must win by at least _MIN_MARGIN.
  _check_gap(logits.sort(dim=-1, descending=True)[0], 1, what)


def _randomize(model, generator):
  """Replaces Hugging Face's init where it would hide bugs: norms, biases, correction bias."""
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
      elif name.endswith(".bias"):
        param.copy_(0.1 * torch.randn(param.shape, generator=generator))
      else:
        param.copy_(_INIT_STD * torch.randn(param.shape, generator=generator))
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        # Zero in a fresh HF model; non-zero here so that a re-implementation that lets the
        # bias leak into the expert weights (it is used only for the selection) fails.
        buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))


def _split_experts(state, prefix):
  """Fused `{prefix}experts.{gate_up_proj,down_proj}` -> per-expert checkpoint tensors."""
  gate_up = state.pop(f"{prefix}experts.gate_up_proj")  # [E, 2 * I, H], gate rows first
  down = state.pop(f"{prefix}experts.down_proj")  # [E, H, I]
  inter = gate_up.shape[1] // 2
  for expert in range(gate_up.shape[0]):
    state[f"{prefix}experts.{expert}.gate_proj.weight"] = gate_up[expert, :inter]
    state[f"{prefix}experts.{expert}.up_proj.weight"] = gate_up[expert, inter:]
    state[f"{prefix}experts.{expert}.down_proj.weight"] = down[expert]


def _mtp_checkpoint_tensors(enorm, hnorm, eh_proj, block, post_norm, layer):
  """Names the MTP layer's tensors as GLM checkpoints do: `model.layers.{L}.*`."""
  prefix = f"model.layers.{layer}."
  state = {f"{prefix}{k}": v for k, v in block.state_dict().items()}
  _split_experts(state, f"{prefix}mlp.")
  state[f"{prefix}enorm.weight"] = enorm.weight
  state[f"{prefix}hnorm.weight"] = hnorm.weight
  state[f"{prefix}eh_proj.weight"] = eh_proj.weight
  state[f"{prefix}shared_head.norm.weight"] = post_norm.weight
  return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in state.items()}


def _append_tensors(folder, extra):
  path = folder / "model.safetensors"
  tensors = safetensors.torch.load_file(path)
  overlap = set(tensors) & set(extra)
  if overlap:
    raise RuntimeError(f"MTP tensors collide with the target's: {sorted(overlap)}")
  tensors.update(extra)
  safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def _to_legacy_rope(folder):
  """Rewrites config.json with top-level rope fields, as the GLM-4.5 hub config.json has them."""
  path = folder / "config.json"
  config = json.loads(path.read_text())
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope["rope_theta"]
  config["partial_rotary_factor"] = rope["partial_rotary_factor"]
  path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _greedy(model, prompt_ids, monitor):
  with monitor.active():
    # An explicit all-ones mask: without it transformers takes prompt tokens equal to the pad id
    # (0) for left padding and drops them from the context.
    out = model.generate(
      prompt_ids,
      attention_mask=torch.ones_like(prompt_ids),
      do_sample=False,
      max_new_tokens=_NEW_TOKENS,
      min_new_tokens=_NEW_TOKENS,
      eos_token_id=None,
      pad_token_id=0,
      output_scores=True,
      return_dict_in_generate=True,
    )
  for step, scores in enumerate(out.scores):
    _check_argmax(scores, f"greedy step {step}")
  return out.sequences[:, prompt_ids.shape[1] :]


def _inputs(generator, vocab_size):
  input_ids = torch.randint(0, vocab_size, (_BATCH, _SEQ), generator=generator)
  prompt_ids = torch.randint(0, vocab_size, (1, _PROMPT_LEN), generator=generator)
  return input_ids, prompt_ids


def _mtp_inputs(model, input_ids, monitor):
  """Target forward and the MTP inputs exactly as MTPCandidateGenerator builds them at prefill."""
  with monitor.active():
    # MTPCandidateGenerator asks for `output_hidden_states=-1`: the last entry is tied to
    # `last_hidden_state`, i.e. the target's final hidden state AFTER the final norm.
    out = model(input_ids, output_hidden_states=-1)
  logits, hidden = out.logits, out.hidden_states[-1]
  _check_argmax(logits[:, -1], "target last-position argmax")
  # Row j of the MTP layer: token j + 1 (the last one is the target's greedy token), the target's
  # hidden state at position j, rotary position j + 1 (the token's own position).
  next_ids = torch.cat([input_ids[:, 1:], logits[:, -1].argmax(-1, keepdim=True)], dim=1)
  positions = torch.arange(1, _SEQ + 1).unsqueeze(0).expand(_BATCH, -1)
  return logits, hidden, next_ids, positions


def _save_reference(folder, **arrays):
  expected = {
    "input_ids": ((_BATCH, _SEQ), np.int64),
    "logits": ((_BATCH, _SEQ, None), np.float32),
    "prompt_ids": ((1, _PROMPT_LEN), np.int64),
    "greedy_ids": ((1, _NEW_TOKENS), np.int64),
    "mtp_hidden": ((_BATCH, _SEQ, None), np.float32),
    "mtp_next_ids": ((_BATCH, _SEQ), np.int64),
    "mtp_positions": ((_BATCH, _SEQ), np.int64),
    "mtp_logits": ((_BATCH, _SEQ, None), np.float32),
  }
  out = {}
  for name, (shape, dtype) in expected.items():
    value = arrays[name].detach().cpu().numpy().astype(dtype)
    if len(value.shape) != len(shape) or any(
      want is not None and got != want for got, want in zip(value.shape, shape, strict=True)
    ):
      raise RuntimeError(f"{name}: shape {value.shape}, expected {shape}")
    if not np.all(np.isfinite(value)):
      raise RuntimeError(f"{name}: non-finite values")
    out[name] = value
  # np.savez writes zip entries with a fixed timestamp, so the bytes are reproducible.
  np.savez(folder / "reference.npz", **out)


def _glm4_moe_attempt(name, spec, seed, out_dir):
  torch.manual_seed(seed)
  generator = torch.Generator().manual_seed(seed)
  fields = {k: v for k, v in spec.items() if not k.startswith("_") and k != "seed"}
  config = Glm4MoeConfig(
    **fields,
    initializer_range=_INIT_STD,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
  )
  config._attn_implementation = "eager"
  model = Glm4MoeForCausalLM(config).eval()
  _randomize(model, generator)
  mtp = MtpModel(model, 1).eval()
  _randomize(mtp.layers, generator)
  input_ids, prompt_ids = _inputs(generator, config.vocab_size)

  monitor = _TieMonitor(model, type(model.model.layers[-1].mlp.gate))
  mtp_monitor = _TieMonitor(mtp, type(model.model.layers[-1].mlp.gate))
  with torch.no_grad():
    logits, hidden, next_ids, positions = _mtp_inputs(model, input_ids, monitor)
    with mtp_monitor.active():
      # MtpModel.forward keeps only the last row's logits; forward_layer + _project_to_logits are
      # the same code for every row.
      mtp_hidden_out = mtp.forward_layer(0, hidden, positions, None, input_ids=next_ids)
      mtp_logits = mtp._project_to_logits(mtp_hidden_out)
    greedy_ids = _greedy(model, prompt_ids, monitor)
  monitor.remove()
  mtp_monitor.remove()

  folder = out_dir / name
  folder.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(folder, safe_serialization=True)
  layer = config.num_hidden_layers
  mtp_layer = mtp.layers[0]
  extra = _mtp_checkpoint_tensors(
    mtp_layer.enorm,
    mtp_layer.hnorm,
    mtp_layer.eh_proj,
    mtp_layer.mtp_block,
    mtp_layer.post_norm,
    layer,
  )
  if spec.get("_mtp_shared_copies"):
    extra[f"model.layers.{layer}.embed_tokens.weight"] = model.model.embed_tokens.weight.clone()
    extra[f"model.layers.{layer}.shared_head.head.weight"] = model.lm_head.weight.clone()
  _append_tensors(folder, extra)
  if spec.get("_legacy_rope"):
    _to_legacy_rope(folder)

  _verify_glm4_moe_reload(folder, input_ids, logits, hidden, next_ids, positions, mtp_logits)
  _save_reference(
    folder,
    input_ids=input_ids,
    logits=logits,
    prompt_ids=prompt_ids,
    greedy_ids=greedy_ids,
    mtp_hidden=hidden,
    mtp_next_ids=next_ids,
    mtp_positions=positions,
    mtp_logits=mtp_logits,
  )


def _verify_glm4_moe_reload(folder, input_ids, logits, hidden, next_ids, positions, mtp_logits):
  """Reloads the folder with transformers' own loaders; logits must match bit for bit."""
  model = Glm4MoeForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
  layer = model.config.num_hidden_layers
  # The class only knows the MTP layer indices of the full-size checkpoints (46, 92); point
  # MtpModel's weight regex at this checkpoint's MTP layer.
  model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layer}\..*"]
  mtp = MtpModel.from_pretrained(model).eval()
  with torch.no_grad():
    reloaded = model(input_ids, output_hidden_states=-1)
    mtp_hidden_out = mtp.forward_layer(
      0, reloaded.hidden_states[-1], positions, None, input_ids=next_ids
    )
    reloaded_mtp_logits = mtp._project_to_logits(mtp_hidden_out)
  for what, got, want in [
    ("logits", reloaded.logits, logits),
    ("mtp_hidden", reloaded.hidden_states[-1], hidden),
    ("mtp_logits", reloaded_mtp_logits, mtp_logits),
  ]:
    if not torch.equal(got, want):
      diff = float((got - want).abs().max())
      raise RuntimeError(f"{folder.name}: reloaded {what} differ (max abs {diff:.3e})")


class DsaMtpLayer(torch.nn.Module):
  """GLM-5 MTP layer built from transformers' own GlmMoeDsaDecoderLayer.

  transformers 5.23.0's MtpModel cannot run `glm_moe_dsa`: its config has no `num_mtp_layers`,
  `get_mtp_config` refuses a config with `layer_types` but no `mtp_layer_types`
  (configuration_utils.py:1617-1621), the MTP mask helper only knows full/sliding/linear
  attention (modeling_layers.py:485-491), and GlmMoeDsaDecoderLayer returns a tuple
  (hidden_states, topk_indices) where MtpLayer expects a tensor (modeling_layers.py:359-368).
  This module follows MtpLayer.forward (modeling_layers.py:343-370) and MtpModel.forward_layer
  (modeling_layers.py:568-609) line by line, with the decoder layer's mask built as
  GlmMoeDsaModel.forward builds it (modeling_glm_moe_dsa.py:696-705). The MTP block runs its own
  indexer ("full"), like layer 0 of the MTP config would.
  """

  def __init__(self, config):
    super().__init__()
    mtp_config = copy.deepcopy(config)
    mtp_config.num_hidden_layers = 1
    mtp_config.mlp_layer_types = ["sparse"]
    mtp_config.indexer_types = ["full"]
    mtp_config.layer_types = ["indexed_attention"]
    self.config = mtp_config
    norm = dsa_modeling.GlmMoeDsaRMSNorm
    self.enorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    self.hnorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    self.eh_proj = torch.nn.Linear(config.hidden_size * 2, config.hidden_size, bias=False)
    self.mtp_block = dsa_modeling.GlmMoeDsaDecoderLayer(mtp_config, 0)
    self.post_norm = norm(config.hidden_size, eps=config.rms_norm_eps)

  def forward(self, target, input_ids, previous_hidden_state, position_ids):
    inputs_embeds = target.model.embed_tokens(input_ids)
    mask = create_causal_mask(
      config=self.config,
      inputs_embeds=inputs_embeds,
      attention_mask=None,
      past_key_values=None,
      position_ids=position_ids,
      allow_is_causal_skip=False,
    )
    position_embeddings = target.model.rotary_emb(inputs_embeds, position_ids=position_ids)
    projection_input = torch.cat(
      [self.enorm(inputs_embeds), self.hnorm(previous_hidden_state)], dim=-1
    )
    hidden_states = self.eh_proj(projection_input)
    hidden_states, _ = self.mtp_block(
      hidden_states,
      attention_mask=mask,
      position_embeddings=position_embeddings,
      position_ids=position_ids,
      past_key_values=None,
    )
    return self.post_norm(hidden_states)


def _dsa_attempt(name, spec, seed, out_dir):
  torch.manual_seed(seed)
  generator = torch.Generator().manual_seed(seed)
  fields = {k: v for k, v in spec.items() if not k.startswith("_") and k != "seed"}
  config = GlmMoeDsaConfig(
    **fields,
    initializer_range=_INIT_STD,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
  )
  config._attn_implementation = "eager"
  model = GlmMoeDsaForCausalLM(config).eval()
  _randomize(model, generator)
  mtp = DsaMtpLayer(config).eval()
  mtp.mtp_block.self_attn.config._attn_implementation = "eager"
  _randomize(mtp, generator)
  input_ids, prompt_ids = _inputs(generator, config.vocab_size)

  router_cls = dsa_modeling.GlmMoeDsaTopkRouter
  indexer_cls = dsa_modeling.GlmMoeDsaIndexer
  monitor = _TieMonitor(model, router_cls, indexer_cls)
  mtp_monitor = _TieMonitor(mtp, router_cls, indexer_cls)
  with torch.no_grad():
    logits, hidden, next_ids, positions = _mtp_inputs(model, input_ids, monitor)
    with mtp_monitor.active():
      mtp_logits = model.lm_head(mtp(model, next_ids, hidden, positions))
    greedy_ids = _greedy(model, prompt_ids, monitor)
  monitor.remove()
  mtp_monitor.remove()

  folder = out_dir / name
  folder.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(folder, safe_serialization=True)
  extra = _mtp_checkpoint_tensors(
    mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.mtp_block, mtp.post_norm, config.num_hidden_layers
  )
  _append_tensors(folder, extra)

  reloaded = GlmMoeDsaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
  with torch.no_grad():
    if not torch.equal(reloaded(input_ids).logits, logits):
      raise RuntimeError(f"{name}: reloaded logits differ")
  _save_reference(
    folder,
    input_ids=input_ids,
    logits=logits,
    prompt_ids=prompt_ids,
    greedy_ids=greedy_ids,
    mtp_hidden=hidden,
    mtp_next_ids=next_ids,
    mtp_positions=positions,
    mtp_logits=mtp_logits,
  )


def _build(name, spec, attempt_fn, out_dir):
  for seed in range(spec["seed"], spec["seed"] + _MAX_SEED_TRIES):
    try:
      attempt_fn(name, spec, seed, out_dir)
    except NearTieError as err:
      print(f"{name}: seed {seed} rejected ({err})")
      continue
    return seed
  raise RuntimeError(f"{name}: no seed without near-ties in {_MAX_SEED_TRIES} tries")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/fixtures"))
  parser.add_argument("--only", nargs="*", help="fixture names to build (default: all)")
  args = parser.parse_args()
  if transformers.__version__ != _TRANSFORMERS_VERSION:
    raise SystemExit(
      f"needs transformers=={_TRANSFORMERS_VERSION}, found {transformers.__version__}"
    )
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()

  fixtures = [(n, s, _glm4_moe_attempt) for n, s in GLM4_MOE_FIXTURES.items()]
  fixtures += [(n, s, _dsa_attempt) for n, s in GLM_MOE_DSA_FIXTURES.items()]
  for name, spec, attempt_fn in fixtures:
    if args.only and name not in args.only:
      continue
    seed = _build(name, spec, attempt_fn, args.out)
    folder = args.out / name
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
      digest.update(path.name.encode() + path.read_bytes())
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{name}: seed {seed}, {size / 1024:.0f} KiB, sha256 {digest.hexdigest()[:16]}")


if __name__ == "__main__":
  main()
