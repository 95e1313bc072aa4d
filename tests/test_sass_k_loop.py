"""benchmarks/micro/sass_k_loop.py's parsing of cuobjdump / ptxas output (the compile itself needs nvcc: not run here)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "micro"))
import sass_k_loop  # noqa: E402

NAME = "_ZN8base_moe13_GLOBAL__N__118expert_gemm_kernelI13__nv_bfloat16Lb1ELi128ELi8ELi4ELi4ELi4ELb1EEEvNS0_10GemmParamsE"


def sass(body):
    """One function's SASS in cuobjdump's layout: addresses 16 bytes apart from 0x0100."""
    lines = [f"        /*{0x100 + 16 * i:04x}*/                   {ins} ;   /* 0x0 */" for i, ins in enumerate(body)]
    return f"\n\t\tFunction : {NAME}\n" + "\n".join(lines) + "\n"


def test_k_loop_is_the_shortest_loop_with_loads_barrier_and_mma():
    body = ["MOV R1, R2",                                   # 0x100: a first qualifying loop, 6 instructions
            "BAR.SYNC.DEFER_BLOCKING 0x0",
            "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",
            "HMMA.16816.F32.BF16 R8, R12, R16, R8",
            "IADD3 R1, R1, 0x1, RZ",
            "@P0 BRA 0x100",                                # 0x150
            "DEPBAR.LE SB0, 0x2",                           # 0x160: the k loop, 5 instructions
            "BAR.SYNC.DEFER_BLOCKING 0x0",
            "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",
            "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24",
            "@P0 BRA.U 0x160",                              # 0x1a0: a back branch with a modifier
            "@P1 BRA 0x100",                                # 0x1b0: the loop around both, 12 instructions
            "@P2 BRA 0x1d0",                                # a forward branch over the next one
            "EXIT"]
    functions = sass_k_loop.functions(sass(body))
    assert list(functions) == [NAME]
    assert sass_k_loop.k_loop_length(functions[NAME]) == 5


def test_no_k_loop_without_mma():
    body = ["DEPBAR.LE SB0, 0x2", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",
            "@P0 BRA 0x100", "EXIT"]
    assert sass_k_loop.k_loop_length(sass(body)) is None


def test_resources_and_template_args():
    ptxas = (f"ptxas info    : Compiling entry function '{NAME}' for 'sm_90a'\n"
             f"ptxas info    : Function properties for {NAME}\n"
             "    0 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads\n"
             "ptxas info    : Used 128 registers, used 1 barriers, 128 bytes smem\n")
    assert sass_k_loop.resources(ptxas) == {NAME: "128 registers, 24 B spilled"}
    assert sass_k_loop.template_args(NAME) == "bf16 true 128 8 4 4 4 true"


def test_compiles_with_setup_py_nvcc_flags():
    flags = sass_k_loop.setup_nvcc_flags()
    assert flags and all(isinstance(f, str) for f in flags)
    assert "-DBASE_MOE_WITH_CUDA" in flags  # the kernels' host glue is compiled only with it
