"""What this host lends the process: the CPUs it may run on.

Every default sized to cores (copy threads, streams in flight, bulk lanes and
engines, the checksum worker) reads `usable_cpus`, so a process pinned to a few
CPUs (taskset, a cpuset container) sizes itself to those, not to the machine.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, else the machine's count (at least 1)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
