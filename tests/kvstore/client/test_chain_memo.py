"""The client's memo of hashed chains (kvstore.client.chain_memo, rules C1-C6): a prompt that begins with
a kept chain's tokens hashes only its new blocks, and every answer equals `chain_hashes`'."""

from __future__ import annotations

import random
import threading
from array import array
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client.chain_memo import MAX_PIECES, ChainMemo, HashChain
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.prefix import chain_hashes, root_hash, token_bytes

BT = 4  # tokens per block: small, so a prompt of a few hundred tokens has many blocks
ROOT = root_hash(V4_1_FLASH.fingerprint, BT)
OTHER_ROOT = root_hash(TINY.fingerprint, BT)


def plain(tokens: Any, root: bytes = ROOT, extra_keys: Any = ()) -> list[bytes]:
    return chain_hashes(list(tokens), block_tokens=BT, parent=root, extra_keys=extra_keys)


def memo(**kwargs: Any) -> ChainMemo:
    return ChainMemo(block_tokens=BT, **{"min_blocks": 1, **kwargs})


def test_c1_a_next_turn_hashes_only_its_new_blocks() -> None:
    m = memo()
    turn = list(range(400))
    assert m.hashes(turn, root=ROOT) == plain(turn)
    nxt = turn + list(range(1000, 1042))
    assert m.hashes(nxt, root=ROOT) == plain(nxt)
    stats = m.stats()
    assert (stats.hits, stats.misses, stats.reused_blocks) == (1, 1, 100)
    assert stats.entries == 1  # the longer chain replaced the one it extends


@pytest.mark.parametrize("where", [0, 1, 200, 399])  # first block, first block again, middle, last full block
def test_c1_different_tokens_of_the_same_length_never_reuse_a_chain(where: int) -> None:
    m = memo()
    kept = list(range(400))
    m.hashes(kept, root=ROOT)
    other = list(kept)
    other[where] += 1
    assert m.hashes(other, root=ROOT) == plain(other) != plain(kept)
    assert m.stats().hits == 0


def test_c1_a_prompt_ending_inside_a_kept_chain_is_hashed_afresh() -> None:
    """The kept chain's tokens are not a prefix of a shorter prompt: nothing of it is reused."""
    m = memo()
    m.hashes(list(range(400)), root=ROOT)
    short = list(range(300))
    assert m.hashes(short, root=ROOT) == plain(short)
    assert m.stats().hits == 0


def test_c1_the_partial_block_kept_with_a_chain_is_not_part_of_its_prefix() -> None:
    """A prompt of 402 tokens is kept with its 2 trailing tokens; a next prompt differing in them reuses
    the 100 full blocks only."""
    m = memo()
    m.hashes(list(range(402)), root=ROOT)
    nxt = [*range(400), 7, 7, 7, 7, 9]
    assert m.hashes(nxt, root=ROOT) == plain(nxt)
    assert m.stats().reused_blocks == 100


def test_c2_other_extra_keys_never_reuse_a_chain() -> None:
    m = memo()
    tokens = list(range(400))
    m.hashes(tokens, root=ROOT, extra_keys=["lora:a"])
    for keys in ([], ["lora:b"], ["lora:a", "salt"], [b"lora:a\x00"]):
        assert m.hashes(tokens, root=ROOT, extra_keys=keys) == plain(tokens, extra_keys=keys)
    assert m.stats().hits == 0
    assert m.hashes(tokens, root=ROOT, extra_keys=[b"lora:a"]) == plain(tokens, extra_keys=["lora:a"])
    assert m.stats().hits == 1  # the same key as bytes is the same key


def test_c2_another_root_never_reuses_a_chain() -> None:
    m = memo()
    tokens = list(range(400))
    m.hashes(tokens, root=ROOT)
    assert m.hashes(tokens, root=OTHER_ROOT) == plain(tokens, root=OTHER_ROOT) != plain(tokens)
    assert m.stats().hits == 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_c3_every_answer_equals_plain_hashing(data: st.DataObject) -> None:
    """Random conversations: turns that extend, branch, shrink or edit earlier prompts, with and
    without extra keys, as lists, arrays and numpy arrays; each answer is `chain_hashes`'."""
    m = memo(max_bytes=data.draw(st.sampled_from([2_000, 20_000, 1 << 20])), max_entries=4)
    prompts: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 8))):
        extend: bool = data.draw(st.booleans())
        if prompts and extend:
            base = data.draw(st.sampled_from(prompts))
            cut = data.draw(st.integers(0, len(base)))
            prompt = base[:cut] + data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=40))
            edit: bool = data.draw(st.booleans())
            if prompt and edit:
                prompt[data.draw(st.integers(0, len(prompt) - 1))] ^= 1  # one token edited
        else:
            prompt = data.draw(st.lists(st.integers(0, 5), max_size=120))
        keys = data.draw(st.sampled_from([(), ("a",), ("b", b"\x00")]))
        root = data.draw(st.sampled_from([ROOT, OTHER_ROOT]))
        form: Any = data.draw(st.sampled_from([list, lambda p: array("I", p), lambda p: np.array(p, dtype=np.int64)]))
        want = plain(prompt, root=root, extra_keys=keys)
        if data.draw(st.booleans()):
            assert m.hashes(form(prompt), root=root, extra_keys=keys) == want
        else:  # C6: the shared form reads as the same hashes, item by item and slice by slice
            got = m.chain(form(prompt), root=root, extra_keys=keys)
            assert got == want and list(got) == want and len(got) == len(want)
            if want:
                i = data.draw(st.integers(-len(want), len(want) - 1))
                a, b = data.draw(st.integers(-len(want) - 2, len(want) + 2)), data.draw(st.integers(-2, len(want) + 2))
                step = data.draw(st.sampled_from([None, 1, 2, -1]))
                assert got[i] == want[i] and got[a:b:step] == want[a:b:step]
        prompts.append(prompt)
        assert m.stats().size_bytes <= m.max_bytes


def test_c4_memory_is_bounded_and_the_least_recently_used_chain_goes_first() -> None:
    probe = memo()
    probe.hashes(list(range(400)), root=ROOT)
    size = probe.stats().size_bytes
    m = memo(max_bytes=3 * size)
    prompts = [[i] * 400 for i in range(5)]
    for p in prompts[:3]:
        m.hashes(p, root=ROOT)
    m.hashes(prompts[0], root=ROOT)  # used again: prompts[1] is now the least recent
    m.hashes(prompts[3], root=ROOT)
    assert m.stats().entries == 3 and m.stats().size_bytes <= 3 * size
    hits = m.stats().hits
    m.hashes(prompts[1], root=ROOT)
    assert m.stats().hits == hits  # forgotten
    m.hashes(prompts[0] + [1, 2, 3, 4], root=ROOT)
    assert m.stats().hits == hits + 1  # kept


def test_c4_the_entry_cap_holds_and_a_chain_larger_than_the_memo_is_not_kept() -> None:
    m = memo(max_entries=2)
    for i in range(4):
        m.hashes([i] * 100, root=ROOT)
    assert m.stats().entries == 2
    tiny = memo(max_bytes=1000)
    tiny.hashes(list(range(400)), root=ROOT)  # 1,600 token bytes alone
    assert tiny.stats().entries == 0
    assert memo(min_blocks=50).hashes(list(range(100)), root=ROOT) == plain(range(100))


def test_c5_one_memo_shared_by_threads_answers_each_exactly() -> None:
    m = memo(max_bytes=40_000, max_entries=8)
    rng = random.Random(5)
    bases = [[rng.randrange(50) for _ in range(300)] for _ in range(4)]
    failures: list[str] = []
    start = threading.Barrier(6)

    def worker(seed: int) -> None:
        r = random.Random(seed)
        start.wait()
        for _ in range(60):
            base = r.choice(bases)
            prompt = base[:r.randrange(len(base))] + [r.randrange(50) for _ in range(r.randrange(20))]
            if m.hashes(prompt, root=ROOT) != plain(prompt):
                failures.append(f"thread {seed}: a wrong chain for a prompt of {len(prompt)} tokens")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures
    stats = m.stats()
    assert stats.hits > 0 and stats.size_bytes <= 40_000 and stats.entries <= 8


@pytest.mark.parametrize("form", [
    lambda p: array("I", p), lambda p: np.array(p, dtype=np.uint32), lambda p: np.array(p, dtype=np.int64),
    lambda p: np.array(p, dtype=">u4"), lambda p: np.array(p, dtype=np.uint16),
])
def test_array_tokens_take_the_same_bytes_as_a_list(form: Any) -> None:
    prompt = [0, 1, 65535, 7, 300, 2, 9, 12]
    assert token_bytes(form(prompt)) == token_bytes(prompt)


def test_tensor_tokens_take_the_same_bytes_as_a_list() -> None:
    torch = pytest.importorskip("torch")
    prompt = [0, 1, 2**31 - 1, 7, 2**32 - 1]
    assert token_bytes(torch.tensor(prompt, dtype=torch.int64)) == token_bytes(prompt)
    with pytest.raises(InvalidArgument, match="token ids"):
        token_bytes(torch.tensor([3, -1]))


@pytest.mark.parametrize("bad", [[-1, 2], [2**32, 0]])
def test_array_tokens_out_of_range_are_refused(bad: list[int]) -> None:
    with pytest.raises(InvalidArgument, match="token ids must be integers"):
        token_bytes(np.array(bad, dtype=np.int64))
    with pytest.raises(InvalidArgument, match="token ids"):
        memo().hashes(cast(Any, np.array(bad, dtype=np.int64)), root=ROOT)


def test_the_client_reuses_a_conversation_chain_over_a_real_server(server: Any) -> None:
    """Turn 1 is put and looked up; turn 2 (turn 1 plus new tokens) finds turn 1's blocks, hashing
    only its new blocks; a client without a memo gets the same answer."""
    from kvstore.client import Client

    with Client(server.target) as client, Client(server.target, chain_memo_bytes=0) as bare:
        bt = client.block_tokens
        turn1 = list(range(40 * bt))
        block = bytes(client.block_bytes)
        assert client.lookup(turn1).found_blocks == 0  # a worker looks up before it computes and puts
        client.put(turn1, [block] * 40)
        turn2 = turn1 + list(range(5000, 5000 + 3 * bt + 1))
        memo_stats = client.connection.chain_memo.stats
        before = memo_stats()
        got = client.lookup(turn2)
        assert (got.found_blocks, got.block_hashes) == (40, bare.lookup(turn2).block_hashes)
        assert memo_stats().reused_blocks > before.reused_blocks
        assert bare.connection.chain_memo.stats().entries == 0


def test_c1_an_array_changed_in_place_after_a_call_is_not_mistaken_for_the_kept_chain() -> None:
    """The memo compares and hashes a uint32 array in place but keeps a copy: the caller may change it."""
    m = memo()
    prompt: Any = np.arange(400, dtype=np.uint32)
    m.hashes(prompt, root=ROOT)
    prompt[10] += 1
    assert m.hashes(prompt, root=ROOT) == plain(prompt.tolist())
    assert m.stats().hits == 0


def test_a_strided_or_big_endian_array_is_read_as_its_values() -> None:
    from kvstore.prefix import token_buffer

    values: Any = np.arange(40, dtype=np.uint32)
    assert bytes(token_buffer(values[::2])) == token_bytes(values[::2].tolist())
    assert bytes(token_buffer(values.astype(">u4"))) == token_bytes(values.tolist())
    assert memo().hashes(values[::2], root=ROOT) == plain(values[::2].tolist())


def test_c6_a_next_turn_shares_the_kept_hashes_and_an_answer_never_changes_after() -> None:
    """The next turn's answer holds the turn before's hashes as they are kept (no copy of them); the
    memo going on (more turns, a branch, cleared) never changes an answer already given."""
    m = memo()
    turn = list(range(400))
    first = m.chain(turn, root=ROOT)
    nxt = turn + list(range(1000, 1040))
    second = m.chain(nxt, root=ROOT)
    assert isinstance(second, HashChain) and second == plain(nxt)
    assert second._pieces[0] is first._pieces[0]  # type: ignore[attr-defined]  # shared, not copied
    kept = list(second)
    m.chain(nxt + list(range(7, 47)), root=ROOT)  # the conversation goes on
    m.chain(turn[:200] + [5] * 40, root=ROOT)  # a branch
    m.clear()
    assert list(second) == kept and list(first) == plain(turn)
    with pytest.raises(IndexError):
        second[len(kept)]
    with pytest.raises(TypeError):
        hash(second)  # equal to a list, so not hashable either


def test_c6_a_long_conversation_joins_its_pieces() -> None:
    m = memo()
    prompt = list(range(80))
    for turn in range(MAX_PIECES + 3):
        prompt += list(range(turn * 8, turn * 8 + 8))
        got = m.chain(prompt, root=ROOT)
        assert got == plain(prompt)
        assert len(got._pieces) <= MAX_PIECES  # type: ignore[attr-defined]


def test_c6_a_hash_chain_reads_as_the_list_of_its_pieces() -> None:
    hashes = [bytes([i]) * 32 for i in range(9)]
    chain = HashChain((tuple(hashes[:2]), tuple(hashes[2:3]), tuple(hashes[3:7]), tuple(hashes[7:])))
    assert chain == hashes and chain == tuple(hashes) and chain != hashes[:-1] and len(chain) == 9
    for a in [None, *range(-11, 12)]:
        for b in [None, *range(-11, 12)]:
            for step in (None, 1, 2, -1, -3):
                assert chain[a:b:step] == hashes[a:b:step], (a, b, step)
    assert [chain[i] for i in range(-9, 9)] == hashes[-9:] + hashes
    assert HashChain(()) == [] and list(HashChain(())) == []


def test_kept_tokens_is_c1_compare_alone_and_changes_nothing() -> None:
    """`kept_tokens` answers what a next turn would reuse (C1, C2), and counts, keeps and reorders nothing."""
    m = memo()
    kept = list(range(402))  # 100 full blocks and 2 tokens
    m.hashes(kept, root=ROOT)
    m.hashes(list(range(500, 600)), root=ROOT)  # a second chain, kept after the first
    before = m.stats()
    nxt = kept + list(range(1000, 1042))
    assert m.kept_tokens(nxt, root=ROOT) == 400
    assert m.kept_tokens(np.array(nxt, dtype=np.uint32), root=ROOT) == 400
    changed = list(nxt)
    changed[399] += 1
    assert m.kept_tokens(changed, root=ROOT) == 0  # C1: the last kept token differs
    assert m.kept_tokens(nxt, root=OTHER_ROOT) == 0  # C2: another root
    assert m.kept_tokens(nxt, root=ROOT, extra_keys=[b"x"]) == 0  # C2: other extra keys
    assert m.stats() == before
    # Nothing moved: the first chain is still the least recently used, so one more chain forgets it.
    m.max_entries = 2
    m.hashes(list(range(700, 800)), root=ROOT)
    assert m.kept_tokens(nxt, root=ROOT) == 0
