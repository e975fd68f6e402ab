"""A long Put's PutStream requests (kvstore.client.puts.put_blocks): each batch names the last hash of the
batch before as its parent, and the first request goes out before the rest of the chain is hashed."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from typing import Any

import pytest

from kvstore.client import puts
from kvstore.errors import InvalidArgument
from kvstore.prefix import chain_hashes, root_hash
from kvstore.v1 import kvstore_pb2 as pb

BT = 16
ROOT = root_hash(b"\x01" * 8, BT)


class _Channel:
    def stream_stream(self, name: str, **_: Any) -> str:
        return name

    def unary_unary(self, name: str, **_: Any) -> str:
        return name


class StreamRecorder:
    """Stands for the client's connection: takes the stream's requests as gRPC would, one at a time, noting
    how many blocks had been hashed when the first was taken."""

    run_blocks = 0
    block_tokens = BT
    root = ROOT
    geometry, namespace = "v4.1-flash", ""
    channel = _Channel()

    def __init__(self, hashed: list[int]) -> None:
        self.hashed = hashed
        self.requests: list[pb.PutRequest] = []
        self.hashed_at_first = -1

    def stream(self, method: Any, requests: Iterator[bytes]) -> Iterator[pb.PutResponse]:
        assert method.endswith("/PutStream")
        for data in requests:
            if not self.requests:
                self.hashed_at_first = sum(self.hashed)
            self.requests.append(pb.PutRequest.FromString(data))
            yield pb.PutResponse(block_hashes=[b"\x00" * 32] * len(self.requests[-1].blocks))


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Blocks hashed by put_blocks, per call of chain_hashes."""
    counts: list[int] = []

    def counted(tokens: Any, **kwargs: Any) -> list[bytes]:
        out = chain_hashes(tokens, **kwargs)
        counts.append(len(out))
        return out

    monkeypatch.setattr(puts, "chain_hashes", counted)
    return counts


@pytest.mark.parametrize(("first_block", "parent_given"), [(0, False), (5, True)])
def test_each_batch_names_the_last_hash_of_the_one_before(hashed: list[int], first_block: int,
                                                          parent_given: bool) -> None:
    n, step = 10, 3  # batches of 3, 3, 3 and 1 blocks
    tokens = array("I", range((first_block + n) * BT + 7))  # a partial block at the end: not sent
    full = chain_hashes(tokens, block_tokens=BT, parent=ROOT)
    parent = full[first_block - 1] if parent_given else b""
    payload = [os.urandom(100) for _ in range(n)]
    connection = StreamRecorder(hashed)
    replies = puts.put_blocks(connection, tokens, payload, first_block=first_block,  # type: ignore[arg-type]
                              parent=parent, extra_keys=(), step=step, on_batch=None)
    assert len(replies) == 4
    sent = connection.requests
    assert [r.parent_hash for r in sent] == [parent] + [full[first_block + s - 1] for s in (3, 6, 9)]
    assert [list(r.blocks) for r in sent] == [payload[s:s + step] for s in (0, 3, 6, 9)]
    assert [r.token_ids for r in sent] == [list(tokens[(first_block + s) * BT:(first_block + min(s + step, n)) * BT])
                                           for s in (0, 3, 6, 9)]
    # The first request went out with only its own batch hashed (the whole chain was 10 blocks before it).
    assert connection.hashed_at_first == step


def test_a_bad_parent_is_refused_before_anything_is_sent(hashed: list[int]) -> None:
    connection = StreamRecorder(hashed)
    with pytest.raises(InvalidArgument, match="parent hash"):
        puts.put_blocks(connection, array("I", range(10 * BT)), [b"x"] * 10, first_block=0,  # type: ignore[arg-type]
                        parent=b"short", extra_keys=(), step=3, on_batch=None)
    assert connection.requests == []
