"""Builds hybrid's native code (``hybrid._C``, a torch C++ extension) at install time: the operators
and the RPC transport that listens on ``runtime.address``; and the benchmarks' (``benchmarks._C``:
the emulated network's delay line).

The package metadata lives in pyproject.toml; this file only adds the extension. It needs torch
at build time (``pip install --no-build-isolation``, as ``make env`` does). Without torch there
(an isolated build) the package installs without the extension and ``hybrid.ops`` uses its
plain-torch code, saying so once at import.
"""

import glob
import os
import sys

from setuptools import setup

# -O3 vectorizes the row loops; -ffp-contract=off keeps every product and sum rounded on its own
# (a fused multiply-add only where the code calls one, as torch's kernels do), whatever
# instruction set a kernel is compiled for, so the results equal hybrid.ops.reference bit for
# bit. No -march: the AVX2 kernels are chosen at run time, so one build runs on any x86-64 (and
# on aarch64). -fopenmp: at::parallel_for is OpenMP code inlined from torch's headers, so without
# it the operators' parallel loops run on one thread; its calls resolve to the libgomp torch loads.
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, is_ninja_available
    except ImportError:
        print("hybrid: torch is not importable at build time; installing without the native operators "
              "(hybrid.ops falls back to plain torch). Build with --no-build-isolation to get them.",
              file=sys.stderr)
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    # The operators (hybrid/ops/csrc), the RPC transport bound to runtime.address (hybrid/launch/csrc)
    # and the trainers' all-reduce ring (hybrid/dense/csrc).
    csrc = [os.path.join("hybrid", part, "csrc") for part in ("ops", "launch", "dense")]
    sources = sorted(f for d in csrc for f in glob.glob(os.path.join(d, "*.cpp"), root_dir=here))
    headers = sorted(f for d in csrc for f in glob.glob(os.path.join(d, "*.h"), root_dir=here))  # a changed header rebuilds
    # The extension uses the process's shared libstdc++ (torch's), named outright: a toolchain that
    # links libstdc++ into it statically (as g++ 13 did for torch 2.11+cu130 on Ubuntu 24.04) gives
    # it a second, uninitialized copy of the locale state, and the first number formatted into an
    # error message crashes the process.
    link = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []
    ext = CppExtension("hybrid._C", sources, depends=headers, extra_compile_args=CXX_FLAGS, extra_link_args=link)
    # The benchmarks' own native code: the emulated network's delay line (benchmarks/csrc).
    bench = CppExtension("benchmarks._C", sorted(glob.glob(os.path.join("benchmarks", "csrc", "*.cpp"), root_dir=here)),
                         extra_compile_args=["-O2"], extra_link_args=link)
    # ninja, where installed, compiles the sources in parallel (MAX_JOBS, default every core).
    return [ext, bench], {"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
