"""What this host lends the process: the CPUs it may run on.

Every default sized to cores (copy threads, streams in flight, bulk lanes and
engines, the checksum worker) reads `usable_cpus`, so a process pinned to a few
CPUs (taskset, a cpuset container) or held to a CPU quota (a container's CPU
limit: Kubernetes, `docker run --cpus`) sizes itself to those, not to the machine.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path

#: Where the cgroup file systems are mounted, and where a process's cgroups are listed.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: The directories a cgroup v1 `cpu` controller is mounted at, by distribution.
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (else the machine's count), at most what
    its CPU quota lends (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _process_quota()
    return min(cpus, quota) if quota is not None else cpus  # a quota is at least 1 (rounded up)


@functools.cache
def _process_quota() -> int | None:
    # Read once: a container's limit is set when it starts, and defaults are sized at import.
    return quota_cpus()


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """CPUs the process's CPU quota lends, rounded up (a quota of 1.5 CPUs lets 2 run at once);
    None where no quota applies or none can be read.

    cgroup v2 (`cpu.max`: "<quota> <period>", or "max") and v1 (`cpu.cfs_quota_us` and
    `cpu.cfs_period_us`, -1 for none) alike, in the process's own cgroup and every one above
    it: the tightest limit counts.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy, pure (at the root) or hybrid (under unified/)
            for base in (root, root / "unified"):
                limits += _limits(base, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            for name in _V1_CPU_DIRS:
                limits += _limits(root / name, path, _v1_limit)
    return math.ceil(min(limits)) if limits else None


def _limits(base: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas `read` finds in cgroup `path` under `base` and each cgroup above it."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(base.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    """CPUs a quota of `quota` per `period` lends; None for no limit (negative) or a bad period."""
    return quota / period if quota > 0 and period > 0 else None
