"""Defaults sized to cores follow the CPUs the process may run on (kvstore/host.py), not the machine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.host import usable_cpus

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
from tiers import blockcopy
print(json.dumps({"cpus": usable_cpus(), "streams": default_streams(), "threads": blockcopy.DEFAULT_THREADS,
                  "copy_threads": TransferSettings().copy_threads, "engines": transfer_bulk.ENGINES,
                  "lanes": client_bulk.LANES, "sleep_share": transfer_bulk.SLEEP_SHARE}))
"""


def sizes(cpus: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _SIZES, str(cpus)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_usable_cpus_is_the_affinity_mask() -> None:
    assert usable_cpus() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin a process to fewer")
def test_a_process_pinned_to_one_cpu_sizes_its_defaults_to_it() -> None:
    one = sizes(1)
    assert one == {"cpus": 1, "streams": 2, "threads": 1, "copy_threads": 1, "engines": 1, "lanes": 1,
                   "sleep_share": 0.7}
    every = sizes(len(os.sched_getaffinity(0)))
    assert every["cpus"] > 1 and every["threads"] > 1 and every["streams"] > 2, "unpinned, sized to more"
