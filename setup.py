"""Build of base_moe and its op library base_moe._C.

The CUDA kernels are compiled when a CUDA toolkit and a CUDA build of torch are both present
(set BASE_MOE_FORCE_CPU=1 to skip them); otherwise the C++ CPU kernels alone are built.
TORCH_CUDA_ARCH_LIST picks the GPU targets (default "9.0a", Hopper; add "8.0" for Ampere).
"""

import glob
import os

# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper: prefer the real toolkit.
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def with_cuda() -> bool:
    if os.environ.get("BASE_MOE_FORCE_CPU", "0") == "1":
        return False
    return CUDA_HOME is not None and torch.version.cuda is not None


def extra_cuda_includes() -> list[str]:
    """cuBLAS/cuSPARSE headers that ATen's CUDA headers pull in live in the pip CUDA packages here."""
    return glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "cu*", "include"))


def extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    cxx_flags = ["-O3"]
    if not with_cuda():
        return CppExtension("base_moe._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags})
    sources += sorted(glob.glob(os.path.join("csrc", "*.cu")))
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DBASE_MOE_WITH_CUDA"]
    return CUDAExtension(
        "base_moe._C",
        sources,
        include_dirs=include_dirs + extra_cuda_includes(),
        define_macros=[("BASE_MOE_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    name="base_moe",
    version="0.1.0",
    description="BASE: batch-aware selection of experts for fast batched MoE decoding",
    packages=find_packages(include=["base_moe", "base_moe.*"]),
    package_data={"base_moe": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "numpy", "safetensors", "tqdm"],
    extras_require={"hf": ["transformers>=5.0"], "plot": ["matplotlib"], "test": ["pytest", "hypothesis"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
