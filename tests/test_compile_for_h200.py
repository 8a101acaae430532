"""The offline H200 compile's report parsers (the compile itself needs the CUDA plugin)."""

import argparse
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from benchmarks.bench_moe import MemoryReport
from benchmarks.compile_for_h200 import (
  PtxasReport,
  SassCounts,
  XlaKernel,
  build_parser,
  count_sass,
  find_cuda_tool,
  index_call,
  parse_entry_kernels,
  parse_ptxas,
  sass_counts,
  with_fields,
)
from jaxspec.kernels.decode_attention.mosaic_gpu import TuningConfig

PTXAS_TWO_KERNELS = (
  "ptxas info    : 0 bytes gmem\n"
  "ptxas info    : Compiling entry function 'gate_up_kernel' for 'sm_90a'\n"
  "ptxas info    : Function properties for gate_up_kernel\n"
  "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
  "ptxas info    : Used 215 registers, used 2 barriers, 1 bytes smem\n"
  "ptxas warning : Registers are spilled to local memory in function 'attention_kernel', "
  "804 bytes spill stores, 712 bytes spill loads\n"
  "ptxas info    : Compiling entry function 'attention_kernel' for 'sm_90a'\n"
  "ptxas info    : Function properties for attention_kernel\n"
  "    536 bytes stack frame, 804 bytes spill stores, 712 bytes spill loads\n"
  "ptxas info    : Used 255 registers, used 2 barriers, 536 bytes cumulative stack size, "
  "1 bytes smem\n"
)

# The shape of a compiled module's text: fused computations first, then the entry computation
# whose fusions name them with calls=; a tuple-shaped fusion; a custom call with no body.
HLO_MODULE = """\
HloModule jit_fn, entry_computation_layout={(f32[8,4]{1,0})->f32[8]{0}}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_pair (p0: f32[8,4]) -> (f32[8], s32[8]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %c = f32[] constant(0)
  %r = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%region_add
  %i = s32[8]{0} iota(), iota_dimension=0
  ROOT %t = (f32[8]{0}, s32[8]{0}) tuple(%r, %i)
}

%fused_twice (p0: f32[8,4], p1: f32[8]) -> f32[8] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %c = f32[] constant(0)
  %r1 = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%region_add
  %r2 = f32[8]{0} reduce(%p0, %c), dimensions={1}, to_apply=%region_add
  %p1 = f32[8]{0} parameter(1)
  %s = f32[8]{0} add(%r1, %r2)
  ROOT %o = f32[8]{0} add(%s, %p1)
}

ENTRY %main (x: f32[8,4]) -> f32[8] {
  %x = f32[8,4]{1,0} parameter(0)
  %input_reduce_fusion = (f32[8]{0}, s32[8]{0}) fusion(%x), kind=kInput, calls=%fused_pair, x={}
  %gte = f32[8]{0} get-tuple-element(%input_reduce_fusion), index=0
  %mpmd_map.0 = f32[8]{0} custom-call(%gte), custom_call_target="mosaic_gpu_v2", api_version=1
  ROOT %loop_reduce_fusion = f32[8]{0} fusion(%x, %mpmd_map.0), kind=kLoop, calls=%fused_twice
}
"""


def test_parse_ptxas_reads_each_entry_with_its_spills():
  assert parse_ptxas(PTXAS_TWO_KERNELS) == [
    PtxasReport("gate_up_kernel", 215, 0, 0),
    PtxasReport("attention_kernel", 255, 804, 712),
  ]


def test_parse_ptxas_rejects_an_entry_without_a_register_count():
  text = PTXAS_TWO_KERNELS.replace("Used 255 registers", "Used registers")
  with pytest.raises(ValueError, match="unexpected ptxas output"):
    parse_ptxas(text)


def test_parse_entry_kernels_lists_fusions_and_custom_calls_with_their_reduces():
  assert parse_entry_kernels(HLO_MODULE) == [
    XlaKernel("input_reduce_fusion", "kInput", "(f32[8]{0}, s32[8]{0})", 1),
    XlaKernel("mpmd_map.0", "mosaic_gpu_v2", "f32[8]{0}", 0),
    XlaKernel("loop_reduce_fusion", "kLoop", "f32[8]{0}", 2),
  ]


def test_with_fields_parses_values_and_names_a_bad_field():
  config = with_fields(TuningConfig(), ["num_stages=3", "page_ids_ahead=True", "num_chunks=None"])
  assert (config.num_stages, config.page_ids_ahead, config.num_chunks) == (3, True, None)
  with pytest.raises(ValueError, match="no_such_field"):
    with_fields(TuningConfig(), ["no_such_field=1"])
  with pytest.raises(ValueError, match="field=value"):
    with_fields(TuningConfig(), ["num_stages"])


def test_repeated_set_options_add_up():
  args = build_parser().parse_args(
    ["moe", "--set", "gather_in_kernel=True", "--set", "num_stages=4", "block_k=64"]
  )
  assert args.set == ["gather_in_kernel=True", "num_stages=4", "block_k=64"]


def test_memory_peak_counts_aliased_bytes_once():
  # An output aliasing an argument is counted in both sizes and in the aliased bytes.
  assert MemoryReport(arguments=10, outputs=2, temporaries=3, aliased=2).peak == 13


def test_index_call_applies_set_and_traces_to_the_op_shapes():
  args = argparse.Namespace(
    tokens=6, topk=10, requests=3, max_blocks=8, block_size=4, set=["blocks_per_sm=2"], module=None
  )
  config, call, shapes = index_call(args)
  assert (config.blocks_per_sm, config.num_sms) == (2, 132)
  physical, counts = jax.eval_shape(call, *(jax.ShapeDtypeStruct(*shape) for shape in shapes))
  assert (physical.shape, counts.shape) == ((6, 10), (6,))
  assert physical.dtype == counts.dtype == jnp.int32


def test_module_replaces_the_installed_kernel_module(tmp_path):
  from jaxspec.kernels.sparse_index import mosaic_gpu

  variant = tmp_path / "index_variant.py"
  variant.write_text(pathlib.Path(mosaic_gpu.__file__).read_text())
  args = argparse.Namespace(
    tokens=6, topk=10, requests=3, max_blocks=8, block_size=4, set=[], module=str(variant)
  )
  config, _, _ = index_call(args)
  assert type(config).__module__ == "index_variant"
  assert type(config) is not mosaic_gpu.TuningConfig


SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x80 ;      /* 0x0000000000007b1d */
        /*0020*/              @UP0 UTMALDG.5D [UR40], [UR10] ;              /* 0x00000000280075b4 */
        /*0030*/                   HGMMA.64x8x16.F32 R24, R64, gdesc[UR8], RZ, !UPT ;
        /*0040*/             @!P1 BRA 0x9790 ;                              /* 0x0000005400d08947 */
        /*0050*/                   STL [R1+0x4], R2 ;                       /* 0x0000040201007387 */
       /*10060*/                   LDL R3, [R1+0x4] ;                       /* 0x0000040001037983 */
       /*10070*/                   UBLKCP.S.G [UR10], [UR4], UR12 ;         /* 0x000000040a0073ba */
       /*10080*/                   BAR.ARV 0x2, 0x80 ;                      /* 0x0000000000007b1d */
"""


def test_count_sass_counts_each_kind_at_any_address_width():
  assert count_sass("k", SASS) == SassCounts(
    kernel="k", instructions=9, barriers=1, wgmmas=1, tma_loads=2, local_memory=2
  )
  with pytest.raises(ValueError, match="no SASS instructions in the disassembly of k"):
    count_sass("k", "Fatbin elf code:\n")


def test_find_cuda_tool_takes_path_then_cuda_home(tmp_path, monkeypatch):
  home = tmp_path / "cuda"
  (home / "bin").mkdir(parents=True)
  tool = home / "bin" / "ptxas"
  tool.write_text("#!/bin/sh\n")
  tool.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  monkeypatch.setenv("CUDA_HOME", str(home))
  assert find_cuda_tool("ptxas") == str(tool)
  monkeypatch.setenv("PATH", str(home / "bin"))
  monkeypatch.delenv("CUDA_HOME")
  assert find_cuda_tool("ptxas") == str(tool)
  with pytest.raises(FileNotFoundError, match="no_such_tool not found"):
    find_cuda_tool("no_such_tool")


def _fake_tool(directory, name, script):
  tool = directory / name
  tool.write_text("#!/bin/sh\n" + script)
  tool.chmod(0o755)


def test_sass_counts_keeps_the_sass_and_ptxas_notes_and_reports_a_failure(tmp_path, monkeypatch):
  bin_dir, ptx_dir = tmp_path / "bin", tmp_path / "ptx"
  bin_dir.mkdir()
  ptx_dir.mkdir()
  (ptx_dir / "kernel_0.ptx").write_text("// ptx\n")
  # ptxas -arch=sm_90a -o CUBIN PTX; cuobjdump -sass CUBIN
  _fake_tool(bin_dir, "ptxas", 'echo "ptxas info    : (C7519) note" >&2; touch "$3"\n')
  # Like the real one, the fake cuobjdump fails unless nvdisasm is on its PATH; nvdisasm is
  # installed apart, found through CUDA_HOME only.
  _fake_tool(
    bin_dir,
    "cuobjdump",
    "command -v nvdisasm >/dev/null || { echo \"Could not find executable file 'nvdisasm'\" >&2;"
    f" exit 1; }}\ncat <<'END'\n{SASS}END\n",
  )
  monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))
  for var in ("CUDA_HOME", "CUDA_PATH"):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(FileNotFoundError, match="nvdisasm not found"):
    sass_counts(ptx_dir)
  cuda_home = tmp_path / "cuda"
  (cuda_home / "bin").mkdir(parents=True)
  _fake_tool(cuda_home / "bin", "nvdisasm", "")
  monkeypatch.setenv("CUDA_HOME", str(cuda_home))
  (counts,) = sass_counts(ptx_dir)
  assert counts == SassCounts("kernel_0", 9, 1, 1, 2, 2, ("ptxas info    : (C7519) note",))
  assert (ptx_dir / "kernel_0.sass").read_text() == SASS
  _fake_tool(bin_dir, "cuobjdump", 'echo "cuobjdump fatal   : bad cubin" >&2; exit 1\n')
  with pytest.raises(
    RuntimeError, match="cuobjdump failed on .*kernel_0.cubin:\ncuobjdump fatal   : bad cubin"
  ):
    sass_counts(ptx_dir)
  _fake_tool(bin_dir, "ptxas", 'echo "ptxas fatal   : bad ptx" >&2; exit 1\n')
  with pytest.raises(
    RuntimeError, match="ptxas failed on .*kernel_0.ptx:\nptxas fatal   : bad ptx"
  ):
    sass_counts(ptx_dir)
