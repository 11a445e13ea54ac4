"""How many CPU threads quantkit's torch work uses: the cores this process may run on and that are not
already busy, unless the user set a thread count.

On a shared machine torch's default (one thread per core) slows down badly: every parallel region ends
at a barrier, and a thread that shares its core with another busy process holds all the others there
for a scheduler time slice. GPTQ on a 2-core machine with one core busy took 8.6 s per layer with two
threads and 4.3 s with one, against 2.6-2.9 s idle (RESULTS.md, CPU times). So the count is the
smallest of: the cores in the affinity mask, the cgroup CPU quota,
and the cores found idle over a short sample of /proc/stat.
"""

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)

# Environment variables through which a user states a thread count, in order of precedence. torch reads
# the last two itself; QUANTKIT_THREADS is quantkit's own and wins over them.
USER_SETTINGS = ("QUANTKIT_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    source: str = "measured"  # "measured", "quantkit" (QUANTKIT_THREADS) or "torch" (a variable torch reads)


def affinity_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")):
    """The CPU quota of this process's cgroup in cores (cgroup v2 cpu.max or v1 cfs files), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _cpu_times(stat_text: str, cpus) -> tuple:
    """(busy, total) jiffies summed over `cpus` from /proc/stat text."""
    busy = total = 0
    for line in stat_text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]
        idle = values[3] + values[4]  # idle + iowait
        busy += sum(values) - idle
        total += sum(values)
    return busy, total


def idle_cores(sample_seconds=0.2, read_stat=lambda: Path("/proc/stat").read_text(), sleep=time.sleep):
    """Cores of the affinity mask left idle by other processes over a short sample, or None where
    /proc/stat is not readable (not Linux)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        busy0, total0 = _cpu_times(read_stat(), cpus)
        sleep(sample_seconds)
        busy1, total1 = _cpu_times(read_stat(), cpus)
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    busy_fraction = (busy1 - busy0) / (total1 - total0)
    return len(cpus) * (1 - busy_fraction)


def choose_threads(environ=None, sample_seconds=0.2, measure_idle=idle_cores) -> ThreadChoice:
    """The thread count quantkit should use, and why (one line for the user)."""
    environ = os.environ if environ is None else environ
    for name in USER_SETTINGS:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            threads = int(value)
        except ValueError:
            if name == "QUANTKIT_THREADS":
                raise QuantkitError(f"QUANTKIT_THREADS must be a positive integer, got {value!r}") from None
            continue  # torch's own variables: torch decides what it makes of them
        return ThreadChoice(max(1, threads), f"{name}={value}", "quantkit" if name == "QUANTKIT_THREADS" else "torch")
    cores = affinity_cores()
    threads, reason = cores, f"{cores} cores available"
    quota = cgroup_quota_cores()
    if quota is not None and math.ceil(quota) < threads:
        threads, reason = max(1, math.ceil(quota)), f"cgroup quota of {quota:g} cores"
    if threads > 1:
        idle = measure_idle(sample_seconds)
        if idle is not None and round(idle) < threads:
            threads, reason = max(1, round(idle)), f"{idle:.1f} of {cores} cores idle (others are busy)"
    return ThreadChoice(threads, reason)


def configure_torch_threads(environ=None) -> ThreadChoice:
    """Apply choose_threads() to torch's intra-op pool. OMP_NUM_THREADS / MKL_NUM_THREADS are left to torch,
    which reads them itself; otherwise the pool is only ever made smaller, so a count the caller set with
    torch.set_num_threads (below one per core) stays."""
    import torch

    choice = choose_threads(environ)
    if choice.source == "quantkit":
        torch.set_num_threads(choice.threads)
    elif choice.source == "measured":
        current = torch.get_num_threads()
        if choice.threads < current:
            torch.set_num_threads(choice.threads)
        else:
            choice = ThreadChoice(current, f"{current} threads, no more than the {choice.reason}")
    log.info("CPU threads: %d (%s)", choice.threads, choice.reason)
    return choice
