"""Defaults sized to cores follow the CPUs the process may run on (kvstore/host.py): its affinity
mask and its CPU quota, not the machine's count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.host import quota_cpus, usable_cpus

ROOT = Path(__file__).resolve().parents[2]

# What each default comes to in a process pinned to `cpus` CPUs (printed as JSON).
_SIZES = """
import json, os, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: int(sys.argv[1])])
from gateway import transfer_bulk
from kvstore.client import transfer_bulk as client_bulk
from kvstore.client.transfer_stream import default_streams
from kvstore.config import TransferSettings
from kvstore.host import usable_cpus
from kvstore.native import blockcopy
print(json.dumps({"cpus": usable_cpus(), "streams": default_streams(), "threads": blockcopy.DEFAULT_THREADS,
                  "copy_threads": TransferSettings().copy_threads, "engines": transfer_bulk.ENGINES,
                  "lanes": client_bulk.LANES, "sleep_share": transfer_bulk.SLEEP_SHARE}))
"""


def sizes(cpus: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _SIZES, str(cpus)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_usable_cpus_is_the_affinity_mask_held_to_the_quota() -> None:
    quota = quota_cpus()
    assert usable_cpus() == min(len(os.sched_getaffinity(0)), quota or 1 << 30) >= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin a process to fewer")
def test_a_process_pinned_to_one_cpu_sizes_its_defaults_to_it() -> None:
    one = sizes(1)
    assert one == {"cpus": 1, "streams": 2, "threads": 1, "copy_threads": 1, "engines": 1, "lanes": 1,
                   "sleep_share": 0.7}
    every = sizes(len(os.sched_getaffinity(0)))
    assert every["cpus"] > 1 and every["threads"] > 1 and every["streams"] > 2, "unpinned, sized to more"


def cgroup(tmp_path: Path, listing: str, files: dict[str, str]) -> int | None:
    """`quota_cpus` over a cgroup tree made of `files` (path under the root -> text) and a
    /proc/self/cgroup of `listing`: the parsing and the walk up the tree, on real files."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "proc-cgroup").write_text(listing)
    return quota_cpus(tmp_path / "fs", tmp_path / "proc-cgroup")


def test_a_cgroup_v2_quota_is_rounded_up_and_the_tightest_above_counts(tmp_path: Path) -> None:
    assert cgroup(tmp_path / "a", "0::/pod/app\n", {"fs/pod/app/cpu.max": "150000 100000\n"}) == 2
    assert cgroup(tmp_path / "b", "0::/pod/app\n", {"fs/pod/app/cpu.max": "max 100000\n",
                                                    "fs/pod/cpu.max": "300000 100000\n"}) == 3
    assert cgroup(tmp_path / "c", "0::/pod/app\n", {"fs/pod/app/cpu.max": "800000 100000\n",
                                                    "fs/pod/cpu.max": "200000 100000\n"}) == 2
    assert cgroup(tmp_path / "d", "0::/\n", {"fs/cpu.max": "50000 100000\n"}) == 1, "half a CPU: 1"
    assert cgroup(tmp_path / "e", "0::/pod\n", {"fs/unified/pod/cpu.max": "400000 100000\n"}) == 4, "hybrid"


def test_a_cgroup_v1_quota_counts_and_none_is_none(tmp_path: Path) -> None:
    v1 = {"fs/cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n", "fs/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    assert cgroup(tmp_path / "a", "3:cpuset:/\n2:cpu,cpuacct:/job\n", v1) == 3
    unlimited = {"fs/cpu/cpu.cfs_quota_us": "-1\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}
    assert cgroup(tmp_path / "b", "1:cpu:/\n", unlimited) is None
    assert cgroup(tmp_path / "c", "0::/x\n", {"fs/x/cpu.max": "max 100000\n"}) is None
    assert cgroup(tmp_path / "d", "0::/x\n", {"fs/x/cpu.max": "garbage\n"}) is None, "unreadable: no limit"
    assert quota_cpus(tmp_path / "none", tmp_path / "no-such-file") is None


def test_usable_cpus_is_held_to_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore import host

    monkeypatch.setattr(host, "_process_quota", lambda: 1)
    assert usable_cpus() == 1
    monkeypatch.setattr(host, "_process_quota", lambda: 10_000)
    assert usable_cpus() == len(os.sched_getaffinity(0)), "a quota above the mask changes nothing"
