"""Which token ids `Client.put` reads: given the parent, a node's Put checks and converts only the tokens it
hashes and sends (from `first_block` on), not the prompt's prefix (docs/BENCHMARKS.md, `bench store`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, overload

import pytest

from kvstore.client import Client
from kvstore.errors import InvalidArgument


class PrefixGuard(Sequence[int]):
    """Token ids `0..n-1` that refuse to be read before `start` (an index, a slice or iteration reaching there)."""

    def __init__(self, n: int, start: int) -> None:
        self.n, self.start = n, start

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.n)
            if lo < self.start:
                raise AssertionError(f"the prefix was read (from {lo}, the Put starts at {self.start})")
            return list(range(lo, hi, step))
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i < self.start:
            raise AssertionError(f"the prefix was read (token {i}, the Put starts at {self.start})")
        return i


def _blocks(client: Client, n: int) -> list[bytes]:
    return [os.urandom(client.block_bytes) for _ in range(n)]


@pytest.mark.parametrize("batch_blocks", [None, 2], ids=["one request", "a stream"])
def test_a_put_given_its_parent_reads_no_token_of_the_prefix(client: Client, batch_blocks: int | None) -> None:
    bt = client.block_tokens
    first = client.put(list(range(2 * bt)), _blocks(client, 2))
    tokens = PrefixGuard(7 * bt, 2 * bt)
    client.put(tokens, _blocks(client, 5), first_block=2, parent=first.block_hashes[-1], batch_blocks=batch_blocks)
    # The server hashed the tokens it was sent into the same chain the whole prompt hashes to.
    assert client.lookup(list(range(7 * bt))).found_blocks == 7


def test_a_bad_token_the_put_sends_is_still_refused(client: Client) -> None:
    bt = client.block_tokens
    first = client.put(list(range(bt)), _blocks(client, 1))
    tokens: list[Any] = list(range(2 * bt))
    tokens[bt + 3] = -5
    with pytest.raises(InvalidArgument, match=r"in \[0, 4294967295\]"):
        client.put(tokens, _blocks(client, 1), first_block=1, parent=first.block_hashes[-1])
    with pytest.raises(InvalidArgument, match="1 block given for 2 full blocks"):  # counted over the whole prompt
        client.put(list(range(3 * bt)), _blocks(client, 1), first_block=1, parent=first.block_hashes[-1])
