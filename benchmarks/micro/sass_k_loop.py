"""Code length of each expert GEMM's k loop in SASS, from a local compile: no GPU needed.

The expert GEMMs are bound by the k loop's instruction latency at least as much as by DRAM (ncu at batch 64 with 16
experts: ~5 cycles per issued instruction per warp, DRAM at 61% of peak; notes/experts_kernel.md, session 12), so the
loop's length is worth watching while csrc/experts.cu changes on a machine without one. This compiles the file for
sm_90a into a cubin (nvcc with torch's headers and nvcc flags, as setup.py's build), disassembles it (cuobjdump:
$CUOBJDUMP, on PATH, or the copy Triton ships) and prints, per kernel instance, its registers, spilled bytes and the
code length of its innermost loop that holds the weight loads (LDGSTS), a barrier and the MMAs (HMMA / HGMMA), i.e.
one k step's code: the instructions between the loop's start and its back branch, including the load block that the
last STAGES - 1 steps skip and the MMAs that warps without tokens skip (an upper bound on the instructions issued).

    python benchmarks/micro/sass_k_loop.py [--source csrc/experts.cu] [--match bfloat16]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA(?:\.\w+)* (0x[0-9a-f]+)")


def k_loop_length(sass: str) -> int | None:
    """Code length of the shortest backward-branch loop of one function's SASS that holds an LDGSTS, a BAR.SYNC and an
    HMMA or HGMMA (None if there is none)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(LINE.match, sass.splitlines()) if m]
    best = None
    for address, instruction in code:
        branch = BRANCH.search(instruction)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        body = [ins for at, ins in code if int(branch.group(1), 16) <= at <= address]
        if (any("LDGSTS" in i for i in body) and any("BAR.SYNC" in i for i in body)
                and any("HMMA" in i or "HGMMA" in i for i in body)):
            best = len(body) if best is None else min(best, len(body))
    return best


def functions(sass: str) -> dict[str, str]:
    """cuobjdump -sass output split by function: mangled name -> its SASS."""
    parts = re.split(r"\n\s*Function : ", sass)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def resources(ptxas: str) -> dict[str, str]:
    """ptxas --resource-usage lines: mangled name -> "R registers, S B spilled"."""
    out, name = {}, None
    for line in ptxas.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes spill stores", line)):
            out[name] = m.group(1)
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            out[name] = f"{m.group(1)} registers, {out.get(name, '0')} B spilled"
            name = None
    return out


def template_args(mangled: str) -> str:
    """The expert_gemm_kernel template arguments of a mangled name, readable: bf16, gated, rows 128, ..."""
    m = re.search(r"expert_gemm_kernelI(\w+?)EEEv", mangled)
    if not m:
        return mangled
    args = m.group(1)
    dtype = "bf16" if args.startswith("13__nv_bfloat16") else "fp16"
    rest = re.findall(r"L(b|i)(\d+)E", args + "E")
    return dtype + " " + " ".join(("true" if v == "1" else "false") if kind == "b" else v for kind, v in rest)


def find_cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, the CUDA toolkit torch builds with, or Triton's copy; None if none is there."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME  # noqa: PLC0415  (torch only for the toolkit's path)

    toolkit = CUDA_HOME and Path(CUDA_HOME) / "bin" / "cuobjdump"
    if toolkit and toolkit.exists():
        return str(toolkit)
    try:
        import triton  # noqa: PLC0415  (only for the cuobjdump it ships)
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def cuobjdump() -> str:
    found = find_cuobjdump()
    if found is None:
        sys.exit("no cuobjdump: set CUOBJDUMP, put one on PATH, install the CUDA toolkit or triton")
    return found


def setup_nvcc_flags() -> list[str]:
    """setup.py's nvcc flags: its ``nvcc_flags`` list, read with ast (importing setup.py would run the build)."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "nvcc_flags" for t in node.targets):
            return list(ast.literal_eval(node.value))
    sys.exit("setup.py has no nvcc_flags list")


def compile_cubin(source: Path, cubin: Path) -> str:
    """nvcc -cubin for sm_90a with setup.py's flags; returns ptxas's resource usage."""
    import torch  # noqa: PLC0415
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths  # noqa: PLC0415

    cuda_includes = sorted((Path(torch.__file__).parent.parent / "nvidia").glob("cu*/include"))
    cuda_home = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else "")
    nvcc = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else "nvcc"
    cmd = [nvcc, "-cubin", str(source), "-o", str(cubin), "-std=c++20", *setup_nvcc_flags(), *COMMON_NVCC_FLAGS,
           "-gencode=arch=compute_90a,code=sm_90a", "--resource-usage", f"-I{REPO / 'csrc' / 'include'}",
           *(f"-I{p}" for p in include_paths("cuda")), *(f"-I{p.resolve()}" for p in cuda_includes),
           "-DTORCH_EXTENSION_NAME=_C", "-D_GLIBCXX_USE_CXX11_ABI=1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    return done.stdout + done.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, default=REPO / "csrc" / "experts.cu")
    ap.add_argument("--match", default="bfloat16", help="only kernels whose mangled name contains this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernels.cubin"
        usage = resources(compile_cubin(args.source, cubin))
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    print(f"{'kernel (dtype, GATED, ROWS, NTW, WARPS, STAGES, WR, WG)':60s} {'k loop':>7s}  resources "
          "(k loop: instructions of one k step's code)")
    for name, code in functions(sass).items():
        if "expert_gemm_kernel" in name and args.match in name:
            print(f"{template_args(name):60s} {k_loop_length(code) or '-':>7}  {usage.get(name, '?')}")


if __name__ == "__main__":
    main()
