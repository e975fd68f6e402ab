"""E10 (docs/EVENTS.md): with `[events] token_ids`, a stored block's live BlockStored event carries the token ids
its Put sent, so a router that keys blocks by hashes of their tokens (Dynamo's KV router, llm-d's indexer) indexes
kvstore's blocks without kvstore's hashing; the replay log's copies carry none (tokens are never written to LMDB).

A real `kvstore serve` with events on, `kvstore.Client.put`, and a consumer on vLLM's own decoder through real ZMQ
sockets (tests/events_consumer.py). The router here is Dynamo's indexing in miniature: each event's tokens cut
into blocks of `block_size`, each block keyed by a hash of its tokens under its parent (found by the event's
parent hash, 8 bytes of it as Dynamo and llm-d take them), and a request matched block by block from the root.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'kvstore[events]')")

import kvstore
from kvstore.events import wire
from tests.children import Child, write_config
from tests.events_consumer import Consumer
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("events-tokens")
    conf = write_config(root / "kvstore.toml", {"events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                                                           "replay_endpoint": "tcp://127.0.0.1:0",
                                                           "token_ids": True}})
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(root / "data"), "--config", str(conf)],
                  root / "logs")
    yield child
    child.kill_if_alive()


def endpoints(child: Child) -> tuple[str, str]:
    """The PUB and replay endpoints the server printed."""
    pattern = r"kvstore events: on (tcp://[\d.:]+), replay on (tcp://[\d.:]+)"
    wait_until(lambda: re.search(pattern, child.out_path.read_text()), "the server's events line")
    match = re.search(pattern, child.out_path.read_text())
    assert match is not None
    return match.group(1), match.group(2)


def prompt(seed: int, n: int) -> list[int]:
    return [(i * 31 + seed * 7919) % 150_000 for i in range(n)]


class TokenRouter:
    """A router's index keyed by token hashes, fed by vLLM-decoded events (Dynamo's KvIndexer in miniature)."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, bytes], int] = {}  # (node, hash of a block's tokens) -> child node
        self.by_external: dict[int, int] = {}             # the event's block hash (8 bytes) -> node
        self.nodes = 1                                    # node 0: the root
        self.skipped = 0                                  # stored blocks whose event had no tokens

    def apply(self, event: Any) -> None:
        if type(event).__name__ != "BlockStored":
            return
        size, tokens = event.block_size, list(event.token_ids)
        if len(tokens) != size * len(event.block_hashes):  # as Dynamo: "token_ids too short", not indexed
            self.skipped += len(event.block_hashes)
            return
        parent = 0 if event.parent_block_hash is None else self.by_external.get(_u64(event.parent_block_hash))
        if parent is None:
            self.skipped += len(event.block_hashes)
            return
        for i, external in enumerate(event.block_hashes):
            key = (parent, _local(tokens[i * size:(i + 1) * size]))
            if key not in self.children:
                self.children[key] = self.nodes
                self.nodes += 1
            parent = self.by_external[_u64(external)] = self.children[key]

    def match(self, tokens: list[int], size: int) -> int:
        """Blocks of `tokens` the index holds, from the first."""
        node, found = 0, 0
        for i in range(len(tokens) // size):
            child = self.children.get((node, _local(tokens[i * size:(i + 1) * size])))
            if child is None:
                break
            node, found = child, found + 1
        return found


def _u64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")  # Dynamo's and llm-d's reading of a byte hash


def _local(tokens: list[int]) -> bytes:
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=8).digest()


def test_e10_a_stored_blocks_live_event_carries_its_put_tokens(server: Child) -> None:
    consumer = Consumer(*endpoints(server))
    try:
        with kvstore.Client(server.target) as client:
            b, size = client.block_tokens, client.block_bytes
            start = _subscribed(consumer, client)
            tokens = prompt(1, 5 * b + 7)
            client.put(tokens[:3 * b], [bytes([i]) * size for i in range(3)])
            client.put(tokens[:5 * b], [bytes([i]) * size for i in range(3, 5)], first_block=3)
            other = prompt(2, 2 * b)
            client.put(other, [bytes([9]) * size] * 2)
        wait_until(lambda: consumer.poll(20) >= 0 and _stored_blocks(consumer, start) >= 7, "the three Puts' events")
        stored = [(theirs, ours) for seq, (_, theirs_batch, ours_batch) in sorted(consumer.batches.items())
                  if seq > start for theirs, ours in zip(theirs_batch.events, ours_batch.events, strict=True)
                  if type(theirs).__name__ == "BlockStored"]
        assert [len(e.block_hashes) for e, _ in stored] == [3, 2, 2]
        for (theirs, ours), expected in zip(stored, [tokens[:3 * b], tokens[3 * b:5 * b], other], strict=True):
            assert list(theirs.token_ids) == expected  # vLLM's decoding: the Put's tokens, block by block
            assert theirs.block_size == b and isinstance(ours, wire.BlockStored) and list(ours.token_ids) == expected
        router = TokenRouter()
        for theirs, _ in stored:
            router.apply(theirs)
        assert router.skipped == 0
        assert router.match(tokens, b) == 5                       # the whole stored prompt
        assert router.match(tokens[:3 * b] + other, b) == 3       # a shared prefix, then another prompt
        assert router.match(other, b) == 2 and router.match(prompt(3, 2 * b), b) == 0
        # The log's copies (what a replay answers) carry no tokens: they were never written to LMDB.
        late = Consumer(*endpoints(server))
        try:
            late.replay(start + 1)
            replayed = [e for _, batch, _ in late.batches.values() for e in batch.events
                        if type(e).__name__ == "BlockStored"]
            assert [len(e.block_hashes) for e in replayed] == [3, 2, 2]
            assert all(list(e.token_ids) == [] for e in replayed)
            fresh = TokenRouter()
            for e in replayed:
                fresh.apply(e)
            assert fresh.skipped == 7 and fresh.match(tokens, b) == 0  # a miss, never a wrong hit
        finally:
            late.close()
    finally:
        consumer.close()


def _stored_blocks(consumer: Consumer, after: int) -> int:
    return sum(len(e.block_hashes) for seq, (_, batch, _) in consumer.batches.items() if seq > after
               for e in batch.events if type(e).__name__ == "BlockStored")


def _subscribed(consumer: Consumer, client: kvstore.Client) -> int:
    """Put warm-up blocks until one reaches the consumer live (ZMQ's SUB joins late: a batch published before
    it joined is only in the log, which carries no tokens); the last sequence number applied then."""
    consumer.replay(0)
    for i in range(200):
        before = consumer.replays
        client.put(prompt(1000 + i, client.block_tokens), [bytes(client.block_bytes)])
        if consumer.poll(100) and consumer.replays == before:
            return consumer.last_seq
    raise AssertionError("no batch reached the consumer live")


def test_the_memo_is_bounded_and_takes_a_run_only_whole() -> None:
    from tiers.events import EventTokens

    memo = EventTokens(max_blocks=3)
    memo.note([b"a", b"b"], list(range(8)), 4)
    assert memo.take([b"a", b"x"]) is None           # not all held: nothing taken
    assert memo.take([b"a", b"b"]) == list(range(8))
    assert memo.take([b"a"]) is None                 # taken once
    memo.note([b"c", b"d", b"e", b"f"], list(range(16)), 4)
    assert memo.take([b"c"]) is None and memo.take([b"f"]) == [12, 13, 14, 15]  # the oldest forgotten
