"""Every public method of the clients raises a `kvstore.errors` class for a bad argument.

Against a real server on loopback: a bad argument is refused before anything is
sent (InvalidArgument naming it), never as a bare ValueError or TypeError from
protobuf or the hashing code, and nothing is stored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.errors import InvalidArgument

H = b"\x01" * 32  # a well-formed hash nobody stored


def _tokens(c: Client, blocks: int = 1) -> list[int]:
    return list(range(c.block_tokens * blocks))


def _block(c: Client) -> bytes:
    return bytes(c.block_bytes)


def _snapshot(c: Client, position: int | None = None) -> bytes:
    """Zero bytes of a snapshot at T = `position` (default: a block, as `_tokens(c)` ends)."""
    return bytes(c.swa.snapshot_bytes(c.block_tokens if position is None else position))


# (what is wrong, the call, a phrase the message must hold)
CASES: list[tuple[str, Callable[[Client], Any], str]] = [
    # hashes / lookup
    ("hashes: token id 2**40", lambda c: c.hashes([2**40] * c.block_tokens), "in [0, 4294967295]"),
    ("hashes: an int extra key", lambda c: c.hashes(_tokens(c), extra_keys=[5]), "extra_keys[0] is a int"),
    ("hashes: extra_keys a str", lambda c: c.hashes(_tokens(c), extra_keys="img"), "sequence of keys"),
    ("lookup: token id -5", lambda c: c.lookup([-5] * c.block_tokens), "in [0, 4294967295]"),
    ("lookup: tokens a str", lambda c: c.lookup("hello"), "token ids must be integers"),
    ("lookup: float token", lambda c: c.lookup([1.5] * c.block_tokens), "token ids"),
    ("lookup: lease_ms -5", lambda c: c.lookup(_tokens(c), lease_ms=-5), "lease_ms = -5"),
    ("lookup: lease_ms 2**40", lambda c: c.lookup(_tokens(c), lease_ms=2**40), "lease_ms = 1099511627776"),
    ("lookup: lease_ms float", lambda c: c.lookup(_tokens(c), lease_ms=1.5), "lease_ms must be an integer"),
    ("lookup: lease_ms bool", lambda c: c.lookup(_tokens(c), lease_ms=True), "lease_ms must be an integer"),
    ("lookup: swa position -1", lambda c: c.lookup(_tokens(c), swa_positions=[-1]), "swa_positions[0] = -1"),
    ("lookup_hashes: str hash", lambda c: c.lookup_hashes(["x" * 32]), "hashes[0] is a str"),
    ("lookup_hashes: short hash", lambda c: c.lookup_hashes([b"x"]), "hashes[0] is 1 bytes"),
    ("lookup_hashes: one bytes", lambda c: c.lookup_hashes(H), "got one bytes"),
    ("lookup_hashes: swa key", lambda c: c.lookup_hashes([H], swa_keys=[b"k"]), "swa_keys[0] is 1 bytes"),
    ("lookup_hashes: swa position", lambda c: c.lookup_hashes([H], swa_keys=[H], swa_positions=[-1]),
     "swa_positions[0] = -1"),
    ("lookup_hashes: lease -1", lambda c: c.lookup_hashes([H], lease_ms=-1), "lease_ms = -1"),
    ("release: int lease id", lambda c: c.release(5), "lease_id must be a str"),
    # put
    ("put: token id 2**40", lambda c: c.put([2**40] * c.block_tokens, [_block(c)]), "in [0, 4294967295]"),
    ("put: token id -5", lambda c: c.put([-5] * c.block_tokens, [_block(c)]), "in [0, 4294967295]"),
    ("put: tokens as bytes", lambda c: c.put(bytes(4 * c.block_tokens), [_block(c)]),
     "tokens must be a sequence of integer token ids, got bytes"),
    ("put: not a sequence", lambda c: c.put(_tokens(c), 5), "blocks must be a sequence of blocks, got int"),
    ("put: float tensor block", lambda c: c.put(_tokens(c), [torch.zeros(c.block_bytes)]),
     "blocks[0] must be uint8 (packed codes), got a torch.float32 tensor"),
    ("put: float tensor blocks", lambda c: c.put(_tokens(c), torch.zeros(1, c.block_bytes)),
     "blocks must be uint8 (packed codes), got a torch.float32 tensor"),
    ("put: str block", lambda c: c.put(_tokens(c), ["x" * c.block_bytes]), "blocks[0] is a str; accepted"),
    ("put: float numpy block", lambda c: c.put(_tokens(c), [np.zeros(c.block_bytes // 8)]), "8-byte items"),
    ("put: short block", lambda c: c.put(_tokens(c), [b"x"]), "blocks[0] is 1 bytes; it must be"),
    ("put: blocks one bytes", lambda c: c.put(_tokens(c), _block(c)), "got one bytes"),
    ("put: blocks 3-D array", lambda c: c.put(_tokens(c), np.zeros((1, 1, c.block_bytes), np.uint8)), "[n, "),
    ("put: block count", lambda c: c.put(_tokens(c, 2), [_block(c)]), "1 block given for 2 full blocks"),
    ("put: first_block -1", lambda c: c.put(_tokens(c), [_block(c)] * 2, first_block=-1), "first_block = -1"),
    ("put: batch_blocks 0", lambda c: c.put(_tokens(c), [_block(c)], batch_blocks=0), "batch_blocks = 0"),
    ("put: batch_blocks -1", lambda c: c.put(_tokens(c), [_block(c)], batch_blocks=-1), "batch_blocks = -1"),
    ("put: short parent", lambda c: c.put(_tokens(c), [_block(c)], parent=b"p"), "parent is 1 bytes"),
    ("put: on_batch not callable", lambda c: c.put(_tokens(c), [_block(c)], on_batch=3), "on_batch must be callable"),
    ("put: int extra key", lambda c: c.put(_tokens(c), [_block(c)], extra_keys=[7]), "extra_keys[0] is a int"),
    ("put: int extra key after a parent", lambda c: c.put(_tokens(c, 2), [_block(c)], first_block=1, parent=H,
                                                          extra_keys=[7]), "extra_keys[0] is a int"),
    # get
    ("get: first_block -1", lambda c: c.get(_tokens(c), first_block=-1), "first_block = -1"),
    ("get: num_blocks -1", lambda c: c.get(_tokens(c), num_blocks=-1), "num_blocks = -1"),
    ("get: token id 2**40", lambda c: c.get([2**40] * c.block_tokens), "token ids"),
    ("get_hashes: str hash", lambda c: c.get_hashes(["x" * 32]), "hashes[0] is a str"),
    ("stream: short hash", lambda c: list(c.stream([b"abc"])), "hashes[0] is 3 bytes"),
    ("get_tensor: float out", lambda c: c.get_tensor(_tokens(c), out=np.zeros(3)), "out must be uint8"),
    ("get_tensor: token id -1", lambda c: c.get_tensor([-1] * c.block_tokens), "token ids"),
    # SWA
    ("swa.put: ttl_s -1", lambda c: c.swa.put(_tokens(c), _snapshot(c), ttl_s=-1), "ttl_s = -1"),
    ("swa.put: ttl_s 0", lambda c: c.swa.put(_tokens(c), _snapshot(c), ttl_s=0), "ttl_s = 0"),
    ("swa.put: ttl_s nan", lambda c: c.swa.put(_tokens(c), _snapshot(c), ttl_s=math.nan), "ttl_s = nan"),
    ("swa.put: ttl_s str", lambda c: c.swa.put(_tokens(c), _snapshot(c), ttl_s="5"), "ttl_s must be"),
    ("swa.put: position -1", lambda c: c.swa.put(_tokens(c), _snapshot(c), position=-1), "= -1"),
    ("swa.put: short snapshot", lambda c: c.swa.put(_tokens(c), b"x"), "snapshots[0] is 1 bytes"),
    ("swa.put: str snapshot", lambda c: c.swa.put(_tokens(c), "x"), "snapshot is a str; accepted"),
    ("swa.put: token id -5", lambda c: c.swa.put([-5], _snapshot(c, 1)), "token ids"),
    ("swa.put_many: str key", lambda c: c.swa.put_many([("k" * 32, 1, _snapshot(c, 1))]),
     "items[0] key is a str"),
    ("swa.put_many: not pairs", lambda c: c.swa.put_many([H]), "items[0] must be a (key, position, snapshot) triple"),
    ("swa.put_many: one bytes", lambda c: c.swa.put_many(H), "items must be a sequence"),
    ("swa.keys: float position", lambda c: c.swa.keys(_tokens(c), [1.5]), "positions[0] must be an integer"),
    ("swa.keys: position past end", lambda c: c.swa.keys(_tokens(c), [10**6]), "outside the"),
    ("swa.key: int extra key", lambda c: c.swa.key(_tokens(c), extra_keys=[1]), "extra_keys[0] is a int"),
    ("swa.get: position -2", lambda c: c.swa.get(_tokens(c), -2), "= -2"),
    ("swa.get_many: str key", lambda c: c.swa.get_many(["x"]), "keys[0] is a str"),
    ("swa.delete_many: str key", lambda c: c.swa.delete_many(["x" * 32]), "keys[0] is a str"),
    ("swa.delete_many: empty", lambda c: c.swa.delete_many([]), "keys is empty"),
]


@pytest.mark.parametrize(("what", "call", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_bad_arguments_raise_invalid_argument(client: Client, what: str, call: Callable[[Client], Any],
                                              phrase: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        call(client)
    assert phrase in info.value.message
    assert client.stats().blocks_stored == 0  # nothing reached the store


@pytest.mark.parametrize(("kwargs", "phrase"), [
    ({"timeout_s": -1}, "timeout_s = -1"),
    ({"target": 50051}, "target must be a str"),
    ({"timeout_s": math.inf}, "timeout_s = inf"),
    ({"namespace": 5}, "namespace must be a str"),
    ({"namespace": "tenant\n"}, "namespace"),
    ({"geometry": None}, "geometry must be a str"),
    ({"geometry": "no-such-model"}, "does not serve geometry"),
])
def test_client_construction_refuses_bad_arguments(server: Any, kwargs: dict[str, Any], phrase: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Client(**{"target": server.target, **kwargs}).lookup([0] * 16)
    assert phrase in info.value.message


def test_a_bad_block_deep_in_a_streamed_put_stores_nothing(client: Client) -> None:
    """Blocks are checked before the first batch goes out, so a long put is all or nothing for bad arguments."""
    blocks = [_block(client)] * 7 + ["not a block"]
    with pytest.raises(InvalidArgument, match=r"blocks\[7\]"):
        client.put(_tokens(client, 8), blocks, batch_blocks=2)
    assert client.stats().blocks_stored == 0


def test_numpy_blocks_are_accepted(client: Client) -> None:
    """A uint8 [n, block_bytes] array, a list of 1-D uint8 arrays and other buffers all store the same bytes."""
    rng = np.random.default_rng(0)
    tokens = _tokens(client, 4)
    data = rng.integers(0, 256, size=(4, client.block_bytes), dtype=np.uint8)
    client.put(tokens[: client.block_tokens * 2], data[:2])
    client.put(tokens[: client.block_tokens * 3], [data[2]], first_block=2)
    client.put(tokens, [memoryview(bytearray(data[3].tobytes()))], first_block=3)
    got = client.get(tokens)
    assert got.blocks == [row.tobytes() for row in data]
    snapshot = rng.integers(0, 256, size=client.swa.snapshot_bytes(len(tokens)), dtype=np.uint8)
    client.swa.put(tokens, snapshot)
    assert client.swa.get(tokens) == snapshot.tobytes()


def test_a_tiny_ttl_is_not_the_servers_ttl(client: Client) -> None:
    """0.4 ms rounds up to 1 ms: rounding down to 0 would ask for the server's full TTL instead."""
    reply = client.swa.put(_tokens(client), os.urandom(client.swa.snapshot_bytes(client.block_tokens)), ttl_s=0.0004)
    assert reply.ttl_ms == 1
    long = client.swa.put(_tokens(client), os.urandom(client.swa.snapshot_bytes(client.block_tokens)), ttl_s=10**9)
    assert 0 < long.ttl_ms <= 2**32 - 1


def test_a_full_store_says_what_can_be_done(start_server: Callable[..., Any], store_settings: Any,
                                            clock: Any) -> None:
    """Issue 9 item 18: retention cannot be shortened; the hint names capacity, leases and when room comes."""
    import dataclasses

    from kvstore.errors import ResourceExhausted

    probe = start_server(store_settings)
    with Client(probe.target) as c:
        block_bytes = c.block_bytes
    server = start_server(dataclasses.replace(store_settings, data_dir=store_settings.data_dir.parent / "full",
                                              capacity_bytes=3 * block_bytes))
    with Client(server.target) as c:
        c.put(_tokens(c, 3), [_block(c)] * 3)
        clock.advance(10 * 3600)
        with pytest.raises(ResourceExhausted) as info:
            c.put([7] * c.block_tokens, [_block(c)])
    message = info.value.message
    assert "store full" in message and "store.capacity_bytes" in message and "release leases" in message
    assert "retry in 62.0 h" in message and "shorten" not in message
