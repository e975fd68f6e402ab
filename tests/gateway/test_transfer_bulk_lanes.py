"""Bulk transport lanes (docs/TRANSFER.md "Bulk transport", "Lanes"): a session fetching through
several client engines, each tied to one of several server engines; a real server with real
LMDB and real Mooncake engines on loopback. The server's engine writes are watched (wrapped,
still run) to see which engines wrote to which client engines."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from gateway import transfer_bulk as server_bulk
from gateway.transfer_bulk_lanes import Lane, Lanes
from kvstore.client import Client
from kvstore.client import transfer_bulk as client_bulk
from kvstore.client.transfer import TransferSession
from kvstore.config import StoreSettings, TransferSettings
from kvstore.transfer import Status
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tests.gateway import test_transfer_bulk as one_lane
from tests.gateway.test_transfer_bulk import BLOCK_BYTES, TOKENS, _fetch, needs_engine

pytestmark = needs_engine
# The one-lane tests' fixtures: a server with bulk on, from the map and from staging.
source = one_lane.source
bulk_server = one_lane.bulk_server


@pytest.fixture(scope="module")
def client_engines() -> Iterator[dict[str, list[tuple[Any, str]]]]:
    """The client's Mooncake engines for this module's tests, apart from the process's: started once
    and shared, as a process's sessions share them (a Mooncake engine takes a second to stop: three
    fresh ones a test cost 3 s of teardown each)."""
    engines: dict[str, list[tuple[Any, str]]] = {}
    yield engines
    engines.clear()


@pytest.fixture(params=[0.0, 0.7], ids=["poll", "sleep"])
def lanes(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
          client_engines: dict[str, list[tuple[Any, str]]]) -> Iterator[list[tuple[int, str]]]:
    """Two server engines and three client engines a session (whatever this host's cores), the
    server waiting on its writes by Mooncake's polling or by sleeping first (`SLEEP_SHARE`);
    yields (server engine, client segment) of each engine write."""
    monkeypatch.setattr(server_bulk, "SLEEP_SHARE", request.param)
    monkeypatch.setattr(server_bulk, "ENGINES", 2)
    monkeypatch.setattr(client_bulk, "LANES", 3)
    monkeypatch.setattr(client_bulk, "IN_FLIGHT", 2)
    monkeypatch.setattr(client_bulk, "_ENGINES", client_engines)
    writes: list[tuple[int, str]] = []
    real = server_bulk.write_blocks

    def write(engine: Any, segment: str, local: list[int], remote: list[int], block_bytes: int) -> int:
        writes.append((id(engine), segment))
        return real(engine, segment, local, remote, block_bytes)

    monkeypatch.setattr(server_bulk, "write_blocks", write)
    yield writes


def test_over_three_lanes_a_bulk_fetch_lands_what_the_grpc_fetch_does(lanes: list[tuple[int, str]],
                                                                      bulk_server: Any) -> None:
    # Found, missing, corrupt (DATA_LOSS, never DONE), a bad hash, prefix reads: as on one lane.
    one_lane.test_a_bulk_fetch_lands_what_the_grpc_fetch_does(bulk_server)
    assert len({segment for _, segment in lanes}) >= 2, "the writes went through several lanes"


def test_a_large_fetch_over_lanes_lands_every_block(lanes: list[tuple[int, str]], bulk_server: Any) -> None:
    client, _ = bulk_server
    n = 30
    tokens = list(range(n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    with TransferSession(client.connection, path="bulk", streams=8) as s:
        region = s.register(n * BLOCK_BYTES)
        state = s.fetch(client.hashes(tokens), region, batch_descriptors=n)  # 15 calls of 2 blocks
        assert s.bulk is not None and len(s.bulk.lanes) == 3 and s.bulk.in_flight() == 6
        assert state.done_prefix == n and bytes(region.view) == b"".join(blocks)
        stats = client.transfer_stats()
        assert (stats.bulk_sessions, stats.bulk_lanes) == (1, 3), "Stats count the lanes"
    assert len(lanes) == 15 and len({segment for _, segment in lanes}) == 3, "every lane was written through"
    assert len({engine for engine, _ in lanes}) == 2, "both server engines wrote"
    by_segment: dict[str, set[int]] = {}
    for engine, segment in lanes:
        by_segment.setdefault(segment, set()).add(engine)
    assert all(len(engines) == 1 for engines in by_segment.values()), "one server engine a lane"


def test_a_client_names_one_engine_to_a_server_that_takes_no_lanes(
        lanes: list[tuple[int, str]], bulk_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A server from before lanes offers "mooncake" alone: it would write every call to the last
    # engine named, past what Mooncake queues for one peer.
    monkeypatch.setattr(client_bulk, "LANES_OFFER", "mooncake-lanes-not-offered")
    monkeypatch.setattr(client_bulk, "_ENGINES", {})  # its own: the engines it starts are counted
    client, _ = bulk_server
    statuses, _, used = _fetch(client, "bulk", _put(client, 4), False)
    assert used == "" and statuses == [(Status.DONE, "")] * 4
    assert len({segment for _, segment in lanes}) == 1 and len(client_bulk._ENGINES["127.0.0.1"]) == 1


def test_a_lane_the_server_refuses_is_dropped(lanes: list[tuple[int, str]], bulk_server: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_bulk, "MAX_LANES", 2)
    client, _ = bulk_server
    hashes = _put(client, 6)
    with TransferSession(client.connection, path="bulk") as s:
        region = s.register(6 * BLOCK_BYTES)
        assert s.fetch(hashes, region).done_prefix == 6 and s.bulk is not None
        assert len(s.bulk.lanes) == 2 and len(s.bulk.engines) == 3, "the region stays registered with all three"
    assert len({segment for _, segment in lanes}) == 2


def test_openbulk_names_each_lane_once_and_at_most_max_lanes(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_bulk, "MAX_LANES", 3)
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store, transfer=TransferSettings(bulk="mooncake"))
    with Client(server.target) as client:
        stub = pb_grpc.TransferStub(client.connection.channel)
        events = stub.OpenSession(pb.OpenSessionRequest())
        try:
            first = next(events)
            assert list(first.bulk_transports) == ["mooncake", "mooncake-lanes"]

            def open_bulk(segment: str) -> Any:
                return stub.OpenBulk(pb.OpenBulkRequest(session_id=first.session_id, transport="mooncake",
                                                        segment=segment))

            for port in (1, 2, 2, 1, 3):  # the same engine named again is no new lane
                assert open_bulk(f"127.0.0.1:{port}").accepted
            refused = open_bulk("127.0.0.1:4")
            assert not refused.accepted and "names 3 engines already" in refused.reason
            with pytest.raises(grpc.RpcError) as err:
                open_bulk("127.0.0.1:5,127.0.0.1:6")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            events.cancel()


def test_a_write_goes_through_the_lane_with_fewest_writes_running() -> None:
    lanes = Lanes()
    lanes.lanes = [Lane("a:1", None, 0), Lane("b:1", None, 1)]
    with lanes.pick() as one, lanes.pick() as two:
        assert {one.segment, two.segment} == {"a:1", "b:1"}
        with lanes.pick() as three:
            assert three.writing == 2
    assert [lane.writing for lane in lanes.lanes] == [0, 0]
    # Idle lanes take turns.
    picked = []
    for _ in range(4):
        with lanes.pick() as lane:
            picked.append(lane.segment)
    assert sorted(picked) == ["a:1", "a:1", "b:1", "b:1"]


def _put(client: Client, n: int) -> list[bytes]:
    tokens = list(range(n * TOKENS))
    client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(n)])
    return client.hashes(tokens)


def test_a_write_sleeps_through_most_of_its_engines_last_pace_before_waiting(
        bulk_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Mooncake's wait polls without sleeping: a write first sleeps SLEEP_SHARE of the time its
    # bytes took at its engine's last pace (nothing before the engine's first write).
    monkeypatch.setattr(server_bulk, "ENGINES", 1)
    monkeypatch.setattr(client_bulk, "LANES", 1)
    monkeypatch.setattr(server_bulk, "_PACE", {})
    monkeypatch.setattr(server_bulk, "SLEEP_SHARE", 0.7)  # as on a host short of cores
    slept: list[tuple[float, list[float]]] = []
    monkeypatch.setattr(server_bulk, "time", SimpleNamespace(
        perf_counter=time.perf_counter, sleep=lambda s: slept.append((s, list(server_bulk._PACE.values())))))
    client, _ = bulk_server
    hashes = _put(client, 4)
    for _ in range(2):
        statuses, _, used = _fetch(client, "bulk", hashes, False, streams=1)  # 2 calls of 2, one at a time
        assert used == "" and statuses == [(Status.DONE, "")] * 4
    assert len(slept) == 4 and slept[0] == (0.0, []), "no pace before the engine's first write"
    for seconds, (pace,) in slept[1:]:
        assert pace > 0 and seconds == pytest.approx(server_bulk.SLEEP_SHARE * pace * 2 * BLOCK_BYTES)
