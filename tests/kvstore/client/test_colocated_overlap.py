"""The same-host reader's read that does not wait for its Lookup (`read(..., wait=False)`), and the
record lookups spread over threads (`kvstore.native.blockcopy.resolve_many`), against a real `kvstore serve`."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.native import blockcopy
from tests.kvstore.client.test_colocated_support import Store, payload, prompt

#: The `store` and `new_store` fixtures (a test module cannot import a conftest under importlib mode).
pytest_plugins = ["tests.kvstore.client.test_colocated_support"]

BLOCK_TOKENS = 16


class EvictingLookup:
    """The client's Lookup stub, but the first call evicts blocks (a real put through another
    client, past the retention) just before it is sent: after the read's txn began, as a
    concurrent writer would, so the snapshot holds records the Lookup no longer finds."""

    def __init__(self, real: Any, evict: Callable[[], None]) -> None:
        self.real, self.evict = real, evict

    def future(self, request: Any, **kwargs: Any) -> Any:
        evict, self.evict = self.evict, lambda: None
        evict()
        return self.real.future(request, **kwargs)

    def __call__(self, request: Any, **kwargs: Any) -> Any:  # a plain client.lookup: untouched
        return self.real(request, **kwargs)


def _evicted_under_the_read(new_store, monkeypatch: pytest.MonkeyPatch, seed: int,
                            n: int = 8, newcomers: int = 8) -> tuple[Any, list[bytes], np.ndarray, Store]:
    """`n` blocks in a store with room for 8; the client's next Lookup first stores `newcomers`
    other blocks, which evict some of them."""
    rng = random.Random(seed)
    s = new_store(f"small{seed}", capacity_bytes=8 * 14_240)  # room for 8 blocks
    s.start()
    client, other = s.client(), s.client()
    tokens = prompt(rng, n)
    blocks = payload(rng, n, client.block_bytes)
    client.put(tokens, blocks)

    def evict() -> None:
        s.clock.advance(73 * 3600)  # past the 72 h retention: eviction may take them
        other.put(prompt(rng, newcomers), payload(rng, newcomers, client.block_bytes))

    monkeypatch.setattr(client.connection.kvstore, "Lookup", EvictingLookup(client.connection.kvstore.Lookup, evict))
    return client, client.hashes(tokens), blocks, s


def test_a_read_that_does_not_wait_holds_the_candidates_until_the_lookup_cuts_them(new_store, monkeypatch) -> None:
    client, hashes, blocks, s = _evicted_under_the_read(new_store, monkeypatch, seed=21, newcomers=3)
    reader = s.reader()
    with reader.read(client, hashes, wait=False) as read:
        # Before the answer: every record the snapshot has, readable, as a copy would use them.
        assert len(read.offsets) == 8 and read.verify() == [True] * 8
        assert bytes(read.view(6)) == blocks[6].tobytes()
        found = read.found_blocks  # waits for the Lookup (which evicted some first), then cuts
        assert found < 8 and found == client.lookup_hashes(hashes).found_blocks
        assert len(read) == found and len(read.spans) == found and read.damaged == []
        out = np.zeros_like(blocks[:found])
        assert read.copy_into(out) == [] and (out == blocks[:found]).all()
    with reader.read(client, hashes) as waited:  # the default waits: cut before read() returns
        assert len(waited.offsets) == waited.found_blocks == found


def test_copy_into_and_spans_take_only_what_the_lookup_found(new_store, monkeypatch) -> None:
    client, hashes, blocks, s = _evicted_under_the_read(new_store, monkeypatch, seed=22)
    reader = s.reader()
    with reader.read(client, hashes, wait=False) as read:
        assert len(read.offsets) == 8
        out = np.zeros_like(blocks)
        assert read.copy_into(out) == []  # settles first: what the Lookup found (none), not eight
        assert read.found_blocks == 0 and not out.any()
    monkeypatch.undo()
    s.clock.advance(73 * 3600)  # the newcomers past retention too: room for three more
    client2 = s.client()
    tokens = prompt(random.Random(5), 3)
    client2.put(tokens, payload(random.Random(5), 3, client2.block_bytes))
    with reader.read(client2, client2.hashes(tokens), wait=False) as read:
        assert [span.index for span in read.spans] == [0, 1, 2]


def test_a_lookup_that_fails_after_read_returned_is_a_typed_error_and_no_block(store: Store) -> None:
    rng = random.Random(23)
    client = store.client()
    tokens = prompt(rng, 4)
    client.put(tokens, payload(rng, 4, client.block_bytes))
    hashes = client.hashes(tokens)
    reader = store.reader()
    with reader.read(client, hashes) as first:  # the reader learns this client's tenant from the server
        assert first.found_blocks == 4
    assert store.server is not None and store.server.stop() == 0
    read = reader.read(client, hashes, wait=False)  # the records are in the file: read() returns
    assert len(read.offsets) == 4
    with pytest.raises(Unavailable):
        _ = read.found_blocks
    assert len(read) == 0 and read.found_blocks == 0  # nothing of it may be used
    read.close()
    store.start()
    client2 = store.client()
    early = reader.read(client2, hashes, wait=False)
    early.close()  # never waited for: closing is clean, and the reader reads on
    with reader.read(client2, hashes) as again:
        assert again.found_blocks == 4 and all(again.verify())


def test_resolve_over_threads_answers_as_one_call(new_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 16 keys on up to 5 threads: the prefix stops at the first miss, whichever slice holds it."""
    if blockcopy.resolve is None:
        pytest.skip("kvstore.native._blockcopy is not built")
    monkeypatch.setattr(blockcopy, "_MIN_RESOLVE_PER_THREAD", 16)
    rng = random.Random(24)
    s = new_store("wide")
    s.start()
    client = s.client()
    tokens = prompt(rng, 300)
    client.put(tokens, payload(rng, 300, client.block_bytes))
    chain = client.hashes(tokens)
    reader = s.reader()
    with reader.read(client, chain) as read:
        assert read.resolved_by == "native" and read.found_blocks == 300
        base, length, txn = read.base_address, read.map_length, read._txn
        assert txn is not None
        root = blockcopy.named_root(base, length, 4096, txn.id(), b"records")
        assert root is not None
        prefix = read._scope.prefix
        for stop in (None, 0, 7, 15, 16, 100, 250, 299):
            asked = list(chain)
            if stop is not None:
                asked[stop] = rng.randbytes(32)
            one = blockcopy.resolve(base, length, 4096, root, prefix, asked)
            many = blockcopy.resolve_many(base, length, 4096, root, prefix, asked, threads=5)
            assert many is not None
            found = 300 if stop is None else stop
            assert one[:2] == many[:2] == (found, 0)
            for raw, column, dtype in zip(one[2:], many[2:], (np.int64, np.int64, np.int64, np.uint64), strict=True):
                assert column.dtype == dtype and column.tolist() == np.frombuffer(raw, dtype, count=found).tolist()
        assert blockcopy.resolve_many(base, length, 4096, root, prefix, chain, threads=1)[0] == 300


def test_a_lookup_that_cannot_be_sent_is_a_typed_error_and_holds_no_txn(store: Store) -> None:
    """The Lookup is sent from inside the read (after its txn began): its error ends the txn,
    and the reader reads on."""
    rng = random.Random(25)
    client = store.client()
    tokens = prompt(rng, 24)
    client.put(tokens, payload(rng, 24, client.block_bytes))
    hashes = client.hashes(tokens)
    reader = store.reader(threads=3)
    with reader.read(client, hashes) as read:  # also teaches the reader this client's tenant
        assert read.found_blocks == 24
    client.close()  # grpc refuses a call on a closed channel
    with pytest.raises(InvalidArgument, match="closed"):
        reader.read(client, hashes, wait=False)
    assert not reader._open  # the failed read holds no txn
    client2 = store.client()
    with reader.read(client2, hashes, wait=False) as again:
        assert again.found_blocks == 24 and all(again.verify())
