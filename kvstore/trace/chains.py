"""A trace request's storage keys: kvstore's chain hashes of its mapped tokens, computed once per block.

Hashing every block of every prompt again (78 million block references in the weka
trace) would dominate a simulation; a prompt mostly extends its session's previous
one, so the keys of the shared leading ids are taken from it, and a (parent, id)
memo serves prompts that share ids across requests (Mooncake's global ids). The
values are exactly `kvstore.prefix.chain_hashes` of `kvstore.trace.tokens`'s tokens.

Each distinct key also gets a number (`keys_and_ids`), its place in `key_of`, so the
simulation's index can keep per-block fields in arrays and refresh a whole fetched
prefix in one vector step. A key's number is fixed when its hash is first computed:
the same (parent, id) in a scope is the same key and the same number.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.prefix import BlockScope, chain_hashes, chain_hashes_of_bytes, extra_keys_tail, root_hash
from kvstore.trace.requests import TraceRequest
from kvstore.trace.tokens import block_tokens_of, blocks_token_bytes, prompt_tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common leading run (slice compares run in C; a binary search over them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class ChainKeys:
    """Storage keys of trace prompts' full blocks, in one layout and tenant.

    Args:
        scope: the layout and tenant (`kvstore.prefix.BlockScope`).
        block_tokens: tokens per block of ours (a trace block of 512 is 512 // 64 of them).
        key_of: the list keys are numbered in (shared by the tenants of one simulation).
    """

    def __init__(self, scope: BlockScope, block_tokens: int, *, key_of: list[bytes] | None = None) -> None:
        self.scope = scope
        self.block_tokens = block_tokens
        self.root = root_hash(scope.fingerprint, block_tokens)
        #: (parent hash, trace id) -> its keys, as (a list, where they start in it, how many, the number of the
        #: first; the others follow it): a run of new ids shares one list.
        self._memo: dict[str, dict[tuple[bytes, int], tuple[list[bytes], int, int, int]]] = {}
        self._last: dict[str, tuple[Sequence[int], list[bytes], int, np.ndarray]] = {}
        #: Every key numbered so far, by its number.
        self.key_of: list[bytes] = [] if key_of is None else key_of
        self._tail = extra_keys_tail(())

    def keys(self, request: TraceRequest) -> list[bytes]:
        """The storage keys of every full block of the request's prompt, in order."""
        return self.keys_and_ids(request)[0]

    def _number(self, keys: Sequence[bytes]) -> int:
        first = len(self.key_of)
        self.key_of.extend(keys)
        return first

    def _hash_new(self, scope: str, ids: Sequence[int], src: int, parent: bytes,
                  memo: dict[tuple[bytes, int], tuple[list[bytes], int, int, int]], keys: list[bytes],
                  numbers: list[int]) -> None:
        """Hash the run of `ids` after `parent` in one pass (`chain_hashes_of_bytes` of their token bytes:
        what `chain_hashes` computes of their tokens), memoize each id's keys, and append them."""
        per, bt = src // self.block_tokens, self.block_tokens
        hashes = chain_hashes_of_bytes(blocks_token_bytes(scope, list(ids), src), block_tokens=bt, parent=parent,
                                       tail=self._tail)
        prefix = self.scope.prefix
        made = [prefix + h for h in hashes]
        first = self._number(made)
        for j, block_id in enumerate(ids):  # src % bt == 0 here, so each id has per >= 1 keys
            memo[(parent, block_id)] = (made, j * per, per, first + j * per)
            parent = hashes[(j + 1) * per - 1]
        keys.extend(made)
        numbers.extend(range(first, first + len(made)))

    def keys_and_ids(self, request: TraceRequest) -> tuple[list[bytes], np.ndarray]:
        """The storage keys of every full block of the request's prompt, in order, and their numbers."""
        src, bt = request.source_block_tokens, self.block_tokens
        ids = request.block_ids
        per = max(src // bt, 1)
        start = 0
        keys: list[bytes] = []
        head: np.ndarray | None = None
        numbers: list[int] = []
        last = self._last.get(request.session)
        if last is not None and last[2] == src:
            shared = _common_prefix(ids, last[0])
            if shared * per <= len(last[1]):
                keys = last[1][: shared * per]
                head = last[3][: shared * per]
                start = shared
        memo = self._memo.setdefault(request.scope, {})
        parent = keys[-1][-32:] if keys else self.root
        prefix = self.scope.prefix
        rest = ids[start:]
        for j, block_id in enumerate(rest):
            got = memo.get((parent, block_id))
            if got is None and src % bt == 0:  # this id and every one after it are new: their parents are new
                self._hash_new(request.scope, rest[j:], src, parent, memo, keys, numbers)
                break
            if got is None:
                hashes = chain_hashes(block_tokens_of(request.scope, block_id, src), block_tokens=bt, parent=parent)
                made = [prefix + h for h in hashes]
                got = memo[(parent, block_id)] = (made, 0, len(made), self._number(made))
            held, at, count, number = got
            if count:
                keys.extend(held[at:at + count])
                numbers.extend(range(number, number + count))
                parent = held[at + count - 1][-32:]
        parent = keys[-1][-32:] if keys else self.root
        full = request.input_tokens // bt
        if full > len(keys) and len(ids) * src < request.input_tokens:  # tokens past the ids: the request's own
            tail = prompt_tokens(request)[len(ids) * src:]
            made = [prefix + h for h in chain_hashes(tail, block_tokens=bt, parent=parent)]
            keys.extend(made)
            first = self._number(made)
            numbers.extend(range(first, first + len(made)))
        tail_ids = np.array(numbers, dtype=np.int64)
        numbered = tail_ids if head is None else np.concatenate((head, tail_ids)) if numbers else head
        self._last[request.session] = (ids, keys, src, numbered)
        return keys[:full], numbered[:full]

    def forget(self, session: str, scope: str | None = None) -> None:
        """Drop what is kept for a session that has ended (and its scope's memo, when it ended too)."""
        self._last.pop(session, None)
        if scope is not None:
            self._memo.pop(scope, None)
