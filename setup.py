"""Build and install megagspo, the `moe` model library and the `megagspo._C` kernel extension.

The extension is always built for CPU from `csrc/cpu/*.cpp` plus the binding `csrc/bindings.cpp`.
CUDA sources (`csrc/cuda/*.cu`) are added when torch has CUDA and nvcc is found, or when forced:

    MEGAGSPO_CUDA=auto (default) | 1 (force, fail if impossible) | 0 (skip)

Install with `pip install --no-build-isolation -e .`: build isolation would install a fresh, unpinned
torch into the build environment (a CUDA build on CPU hosts; see docs/platform.md).
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - install-order error, not a runtime path
    raise SystemExit(
        "megagspo's setup.py needs torch installed first (pip install torch==2.13.0 on CPU hosts), "
        "then `pip install --no-build-isolation -e .`"
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_runtime_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("extension_runtime", os.path.join(HERE, "tools",
                                                                                     "extension_runtime.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _BuildExtension(BuildExtension):
    """torch's BuildExtension, then a check of what was built: an extension that carries its own copy of
    the C++ exception runtime (a toolchain that links libstdc++ statically) crashes on its first failed
    input check, so that build is refused with the fix (tools/extension_runtime.py)."""

    def build_extension(self, ext):
        super().build_extension(ext)
        problem = _import_runtime_check().private_runtime_problem(
            self.get_ext_fullpath(ext.name), compiler=os.environ.get("CXX", "c++"))
        if problem:
            raise SystemExit(f"megagspo: {problem}")


def _cuda_wanted() -> bool:
    mode = os.environ.get("MEGAGSPO_CUDA", "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"MEGAGSPO_CUDA must be one of auto, 1, 0; got {mode!r}")
    possible = torch.version.cuda is not None and (CUDA_HOME is not None or shutil.which("nvcc"))
    if mode == "1" and not possible:
        raise SystemExit(
            "MEGAGSPO_CUDA=1 but this torch has no CUDA (torch.version.cuda="
            f"{torch.version.cuda}) or nvcc was not found (CUDA_HOME={CUDA_HOME})"
        )
    return mode == "1" or (mode == "auto" and bool(possible))


def _extension():
    rel = lambda paths: sorted(os.path.relpath(p, HERE) for p in paths)  # noqa: E731
    sources = rel(glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    sources += rel(glob.glob(os.path.join(HERE, "csrc", "cpu", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    include_dirs = [os.path.join(HERE, "csrc")]
    if _cuda_wanted():
        sources += rel(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")))
        nvcc_flags = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo"]
        arch = os.environ.get("MEGAGSPO_CUDA_ARCH", "90")
        nvcc_flags += [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
        return CUDAExtension(
            "megagspo._C",
            sources,
            include_dirs=include_dirs,
            define_macros=[("MEGAGSPO_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "megagspo._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )


setup(
    name="megagspo",
    version="0.1.0",
    description="GSPO reinforcement learning for Qwen3-MoE models on Megatron-Core",
    packages=find_packages(include=["megagspo", "megagspo.*", "moe", "moe.*"]),
    python_requires=">=3.10",
    # torch is deliberately not listed: it is installed first and pinned per host (CPU: torch==2.13.0,
    # GPU hosts: their CUDA build); listing it here would let pip replace it.
    install_requires=[
        "megatron-core==0.16.1",
        "transformers>=5.0",
        "safetensors",
        "numpy",
        "PyYAML",
        "packaging",
    ],
    # MEGAGSPO_NO_EXT=1: metadata-only install; the Makefile then builds the extension once, in place,
    # with `setup.py build_ext --inplace` so that later csrc/ edits rebuild incrementally with ninja.
    ext_modules=[] if os.environ.get("MEGAGSPO_NO_EXT") == "1" else [_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["megagspo=megagspo.cli:main"]},
)
