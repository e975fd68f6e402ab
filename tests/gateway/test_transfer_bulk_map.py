"""The bulk transport served from LMDB's map (docs/TRANSFER.md "Bulk transport", "From the map"):
a real server with real LMDB and real Mooncake engines on loopback; the engine's write and the
staging copy are watched (wrapped, still run) to see which path served a call and from where."""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway import transfer_bulk
from kvstore.client import Client
from kvstore.client.transfer import TransferSession
from kvstore.config import StoreSettings, TransferSettings
from kvstore.transfer import DONE, Status
from tests.gateway.test_transfer_bulk import BLOCK_BYTES, TOKENS, _fetch, needs_engine
from tests.gateway.test_transfer_fetch import corrupt
from tests.waiting import wait_until
from tiers.ring import Mapping

pytestmark = needs_engine


def _active_txns(env: Any) -> int:
    """Read txns open now in the environment's reader table (an idle slot shows txnid "-")."""
    lines = env.readers().splitlines()[1:]
    return sum(1 for line in lines if line.split() and line.split()[-1] != "-")


class _Watch:
    """Wraps the engine's write and the staging copy (both still run), noting what each saw."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, env: Any, fail_after: int | None = None) -> None:
        self.env = env
        self.writes: list[dict[str, Any]] = []
        self.staged = 0
        real_write, real_copy = transfer_bulk.write_blocks, transfer_bulk.copy_blocks

        def write(engine: Any, segment: str, local: list[int], remote: list[int], block_bytes: int) -> int:
            seen = {"local": list(local), "txns": _active_txns(env),
                    "bytes": [ctypes.string_at(a, block_bytes) for a in local]}
            self.writes.append(seen)
            if fail_after is not None:  # a write that fails mid-way: some blocks landed, then an error
                real_write(engine, segment, local[:fail_after], remote[:fail_after], block_bytes)
                return -1
            return real_write(engine, segment, local, remote, block_bytes)

        def copy(*args: Any) -> Any:
            self.staged += 1
            return real_copy(*args)

        monkeypatch.setattr(transfer_bulk, "write_blocks", write)
        monkeypatch.setattr(transfer_bulk, "copy_blocks", copy)


def _server(start_server: Callable[..., Any], tmp_path: Path, max_blocks: int = 2, from_map: bool = True) -> Any:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    return start_server(store, transfer=TransferSettings(bulk="mooncake", bulk_max_blocks=max_blocks,
                                                         bulk_staging_bytes=1 << 20, bulk_from_map=from_map))


def service(srv: Any) -> Any:
    """The running server's Transfer servicer (its bulk server, `.bulk`)."""
    from gateway.transfer_servicer import TransferServicer

    return next(c.__self__ for c in srv.closers if isinstance(getattr(c, "__self__", None), TransferServicer))


def _put(client: Client, n: int, first: int = 0) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(first, first + n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


def test_a_bulk_fetch_writes_straight_from_lmdbs_map_under_a_read_txn(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path)
    watch = _Watch(monkeypatch, srv.tier.env)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 5)
        asked = [hashes[0], b"\x07" * 32, *hashes[1:]]  # a miss between found blocks: 3 calls of 2
        statuses, landed, used = _fetch(client, "bulk", asked, False)
    assert used == "" and [s for s, _ in statuses] == [Status.DONE, Status.MISSING] + [Status.DONE] * 4
    assert landed == blocks[0] + bytes(BLOCK_BYTES) + b"".join(blocks[1:])
    assert watch.staged == 0, "no block went through a staging slot"
    mapping = Mapping(srv.tier.env)
    assert sum(len(w["local"]) for w in watch.writes) == 5
    for w in watch.writes:
        assert all(mapping.base <= a < mapping.base + mapping.length for a in w["local"]), "written from the map"
        assert w["txns"] >= 1, "the read txn is held while the engine writes"
    # Calls on several lanes write at once: in any order.
    assert sorted(b for w in watch.writes for b in w["bytes"]) == sorted(blocks)
    assert _active_txns(srv.tier.env) == 0, "the txn ends once the write returned"


def test_the_staging_path_serves_when_the_map_is_off(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path, from_map=False)
    watch = _Watch(monkeypatch, srv.tier.env)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 4)
        statuses, landed, used = _fetch(client, "bulk", hashes, False)
    assert used == "" and statuses == [(Status.DONE, "")] * 4 and landed == b"".join(blocks)
    assert watch.staged == 2, "each call verify-copied its blocks into a slot"
    mapping = Mapping(srv.tier.env)
    assert not any(mapping.base <= a < mapping.base + mapping.length for w in watch.writes for a in w["local"])


def test_a_corrupt_block_hands_its_call_to_staging(start_server: Callable[..., Any], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path)
    watch = _Watch(monkeypatch, srv.tier.env)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 4)
        corrupt(srv.tier.settings.data_dir / "data.mdb", blocks[3])
        statuses, landed, used = _fetch(client, "bulk", hashes, False)
        assert used == "" and statuses == [(Status.DONE, "")] * 3 + [(Status.FAILED, "DATA_LOSS")]
        assert landed == b"".join(blocks[:3]) + bytes(BLOCK_BYTES), "the corrupt block never lands"
        assert watch.staged == 1, "only the call holding the corrupt block went through staging"
        # Dropped as Fetch drops it: now a miss, served from the map.
        assert _fetch(client, "bulk", hashes, False)[0][3] == (Status.MISSING, "")
        assert watch.staged == 1


def test_a_replaced_data_file_turns_the_map_path_off(start_server: Callable[..., Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path)
    watch = _Watch(monkeypatch, srv.tier.env)
    data = srv.tier.settings.data_dir / "data.mdb"
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 2)
        assert _fetch(client, "bulk", hashes, False)[1] == b"".join(blocks) and watch.staged == 0
        # A repair swaps a rebuilt file in: the server's map is then of a file the store is no longer in.
        shutil.copyfile(data, tmp_path / "rebuilt.mdb")
        os.replace(tmp_path / "rebuilt.mdb", data)
        statuses, landed, used = _fetch(client, "bulk", hashes, False)
        assert used == "" and statuses == [(Status.DONE, "")] * 2 and landed == b"".join(blocks)
        assert watch.staged == 1, "served through staging once the file was replaced"


def test_a_remapped_environment_turns_the_map_path_off(start_server: Callable[..., Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path)
    watch = _Watch(monkeypatch, srv.tier.env)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 2)
        assert _fetch(client, "bulk", hashes, False)[1] == b"".join(blocks) and watch.staged == 0
        # LMDB maps the file again (maybe elsewhere) when the map size changes.
        srv.tier.env.set_mapsize(srv.tier.env.info()["map_size"] + (64 << 20))
        statuses, landed, used = _fetch(client, "bulk", hashes, False)
        assert used == "" and statuses == [(Status.DONE, "")] * 2 and landed == b"".join(blocks)
        assert watch.staged == 1


def test_a_write_failing_midway_ends_the_txn_and_the_client_falls_back(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path, max_blocks=4)
    _Watch(monkeypatch, srv.tier.env, fail_after=2)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 4)
        with TransferSession(client.connection, path="bulk") as s:
            region = s.register(4 * BLOCK_BYTES)
            state = s.fetch(hashes, region)
            assert s.bulk is None and "BulkFetch failed" in s.bulk_reason and "Mooncake returned -1" in s.bulk_reason
            assert state.done_prefix == 4 and bytes(region.view) == b"".join(blocks)
    assert _active_txns(srv.tier.env) == 0, "a failed write ends its txn too"


def test_a_prefix_fetch_from_the_map_stops_at_its_first_miss(start_server: Callable[..., Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    srv = _server(start_server, tmp_path, max_blocks=4)
    watch = _Watch(monkeypatch, srv.tier.env)
    with Client(srv.target) as client:
        hashes, blocks = _put(client, 3)
        asked = [hashes[0], b"\x07" * 32, hashes[1], hashes[2]]  # one call
        statuses, landed, used = _fetch(client, "bulk", asked, True)
        assert used == "" and [s for s, _ in statuses] == [Status.DONE, Status.MISSING, Status.SKIPPED, Status.SKIPPED]
        assert statuses == _fetch(client, "stream", asked, True)[0]
    assert landed[:BLOCK_BYTES] == blocks[0] and watch.staged == 0
    assert [len(w["local"]) for w in watch.writes] == [1], "nothing past the prefix is written"


def test_a_cancelled_call_frees_its_staging_slot_only_once_the_write_returned(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import grpc

    from kvstore.v1 import transfer_pb2 as pb
    from kvstore.v1 import transfer_pb2_grpc as pb_grpc

    srv = _server(start_server, tmp_path, max_blocks=512, from_map=False)  # one slot: the most blocks 1 MiB holds
    events: list[str] = []
    release = threading.Event()
    real_write, real_copy = transfer_bulk.write_blocks, transfer_bulk.copy_blocks

    def write(*args: Any) -> int:
        events.append("write")
        if len(events) == 2:  # the first call's write: held until the second call is under way
            release.wait(30)
        rc = real_write(*args)
        events.append("written")
        return rc

    def copy(*args: Any) -> Any:
        events.append("copy")
        return real_copy(*args)

    monkeypatch.setattr(transfer_bulk, "write_blocks", write)
    monkeypatch.setattr(transfer_bulk, "copy_blocks", copy)
    with Client(srv.target) as client:
        hashes, _ = _put(client, 1)
        with TransferSession(client.connection, path="bulk") as s:
            region = s.register(BLOCK_BYTES)
            assert s.bulk is not None
            stub = pb_grpc.TransferStub(client.connection.channel)
            fetch = pb.BulkFetchRequest(session_id=s.session_id, block_hashes=hashes[0], address=s.bulk.addresses[
                region.region_id], size_bytes=BLOCK_BYTES, offsets_bytes=[0])
            first = stub.BulkFetch.future(fetch, timeout=60)
            wait_until(lambda: events == ["copy", "write"], "the first call's write never began")
            first.cancel()  # the caller gives up while the engine writes
            with pytest.raises(grpc.FutureCancelledError):
                first.result()
            staging = service(srv).bulk._staging
            second = stub.BulkFetch.future(fetch, timeout=60)
            # Until the second call waits for the slot, or (a server that freed the slot at the cancel)
            # copies into it: the order below is what is asserted, not a duration.
            wait_until(lambda: len(staging.ready._waiters or ()) == 1 or len(events) > 2,
                       "the second call neither waited for the slot nor took it")
            release.set()
            assert second.result().statuses == bytes([DONE])
    assert events == ["copy", "write", "written", "copy", "write", "written"], events
