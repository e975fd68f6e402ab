"""The one-copy TCP transport, client side (docs/TRANSFER.md "The one-copy TCP transport"): a real
`kvstore serve` process on loopback with `transfer.tcp_bulk` on; sessions on path "bulk" fetch
through it into their regions, and fall back to gRPC when it fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.harness import serve_process
from kvstore.client import Client, transfer_tcp
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_tcp import TcpPath
from kvstore.transfer import Status
from tests.gateway.test_transfer_fetch import corrupt

TOKENS = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Path]]:
    """A `kvstore serve` child with the TCP transport on (4 blocks a request), a client, its data file."""
    folder = tmp_path_factory.mktemp("tcp")
    env = {"KVSTORE_TRANSFER_TCP_BULK": "true", "KVSTORE_TRANSFER_TCP_MAX_REQUEST_BYTES": str(1 << 16)}
    with serve_process(folder / "store", 64 << 20, TOKENS, env) as target, Client(target) as client:
        yield client, folder / "store" / "data.mdb"


def _put(client: Client, n: int, first: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(first, first + n * TOKENS))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


def _fetch(client: Client, asked: list[bytes], prefix_only: bool = False) -> tuple[list[Any], bytes, Any]:
    with TransferSession(client.connection, path="bulk") as s:
        region = s.register(len(asked) * client.block_bytes)
        state = s.fetch(asked, region, batch_descriptors=len(asked), prefix_only=prefix_only)
        return [(r.status, r.code) for r in state.results], bytes(region.view), (s.bulk, s.bulk_reason)


def test_tc1_a_session_fetches_over_tcp_and_lands_the_stored_bytes(served: Any) -> None:
    client, _ = served
    hashes, blocks = _put(client, 40, 0)  # several requests a batch, IN_FLIGHT at once
    results, data, (path, reason) = _fetch(client, hashes)
    assert isinstance(path, TcpPath) and reason == ""
    assert path.max_blocks == (1 << 16) // client.block_bytes < 40  # so the batch took several requests
    assert results == [(Status.DONE, "")] * 40
    assert data == b"".join(blocks)


def test_tc2_misses_land_nothing_and_a_prefix_stops(served: Any) -> None:
    client, _ = served
    hashes, blocks = _put(client, 3, 10_000)
    asked = [hashes[0], b"\5" * 32, hashes[1], hashes[2]]
    results, data, (path, _) = _fetch(client, asked)
    assert isinstance(path, TcpPath)
    assert [r for r, _ in results] == [Status.DONE, Status.MISSING, Status.DONE, Status.DONE]
    size = client.block_bytes
    assert (
        data[:size] == blocks[0] and data[size : 2 * size] == bytes(size) and data[2 * size :] == blocks[1] + blocks[2]
    )
    results, _, _ = _fetch(client, asked, prefix_only=True)
    assert [r for r, _ in results] == [Status.DONE, Status.MISSING, Status.SKIPPED, Status.SKIPPED]


def test_tc3_a_damaged_block_fails_with_data_loss_and_is_not_landed(served: Any) -> None:
    client, data_file = served
    hashes, blocks = _put(client, 3, 20_000)
    corrupt(data_file, blocks[1])
    results, data, (path, _) = _fetch(client, hashes)
    assert isinstance(path, TcpPath)
    assert results[0] == (Status.DONE, "") and results[2] == (Status.DONE, "")
    assert results[1] == (Status.FAILED, "DATA_LOSS")
    size = client.block_bytes
    assert data[size : 2 * size] == bytes(size)


def test_tc4_a_refused_connection_falls_back_to_grpc_and_says_why(served: Any) -> None:
    client, _ = served
    hashes, blocks = _put(client, 4, 30_000)
    with TransferSession(client.connection, path="bulk") as s:
        assert isinstance(s.bulk, TcpPath)
        s.bulk.token = bytes(16)  # as a token the server never gave: the next connection is refused
        s.bulk._close_socket()
        region = s.register(4 * client.block_bytes)
        state = s.fetch(hashes, region, batch_descriptors=4)
        assert [r.status for r in state.results] == [Status.DONE] * 4 and bytes(region.view) == b"".join(blocks)
        assert s.bulk is None
        assert (
            "Unauthenticated: tcp transport: no open session" in s.bulk_reason and "fetching over gRPC" in s.bulk_reason
        )


def test_tc5_the_environment_can_ask_for_mooncake_instead(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = served
    monkeypatch.setenv(transfer_tcp.PREFER_ENV, "mooncake")
    with TransferSession(client.connection, path="bulk") as s:
        assert s.bulk is None  # this server offers no Mooncake transport: gRPC
        assert s.bulk_reason == "off: the server offers no bulk transport (its transfer.bulk is off)"
