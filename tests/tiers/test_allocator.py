"""`kvstore serve` keeps the memory a Put frees for the next Put (tiers/allocator.py): freeing and
allocating a batch's blocks again stops faulting their pages in each time; an operator's own
glibc settings win."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiers import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")

# Allocate and free a 64-block batch of V4.1-sized buffers (or one Lookup's 500 KB of packed
# hashes) 40 times; print the minor page faults of the last 30 rounds (a fault count, not a
# time: the same on a busy machine).
WORKLOAD = """
import resource, sys
from tiers import allocator
took = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
sizes = [56960] * 64 if sys.argv[2] == "put" else [500_000]
def batch():
    blocks = [bytearray(n) for n in sizes]
    del blocks
for _ in range(10):
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    batch()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str, env: dict[str, str] | None = None, *, workload: str = "put") -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", WORKLOAD, mode, workload], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_blocks_are_reused_not_faulted_in_again() -> None:
    took, kept = faults("keep")
    _, default = faults("default")
    assert took
    # By default each round hands the batch's pages back and faults them in again (~900 a round).
    assert default > 30 * 64 * 4 and kept < default / 10, (kept, default)


def test_a_lookups_half_megabyte_is_not_mapped_afresh_each_time() -> None:
    # Changing glibc's settings stops it raising its mmap threshold by itself: the heap must
    # take these too, or each one is mapped and its 123 pages faulted in again.
    _, kept = faults("keep", workload="lookup")
    assert kept < 30 * 10, kept


def test_the_operators_own_settings_win() -> None:
    import os

    env = {**os.environ, "MALLOC_TOP_PAD_": "0"}
    took, _ = faults("keep", env)
    assert not took
    assert not allocator.keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "131072"})
