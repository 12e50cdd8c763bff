"""Builds csrc/ as torch custom ops (TORCH_LIBRARY, abi3) when nvcc and a CUDA torch are present.

Without them the package installs as pure Python and runs its Triton kernels.
MIXPREC_BUILD_CUDA=0 skips the build, =1 makes a missing toolchain an error.
MIXPREC_CUDA_ARCHS overrides the targets (default "80;90a").
"""
import glob
import os
import shutil
import subprocess

from setuptools import setup


def _check_shared_cxx_runtime(path: str) -> None:
    """Refuse an extension that carries its own copy of the C++ runtime.

    Some compiler wrappers link libstdc++ statically; a TORCH_CHECK failing inside an op then
    crashes the process in the unwinder instead of raising in Python (seen on the GPU host
    with /opt/gcc, scripts/diag_cxx_throw.sh). torch links it dynamically; so must we.
    """
    if not shutil.which("readelf"):
        return
    dyn = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True).stdout
    if "libstdc++" not in dyn:
        raise RuntimeError(
            f"{path} does not link libstdc++ dynamically (the compiler {os.environ.get('CXX', 'c++')} "
            "links it statically): op errors would crash instead of raising. Build with a plain "
            "g++, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++")


def _cuda_extensions():
    want = os.environ.get("MIXPREC_BUILD_CUDA", "auto")
    if want == "0":
        return [], {}
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        # torch guesses CUDA_HOME from `which nvcc`; a wrapper script in /usr/local/bin makes
        # that /usr/local, which has no cuda_runtime.h. Prefer a real toolkit directory.
        for cand in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
            if os.path.exists(os.path.join(cand, "include", "cuda_runtime.h")):
                os.environ["CUDA_HOME"] = cand
                break
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME
    except ImportError:
        if want == "1":
            raise
        return [], {}
    have = torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc")
    if not have:
        if want == "1":
            raise RuntimeError("MIXPREC_BUILD_CUDA=1 but nvcc or a CUDA build of torch is missing")
        print("vllm_mixprec: no nvcc/CUDA torch; installing without csrc/ (Triton kernels only)")
        return [], {}
    archs = os.environ.get("MIXPREC_CUDA_ARCHS", "80;90a").split(";")
    gencode = []
    for a in archs:
        gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    ext = CUDAExtension(
        name="vllm_mixprec._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"] + gencode,
        },
        py_limited_api=True,
    )
    class Build(BuildExtension):
        def build_extension(self, ext):
            super().build_extension(ext)
            _check_shared_cxx_runtime(self.get_ext_fullpath(ext.name))

    return [ext], {"build_ext": Build.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass,
      options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {})
