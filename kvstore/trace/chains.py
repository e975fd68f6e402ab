"""A trace request's storage keys: kvstore's chain hashes of its mapped tokens, computed once per block.

Hashing every block of every prompt again (78 million block references in the weka
trace) would dominate a simulation; a prompt mostly extends its session's previous
one, so the keys of the shared leading ids are taken from it, and a (parent, id)
memo serves prompts that share ids across requests (Mooncake's global ids). The
values are exactly `kvstore.prefix.chain_hashes` of `kvstore.trace.tokens`'s tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.trace.requests import TraceRequest
from kvstore.trace.tokens import block_tokens_of, prompt_tokens


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
    """

    def __init__(self, scope: BlockScope, block_tokens: int) -> None:
        self.scope = scope
        self.block_tokens = block_tokens
        self.root = root_hash(scope.fingerprint, block_tokens)
        self._memo: dict[str, dict[tuple[bytes, int], tuple[bytes, ...]]] = {}
        self._last: dict[str, tuple[Sequence[int], list[bytes], int]] = {}

    def keys(self, request: TraceRequest) -> list[bytes]:
        """The storage keys of every full block of the request's prompt, in order."""
        src, bt = request.source_block_tokens, self.block_tokens
        ids = request.block_ids
        per = max(src // bt, 1)
        start = 0
        keys: list[bytes] = []
        last = self._last.get(request.session)
        if last is not None and last[2] == src:
            shared = _common_prefix(ids, last[0])
            if shared * per <= len(last[1]):
                keys = last[1][: shared * per]
                start = shared
        memo = self._memo.setdefault(request.scope, {})
        parent = keys[-1][-32:] if keys else self.root
        prefix = self.scope.prefix
        for block_id in ids[start:]:
            got = memo.get((parent, block_id))
            if got is None:
                hashes = chain_hashes(block_tokens_of(request.scope, block_id, src), block_tokens=bt, parent=parent)
                got = tuple(prefix + h for h in hashes)
                memo[(parent, block_id)] = got
            keys.extend(got)
            parent = got[-1][-32:] if got else parent
        full = request.input_tokens // bt
        if full > len(keys) and len(ids) * src < request.input_tokens:  # tokens past the ids: the request's own
            tail = prompt_tokens(request)[len(ids) * src:]
            keys.extend(prefix + h for h in chain_hashes(tail, block_tokens=bt, parent=parent))
        self._last[request.session] = (ids, keys, src)
        return keys[:full]

    def forget(self, session: str, scope: str | None = None) -> None:
        """Drop what is kept for a session that has ended (and its scope's memo, when it ended too)."""
        self._last.pop(session, None)
        if scope is not None:
            self._memo.pop(scope, None)
