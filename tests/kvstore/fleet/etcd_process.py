"""A real etcd member on loopback for the tests (Debian's etcd 3.4 on PATH).

The process itself is kvstore/bench/fleet_processes.py's `EtcdProcess`, shared with
`kvstore bench fleet`; here it skips a test where etcd is missing (fails it in CI).
"""

from __future__ import annotations

import os
import shutil

import pytest

from kvstore.bench import fleet_processes

__all__ = ["EtcdProcess", "need_etcd"]


def need_etcd() -> str:
    """The etcd binary; skip without it, except in CI (CI=true), where its absence is a failure."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not on PATH and CI=true: apt-get install etcd-server etcd-client")
        pytest.skip("etcd is not on PATH (apt-get install etcd-server)")
    return binary


class EtcdProcess(fleet_processes.EtcdProcess):
    """The bench's etcd process, skipping the test where etcd is missing."""

    def binary(self) -> str:
        """etcd on PATH, or skip."""
        return need_etcd()
