"""A real etcd member on loopback for the tests (Debian's etcd 3.4 on PATH).

The process itself is kvstore/bench/fleet_processes.py's `EtcdProcess`, shared with
`kvstore bench fleet`; here it skips a test where etcd is missing (fails it in CI).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
    """The bench's etcd process, skipping the test where etcd is missing.

    Args:
        auth_token: etcd's `--auth-token` (e.g. `jwt,pub-key=...,priv-key=...,sign-method=RS256,ttl=3s`,
            docs/FLEET.md F70c; None: etcd's default, simple tokens).
        args, kwargs: the bench's EtcdProcess's.
    """

    def __init__(self, workdir: Path, *args: object, auth_token: str | None = None, **kwargs: object) -> None:
        super().__init__(workdir, *args, **kwargs)  # type: ignore[arg-type]
        self.auth_token = auth_token

    def binary(self) -> str:
        """etcd on PATH, or skip."""
        return need_etcd()

    def launch(self) -> EtcdProcess:
        """The bench's launch, with `auth_token` given as etcd's ETCD_AUTH_TOKEN (its flag's variable) to
        this child only: the environment is set around the Popen and put back at once."""
        if self.auth_token is None:
            super().launch()
            return self
        before = os.environ.get("ETCD_AUTH_TOKEN")
        os.environ["ETCD_AUTH_TOKEN"] = self.auth_token
        try:
            super().launch()
        finally:
            if before is None:
                del os.environ["ETCD_AUTH_TOKEN"]
            else:
                os.environ["ETCD_AUTH_TOKEN"] = before
        return self
