"""SGLang `v4` pages shared with the model's rows where the transcoding is exact (issue 27 item 3).

With SGLang's default `SGLANG_DSV4_KV_LAYOUT=v4` a compressed-KV row is SGLang's FP8 store of the
model's FP4 row (kvstore.codec.sglang_v4), so a V4 block can be kept as the model's rows, shared with
every engine that keeps those (SGLang `v41` on SM100, `kvstore.Client`), at 890 B/token instead of
1,630, whenever that is provably exact. The rule (docs/ENGINES.md "Sharing SGLang v4 rows"):

1. On save, each page's blocks are transcoded (`v4_blocks_to_native`). A block is exact when every
   compressed-KV row of it re-encodes (`encode_rows`, SGLang's store math) to the engine's bytes bit
   for bit; its indexer rows are the model's in both layouts.
2. A page run is stored as the model's rows (the backend's chain, under the model geometry) from its
   first page up to the first page with an inexact block; that page and the rest of the call are
   stored as SGLang's own records under the `sglang-v4` layout (`V4Sharing.keep_engine`). A chain lives
   in one layout from its root (a Put's parent must be stored in its own layout), so when a chain
   that began in the model's rows must go on in SGLang's, its stored prefix is re-encoded into
   SGLang's rows (exact: it was stored only because it was) and put under the engine layout first.
3. On load, a page found in the model's rows is re-encoded into SGLang's rows (`native_blocks_to_v4`);
   a page found only under the engine layout is read as it is. A hit is the longer of the two chains.
4. The SWA window stays SGLang's (584-B rows from fp32 registers, no FP4 step: not a function of the
   model's 528-B window rows): snapshots are under the engine layout, keyed by the model chain's pages.

Counters (`counters()` of the backend): `blocks_shared` (stored as the model's rows), `blocks_engine`
(stored as SGLang's records: inexact, or after an inexact block in their chain), `rows_exact` /
`rows_transcoded`, `pages_reencoded` (loaded from the model's rows); each save logs one line.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from integrations.sglang_keys import KeyLedger, page_blocks
from kvstore.client import Client
from kvstore.codec.sglang_v4 import native_blocks_to_v4, v4_blocks_to_native
from kvstore.errors import KVStoreError
from kvstore.geometry import ModelGeometry
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

#: Engine-layout chain hashes remembered per model page key (a page's n block hashes).
MEMO_PAGES = 1 << 16
#: The counters sharing adds to the backend's.
COUNTERS = ("blocks_shared", "blocks_engine", "rows_transcoded", "rows_exact", "pages_reencoded",
            "engine_prefix_moves")


class V4Sharing:
    """The two layouts one SGLang v4 backend stores in: the model's rows where exact, its own records else.

    Args:
        native: the client of the model's geometry (the backend's keys, ledger and chain root).
        engine: the client of the model's `+sglang-v4` geometry (SGLang's records, and the SWA window).
        model: the model's geometry.
        ledger: the backend's page keys (model-chain hashes) with their tokens.
        stats: the backend's counters (COUNTERS are added).
        device: where the transcoding runs ("cpu", or "cuda" to move the blocks to the GPU and back).
    """

    def __init__(self, native: Client, engine: Client, model: ModelGeometry, ledger: KeyLedger,
                 stats: dict[str, int], device: str = "cpu") -> None:
        self.native, self.engine, self.model, self.ledger = native, engine, model, ledger
        self.block_tokens = native.block_tokens
        self.stats = stats
        for name in COUNTERS:
            stats.setdefault(name, 0)
        self.device = torch.device(device)
        #: model page key -> (its engine-layout block hashes, the engine chain's run bridge at its last block).
        self._memo: OrderedDict[str, tuple[tuple[bytes, ...], bytes | None]] = OrderedDict()
        self._lock = threading.Lock()

    # -- the engine layout's chain for the model chain's pages -------------------------

    def engine_blocks(self, key: str) -> tuple[bytes, ...] | None:
        """The engine-layout chain hashes of the blocks of page `key` (a model-chain page key), from the
        ledger's tokens, hashed as the model chain is (`sglang_keys.page_blocks`: over a fleet each run a
        chain of its own from the engine root, bridged to the engine chain before it, F29); None when a
        page of its chain is not in the ledger."""
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit[0]
        path: list[str] = []
        current, parent, bridge = key, self.engine.root, None
        while True:                      # walk up to a memoized page or the root, then hash down
            entry = self.ledger.page(current)
            if entry is None:
                return None
            path.append(current)
            if entry.parent == self.ledger.root:
                break
            with self._lock:
                above = self._memo.get(entry.parent.hex())
            if above is not None:
                parent, bridge = above[0][-1], above[1]
                break
            current = entry.parent.hex()
        blocks: tuple[bytes, ...] = ()
        for k in reversed(path):
            entry = self.ledger.page(k)
            if entry is None:
                return None
            hashed, bridge = page_blocks(entry.tokens, root=self.engine.root, block_tokens=self.block_tokens,
                                         run_blocks=self.ledger.run_blocks, parent=parent,
                                         extra_keys=entry.extra_keys, first_block=entry.first_block, bridge=bridge)
            blocks = tuple(hashed)
            with self._lock:
                self._memo[k] = (blocks, bridge)
                while len(self._memo) > MEMO_PAGES:
                    self._memo.popitem(last=False)
            parent = blocks[-1]
        return blocks

    def engine_chain(self, pages: Sequence[bytes]) -> list[bytes] | None:
        """The engine-layout block hashes of a model chain's pages (from the root), or None."""
        out: list[bytes] = []
        for p in pages:
            blocks = self.engine_blocks(p.hex())
            if blocks is None:
                return None
            out.extend(blocks)
        return out

    def engine_chain_blocks(self, keys: Sequence[str]) -> tuple[list[bytes], int] | None:
        """The engine-layout block hashes from the sequence start through the pages `keys` (consecutive
        model-chain pages), and the index of the first block of `keys[0]`: what a fleet's reads take (as
        `KeyLedger.chain_blocks` for the model chain). None when a page of that chain is not in the ledger."""
        pages = self.ledger.chain_to_root(keys[0]) if keys else None
        before = self.engine_chain(pages[:-1]) if pages is not None else None
        mine = self.engine_chain([bytes.fromhex(k) for k in keys])
        if before is None or mine is None:
            return None
        return before + mine, len(before)

    # -- lookups -----------------------------------------------------------------------

    def lookup(self, pages: Sequence[bytes], native_blocks: Sequence[bytes], *, swa_keys: Sequence[bytes] = (),
               swa_positions: Sequence[int] = ()) -> tuple[int, int | None]:
        """Blocks found of the chain (the longer of its model-rows and engine-layout chains) and, when
        snapshot keys are given, the position of the snapshot serving the longest resume (engine layout).

        Raises:
            KVStoreError: a failed call.
        """
        found = self.native.lookup_hashes(list(native_blocks)).found_blocks
        if found < len(native_blocks):
            chain = self.engine_chain(pages)
            if chain is not None:
                found = max(found, self.engine.lookup_hashes(chain).found_blocks)
        if not swa_keys or not found:
            return found, None
        c = self.engine.connection
        request = pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, swa_keys=list(swa_keys),
                                   swa_positions=list(swa_positions),
                                   swa_found_tokens=found * self.block_tokens)
        reply = c.call(c.kvstore.Lookup, request)
        return found, (reply.swa_position if reply.swa_found else None)

    # -- saves -------------------------------------------------------------------------

    def transcode(self, pages: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[bool]]:
        """The model-rows blocks of V4 pages ([n, v4 block_bytes] each) and which pages are exact."""
        stacked = torch.stack([p.reshape(-1, self.engine.block_bytes) for p in pages])
        n = stacked.shape[1]
        found = v4_blocks_to_native(self.model, stacked.reshape(-1, stacked.shape[-1]).to(self.device),
                                    self.block_tokens)
        self.stats["rows_transcoded"] += found.rows
        self.stats["rows_exact"] += found.exact_rows
        native = found.native.cpu().reshape(len(pages), n, -1)
        return native, found.exact.cpu().reshape(len(pages), n).all(dim=-1).tolist()

    def save(self, keys: Sequence[str], pages: Sequence[torch.Tensor], write_native: Callable[..., list[bool]],
             *, keep_until_s: float = 0.0, granted: list[Any] | None = None) -> list[bool]:
        """Store pages of one call (rule 2): the exact leading run as the model's rows, the rest as SGLang's.

        With `keep_until_s`, whichever Put stores the call's last page pins the chain through it in its own
        transaction, in the layout it went to (docs/RETENTION.md R22, R28); its `PutResult` appended to
        `granted`.
        """
        if not keys:
            return []
        native, exact = self.transcode(pages)
        lead = next((i for i, ok in enumerate(exact) if not ok), len(keys))
        n = native.shape[1]
        keep = keep_until_s if lead == len(keys) else 0.0   # the model chain holds the last page: it pins
        results = write_native(keys[:lead], [native[i] for i in range(lead)], keep_until_s=keep,
                               granted=granted) if lead else []
        # A page the model chain could not take (its parent went to the engine layout, or the Put failed)
        # goes to the engine layout with everything after it.
        cut = next((i for i, ok in enumerate(results) if not ok), lead)
        shared = sum(results[:cut])
        results = results[:cut] + self.keep_engine(keys[cut:], pages[cut:], keep_until_s=keep_until_s,
                                                   granted=granted)
        self.stats["blocks_shared"] += shared * n
        self.stats["blocks_engine"] += sum(results[cut:]) * n
        logger.info("kvstore: SGLang v4 save of %d pages: %d stored as the model's rows (every row re-encodes "
                    "exactly), %d as SGLang's records (%d inexact)", len(keys), shared, sum(results[cut:]),
                    len(keys) - lead)
        return results

    def keep_engine(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, keep_until_s: float = 0.0,
                    granted: list[Any] | None = None) -> list[bool]:
        """Store pages as SGLang's records under the engine layout, their chain from its root (rule 2); with
        `keep_until_s` the Put pins its last page (R22), its `PutResult` appended to `granted`."""
        results = [False] * len(keys)
        if not keys:
            return results
        first = self.ledger.page(keys[0])
        pages_above = self.ledger.chain_to_root(keys[0])
        chain = self.engine_chain([bytes.fromhex(k) for k in keys]) if pages_above is not None else None
        if first is None or pages_above is None or chain is None:
            logger.warning("kvstore backend: page %s is not in the ledger; not stored", keys[0][:16])
            self.stats["unknown_keys"] += 1
            return results
        above = pages_above[:-1]
        tokens = [t for p in above + [bytes.fromhex(k) for k in keys] for t in self._tokens(p)]
        prefix_blocks = sum(len(self._entry(p).blocks) for p in above)
        blocks = [b for page in pages for b in page.reshape(-1, self.engine.block_bytes)]
        try:
            engine_above = self.engine_chain(above) or []
            have = self.engine.lookup_hashes(engine_above).found_blocks if above else 0
            start = prefix_blocks
            if have < prefix_blocks:      # the chain began in the model's rows: its prefix moves over (exact)
                moved = self._prefix_as_engine(above, prefix_blocks)
                if moved is None:
                    return results
                blocks, start = moved + blocks, 0
                self.stats["engine_prefix_moves"] += 1
            put = self.engine.put(tokens, blocks, extra_keys=first.extra_keys, first_block=start,
                                  keep_until_s=keep_until_s)
            if keep_until_s and granted is not None:
                granted.append(put)
        except KVStoreError as exc:
            self.stats["write_failures"] += 1
            logger.warning("kvstore put of %d SGLang v4 pages failed: %s", len(keys), exc)
            return results
        stored = put.block_hashes[-len(chain):]
        per = len(chain) // len(keys)
        return [list(stored[i * per:(i + 1) * per]) == chain[i * per:(i + 1) * per] for i in range(len(keys))]

    def _entry(self, page: bytes):  # type: ignore[no-untyped-def]
        entry = self.ledger.page(page.hex())
        assert entry is not None  # walked by chain_to_root just before
        return entry

    def _tokens(self, page: bytes) -> Sequence[int]:
        return self._entry(page).tokens

    def _prefix_as_engine(self, above: Sequence[bytes], prefix_blocks: int) -> list[torch.Tensor] | None:
        """The stored model-rows prefix `above` re-encoded into SGLang's rows, or None when it is not all there."""
        hashes = [b for p in above for b in self._entry(p).blocks]
        got: dict[int, bytes] = {}
        for index, status, data in self.native.stream(hashes):
            if status == pb.BLOCK_STATUS_FOUND and len(data) == self.native.block_bytes:
                got[index] = bytes(data)
        if len(got) != prefix_blocks:
            logger.warning("kvstore backend: the model-rows prefix of a v4 chain is gone; its pages are not stored")
            return None
        native = torch.stack([torch.frombuffer(bytearray(got[i]), dtype=torch.uint8) for i in range(prefix_blocks)])
        return list(native_blocks_to_v4(self.model, native.to(self.device), self.block_tokens).cpu())

    # -- loads -------------------------------------------------------------------------

    def to_engine(self, native_blocks: torch.Tensor) -> torch.Tensor:
        """Model-rows blocks [n, block_bytes] as SGLang's V4 blocks [n, v4 block_bytes] (rule 3)."""
        return native_blocks_to_v4(self.model, native_blocks.to(self.device), self.block_tokens).cpu()
