"""C7 (docs/PREFIX_HASHING.md): a next turn's Lookup is sent on the chain memo's guess while C1's compare runs
on a worker, and its reply is used only when the compare holds. Against a real server on loopback."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.client.chain_memo import ChainMemo
from kvstore.client.store import OVERLAP_MIN_CPUS
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import chain_hashes, root_hash

TURN_BLOCKS = 80  # past the anchors' 64-block floor (kvstore.client.lookup_anchors.MIN_BLOCKS)
BT = 4  # the memo-only test's tokens per block
ROOT = root_hash(V4_1_FLASH.fingerprint, BT)


def tokens(start: int, count: int) -> Any:
    """Token ids as an engine holds them: a uint32 array (Any: the client takes it as a Sequence[int])."""
    return np.arange(start, start + count, dtype=np.uint32)


def cat(*parts: Any) -> Any:
    return np.concatenate(parts)


def plain_hashes(prompt: list[int]) -> list[bytes]:
    return chain_hashes(prompt, block_tokens=BT, parent=ROOT)


def guesses(client: Client) -> tuple[int, int]:
    stats = client.connection.chain_memo.stats()
    return stats.guesses_held, stats.guesses_refused


def test_c7_a_next_turn_goes_on_the_guess_and_answers_as_the_safe_path(server: Any) -> None:
    """Turn 2 (turn 1 plus new tokens) is looked up on the guess (counted held) and answers what a client
    without a memo answers; the chain it kept is the guess of turn 3, whose blocks turn 2 stored."""
    with Client(server.target) as client, Client(server.target, chain_memo_bytes=0) as bare:
        client.overlap_compare = True  # whatever this machine's CPUs make the default
        bt, block = client.block_tokens, bytes(client.block_bytes)
        turn1 = tokens(0, TURN_BLOCKS * bt)
        client.put(turn1, [block] * TURN_BLOCKS)
        assert client.lookup(turn1).found_blocks == TURN_BLOCKS  # kept by the memo, its anchor noted
        assert guesses(client) == (0, 0)
        turn2 = cat(*[turn1, tokens(50_000, 3 * bt + 5)])
        got = client.lookup(turn2)
        assert guesses(client) == (1, 0)
        assert (got.found_blocks, list(got.block_hashes)) == (TURN_BLOCKS, bare.lookup(turn2).block_hashes)
        client.put(turn2, [block] * (TURN_BLOCKS + 3))
        turn3 = cat(*[turn2, tokens(60_000, 2 * bt)])
        got = client.lookup(turn3)
        assert guesses(client) == (2, 0)
        assert (got.found_blocks, list(got.block_hashes)) == (TURN_BLOCKS + 3, bare.lookup(turn3).block_hashes)
        as_list = [int(t) for t in turn3] + [7] * bt  # a Python list: converted once, guessed as well
        got = client.lookup(as_list)
        assert guesses(client) == (3, 0)
        assert (got.found_blocks, list(got.block_hashes)) == (TURN_BLOCKS + 3, bare.lookup(as_list).block_hashes)
        # A leased Lookup is never sent on a guess (a wrong one would lease another chain): the safe path.
        assert client.lookup(turn3, lease_ms=1000).found_blocks == TURN_BLOCKS + 3
        assert guesses(client) == (3, 0)


def test_c7_another_prompt_with_the_same_last_blocks_never_reuses_the_guessed_reply(server: Any) -> None:
    """A prompt that repeats the kept chain's last blocks but not its first token is guessed (its request
    flies, anchored on turn 1's chain), the compare fails, and the answer is the safe path's: the 10 blocks
    stored of this prompt, not turn 1's 80."""
    with Client(server.target) as client, Client(server.target, chain_memo_bytes=0) as bare:
        client.overlap_compare = True  # whatever this machine's CPUs make the default
        bt, block = client.block_tokens, bytes(client.block_bytes)
        turn1 = tokens(0, TURN_BLOCKS * bt)
        client.put(turn1, [block] * TURN_BLOCKS)
        assert client.lookup(turn1).found_blocks == TURN_BLOCKS
        other = turn1.copy()
        other[0] += 1
        bare.put(other[: 10 * bt], [block] * 10)
        prompt = cat(*[other, tokens(50_000, 2 * bt)])
        got = client.lookup(prompt)
        assert (got.found_blocks, list(got.block_hashes)) == (10, bare.lookup(prompt).block_hashes)
        assert guesses(client) == (0, 1)
        # The refused guess kept nothing of its own: turn 1's next turn is still guessed and held.
        assert client.lookup(cat(*[turn1, tokens(70_000, bt)])).found_blocks == TURN_BLOCKS
        assert guesses(client) == (1, 1)


def test_c7_a_guess_whose_anchor_the_server_does_not_hold_is_looked_up_again(server: Any) -> None:
    """A4 on the guessed path: the anchor named is a hash of the chain whose block is not stored (as an anchor
    evicted since); the server answers anchor_unknown, the client forgets it and looks the held chain up with
    the anchor below it: the stored 80 blocks."""
    with Client(server.target) as client, Client(server.target, chain_memo_bytes=0) as bare:
        client.overlap_compare = True
        bt, block = client.block_tokens, bytes(client.block_bytes)
        turn1 = tokens(0, TURN_BLOCKS * bt)
        client.put(turn1, [block] * TURN_BLOCKS)
        client.lookup(turn1)
        turn2 = cat(turn1, tokens(50_000, 4 * bt))
        kept = client.lookup(turn2).block_hashes  # 80 found; the memo keeps all 84 blocks
        client.connection.anchors.note(kept[-1], len(kept))  # an anchor at block 84, which is not stored
        prompt = cat(turn2, tokens(60_000, bt))
        got = client.lookup(prompt)
        assert guesses(client) == (2, 0)
        assert (got.found_blocks, list(got.block_hashes)) == (TURN_BLOCKS, bare.lookup(prompt).block_hashes)
        assert client.connection.anchors.best(kept) == TURN_BLOCKS  # the unknown anchor forgotten


def test_c7_a_prompt_that_ends_otherwise_is_not_guessed(server: Any) -> None:
    """No kept chain's last block at its place in the prompt: no guess, the memo's own path."""
    with Client(server.target) as client:
        client.overlap_compare = True
        bt, block = client.block_tokens, bytes(client.block_bytes)
        turn1 = tokens(0, TURN_BLOCKS * bt)
        client.put(turn1, [block] * TURN_BLOCKS)
        client.lookup(turn1)
        prompt = turn1.copy()
        prompt[-1] += 1
        assert client.lookup(prompt).found_blocks == TURN_BLOCKS - 1
        assert guesses(client) == (0, 0)


def test_c7_the_overlap_is_on_by_default_where_there_are_cpus_for_it() -> None:
    assert Client.overlap_compare == (len(os.sched_getaffinity(0)) >= OVERLAP_MIN_CPUS)


def test_c7_the_serial_path_when_the_overlap_is_off(server: Any) -> None:
    """`overlap_compare = False`: the compare first, then the request (the bench's baseline); same answer."""
    with Client(server.target) as client:
        client.overlap_compare = False
        bt, block = client.block_tokens, bytes(client.block_bytes)
        turn1 = tokens(0, TURN_BLOCKS * bt)
        client.put(turn1, [block] * TURN_BLOCKS)
        client.lookup(turn1)
        assert client.lookup(cat(*[turn1, tokens(50_000, bt)])).found_blocks == TURN_BLOCKS
        assert guesses(client) == (0, 0) and client.connection.chain_memo.stats().hits >= 1


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_c7_a_guess_holds_exactly_when_c1_does_and_extends_to_the_plain_chain(data: st.DataObject) -> None:
    """The worker's memcmp (ctypes, the GIL released) against `bytes.startswith` and plain hashing, on kept
    chains of several turns (segments) and prompts edited anywhere, as numpy arrays and lists."""
    memo = ChainMemo(block_tokens=BT, min_blocks=1)
    turns = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    conversation: list[int] = []
    for blocks in turns:  # each turn extends the one before: its chain kept as one more segment
        conversation += data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=blocks * BT, max_size=blocks * BT))
        memo.chain(conversation, root=ROOT)
    prompt = conversation + data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=3 * BT))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(prompt) - 1))
        prompt[at] = (prompt[at] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    as_array = data.draw(st.booleans())
    guess = memo.guess(np.array(prompt, dtype=np.uint32) if as_array else prompt, root=ROOT)  # type: ignore[arg-type]
    if guess is None:  # no kept chain ends like the prompt: nothing to compare
        return
    assert guess.base.is_prefix_of_released(guess.raw) == guess.base.is_prefix_of(guess.raw)
    assert memo.holds(guess) == (bytes(guess.raw[: guess.base.length]) == b"".join(guess.base.segments))
    if memo.holds(guess):
        assert list(memo.extend(guess)) == plain_hashes(prompt)
