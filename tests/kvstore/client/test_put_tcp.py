"""Put over the one-copy TCP transport, end to end (docs/TRANSFER.md "Put over the one-copy TCP transport"):
real servers on loopback with real LMDB; `Client.put` takes the TCP transport for a large put to a node
that offers it, and gRPC otherwise, with the same results and errors."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client, put_tcp
from kvstore.client.admin import AdminClient
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import meta_key
from kvstore.prefix import BlockScope
from tests.tcp_puts import watch_tcp_puts

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)
#: Blocks of the tests' puts, and blocks a request: several frames a put.
BLOCKS, STEP = 40, 8


@pytest.fixture
def frames(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Puts of any size try the transport; each put that went over it lists its reply count."""
    return watch_tcp_puts(monkeypatch)


@pytest.fixture
def start(start_server: Callable[..., Any], tmp_path: Path) -> Callable[..., Any]:
    """`start(name, **settings)`: a server on its own store of 256 blocks."""
    def _start(name: str = "store", **kwargs: Any) -> Any:
        store = StoreSettings(data_dir=tmp_path / name, capacity_bytes=256 * BLOCK_BYTES, block_tokens=TOKENS)
        return start_server(store, **kwargs)

    return _start


def _prompt(seed: int = 1, n: int = BLOCKS) -> tuple[list[int], list[bytes]]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n * TOKENS)], [rng.randbytes(BLOCK_BYTES) for _ in range(n)]


def _records(server: Any, hashes: list[bytes]) -> list[bytes | None]:
    """Each block's record as the store holds it (its metadata: size, checksum, retention)."""
    tier = server.tier
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    with tier.env.begin() as txn:
        return [txn.get(meta_key(scope.key(h)), db=tier._records) for h in hashes]


def test_a_put_over_tcp_stores_what_a_grpc_put_stores(start: Callable[..., Any], frames: list[int],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, blocks = _prompt()
    over_tcp, over_grpc = start("tcp"), start("grpc")
    acked: dict[str, list[int]] = {"tcp": [], "grpc": []}
    results = {}
    for name, server in (("tcp", over_tcp), ("grpc", over_grpc)):
        if name == "grpc":
            monkeypatch.setenv(put_tcp.TRANSPORT_ENV, "grpc")
        with Client(server.target) as client:
            # Half first, then the rest from its parent: the second put extends the first's chain.
            first = client.put(tokens[:20 * TOKENS], blocks[:20], batch_blocks=STEP, on_batch=acked[name].append)
            rest = client.put(tokens, blocks[20:], first_block=20, parent=first.block_hashes[-1], batch_blocks=STEP,
                              on_batch=acked[name].append, keep_until_s=4e9)
            again = client.put(tokens, blocks, batch_blocks=STEP)  # all existing now
            assert client.lookup(tokens).found_blocks == BLOCKS
            assert client.get(tokens).blocks == blocks
            results[name] = (first, rest, again, client.hashes(tokens))
    assert frames == [3, 3, 5], "the puts went over TCP to one server, by gRPC to the other"
    assert acked["tcp"] == acked["grpc"] == [8, 8, 4, 8, 8, 4]
    assert results["tcp"] == results["grpc"]
    first, rest, again, hashes = results["tcp"]
    assert first.block_hashes + rest.block_hashes == hashes
    assert (first.written_blocks, rest.written_blocks, again.written_blocks, again.existing_blocks) == (20, 20, 0, 40)
    assert rest.keep_note  # the pin asked was answered (refused by the default policy) on both alike
    assert _records(over_tcp, hashes) == _records(over_grpc, hashes)


def test_a_small_put_stays_on_grpc(start: Callable[..., Any], frames: list[int],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(put_tcp, "TCP_PUT_MIN_BYTES", BLOCKS * BLOCK_BYTES + 1)
    tokens, blocks = _prompt()
    with Client(start().target) as client:
        assert client.put(tokens, blocks, batch_blocks=STEP).written_blocks == BLOCKS
    assert frames == []


def test_the_environment_switch_puts_by_grpc(start: Callable[..., Any], frames: list[int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(put_tcp.TRANSPORT_ENV, "grpc")
    tokens, blocks = _prompt()
    with Client(start().target) as client:
        assert client.put(tokens, blocks, batch_blocks=STEP).written_blocks == BLOCKS
    assert frames == []


def test_a_server_without_tcp_put_is_put_by_grpc(start: Callable[..., Any], frames: list[int]) -> None:
    tokens, blocks = _prompt()
    with Client(start(transfer=TransferSettings(tcp_put=False)).target) as client:
        assert client.put(tokens[:20 * TOKENS], blocks[:20], batch_blocks=STEP).written_blocks == 20
        assert put_tcp.refused(client.connection) == "transfer.tcp_put is off on this server"
        assert client.put(tokens, blocks[20:], first_block=20, batch_blocks=STEP).written_blocks == 20
        assert client.get(tokens).blocks == blocks
    assert frames == []


def test_a_listener_that_does_not_answer_falls_back_to_grpc(start: Callable[..., Any], frames: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = put_tcp.open_put
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now

    def elsewhere(connection: Any) -> Any:
        grant = real(connection)
        return None if grant is None else put_tcp.PutGrant(address=("127.0.0.1", port), grant_id=grant.grant_id,
                                                           token=grant.token, max_frame_bytes=grant.max_frame_bytes)

    monkeypatch.setattr(put_tcp, "open_put", elsewhere)
    tokens, blocks = _prompt()
    with Client(start().target) as client:
        assert client.put(tokens, blocks, batch_blocks=STEP).written_blocks == BLOCKS
        assert "did not answer" in put_tcp.refused(client.connection)
        assert client.get(tokens).blocks == blocks
    assert frames == []


def test_a_put_on_a_parent_not_stored_is_refused_and_stores_nothing(start: Callable[..., Any],
                                                                      frames: list[int]) -> None:
    tokens, blocks = _prompt()
    with Client(start().target) as client:
        with pytest.raises(FailedPrecondition):
            client.put(tokens, blocks[5:], first_block=5, batch_blocks=STEP)
        assert client.put(tokens[:5 * TOKENS], blocks[:5], batch_blocks=STEP).written_blocks == 5  # none was stored
    assert frames == [-1, 1], "the refused put went over TCP (and raised), the next one too"


@pytest.fixture
def tenants(start: Callable[..., Any]) -> Iterator[tuple[Any, dict[str, str]]]:
    server = start()
    path = server.tenants.path
    made = {name: api_tokens.create(path, name, frozenset(rights))[1]
            for name, rights in (("ops", {"read", "write", "admin"}), ("acme", {"read", "write"}),
                                 ("reader", {"read"}))}
    server.tenants.refresh()
    yield server, made


def test_a_read_only_token_is_refused(tenants: tuple[Any, dict[str, str]], frames: list[int]) -> None:
    server, made = tenants
    tokens, blocks = _prompt()
    with Client(server.target, token=made["reader"]) as reader:
        with pytest.raises(PermissionDenied, match="'write' right"):
            reader.put(tokens, blocks, batch_blocks=STEP)
        assert put_tcp.refused(reader.connection) == ""  # refused as the Put is, not taken for a missing transport
        assert reader.lookup(tokens).found_blocks == 0


def test_the_nvme_quota_ends_a_tcp_put_after_the_batches_before_it(tenants: tuple[Any, dict[str, str]],
                                                                     frames: list[int]) -> None:
    server, made = tenants
    with AdminClient(server.target, token=made["ops"]) as admin:
        admin.set_policy("acme", nvme_quota_bytes=12 * BLOCK_BYTES)
    tokens, blocks = _prompt()
    acked: list[int] = []
    with Client(server.target, token=made["acme"]) as acme:
        with pytest.raises(ResourceExhausted, match="'acme' is over its NVMe quota"):
            acme.put(tokens, blocks, batch_blocks=STEP, on_batch=acked.append)
        assert put_tcp.refused(acme.connection) == ""
        # The second batch would pass the quota: what was acknowledged before it is stored (the first batch, when
        # its commit ran alone; none, when the two shared the refused commit), and nothing after.
        assert acme.lookup(tokens).found_blocks == sum(acked) <= 8


def test_a_put_through_tcp_of_many_frames_keeps_them_in_order(start: Callable[..., Any], frames: list[int]) -> None:
    tokens, blocks = _prompt(seed=3, n=200)
    with Client(start().target) as client:
        result = client.put(tokens, blocks, batch_blocks=2)  # 100 frames, many ahead of their commits
        assert result.block_hashes == client.hashes(tokens) and result.written_blocks == 200
        assert client.get(tokens).blocks == blocks
    assert frames == [100]


def test_requests_are_cut_to_the_servers_frame_limit(start: Callable[..., Any], frames: list[int]) -> None:
    limit = max(1 << 16, 4 * BLOCK_BYTES)  # 4 blocks a frame
    tokens, blocks = _prompt(seed=5)
    with Client(start(transfer=TransferSettings(tcp_max_request_bytes=limit)).target) as client:
        assert client.put(tokens, blocks, batch_blocks=STEP).written_blocks == BLOCKS
    assert frames == [BLOCKS // (limit // BLOCK_BYTES)]


def test_blocks_given_as_arrays_go_from_their_buffers(start: Callable[..., Any], frames: list[int]) -> None:
    np = pytest.importorskip("numpy")
    tokens, blocks = _prompt(seed=4)
    array = np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(BLOCKS, BLOCK_BYTES)
    with Client(start().target) as client:
        assert client.put(tokens, array, batch_blocks=STEP).written_blocks == BLOCKS
        assert client.get(tokens).blocks == blocks
    assert frames == [5]



def test_an_error_reaches_the_client_while_it_still_sends(start: Callable[..., Any], frames: list[int]) -> None:
    # The first frame is refused while the client has ~14 MB more to send: the server must not reset the
    # connection (dropping its error frame) for the bytes it will not read.
    n = 1000
    tokens = list(range(n * TOKENS))
    blocks = [bytes([i % 256]) * BLOCK_BYTES for i in range(n)]
    with Client(start().target) as client:
        for _ in range(3):
            with pytest.raises(FailedPrecondition):
                client.put(tokens, blocks[1:], first_block=1, batch_blocks=4)
        assert put_tcp.refused(client.connection) == ""


def test_why_a_put_goes_by_grpc_is_said(start: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(put_tcp, "TCP_PUT_MIN_BYTES", 2 * BLOCK_BYTES)
    monkeypatch.delenv(put_tcp.TRANSPORT_ENV, raising=False)
    with Client(start().target) as client:
        assert put_tcp.why_not(client.connection, 2 * BLOCK_BYTES) == ""
        assert put_tcp.why_not(client.connection, BLOCK_BYTES).startswith("below put_tcp.TCP_PUT_MIN_BYTES")
        monkeypatch.setenv(put_tcp.TRANSPORT_ENV, "grpc")
        assert put_tcp.why_not(client.connection, 2 * BLOCK_BYTES) == "KVSTORE_CLIENT_PUT=grpc"
        monkeypatch.delenv(put_tcp.TRANSPORT_ENV)
        put_tcp.refuse(client.connection, "said so")
        assert put_tcp.why_not(client.connection, 2 * BLOCK_BYTES) == "said so"
