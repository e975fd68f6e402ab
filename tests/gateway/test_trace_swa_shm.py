"""A recording `kvstore serve` (`[trace] enabled`) traces each SWA snapshot put and get over shared memory as it
traces SwaPool.Put and Get over gRPC: one record per call, with its tenant, its snapshot keys (cut to
`hash_bytes`) and what it found or stored (docs/CAPACITY.md, "Recording"). A real child server, a real
same-host client on the shared-memory path, the records read back from the server's files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client, SwaClient
from kvstore.trace import recorded
from tests.children import Child, write_config
from tests.waiting import wait_until

RW = frozenset({"read", "write"})
TOKENS = list(range(300))
HASH_BYTES = 8


@dataclass
class Recording:
    child: Child
    tokens: dict[str, str]
    folder: Path

    def client(self, who: str) -> Client:
        return Client(self.child.target, token=self.tokens[who])

    def written(self) -> int:
        """The trace records the running server has written (its Stats answer)."""
        with self.client("admin") as admin:
            return int(admin.stats().trace.written_records)

    def swa_records(self) -> list[dict[str, Any]]:
        return [r for _, _, r in recorded.records(self.folder) if r["op"] in ("swa_put", "swa_get")]


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[Recording]:
    data_dir = tmp_path / "store"
    data_dir.mkdir()
    tenants = data_dir / "tenants.json"
    tokens = {who: api_tokens.create(tenants, f"tenant-{who}", RW)[1] for who in ("a", "b")}
    tokens["admin"] = api_tokens.create(tenants, "ops", frozenset({"read", "write", "admin"}))[1]
    folder = tmp_path / "trace"
    cfg = write_config(tmp_path / "kvstore.toml", {
        "store": {"data_dir": str(data_dir), "capacity_bytes": 1 << 30},
        "swa": {"cap_bytes": 256 << 20},
        "trace": {"enabled": True, "dir": str(folder), "flush_s": 0.05, "hash_bytes": HASH_BYTES}})
    child = Child("serve", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")
    try:
        yield Recording(child=child, tokens=tokens, folder=folder)
    finally:
        child.kill_if_alive()


def _hex(*keys: bytes) -> str:
    return "".join(k[:HASH_BYTES].hex() for k in keys)


def _snap(client: Client, position: int) -> bytes:
    return os.urandom(client.swa.snapshot_bytes(position))


def test_each_swa_put_and_get_over_shared_memory_is_one_record_as_over_grpc(recording: Recording) -> None:
    with recording.client("a") as c:
        swa, gateway = c.swa, SwaClient(c.connection, path="gateway")
        (k1, d1), (k2, d2) = [(swa.key(TOKENS, t), _snap(c, t)) for t in (127, 200)]
        missing = swa.key(TOKENS, 251)
        assert swa.put_many([(k1, 127, d1), (k2, 200, d2)]).stored == 2 and swa.last_path == "shm"
        assert swa.get_many([k2, missing, k1]) == [d2, None, d1] and swa.last_path == "shm"
        assert gateway.get_many([k1, missing]) == [d1, None]  # the same records, asked through SwaPool.Get
    with recording.client("b") as c:
        kb, db = c.swa.key(TOKENS, 200), _snap(c, 200)
        assert c.swa.put_many([(kb, 200, db)]).stored == 1 and c.swa.last_path == "shm"
        assert c.swa.get_many([kb, k1]) == [db, None] and c.swa.last_path == "shm"  # a's key is not b's
    # Written while the server runs: a session thread's record wakes the writer (not only the shutdown).
    wait_until(lambda: recording.written() == 5, "the five SWA calls' records written")
    got = recording.swa_records()
    assert [{k: v for k, v in r.items() if k not in ("t", "geometry")} for r in got] == [
        {"op": "swa_put", "tenant": "tenant-a", "via": "shm", "snapshots": 2, "stored": 2, "hashes": _hex(k1, k2)},
        {"op": "swa_get", "tenant": "tenant-a", "via": "shm", "asked": 3, "found": 2,
         "hashes": _hex(k2, missing, k1)},
        {"op": "swa_get", "tenant": "tenant-a", "via": "grpc", "asked": 2, "found": 1, "hashes": _hex(k1, missing)},
        {"op": "swa_put", "tenant": "tenant-b", "via": "shm", "snapshots": 1, "stored": 1, "hashes": _hex(kb)},
        {"op": "swa_get", "tenant": "tenant-b", "via": "shm", "asked": 2, "found": 1, "hashes": _hex(kb, k1)},
    ]
    assert len({r["geometry"] for r in got}) == 1 and all(r["t"] > 0 for r in got)
    assert recording.child.stop() == 0
    assert ", 0 dropped" in recording.child.log()


def test_a_put_over_grpc_records_its_keys_as_one_over_shared_memory_does(recording: Recording) -> None:
    with recording.client("a") as c:
        gateway = SwaClient(c.connection, path="gateway")
        key, data = gateway.key(TOKENS, 128), _snap(c, 128)
        assert gateway.put_many([(key, 128, data)]).stored == 1
    wait_until(lambda: recording.written() == 1, "the SwaPool.Put's record written")
    [record] = recording.swa_records()
    assert record["op"] == "swa_put" and record["via"] == "grpc" and record["tenant"] == "tenant-a"
    assert (record["snapshots"], record["stored"], record["hashes"]) == (1, 1, _hex(key))
