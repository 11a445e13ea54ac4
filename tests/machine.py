"""What a test needs of the machine (a GPU, Triton, a compiled extension, a toolchain): checked, built or
loaded in one place, or the test skipped with a reason naming what is missing.

Tests ask through the `requires` fixture (requires(what) -> the thing) or the marker
@pytest.mark.requires(what, ...), both in conftest.py; code outside a fixture calls require(what).
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

CUDA_EXTENSIONS = ("lutgemm", "gptq", "anyprec")  # built on first use by quantkit.kernels.build.load
CPU_EXTENSIONS = ("anyprec_cpu",)  # built on first use by quantkit.kernels.build.load_cpu
GPU_REQUIREMENTS = {"cuda", "sm90", *CUDA_EXTENSIONS}  # a test marked with one of these is also marked `gpu`
REQUIREMENTS = {  # name -> what it stands for, as the skip reason says it
    "cuda": "a CUDA device",
    "no_cuda": "no CUDA device (the test checks what happens without one)",
    "sm90": "a CUDA device of compute capability 9.0+ (where kernel launches overlap)",
    "triton": "Triton",
    "nvcc": "nvcc (on PATH or in CUDA_HOME/bin)",
    "g++": "g++ on PATH",
    "cuda_headers": "the CUDA headers (cuda_fp16.h under CUDA_HOME, CUDA_PATH, nvcc's root or /usr/local/cuda*)",
    **{name: f"the {name} CUDA extension" for name in CUDA_EXTENSIONS},
    **{name: f"the {name} C++ extension" for name in CPU_EXTENSIONS},
}


def _nvcc():
    path = shutil.which("nvcc")
    if path is None and "CUDA_HOME" in os.environ:
        path = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    return path if path and os.path.exists(path) else None


def _cuda_include():
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots += sorted(str(p) for p in Path("/usr/local").glob("cuda*"))
    for root in roots:
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    return None


def _provide(what):
    """(the thing, None) when this machine has `what`, else (None, why not)."""
    if what == "cuda":
        return (True, None) if torch.cuda.is_available() else (None, "CUDA is not available")
    if what == "no_cuda":
        return (None, "a CUDA device is present") if torch.cuda.is_available() else (True, None)
    if what == "sm90":
        if not torch.cuda.is_available():
            return None, "CUDA is not available"
        major, minor = torch.cuda.get_device_capability()
        return (True, None) if major >= 9 else (None, f"this GPU has compute capability {major}.{minor}")
    if what == "triton":
        try:
            import triton
        except ImportError:
            return None, "Triton is not installed"
        return triton, None
    if what == "nvcc":
        path = _nvcc()
        return (path, None) if path else (None, "nvcc not found")
    if what == "g++":
        path = shutil.which("g++")
        return (path, None) if path else (None, "g++ not found")
    if what == "cuda_headers":
        include = _cuda_include()
        return (include, None) if include else (None, "cuda_fp16.h not found")
    if what in CUDA_EXTENSIONS:
        from quantkit.kernels import build

        module = build.load(what)  # None, warned once, without CUDA or when the build fails
        return (module, None) if module is not None else (None, build.unavailable_reason(what) or "not built")
    if what in CPU_EXTENSIONS:
        from quantkit.kernels import build

        module = build.load_cpu(what)
        if module is not None:
            return module, None
        if os.environ.get("QUANTKIT_NO_KERNELS") == "1":
            return None, "QUANTKIT_NO_KERNELS=1"
        return None, getattr(build, "_failures", {}).get(f"{what}:cpu", "the build failed")
    raise ValueError(f"unknown requirement {what!r}; one of {', '.join(sorted(REQUIREMENTS))}")


def require(what):
    """The thing `what` names (a compiled extension module, a tool's path, the CUDA include directory, the
    triton module, or True for a property of the machine), or pytest.skip with a reason naming what is missing
    and why, reported at the test (as skipif marks are), not here. Extensions are built on first use and cached
    by quantkit.kernels.build."""
    thing, why = _provide(what)
    if why is not None:
        reason = f"needs {REQUIREMENTS[what]}: {why}"
        try:
            skipped = pytest.skip.Exception(reason, _use_item_location=True)
        except TypeError:  # a pytest without the keyword: reported here instead
            skipped = pytest.skip.Exception(reason)
        raise skipped
    return thing
