"""Builds gspo_kernels and its extension gspo_kernels.backends._C.

The CPU kernels are always built. The CUDA kernels are built when nvcc and a CUDA build of
torch are present. Switches (environment variables):

    GSPO_SKIP_CUDA_BUILD=1     build the CPU part only
    GSPO_CUDA_ARCHS="80;90"    SASS targets (default 80 and 90), plus PTX of the highest
    GSPO_CPU_CAPABILITY=avx2   SIMD level of the CPU kernel: default | avx2 | avx512
    GSPO_NO_OPENMP=1           CPU kernels on one thread (default: OpenMP where torch uses it)
                               (default: the best the build machine has; the extension is
                               built for the machine that runs it, like any source build)
    GSPO_PREBUILT_EXTENSION=1  build no extension: an editable install whose tree already holds
                               gspo_kernels/backends/_C*.so built from these sources against the
                               same torch (scripts/test_areal.sh's second environment)
    MAX_JOBS=2                 parallel compile jobs (ninja)

Install torch first, then `pip install --no-build-isolation .`: an isolated build would
download a second, multi-GB torch.
"""

import os
import pathlib
import shutil

from setuptools import setup

ROOT = pathlib.Path(__file__).parent.resolve()

_CPU_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _cpu_capability() -> str:
    chosen = os.environ.get("GSPO_CPU_CAPABILITY")
    if chosen:
        if chosen not in _CPU_FLAGS:
            raise SystemExit(f"GSPO_CPU_CAPABILITY must be one of {sorted(_CPU_FLAGS)}; got {chosen!r}")
        return chosen
    try:
        flags = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
        return "avx512"  # 1.2-1.3x faster than avx2 on the 2-core EPYC this was measured on
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "default"


def _openmp_flags(torch) -> list[str]:
    """-fopenmp where torch's own parallel backend is OpenMP: at::parallel_for is a template whose
    `#pragma omp parallel` compiles into this extension, so without the flag the CPU kernels run
    on one thread whatever torch.set_num_threads says. The extension then needs libgomp.so.1,
    the one torch loads (torch/lib), so both share one thread pool. GSPO_NO_OPENMP=1: serial."""
    if _truthy("GSPO_NO_OPENMP"):
        return []
    if not torch.backends.openmp.is_available() or os.uname().sysname != "Linux":
        print("gspo_kernels: torch's parallel backend is not OpenMP here: the CPU kernels run serially")
        return []
    return ["-fopenmp"]


def _cuda_arch_flags() -> list[str]:
    archs = [a.strip().replace(".", "") for a in os.environ.get("GSPO_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    top = max(archs, key=int)
    return flags + [f"-gencode=arch=compute_{top},code=compute_{top}"]


def _pip_cuda_include_dirs() -> list[str]:
    """pip's CUDA headers (cusparse.h and friends) that torch's headers include."""
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for base in nvidia.__path__:
        for sub in ("cu13/include", "cu12/include"):
            if (pathlib.Path(base) / sub).is_dir():
                dirs.append(str(pathlib.Path(base) / sub))
    return dirs


def _extensions():
    if _truthy("GSPO_PREBUILT_EXTENSION"):
        print("gspo_kernels: GSPO_PREBUILT_EXTENSION=1, the extension in the tree is used as it is")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        raise SystemExit(
            "gspo_kernels builds its C++ extension against an installed torch: install torch first, "
            "then `pip install --no-build-isolation .`"
        ) from exc

    capability = _cpu_capability()
    openmp = _openmp_flags(torch)
    cxx = ["-O3", "-DNDEBUG", f'-DGSPO_CPU_CAPABILITY_NAME="{capability.upper()}"'] + _CPU_FLAGS[capability] + openmp
    sources = ["csrc/ops.cpp", "csrc/cpu/kernels.cpp", "csrc/cpu/kept_set.cpp", "csrc/cpu/top_p_cut.cpp", "csrc/cpu/kept_products.cpp", "csrc/cpu/kept_softmax.cpp", "csrc/cpu/segments.cpp",
               "csrc/cpu/accumulate.cpp"]
    nvcc_found = CUDA_HOME is not None and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is not None
    with_cuda = not _truthy("GSPO_SKIP_CUDA_BUILD") and torch.version.cuda is not None and nvcc_found
    kwargs = dict(
        name="gspo_kernels.backends._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=openmp,
    )
    if with_cuda:
        kwargs["sources"] = sources + ["csrc/cuda/kernels.cu", "csrc/cuda/segments.cu"]
        kwargs["include_dirs"] += _pip_cuda_include_dirs()
        kwargs["extra_compile_args"]["cxx"] = cxx + ["-DGSPO_WITH_CUDA"]
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-DNDEBUG", "-lineinfo"] + _cuda_arch_flags()
        ext = CUDAExtension(**kwargs)
    else:
        ext = CppExtension(**kwargs)
    print(f"gspo_kernels: building _C with CPU capability {capability}, OpenMP {'on' if openmp else 'off'}, "
          f"CUDA {'on' if with_cuda else 'off'}")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
