"""Loading straight into shards (`load_pretrained(..., sharding_for=rule)`) on 8 CPU devices.

`--xla_force_host_platform_device_count=8` must be set before jax is imported, so each test runs
its checks in a fresh interpreter (`_run_on_8_devices`) and the rest of the suite keeps one device.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxspec.testing import appended_xla_flags

REPO = Path(__file__).parents[2]
FIXTURES = REPO / "tests" / "fixtures"

# Shared by every script: a tensor-parallel-like rule and the comparison with the unsharded load.
_PRELUDE = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxspec
from jaxspec.model import weights

assert len(jax.devices()) == 8, jax.devices()
FIXTURES = sys.argv[1]


def mesh_of(**axes):
  return Mesh(np.array(jax.devices()[: np.prod(list(axes.values()))]).reshape(
    tuple(axes.values())), tuple(axes))


def split_rule(mesh):
  # Column-parallel kernels split their output dim over "tp", row-parallel ones (o_proj, down)
  # their input dim, as tensor parallelism does; stacked experts also split over "ep"; the
  # embedding splits the vocabulary; vectors go to the default device (None).
  tp, ep = mesh.shape.get("tp", 1), mesh.shape.get("ep", 1)

  def rule(path, shape):
    spec = [None] * len(shape)
    row_parallel = path[-2] in ("o_proj", "down_proj") or path[-1] == "down"
    if len(shape) == 1:
      return None
    if len(shape) == 3 and "ep" in mesh.shape and shape[0] % ep == 0:
      spec[0] = "ep"
    dim = -2 if row_parallel else -1
    if path[-1] == "embedding":
      dim = 0
    if shape[dim] % tp == 0:
      spec[dim] = "tp"
    return NamedSharding(mesh, P(*spec))

  return rule


def params(model):
  return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def check_against_unsharded(sharded, single, rule):
  # Every parameter equals the unsharded load, has the rule's sharding, and every device holds
  # exactly its slice. Returns the number of parameters split over more than one device.
  split = 0
  for path, value in params(sharded).items():
    want = params(single)[path]
    assert value.shape == want.shape and value.dtype == want.dtype, (path, value.dtype)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=str(path))
    sharding = rule(path, value.shape)
    if sharding is None:
      assert value.sharding.device_set == {jax.devices()[0]}, path
      continue
    assert value.sharding.is_equivalent_to(sharding, value.ndim), (path, value.sharding)
    shards = value.addressable_shards
    assert {s.device for s in shards} == sharding.device_set, path
    for shard in shards:
      assert shard.data.shape == sharding.shard_shape(value.shape), (path, shard.data.shape)
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
    split += not sharding.is_fully_replicated
  return split
"""


def _run_on_8_devices(script: str, *args: str) -> str:
  """Runs `_PRELUDE + script` in a fresh interpreter with 8 virtual CPU devices; returns stdout."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = appended_xla_flags("--xla_force_host_platform_device_count=8")
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  code = _PRELUDE + textwrap.dedent(script)
  result = subprocess.run(
    [sys.executable, "-c", code, str(FIXTURES), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}"
  return result.stdout


@pytest.mark.parametrize(
  "fixture, axes, dtype",
  [
    ("glm4_moe_a", "tp=8", "float32"),
    ("glm_moe_dsa_a", "ep=2,tp=4", "bfloat16"),
  ],
)
def test_sharded_load_equals_unsharded_load(fixture, axes, dtype):
  out = _run_on_8_devices(
    """
    fixture, axes, dtype = sys.argv[2], sys.argv[3], getattr(jnp, sys.argv[4])
    mesh = mesh_of(**{k: int(v) for k, v in (a.split("=") for a in axes.split(","))})
    rule = split_rule(mesh)
    single = jaxspec.load_pretrained(f"{FIXTURES}/{fixture}", dtype=dtype)
    sharded = jaxspec.load_pretrained(f"{FIXTURES}/{fixture}", dtype=dtype, sharding_for=rule)
    assert sharded.mtp is not None and type(sharded) is type(single)
    split = check_against_unsharded(sharded, single, rule)
    print("split", split, "of", len(params(sharded)))
    """,
    fixture,
    axes,
    dtype,
  )
  split, total = int(out.split()[1]), int(out.split()[3])
  assert split > total // 3, out  # most matrices and every expert stack were split


def test_sharded_index_checkpoint_is_read_by_slices(tmp_path):
  """A checkpoint of several files (`model.safetensors.index.json`) loads into shards, and each
  read from a file is exactly one device's slice of the tensor, never the whole of a split one."""
  out = _run_on_8_devices(
    """
    import collections
    fixture = jaxspec.load_pretrained(f"{FIXTURES}/glm4_moe_a", dtype=jnp.float32)
    jaxspec.save_pretrained(fixture, sys.argv[2], max_shard_bytes=100_000)
    mesh = mesh_of(ep=2, tp=4)
    rule = split_rule(mesh)

    reads = collections.defaultdict(list)
    original_read = weights._TensorFiles.read

    def spy(self, name, index):
      value = original_read(self, name, index)
      reads[name].append(value.shape)
      return value

    weights._TensorFiles.read = spy
    sharded = jaxspec.load_pretrained(sys.argv[2], dtype=jnp.float32, sharding_for=rule)
    weights._TensorFiles.read = original_read
    assert check_against_unsharded(sharded, fixture, rule) > 0

    shapes = {p: v.shape for p, v in params(fixture).items()}
    config = fixture.config
    for entry in weights._entries(config, False, False):
      shape = shapes[entry.path]
      sharding = rule(entry.path, shape)
      slice_shape = shape if sharding is None else sharding.shard_shape(shape)
      if entry.layout != "copy":
        slice_shape = slice_shape[:-2] + (slice_shape[-1], slice_shape[-2])
      if entry.layout == "stack_transpose":
        slice_shape = slice_shape[1:]
      for name in entry.names:
        assert reads[name], name
        assert all(s == slice_shape for s in reads[name]), (name, reads[name], slice_shape)
        # Devices that hold the same slice share one read.
        indices = {} if sharding is None else sharding.devices_indices_map(shape)
        distinct = len({tuple((s.start, s.stop) for s in i) for i in indices.values()}) or 1
        assert len(reads[name]) <= distinct, (name, len(reads[name]), distinct)
    print("files", len(list(__import__("pathlib").Path(sys.argv[2]).glob("*.safetensors"))))
    """,
    str(tmp_path / "ckpt"),
  )
  assert int(out.split()[1]) > 2, out


def test_bad_sharding_rule_is_a_value_error_naming_the_parameter():
  _run_on_8_devices(
    """
    import pytest
    path = f"{FIXTURES}/glm4_moe_a"
    mesh = mesh_of(tp=3)  # 48 and 96 divide by 3, the vocabulary (160) does not

    def columns(param_path, shape):
      return NamedSharding(mesh, P(None, "tp")) if len(shape) == 2 else None

    with pytest.raises(ValueError, match=r"parameter lm_head\\.kernel \\(checkpoint tensor "
                       r"lm_head\\.weight, shape \\(48, 160\\)\\).*dimension 1 \\(size 160\\).*"
                       r"size 3, which does not divide it"):
      jaxspec.load_pretrained(path, dtype=jnp.float32, sharding_for=columns)

    with pytest.raises(ValueError, match=r"model\\.norm\\.weight.*more entries than the parameter"):
      jaxspec.load_pretrained(
        path, dtype=jnp.float32, sharding_for=lambda p, s: NamedSharding(mesh, P(None, None)))

    with pytest.raises(TypeError, match=r"returned 'tp' for parameter model\\.embed_tokens"):
      jaxspec.load_pretrained(path, dtype=jnp.float32, sharding_for=lambda p, s: "tp")
    print("ok")
    """
  )


@pytest.mark.gpu
def test_full_width_checkpoint_loads_into_shards_on_two_gpus(tmp_path):
  """GLM-4.5-Air widths (2 layers, 32 of the 128 experts, the MTP layer; 5 GB in bf16) saved in
  1 GiB files, then loaded split over two GPUs: every parameter equals the one saved, each GPU
  holds only its shards, and the host never holds much more than the largest tensor."""
  import time
  import tracemalloc

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  import jaxspec
  from jaxspec.model.config import glm45_air

  if len(jax.devices()) < 2:
    pytest.skip("needs two GPUs")
  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

  def rule(path, shape):
    split = len(shape) >= 2 and shape[-1] % 2 == 0
    return NamedSharding(mesh, PartitionSpec(*[None] * (len(shape) - 1), "tp" if split else None))

  config = glm45_air().replace(num_hidden_layers=2, n_routed_experts=32)
  model = jaxspec.GlmForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  jaxspec.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=1 << 30)
  original = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

  tracemalloc.start()
  start = time.perf_counter()
  loaded = jaxspec.load_pretrained(tmp_path / "ckpt", dtype=jnp.bfloat16, sharding_for=rule)
  jax.block_until_ready(nnx.state(loaded))
  seconds = time.perf_counter() - start
  host_peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()

  for path, variable in nnx.to_flat_state(nnx.state(loaded, nnx.Param)):
    value, sharding = variable.get_value(), rule(path, variable.shape)
    assert value.sharding.is_equivalent_to(sharding, value.ndim), path
    assert {s.device for s in value.addressable_shards} == set(mesh.devices.flat), path
    for shard in value.addressable_shards:
      assert shard.data.shape == sharding.shard_shape(value.shape), path
    assert bool(jnp.array_equal(value, jax.device_put(original[path], sharding))), path
  total = sum(v.nbytes for v in original.values())
  largest = max(v.nbytes for v in original.values())
  print(
    f"loaded {total / 1e9:.2f} GB into 2 GPUs in {seconds:.1f} s ({total / 1e9 / seconds:.2f} "
    f"GB/s); host peak {host_peak / 1e9:.2f} GB, largest tensor {largest / 1e9:.2f} GB"
  )
  assert host_peak < 1.5 * largest
