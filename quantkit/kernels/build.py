"""Build-on-first-use for the CUDA sources in kernels/csrc, cached across processes.

`load("lutgemm")` compiles csrc/lutgemm.cu (and csrc/lutgemm.cpp when present) with
torch.utils.cpp_extension.load into ~/.cache/quantkit/kernels/<name>-<source hash>/ (override
with QUANTKIT_KERNEL_CACHE), so a changed source never reuses a stale build and an unchanged one
compiles once per machine. It returns None, with one warning saying why, when CUDA is absent,
QUANTKIT_NO_KERNELS=1 is set, or the build fails: the caller then uses its PyTorch path.
"""

import hashlib
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
_loaded = {}
_failures = {}


def cache_root() -> Path:
    default = Path.home() / ".cache" / "quantkit" / "kernels"
    return Path(os.environ.get("QUANTKIT_KERNEL_CACHE", default))


def sources_for(name):
    files = [CSRC / f"{name}.cu", CSRC / f"{name}.cpp"]
    return [f for f in files if f.exists()]


def unavailable_reason(name):
    if os.environ.get("QUANTKIT_NO_KERNELS") == "1":
        return "QUANTKIT_NO_KERNELS=1"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not sources_for(name):
        return f"no sources for kernel {name!r} in {CSRC}"
    return _failures.get(name)


def load(name, verbose=False):
    """The compiled extension module `name`, or None (warned once) when it cannot be used."""
    if name in _loaded:
        return _loaded[name]
    reason = unavailable_reason(name)
    if reason is not None:
        _loaded[name] = None
        if torch.cuda.is_available() and os.environ.get("QUANTKIT_NO_KERNELS") != "1":
            warnings.warn(f"quantkit kernel {name!r} unavailable ({reason}); using the PyTorch path")
        return None
    sources = sources_for(name)
    digest = hashlib.sha256()
    for f in sources:
        digest.update(f.read_bytes())
    build_dir = cache_root() / f"{name}-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load as load_extension

    try:
        module = load_extension(
            name=f"quantkit_{name}",
            sources=[str(f) for f in sources],
            build_directory=str(build_dir),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            verbose=verbose,
        )
    except Exception as exc:  # a compiler error must not take the run down: fall back and say so
        _failures[name] = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
        warnings.warn(f"quantkit kernel {name!r} {_failures[name]}; using the PyTorch path")
        module = None
    _loaded[name] = module
    return module
