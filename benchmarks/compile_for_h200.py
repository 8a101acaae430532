"""Compile jaxspec's kernels for an H200 without a GPU: XLA kernels, memory, ptxas registers.

XLA compiles for the GPU it is described, not only the one it sees: jax's ahead-of-time path
(``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``) takes a
``GpuTargetConfigProto`` of the device, and the CUDA plugin's compiler then runs its whole
pipeline for it (fusion, scheduling, and the Mosaic GPU kernels through ptxas) with no CUDA
device attached. Three things come out of that without a GPU run:

* which XLA kernels a call becomes and what each one fuses (``moe``): the counting-sort route
  plan at 384 tokens showed the per-expert sums of the earlier blocks recomputed inside the
  combine fusion for every output element (``benchmarks/NOTES_routed_experts.md``);
* XLA's memory analysis of the call, the peak-memory figure ``bench_moe.py`` reports (for
  main's routed experts at GLM-4.5-Air 8192 tokens the H200 run's figure to the byte; at
  GLM-4.5 0.27 MB below it, of 8.16 GB);
* ptxas's registers and spills per Mosaic GPU kernel (``attention``, ``moe``, ``index``), which
  bound how many work items an SM holds: a warp takes registers in units of 256, so a 128-thread
  warpgroup at ``r`` registers a thread holds ``128 * ceil(r / 8) * 8`` of the SM's 65536.

Timings still need the GPU; nothing here runs a kernel.

Set-up, in an environment of its own (the CUDA plugin is not a jaxspec dependency, and on a
machine without a GPU its version check finds no cuDNN, hence the variable)::

  python3.12 -m venv .venv-h200
  .venv-h200/bin/pip install -e . jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
  export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
  .venv-h200/bin/python benchmarks/compile_for_h200.py moe --shape GLM-4.5-Air --tokens 384
  .venv-h200/bin/python benchmarks/compile_for_h200.py attention --group 12 --q-len 7 \\
      --set transposed_scores=True two_warpgroup_tiles=False
  .venv-h200/bin/python benchmarks/compile_for_h200.py index --tokens 4096 --topk 2048

``--set field=value`` replaces fields of the op's ``default_config``; ``--module FILE`` compiles
another version of the op's ``mosaic_gpu.py`` (a branch's, say) in place of the installed one.
``--ptx-dir DIR`` keeps each Mosaic GPU kernel's PTX (with the other dumps of Mosaic GPU) in
``DIR``; ``--sass`` then assembles it for sm_90a and disassembles it (``ptxas``, ``cuobjdump``
and the ``nvdisasm`` that cuobjdump runs: from a CUDA toolkit, or the wheels ``nvidia-cuda-nvcc``,
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``, which install them under
``site-packages/nvidia/cu13/bin``), keeps the SASS, the instructions the H200
would run, beside the PTX, and prints its static counts: instructions, warpgroup barriers,
wgmmas, TMA loads, local-memory accesses (spills). Those counts are what the notes cite, e.g.::

  .venv-h200/bin/python benchmarks/compile_for_h200.py attention --fp8 --ptx-dir DIR --sass
"""

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import topologies

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks._modules import load_module  # noqa: E402
from benchmarks.bench_moe import SHAPES, TOP_K, MemoryReport  # noqa: E402
from jaxspec.kernels.decode_attention import mosaic_gpu as attention_mosaic_gpu  # noqa: E402
from jaxspec.kernels.routed_experts import mosaic_gpu as routed_experts_mosaic_gpu  # noqa: E402
from jaxspec.kernels.sparse_index import mosaic_gpu as index_mosaic_gpu  # noqa: E402

# One H200 SXM as XLA's GPU compiler sees it (``xla/stream_executor/device_description.proto``):
# 132 SMs of compute capability 9.0, 228 KiB shared memory per SM (227 KiB to one block),
# 64K registers per SM, 50 MiB of L2, HBM3e at 4.8 TB/s. Fusion and tiling decisions read these.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 13 minor: 0 patch: 0 }
dnn_version_info { major: 9 minor: 10 }
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""

ATTENTION_KV_HEADS = 8
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class PtxasReport:
  """What ptxas printed for one kernel entry."""

  kernel: str
  registers: int
  spill_stores: int
  spill_loads: int


@dataclasses.dataclass(frozen=True)
class XlaKernel:
  """One instruction of the compiled entry computation that launches work."""

  name: str
  kind: str  # fusion kind (kLoop, kInput, kCustom), or the custom call's target
  shape: str
  reduces: int  # reduce instructions inside the fusion: > 1 in a loop fusion means recomputation


@dataclasses.dataclass(frozen=True)
class SassCounts:
  """Instructions of one kernel's SASS, the code the H200 runs, by kind (static counts)."""

  kernel: str
  instructions: int
  barriers: int  # BAR.SYNC: block and named (warpgroup) barriers
  wgmmas: int  # HGMMA
  tma_loads: int  # UTMALDG (tensor copies) and UBLKCP.S.G (bulk copies into shared memory)
  local_memory: int  # LDL and STL: spills, or arrays the compiler put in local memory
  ptxas_notes: tuple[str, ...] = ()  # what ptxas said while assembling (e.g. wgmma serialised)


def h200_sharding() -> jax.sharding.SingleDeviceSharding:
  """A single-device sharding on a described (not attached) H200."""
  topology = topologies.get_topology_desc(
    "h200", "cuda", target_config=H200_TARGET_CONFIG, topology="1x1x1"
  )
  return jax.sharding.SingleDeviceSharding(topology.devices[0])


def parse_ptxas(text: str) -> list[PtxasReport]:
  """One report per ``Compiling entry function`` block of ptxas's ``-v`` output."""
  reports = []
  for block in re.split(r"Compiling entry function ", text)[1:]:
    kernel = re.match(r"'([^']+)'", block)
    registers = re.search(r"Used (\d+) registers", block)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
    if not (kernel and registers and spills):
      raise ValueError(f"unexpected ptxas output: {block[:300]!r}")
    reports.append(
      PtxasReport(
        kernel.group(1), int(registers.group(1)), int(spills.group(1)), int(spills.group(2))
      )
    )
  return reports


def count_sass(kernel: str, sass_text: str) -> SassCounts:
  """``SassCounts`` of ``cuobjdump -sass`` output (one kernel)."""
  # Instruction lines: /*0040*/ [@P0] OPCODE.MODIFIERS operands ;
  opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass_text)
  if not opcodes:
    raise ValueError(f"no SASS instructions in the disassembly of {kernel}")

  def count(*prefixes):
    return sum(any(op == p or op.startswith(p + ".") for p in prefixes) for op in opcodes)

  return SassCounts(
    kernel=kernel,
    instructions=len(opcodes),
    barriers=count("BAR.SYNC"),
    wgmmas=count("HGMMA"),
    tma_loads=count("UTMALDG", "UBLKCP.S.G"),
    local_memory=count("LDL", "STL"),
  )


def find_cuda_tool(name: str) -> str:
  """``name`` (ptxas, cuobjdump, nvdisasm) from ``PATH``, ``$CUDA_HOME/bin`` or the CUDA wheels'
  ``nvidia/cu13/bin``."""
  candidates = [shutil.which(name)]
  candidates += [
    os.path.join(os.environ[var], "bin", name)
    for var in ("CUDA_HOME", "CUDA_PATH")
    if var in os.environ
  ]
  nvidia = importlib.util.find_spec("nvidia")
  if nvidia is not None and nvidia.submodule_search_locations:
    candidates += [
      os.path.join(root, "cu13", "bin", name) for root in nvidia.submodule_search_locations
    ]
  for candidate in candidates:
    if candidate and os.access(candidate, os.X_OK):
      return candidate
  raise FileNotFoundError(
    f"{name} not found on PATH, in $CUDA_HOME/bin or in site-packages/nvidia/cu13/bin: install a "
    "CUDA toolkit or the wheels nvidia-cuda-nvcc, nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm"
  )


def sass_counts(ptx_dir: pathlib.Path) -> list[SassCounts]:
  """Assembles each kernel's PTX in ``ptx_dir`` for sm_90a and counts its SASS; the SASS is kept
  beside the PTX (``<kernel>.sass``)."""
  ptxas, cuobjdump = find_cuda_tool("ptxas"), find_cuda_tool("cuobjdump")
  # cuobjdump disassembles through nvdisasm, which it looks up on PATH only.
  nvdisasm_dir = os.path.dirname(find_cuda_tool("nvdisasm"))
  env = dict(os.environ, PATH=os.pathsep.join([nvdisasm_dir, os.environ.get("PATH", "")]))
  counts = []
  for ptx in sorted(ptx_dir.glob("*.ptx")):
    cubin = ptx.with_suffix(".cubin")
    assembled = subprocess.run(
      [ptxas, "-arch=sm_90a", "-o", str(cubin), str(ptx)], capture_output=True, text=True
    )
    notes = tuple(line for line in (assembled.stdout + assembled.stderr).splitlines() if line)
    if assembled.returncode:
      raise RuntimeError(f"ptxas failed on {ptx}:\n" + "\n".join(notes))
    disassembled = subprocess.run(
      [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env
    )
    if disassembled.returncode:
      raise RuntimeError(f"cuobjdump failed on {cubin}:\n{disassembled.stderr.strip()}")
    sass = disassembled.stdout
    ptx.with_suffix(".sass").write_text(sass)
    counts.append(dataclasses.replace(count_sass(ptx.stem, sass), ptxas_notes=notes))
  return counts


def parse_entry_kernels(hlo_text: str) -> list[XlaKernel]:
  """The fusions and custom calls of the compiled module's entry computation."""
  bodies = {}
  for match in re.finditer(r"^%(\S+) \(.*?^}", hlo_text, flags=re.M | re.S):
    bodies[match.group(1)] = match.group(0)
  entry = hlo_text[hlo_text.index("\nENTRY") :]
  kernels = []
  pattern = (
    r"%(\S+) = (\(.*?\)|\S+) (fusion|custom-call)\("
    r".*?(?:kind=(\w+)|custom_call_target=\"(\w+)\")"
  )
  for match in re.finditer(pattern, entry):
    name, shape, _, kind, target = match.groups()
    called = re.search(r"calls=%([\w.-]+)", entry[match.start() : entry.index("\n", match.end())])
    body = bodies.get(called.group(1), "") if called else ""
    kernels.append(XlaKernel(name, kind or target, shape, len(re.findall(r" reduce\(", body))))
  return kernels


def compile_and_report(
  fn, args, ptx_dir=None
) -> tuple[list[XlaKernel], list[PtxasReport], MemoryReport]:
  """Compiles ``jit(fn)`` for the H200: its XLA kernels, ptxas's reports and XLA's memory
  analysis.

  Mosaic GPU has ptxas report each kernel when ``MOSAIC_GPU_DUMP_PTXAS`` is set as it compiles.
  ptxas prints from the compiler's own threads to the process's stdout and stderr, so both file
  descriptors are pointed at a temporary file for the compile. With ``ptx_dir`` Mosaic GPU
  writes each kernel's PTX, its ptxas report and its other dumps there instead
  (``MOSAIC_GPU_DUMP_TO``), and the reports are read from those files.
  """
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  if ptx_dir is not None:
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(ptx_dir)
    os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
  sharding = h200_sharding()
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in args]
  lowered = jax.jit(fn, in_shardings=sharding, out_shardings=sharding).lower(*args)
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(1), os.dup(2)
  with tempfile.TemporaryFile(mode="w+") as capture:
    os.dup2(capture.fileno(), 1)
    os.dup2(capture.fileno(), 2)
    try:
      compiled = lowered.compile()
    finally:
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
    capture.seek(0)
    ptxas_text = capture.read()
  if ptx_dir is not None:
    ptxas_text = "".join(path.read_text() for path in sorted(ptx_dir.glob("*.ptxas")))
  return (
    parse_entry_kernels(compiled.as_text()),
    parse_ptxas(ptxas_text),
    MemoryReport.of(compiled),
  )


def with_fields(config, assignments: list[str]):
  """``config`` with ``field=value`` assignments applied (ints, bools and None parsed)."""
  fields = {}
  for assignment in assignments:
    name, sep, value = assignment.partition("=")
    if not sep or not hasattr(config, name):
      raise ValueError(
        f"--set takes field=value with a field of {type(config).__name__}: {assignment!r}"
      )
    literals = {"True": True, "False": False, "None": None}
    if value in literals:
      fields[name] = literals[value]
    elif re.fullmatch(r"-?\d+", value):
      fields[name] = int(value)
    else:
      fields[name] = value  # a string field (routed experts' warpgroup_split); validated below

  return dataclasses.replace(config, **fields)


def attention_call(args):
  """The paged decode attention call of a batch of ``--batch`` requests of ``--kv-len``."""
  rows = args.group * args.q_len
  batch, kv_len, head_dim = args.batch, args.kv_len, args.head_dim
  if kv_len % PAGE_SIZE:
    raise ValueError(f"--kv-len must be a multiple of the page size {PAGE_SIZE}, got {kv_len}")
  kv_dtype = jnp.float8_e4m3fn if args.fp8 else jnp.bfloat16
  module = load_module(args.module, attention_mosaic_gpu)
  config = module.default_config(head_dim, PAGE_SIZE, kv_dtype, rows, ATTENTION_KV_HEADS * batch)
  # The described device has no SM count to ask, so the plan takes the H200's.
  config = with_fields(dataclasses.replace(config, num_sms=132), args.set)
  pages = batch * kv_len // PAGE_SIZE

  def call(q, k_pages, v_pages, block_tables, seq_lens, *scales):
    # fp8 pages: the kernel takes the per-KV-head scales as float32 [Hkv] arrays.
    k_scale, v_scale = scales or (None, None)
    return module.paged_decode_attention_mosaic_gpu(
      q,
      k_pages,
      v_pages,
      block_tables,
      seq_lens,
      sm_scale=head_dim**-0.5,
      config=config,
      k_scale=k_scale,
      v_scale=v_scale,
    )

  shapes = [
    ((batch, args.q_len, ATTENTION_KV_HEADS * args.group, head_dim), jnp.bfloat16),  # q
    ((ATTENTION_KV_HEADS, pages, PAGE_SIZE, head_dim), kv_dtype),  # k_pages
    ((ATTENTION_KV_HEADS, pages, PAGE_SIZE, head_dim), kv_dtype),  # v_pages
    ((batch, kv_len // PAGE_SIZE), jnp.int32),  # block_tables
    ((batch,), jnp.int32),  # seq_lens
  ]
  if args.fp8:
    shapes += [((ATTENTION_KV_HEADS,), jnp.float32)] * 2  # k_scale, v_scale
  return config, call, shapes


def moe_call(args):
  """One routed-experts layer of ``--tokens`` tokens at a GLM expert shape."""
  module = load_module(args.module, routed_experts_mosaic_gpu)
  experts, hidden, intermediate = SHAPES[args.shape]
  config = module.default_config(args.tokens, TOP_K, experts, hidden, intermediate)
  config = with_fields(config, args.set)

  def call(x, expert_ids, weights, w_gate, w_up, w_down):
    return module.routed_experts_mosaic_gpu(
      x, expert_ids, weights, w_gate, w_up, w_down, config=config
    )

  shapes = [
    ((args.tokens, hidden), jnp.bfloat16),  # x
    ((args.tokens, TOP_K), jnp.int32),  # expert_ids
    ((args.tokens, TOP_K), jnp.float32),  # weights
    ((experts, hidden, intermediate), jnp.bfloat16),  # w_gate
    ((experts, hidden, intermediate), jnp.bfloat16),  # w_up
    ((experts, intermediate, hidden), jnp.bfloat16),  # w_down
  ]
  return config, call, shapes


def index_call(args):
  """The top-k index conversion of ``--tokens`` tokens of ``--topk`` entries each."""
  # The persistent grid's plan reads the SM count, which the described device cannot give.
  module = load_module(args.module, index_mosaic_gpu)
  config = with_fields(module.TuningConfig(num_sms=132), args.set)

  def call(req_ids, block_table, topk):
    return module.convert_topk_to_physical_mosaic_gpu(
      req_ids,
      block_table,
      topk,
      block_size=args.block_size,
      block_stride=args.block_size,
      config=config,
    )

  shapes = [
    ((args.tokens,), jnp.int32),  # req_ids
    ((args.requests, args.max_blocks), jnp.int32),  # block_table
    ((args.tokens, args.topk), jnp.int32),  # topk
  ]
  return config, call, shapes


def build_parser() -> argparse.ArgumentParser:
  """The command line: one subcommand per op, each with the shared options."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="op", required=True)
  attention = commands.add_parser("attention", help="paged decode attention")
  attention.add_argument("--group", type=int, default=8, help="query heads per KV head (G)")
  attention.add_argument("--q-len", type=int, default=1)
  attention.add_argument("--head-dim", type=int, default=128)
  attention.add_argument("--batch", type=int, default=64)
  attention.add_argument("--kv-len", type=int, default=32768)
  attention.add_argument("--fp8", action="store_true", help="float8_e4m3fn KV pages")
  moe = commands.add_parser("moe", help="one routed-experts layer")
  moe.add_argument("--shape", choices=sorted(SHAPES), default="GLM-4.5-Air")
  moe.add_argument("--tokens", type=int, default=384)
  index = commands.add_parser("index", help="top-k index conversion of sparse MLA")
  index.add_argument("--tokens", type=int, default=4096)
  index.add_argument("--topk", type=int, default=2048)
  index.add_argument("--requests", type=int, default=1024, help="rows of the block table")
  index.add_argument("--max-blocks", type=int, default=1024, help="columns of the block table")
  index.add_argument("--block-size", type=int, default=64)
  for sub in (attention, moe, index):
    sub.add_argument("--module", help="a file to compile in place of the op's mosaic_gpu.py")
    sub.add_argument("--set", nargs="*", action="extend", default=[], metavar="FIELD=VALUE")
    sub.add_argument(
      "--ptx-dir", type=pathlib.Path, help="a new or empty folder for each kernel's PTX"
    )
    sub.add_argument(
      "--sass",
      action="store_true",
      help="assemble the PTX (ptxas, cuobjdump) and count the SASS; needs --ptx-dir",
    )
  return parser


def main(argv=None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.sass:  # checked before the compile, which can take minutes
    if args.ptx_dir is None:
      parser.error("--sass needs --ptx-dir, where the PTX and the SASS are written")
    try:
      find_cuda_tool("ptxas"), find_cuda_tool("cuobjdump")
    except FileNotFoundError as error:
      parser.error(str(error))
  if args.ptx_dir is not None and args.ptx_dir.exists() and any(args.ptx_dir.iterdir()):
    parser.error(f"--ptx-dir {args.ptx_dir} is not empty: its reports would mix with this run's")
  try:  # a bad --kv-len or --set (an unknown field, or a value the config refuses)
    calls = {"attention": attention_call, "moe": moe_call, "index": index_call}
    config, call, shapes = calls[args.op](args)
  except ValueError as error:
    parser.error(str(error))
  print(config)
  if args.ptx_dir is not None:
    args.ptx_dir.mkdir(parents=True, exist_ok=True)
  kernels, reports, memory = compile_and_report(call, shapes, args.ptx_dir)
  print(f"\nXLA entry kernels ({len(kernels)}):")
  for kernel in kernels:
    print(f"  {kernel.name:36s} {kernel.kind:16s} {kernel.shape:28s} reduces {kernel.reduces}")
  print(
    f"\nXLA memory analysis: peak {memory.peak / 1e9:.3f} GB = arguments "
    f"{memory.arguments / 1e9:.3f} + outputs {memory.outputs / 1e9:.3f} + temporaries "
    f"{memory.temporaries / 1e9:.3f} - aliased {memory.aliased / 1e9:.3f}"
  )
  print("\nptxas (sm_90a):")
  for report in reports:
    print(
      f"  {report.kernel}: {report.registers} registers, spill stores {report.spill_stores} B, "
      f"spill loads {report.spill_loads} B"
    )
  if args.sass:
    print(f"\nSASS (sm_90a, static counts; kept in {args.ptx_dir}):")
    for counts in sass_counts(args.ptx_dir):
      print(
        f"  {counts.kernel}: {counts.instructions} instructions, {counts.barriers} BAR.SYNC, "
        f"{counts.wgmmas} HGMMA, {counts.tma_loads} TMA loads, "
        f"{counts.local_memory} local-memory accesses"
      )
      for note in counts.ptxas_notes:
        print(f"    {note}")


if __name__ == "__main__":
  main()
