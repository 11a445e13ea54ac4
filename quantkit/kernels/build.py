"""Build-on-first-use of the CUDA/C++ extensions from the kernel sources, cached across processes.

The sources live in the repository's top-level kernels/ directory; a built wheel carries a copy of it as
quantkit/kernels/_sources/ (setup.py's build_py puts it there). `SOURCE_DIR` is whichever of the two this
install has: the packaged copy when present, else the checkout's kernels/ (editable and development
installs).

`load("lutgemm")` compiles the translation units SOURCES["lutgemm"] (lutgemm.cu + lutgemm.cpp) with
torch.utils.cpp_extension.load into ~/.cache/quantkit/kernels/<name>-<source hash>/ (override with
QUANTKIT_KERNEL_CACHE), so a changed source never reuses a stale build and an unchanged one compiles once
per machine. The hash covers those units, every header in SOURCE_DIR (*.h, *.cuh), the flags and the GPU
architectures built for (TORCH_CUDA_ARCH_LIST, else the visible GPUs'), so a cache shared with another GPU
model does not hand back a build without this GPU's code (the kernels' sm_90 paths, kernels/overlap.py).
It returns None, with one warning saying why, when CUDA is absent, QUANTKIT_NO_KERNELS=1 (or =cuda) is set,
or the build fails: the caller then uses its PyTorch path.

`load_cpu("anyprec_cpu")` does the same for a CPU-only extension (CPU_SOURCES; OpenMP, no CUDA needed),
cached under <name>-cpu-<hash>. It is built with plain -O3 (no -march=native, so a build cached on one CPU
still runs on another) and returns None, warned once, on failure or with QUANTKIT_NO_KERNELS=1.
QUANTKIT_NO_KERNELS=cuda turns off the CUDA extensions only: runs that must not wait for a first CUDA build
(many benchmark processes on a fresh machine) keep the CPU extension, whose exact k-means changes results.
"""

import hashlib
import os
import warnings
from pathlib import Path

import torch

PACKAGED_SOURCES = Path(__file__).parent / "_sources"  # in a built wheel (setup.py)
CHECKOUT_SOURCES = Path(__file__).resolve().parents[2] / "kernels"  # the repository's kernels/
SOURCE_DIR = PACKAGED_SOURCES if PACKAGED_SOURCES.is_dir() else CHECKOUT_SOURCES

# Translation units of each extension, in SOURCE_DIR; the headers they include are found next to them. A name
# not listed here builds <name>.cu and <name>.cpp where they exist.
SOURCES = {
    "lutgemm": ("lutgemm.cu", "lutgemm.cpp"),
    "anyprec": ("anyprec.cu", "anyprec_variants.cu", "anyprec_rows.cu", "anyprec.cpp"),
    "gptq": ("gptq.cu", "gptq.cpp"),
}
CPU_SOURCES = {"anyprec_cpu": ("anyprec_cpu.cpp",)}
HEADER_SUFFIXES = (".h", ".cuh")

_loaded = {}
_failures = {}


def cache_root() -> Path:
    default = Path.home() / ".cache" / "quantkit" / "kernels"
    return Path(os.environ.get("QUANTKIT_KERNEL_CACHE", default))


def sources_for(name):
    """The existing translation units of CUDA extension `name`, in SOURCE_DIR."""
    files = [SOURCE_DIR / f for f in SOURCES.get(name, (f"{name}.cu", f"{name}.cpp"))]
    return [f for f in files if f.exists()]


def headers():
    """Every header in SOURCE_DIR: part of every build's cache key."""
    return sorted(f for f in SOURCE_DIR.iterdir() if f.suffix in HEADER_SUFFIXES) if SOURCE_DIR.is_dir() else []


def sources_digest() -> str:
    """sha256 over every kernel source file: what a build is made from, for fingerprints of runs whose
    numbers depend on it (a resumed quantization must use the kernels it started with)."""
    digest = hashlib.sha256()
    if SOURCE_DIR.is_dir():
        for path in sorted(p for p in SOURCE_DIR.iterdir() if p.is_file()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cuda_off():
    return os.environ.get("QUANTKIT_NO_KERNELS") in ("1", "cuda")


def unavailable_reason(name):
    if _cuda_off():
        return f"QUANTKIT_NO_KERNELS={os.environ['QUANTKIT_NO_KERNELS']}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not sources_for(name):
        return f"no sources for kernel {name!r} in {SOURCE_DIR}"
    return _failures.get(name)


CUDA_FLAGS = {"extra_cflags": ["-O3"], "extra_cuda_cflags": ["-O3", "-lineinfo"]}
# extra nvcc flags for experiments, e.g. QUANTKIT_KERNEL_DEFINES="-DAP_MIN_BLOCKS=3" to override a switch of
# kernels/*_tuning.h (benchmarks/ab_defines.sh); part of the cache key
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
    """Build `sources` as module quantkit_<name> in a directory keyed by their bytes and the headers', the
    flags, the target architectures and the torch version; None (warned, reason kept in _failures[key]) when
    the compiler fails."""
    digest = hashlib.sha256()
    for f in [*sources, *headers()]:
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
        warnings.warn(f"quantkit {label} {name!r} {_failures[key]}; using the PyTorch path", stacklevel=3)
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
        if torch.cuda.is_available() and not _cuda_off():
            warnings.warn(f"quantkit kernel {name!r} unavailable ({reason}); using the PyTorch path", stacklevel=2)
        return None
    flags = CUDA_FLAGS
    extra = os.environ.get(EXTRA_CUDA_ENV, "").split()
    if extra:
        flags = {**CUDA_FLAGS, "extra_cuda_cflags": CUDA_FLAGS["extra_cuda_cflags"] + extra}
    return _compile(name, "kernel", name, sources_for(name), flags, verbose, cuda_targets())


def load_cpu(name, verbose=False):
    """The compiled CPU extension `name` (CPU_SOURCES, else <name>.cpp), or None (warned once) when it cannot
    be built."""
    key = f"{name}:cpu"
    if key in _loaded:
        return _loaded[key]
    if os.environ.get("QUANTKIT_NO_KERNELS") == "1":
        _loaded[key] = None
        return None
    sources = [SOURCE_DIR / f for f in CPU_SOURCES.get(name, (f"{name}.cpp",))]
    missing = [f for f in sources if not f.exists()]
    if missing:
        _failures[key] = f"no source {missing[0]}"
        warnings.warn(f"quantkit CPU extension {name!r} unavailable ({_failures[key]}); using the PyTorch path",
                      stacklevel=2)
        _loaded[key] = None
        return None
    return _compile(key, "CPU extension", name, sources, CPU_FLAGS, verbose)
