"""Work that grows with a request (checking, hashing, checksumming, copying) runs off
the server's event loop: while one such call is in flight, other calls are answered.

Each test holds the step in question (a real server on loopback, the step made to
wait for the test), asks GetInfo on another channel meanwhile, and checks that
the answer came while the held call was still in flight: ordering, not timing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from gateway import swa_servicer, validate
from kvstore.client import Client, SwaClient
from kvstore.transfer import Descriptor, Status
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class Hold:
    """Holds a server-side step (a module function) until released: a call stays in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.released = threading.Event()

    def step(self, owner: Any, name: str) -> threading.Event:
        """Hold `owner.name` on every call; the returned event is set when a call reaches it."""
        entered = threading.Event()
        real = getattr(owner, name)

        def held_step(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            self.released.wait(60)
            return real(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, held_step)
        return entered

    def served_meanwhile(self, target: str, entered: threading.Event, call: Callable[[], Any]) -> Any:
        """Start `call`, and once its held step runs check that GetInfo on another channel is
        answered while it is still held; then release it and return its result."""
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call)
            try:
                assert entered.wait(30), "the held step never ran"
                with grpc.insecure_channel(target) as channel:
                    # The timeout only ends a wait that would never end (the event loop held).
                    info = pb_grpc.KVStoreStub(channel).GetInfo(pb.GetInfoRequest(), timeout=20)
                assert info.block_tokens > 0
                assert not pending.done()  # answered while the held call was still in flight
            finally:
                self.released.set()
            return pending.result(timeout=60)


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hold]:
    """Hold server-side steps; whatever is held is released at the end."""
    h = Hold(monkeypatch)
    yield h
    h.released.set()


@pytest.mark.parametrize("batch_blocks", [None, 2], ids=["Put", "PutStream"])
def test_other_calls_are_served_while_a_put_is_checked_and_hashed(
        server: Any, client: Client, hold: Hold, batch_blocks: int | None) -> None:
    entered = hold.step(validate, "put_plan")
    tokens = list(range(client.block_tokens * 4))
    blocks = [os.urandom(client.block_bytes) for _ in range(4)]
    result = hold.served_meanwhile(server.target, entered,
                                   lambda: client.put(tokens, blocks, batch_blocks=batch_blocks))
    assert result.written_blocks == 4
    assert client.get(tokens).blocks == blocks



def test_other_calls_are_served_while_swa_snapshots_are_checked(server: Any, client: Client, hold: Hold) -> None:
    # The held step is the gateway's: the shared-memory path would not pass through it.
    swa = SwaClient(client.connection, path="gateway")
    entered = hold.step(swa_servicer, "check_snapshot")
    tokens = list(range(100))
    snap = os.urandom(swa.snapshot_bytes(len(tokens)))
    assert hold.served_meanwhile(server.target, entered, lambda: swa.put(tokens, snap)).stored == 1
    assert swa.get(tokens) == snap


def test_other_calls_are_served_while_a_swa_reply_is_filled(server: Any, client: Client, hold: Hold) -> None:
    # The held step is the gateway's: the shared-memory path would not pass through it.
    swa = SwaClient(client.connection, path="gateway")
    tokens = list(range(100))
    snap = os.urandom(swa.snapshot_bytes(len(tokens)))
    swa.put(tokens, snap)
    entered = hold.step(swa_servicer, "_get_reply")
    assert hold.served_meanwhile(server.target, entered, lambda: swa.get(tokens)) == snap


def test_other_calls_are_served_while_a_transfer_write_is_checked_and_hashed(
        server: Any, client: Client, hold: Hold) -> None:
    size = client.block_bytes
    tokens = list(range(client.block_tokens * 2))
    data = [os.urandom(size) for _ in range(2)]
    with client.transfer() as session:
        region = session.register(2 * size)
        region.view[:] = b"".join(data)
        descs = [Descriptor(region_id=region.region_id, offset_bytes=i * size, length_bytes=size) for i in range(2)]
        entered = hold.step(validate, "put_plan")
        state = hold.served_meanwhile(server.target, entered, lambda: session.write(tokens, descs).wait())
    assert [r.status for r in state.results] == [Status.DONE] * 2
    assert client.get(tokens).blocks == data
