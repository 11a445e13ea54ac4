"""Packaging step that ships the kernel sources: the top-level kernels/ directory goes into built wheels.

Everything else about the package is declared in pyproject.toml. The CUDA/C++ sources live in kernels/ at
the repository's top level and are compiled on first use (quantkit/kernels/build.py), so an installed
quantkit needs them as files: build_py copies kernels/ into the built package as quantkit/kernels/_sources/,
and sdist adds kernels/ to the source archive so that a wheel built from it gets them too. An editable
install needs neither: build.py reads the checkout's kernels/ directly.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "kernels"
PACKAGED = ("quantkit", "kernels", "_sources")  # where build.py looks in an installed package
SOURCE_SUFFIXES = {".cu", ".cuh", ".cpp", ".h"}


def kernel_sources():
    """The kernel source files to ship, in a stable order."""
    if not KERNELS.is_dir():
        raise FileNotFoundError(f"{KERNELS} is missing: the kernel sources must ship with quantkit")
    return sorted(f for f in KERNELS.iterdir() if f.is_file() and f.suffix in SOURCE_SUFFIXES)


class BuildPyWithKernels(build_py):
    """build_py, plus kernels/* copied into the built package as quantkit/kernels/_sources/*."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's kernels/ in place
            return
        target = Path(self.build_lib).joinpath(*PACKAGED)
        self.mkpath(str(target))
        for source in kernel_sources():
            self.copy_file(str(source), str(target / source.name))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        target = Path(self.build_lib).joinpath(*PACKAGED)
        return outputs + [str(target / source.name) for source in kernel_sources()]


class SdistWithKernels(sdist):
    """sdist, plus kernels/* in the archive (a wheel built from the sdist then ships them as well)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / KERNELS.name
        self.mkpath(str(target))
        for source in kernel_sources():
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithKernels, "sdist": SdistWithKernels})
