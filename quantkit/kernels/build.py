"""Build-on-first-use for the CUDA sources in kernels/csrc, cached across processes.

`load("lutgemm")` compiles csrc/lutgemm.cu (and csrc/lutgemm.cpp when present) with
torch.utils.cpp_extension.load into ~/.cache/quantkit/kernels/<name>-<source hash>/ (override
with QUANTKIT_KERNEL_CACHE), so a changed source never reuses a stale build and an unchanged one
compiles once per machine. The hash covers the GPU architectures built for (TORCH_CUDA_ARCH_LIST,
else the visible GPUs'), so a cache shared with another GPU model does not hand back a build
without this GPU's code (the kernels' sm_90 paths, kernels/overlap.py). It returns None, with one warning saying why, when CUDA is absent,
QUANTKIT_NO_KERNELS=1 is set, or the build fails: the caller then uses its PyTorch path.

`load_cpu("anyprec_cpu")` does the same for a CPU-only C++ source csrc/<name>.cpp (OpenMP, no CUDA
needed), cached under <name>-cpu-<hash>. It is built with plain -O3 (no -march=native, so a build
cached on one CPU still runs on another) and returns None, warned once, on failure or with
QUANTKIT_NO_KERNELS=1.
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


CUDA_FLAGS = {"extra_cflags": ["-O3"], "extra_cuda_cflags": ["-O3", "-lineinfo"]}
# extra nvcc flags for experiments (e.g. QUANTKIT_KERNEL_DEFINES="-DAP_MIN_BLOCKS=3"); part of the cache key
EXTRA_CUDA_ENV = "QUANTKIT_KERNEL_DEFINES"
# no FP traps are used: -fno-trapping-math lets the division loops vectorise
CPU_FLAGS = {"extra_cflags": ["-O3", "-fno-trapping-math", "-fopenmp"], "extra_ldflags": ["-fopenmp"]}


def cuda_targets():
    """The architectures torch's extension build compiles for: TORCH_CUDA_ARCH_LIST, else the visible GPUs'."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed:
        return listed
    return ",".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def _compile(key, label, name, sources, flags, verbose, target=""):
    """Build `sources` as module quantkit_<name> in a directory keyed by their bytes, the flags, the
    target architectures and the torch version; None (warned, reason kept in _failures[key]) when the
    compiler fails."""
    digest = hashlib.sha256()
    for f in [*sources, *sorted(CSRC.glob("*.h"))]:  # shared headers (check.h) are part of every build
        digest.update(f.read_bytes())
    digest.update(repr(sorted(flags.items())).encode() + target.encode() + torch.__version__.encode())
    build_dir = cache_root() / f"{key.replace(':', '-')}-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load as load_extension

    try:
        module = load_extension(name=f"quantkit_{name}", sources=[str(f) for f in sources],
                                build_directory=str(build_dir), verbose=verbose, **flags)
    except Exception as exc:  # a compiler error must not take the run down: fall back and say so
        _failures[key] = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
        warnings.warn(f"quantkit {label} {name!r} {_failures[key]}; using the PyTorch path")
        module = None
    _loaded[key] = module
    return module


def load(name, verbose=False):
    """The compiled CUDA extension `name`, or None (warned once) when it cannot be used."""
    if name in _loaded:
        return _loaded[name]
    reason = unavailable_reason(name)
    if reason is not None:
        _loaded[name] = None
        if torch.cuda.is_available() and os.environ.get("QUANTKIT_NO_KERNELS") != "1":
            warnings.warn(f"quantkit kernel {name!r} unavailable ({reason}); using the PyTorch path")
        return None
    flags = CUDA_FLAGS
    extra = os.environ.get(EXTRA_CUDA_ENV, "").split()
    if extra:
        flags = {**CUDA_FLAGS, "extra_cuda_cflags": CUDA_FLAGS["extra_cuda_cflags"] + extra}
    return _compile(name, "kernel", name, sources_for(name), flags, verbose, cuda_targets())


def load_cpu(name, verbose=False):
    """The compiled CPU extension csrc/<name>.cpp, or None (warned once) when it cannot be built."""
    key = f"{name}:cpu"
    if key in _loaded:
        return _loaded[key]
    source = CSRC / f"{name}.cpp"
    if os.environ.get("QUANTKIT_NO_KERNELS") == "1":
        _loaded[key] = None
        return None
    if not source.exists():
        _failures[key] = f"no source {source}"
        warnings.warn(f"quantkit CPU extension {name!r} unavailable ({_failures[key]}); using the PyTorch path")
        _loaded[key] = None
        return None
    return _compile(key, "CPU extension", name, [source], CPU_FLAGS, verbose)
