"""Tensor + expert parallelism on 8 virtual CPU devices: sharded results equal one device's.

`--xla_force_host_platform_device_count=8` must be set before jax is imported, so every check
runs in a fresh interpreter (`_run_on_8_devices`); the rest of the suite keeps one device. Each
script asserts and prints one line per case; a failing assertion fails the test with its output.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxspec.testing import appended_xla_flags

REPO = Path(__file__).parents[1]

_PRELUDE = """
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxspec
from jaxspec.model.config import tiny
from jaxspec.model.dsa_config import tiny_dsa
from jaxspec.model.metadata import KernelChoices, StepMetadata

assert len(jax.devices()) == 8, jax.devices()
FIXTURES = "tests/fixtures/"


def same_params(sharded, single):
  flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))
  ours, theirs = flat(sharded), flat(single)
  for path, variable in theirs.items():
    np.testing.assert_array_equal(np.asarray(ours[path].get_value()), variable.get_value())


def logits_and_mtp(model, ids, kernels):
  def run(ids):
    step = StepMetadata.plain(ids, kernels)
    hidden, _ = model.forward(ids, step)
    mtp_hidden, _ = model.mtp_forward(ids, hidden, step)
    return model.logits(hidden), model.mtp_logits(mtp_hidden)

  return [np.asarray(x) for x in jax.jit(run)(ids)]


MOE_PATHS = ("grouped", "per_route")


def outputs_by_moe_path(model, ids):
  return {moe: logits_and_mtp(model, ids, KernelChoices(moe=moe)) for moe in MOE_PATHS}


# single_outputs: outputs_by_moe_path of the single-device model on the same ids.
def assert_same_outputs(sharded, single_outputs, ids, label):
  for moe, want in single_outputs.items():
    got = logits_and_mtp(sharded, ids, KernelChoices(moe=moe))
    for name, a, b in zip(("logits", "mtp logits"), got, want):
      # float32 throughout: only the order of the partial sums differs.
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=label)
  print(label, "ok")
"""


def _run_on_8_devices(body: str) -> str:
  flags = appended_xla_flags("--xla_force_host_platform_device_count=8")
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  script = _PRELUDE + textwrap.dedent(body)
  result = subprocess.run(
    [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stdout + result.stderr[-6000:]
  return result.stdout


def test_sharded_fixtures_give_the_single_device_logits_and_mtp_logits():
  """Both families on the HF parity fixtures, over tp (KV heads split, or replicated when tp
  exceeds them), ep and both together, with parameters loaded straight into their shards."""
  out = _run_on_8_devices(
    """
    singles = {}
    for name, tp, ep in [
      ("glm4_moe_a", 2, 4), ("glm4_moe_a", 1, 8), ("glm4_moe_b", 4, 2), ("glm4_moe_c", 4, 1),
      ("glm_moe_dsa_a", 4, 2), ("glm_moe_dsa_b", 2, 4),
    ]:
      ids = jnp.asarray(np.load(FIXTURES + name + "/reference.npz")["input_ids"], jnp.int32)
      if name not in singles:  # each fixture's single-device run serves all its meshes
        single = jaxspec.load_pretrained(FIXTURES + name, dtype=jnp.float32)
        singles[name] = single, outputs_by_moe_path(single, ids)
      single, single_outputs = singles[name]
      mesh = jaxspec.make_mesh(tp=tp, ep=ep)
      sharded = jaxspec.load_pretrained(FIXTURES + name, dtype=jnp.float32, mesh=mesh)
      same_params(sharded, single)
      assert_same_outputs(sharded, single_outputs, ids, f"{name} tp={tp} ep={ep}")
    """
  )
  assert out.count(" ok") == 6, out


def test_tp8_on_eight_head_models_of_both_families():
  out = _run_on_8_devices(
    """
    for config in (
      tiny(num_attention_heads=8, num_key_value_heads=8, hidden_size=64, head_dim=8,
           moe_intermediate_size=16, n_group=1),
      tiny_dsa(
        num_attention_heads=8, num_key_value_heads=8, intermediate_size=64,
        moe_intermediate_size=16, n_group=1,
      ),
    ):
      single = jaxspec.GlmForCausalLM(config, rngs=nnx.Rngs(0))
      sharded = jaxspec.GlmForCausalLM(config, rngs=nnx.Rngs(0), mesh=jaxspec.make_mesh(tp=8))
      same_params(sharded, single)
      q_proj = sharded.model.layers[0].self_attn.q_b_proj if config.attention_kind == "mla" else (
        sharded.model.layers[0].self_attn.q_proj)
      shard_shapes = {s.data.shape for s in q_proj.kernel[...].addressable_shards}
      assert shard_shapes == {(q_proj.kernel.shape[0], q_proj.kernel.shape[1] // 8)}, shard_shapes
      ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)), jnp.int32)
      want = outputs_by_moe_path(single, ids)
      assert_same_outputs(sharded, want, ids, f"{config.model_type} tp=8")
    """
  )
  assert out.count(" ok") == 2, out


def test_speculative_decoding_on_a_mesh_equals_plain_greedy_on_one_device_without_recompiles():
  out = _run_on_8_devices(
    """
    from jaxspec.serving.engine import EngineConfig, Generator
    from jaxspec.serving.speculative import SpeculativeConfig, SpeculativeGenerator
    from jaxspec.testing import count_compiles

    engine = EngineConfig(max_batch_size=2, max_seq_len=48, page_size=4, attention_impl="xla")
    for name, tp, ep in [("glm4_moe_a", 2, 4), ("glm_moe_dsa_a", 4, 2)]:
      reference = np.load(FIXTURES + name + "/reference.npz")
      prompts = [reference["prompt_ids"][0].tolist(), [3, 4, 5]]
      single = jaxspec.load_pretrained(FIXTURES + name, dtype=jnp.float32)
      plain = Generator(single, engine).generate(prompts, max_new_tokens=20, stop_token_ids=())
      mesh = jaxspec.make_mesh(tp=tp, ep=ep)
      sharded = jaxspec.load_pretrained(FIXTURES + name, dtype=jnp.float32, mesh=mesh)
      generator = SpeculativeGenerator(sharded, engine, SpeculativeConfig(3))
      spec = generator.generate(prompts, max_new_tokens=20, stop_token_ids=())
      assert spec.tokens == plain.tokens, (spec.tokens, plain.tokens)
      assert spec.tokens[0] == reference["greedy_ids"][0, :20].tolist()
      for pages in generator.cache.layers:  # the cache lives in its shards
        for leaf in jax.tree.leaves(pages):
          assert len(leaf.sharding.device_set) == tp * ep
      with count_compiles() as count:
        again = generator.generate(prompts, max_new_tokens=24, stop_token_ids=())
      assert count.compiles == 0, count.compiles
      assert again.tokens[0][:20] == plain.tokens[0]
      print(name, "ok")
    """
  )
  assert out.count(" ok") == 2, out


# One interpreter for all the cases: each would spend more on starting it than on its check.
BAD_MESHES = [
  ("jaxspec.make_mesh(tp=3, ep=3)", "9 devices needed, but only 8"),
  ("jaxspec.make_mesh(tp=0)", "tp must be a positive int"),
  (
    "jaxspec.load_pretrained(FIXTURES + 'glm4_moe_a', mesh=jaxspec.make_mesh(tp=4))",
    "tp = 4 does not divide num_attention_heads = 6",
  ),
  (
    "jaxspec.load_pretrained(FIXTURES + 'glm4_moe_c', mesh=jaxspec.make_mesh(ep=8))",
    "ep = 8 does not divide n_routed_experts = 4",
  ),
]


def test_a_bad_mesh_is_a_clear_error():
  out = _run_on_8_devices(
    "".join(
      f"""
    try:
      {body}
    except ValueError as error:
      print("case {i} error:", error)
    """
      for i, (body, _) in enumerate(BAD_MESHES)
    )
  )
  errors = dict(line.split(" error: ", 1) for line in out.splitlines() if " error: " in line)
  for i, (_, message) in enumerate(BAD_MESHES):
    assert message in errors.get(f"case {i}", ""), out
