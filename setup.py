"""Builds verispec.cpu_kernels, the compiled CPU kernels, when a C++ compiler and torch's headers are at
hand (`make setup` installs torch first). Without them the package installs anyway and runs
its pure-torch fallback (verispec.model.quant.kernels says which path runs)."""

import os
import sys

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch at build time: nothing to build against
    BuildExtension = CppExtension = None


class OptionalBuildExt(BuildExtension or object):
    """A failed kernel build leaves the package installable: it then runs the torch fallback."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # the compiler's or setuptools' own failures, whatever type
            print(f"verispec: the compiled kernels were not built ({error}); "
                  f"the pure-torch fallback will run", file=sys.stderr)


def extensions() -> list:
    if os.environ.get("VERISPEC_NO_EXTENSION"):
        return []
    if CppExtension is None:
        return []
    sources = ["csrc/binding.cpp", "csrc/attention.cpp", "csrc/qlinear.cpp", "csrc/decoder.cpp",
               "csrc/eagle_chain.cpp", "csrc/vecmath.cpp", "csrc/f32linear.cpp",
               "csrc/sampling.cpp"] + [f"csrc/qgemm_{isa}.cpp"
                                      for isa in ("amx", "avx512vnni", "avxvnni", "avx512bw", "avx2",
                                                  "generic")]
    # -fopenmp: at::parallel_for runs on torch's OpenMP threads only in code compiled with it;
    # without, every range ran on the calling thread. -ffp-contract=off: no fused multiply-adds,
    # so every path performs the operations written (csrc/qgemm_kernel.inc). -fno-trapping-math
    # lets loops with a min, max or select vectorize (exp_approx); it changes no result, only
    # whether floating-point exceptions may be raised on lanes whose values are discarded.
    return [CppExtension("verispec.cpu_kernels", sources,
                         extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math",
                                             "-fopenmp"],
                         extra_link_args=["-fopenmp"])]


setup(ext_modules=extensions(),
      cmdclass={"build_ext": OptionalBuildExt} if BuildExtension is not None else {})
