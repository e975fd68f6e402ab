"""Block id -> token ids: a deterministic run per (scope, id), so prompts keep the trace's prefixes.

A trace names a prompt's blocks by id and holds no tokens. Each id becomes the same
run of token ids wherever it appears (SHAKE-128 of the scope and the id, as
little-endian u32), so kvstore's own chain hashes (`kvstore.prefix.chain_hashes`)
see exactly the trace's sharing: two prompts share their first k blocks of ours iff
their id lists share the ids covering them. A trace block of 512 tokens is 8 blocks
of 64. Ids of different scopes (weka's per-session ids) never share tokens. Tokens a
request names beyond its ids (a prompt's partial last block) are its own: salted with
where it came from, they are never shared.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

from kvstore.trace.requests import TraceRequest

_TAG = b"kvstore.trace.tokens.v1\0"


def block_token_bytes(scope: str, block_id: int, tokens: int) -> bytes:
    """The `tokens` token ids of trace block `block_id` in `scope`, as little-endian u32 bytes."""
    return hashlib.shake_128(_TAG + scope.encode() + b"\0" + block_id.to_bytes(8, "little")).digest(4 * tokens)


def blocks_token_bytes(scope: str, block_ids: list[int], tokens: int) -> bytes:
    """`block_token_bytes` of each of `block_ids`, joined (one call for a run of new ids)."""
    head, n, shake = _TAG + scope.encode() + b"\0", 4 * tokens, hashlib.shake_128
    return b"".join([shake(head + i.to_bytes(8, "little")).digest(n) for i in block_ids])


def _as_ids(raw: bytes) -> array:
    ids = array("I", raw)
    if sys.byteorder == "big":  # pragma: no cover - no such platform in use
        ids.byteswap()
    return ids


def block_tokens_of(scope: str, block_id: int, tokens: int) -> array:
    """The token ids of one trace block (an `array('I')`)."""
    return _as_ids(block_token_bytes(scope, block_id, tokens))


def prompt_tokens(request: TraceRequest) -> array:
    """The whole prompt of `request`: its blocks' tokens, cut or extended to `input_tokens`.

    Blocks past `input_tokens` are cut (Mooncake's last block is often partial); tokens past
    the last block are the request's own (salted with `where`).
    """
    src = request.source_block_tokens
    raw = b"".join(block_token_bytes(request.scope, i, src) for i in request.block_ids)
    want = 4 * request.input_tokens
    if len(raw) < want:
        raw += hashlib.shake_128(_TAG + b"tail\0" + request.where.encode()).digest(want - len(raw))
    return _as_ids(raw[:want])
