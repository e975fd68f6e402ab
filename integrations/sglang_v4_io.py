"""SGLang's DeepSeek-V4 HiCache pages in and out of kvstore: one page = its side pools' pages = n blocks.

A V4 page (256 tokens) lives in four side pools (sglang_v4_pools.SERVED) at one host
index, the anchor's. Reading a page fetches its `n = page_tokens / block_tokens` blocks
(their chain hashes from the ledger: sglang_keys) and, only when all n are there, splits
them into the side pools (sglang_v4.blocks_to_pages); fewer is a miss. Writing joins
the side pools' pages into blocks (pages_to_blocks) and Puts them with the page's
tokens, as the backend Puts any page.

SGLang asks for one page set twice: its cache controller reads the anchor
(`batch_get_v1`) and then the side pools (`batch_get_v2`, same keys and host indices),
and writes the side pools (`batch_set_v2`) before the anchor (`batch_set_v1`, in
batches of 128 pages). Whichever call comes first moves the whole page; `V4Pages` notes
its per-page outcome (per thread: each of SGLang's storage threads runs its own calls in
order) and the other call answers from that note, so nothing crosses the wire twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from integrations.sglang_keys import KeyLedger, stream_part
from integrations.sglang_share import V4Sharing
from integrations.sglang_swa import read_only
from integrations.sglang_v4 import V4PageLayout, blocks_to_pages, pages_to_blocks
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

#: Outcomes remembered per thread before the oldest are dropped (a call never answered by its twin).
MAX_NOTED = 1 << 16


class V4Pages:
    """The V4 side pools' pages as kvstore blocks.

    Args:
        client: the backend's kvstore client.
        ledger: the page keys' tokens and block hashes.
        layout: the page arrangement (sglang_v4_pools.layout).
        pools: side pool name -> SGLang host pool (registered so far; read at call time).
        write_pages: the backend's Put of pages as runs of one chain (keys, [n, block_bytes] pages; with
            `keep_until_s` and `granted`, the run ending at the last key pinning it in its own Put, R22).
        stats: the backend's counters (pages read here are added to "pages_read").
        sharing: with SGLang's v4 rows shared as the model's where exact (integrations.sglang_share): the
            blocks are read and written through it (`client` is then the model geometry's).
    """

    def __init__(self, client: Client, ledger: KeyLedger, layout: V4PageLayout, pools: Mapping[str, Any],
                 write_pages: Callable[..., list[bool]],
                 stats: dict[str, int], *, sharing: V4Sharing | None = None) -> None:
        self.sharing = sharing
        self.stats = stats
        self.client = client
        self.ledger = ledger
        self.layout = layout
        self.pools = pools
        self.write_pages = write_pages
        self._noted = threading.local()

    # -- the v1/v2 twin calls ------------------------------------------------------

    def _note(self, op: str, keys: Sequence[str], host_indices: torch.Tensor, results: list[bool]) -> None:
        noted: dict[tuple[str, str, int], bool] = self._noted.__dict__.setdefault("outcomes", {})
        if len(noted) > MAX_NOTED:
            noted.clear()
        for i, key in enumerate(keys):
            noted[(op, key, self._slot(host_indices, i))] = results[i]

    def _take(self, op: str, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool] | None:
        """The noted outcome of every page of this call (then forgotten), or None when one is not noted."""
        noted: dict[tuple[str, str, int], bool] = self._noted.__dict__.setdefault("outcomes", {})
        wanted = [(op, key, self._slot(host_indices, i)) for i, key in enumerate(keys)]
        if not keys or any(w not in noted for w in wanted):
            return None
        return [noted.pop(w) for w in wanted]

    def _slot(self, host_indices: torch.Tensor, i: int) -> int:
        return int(host_indices[i * self.layout.page_tokens])

    def read(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Read the pages of `keys` into every side pool at `host_indices` (or answer a twin call's outcome)."""
        done = self._take("get", keys, host_indices)
        if done is None:
            done = self._read(keys, host_indices)
            self._note("get", keys, host_indices, done)
        return done

    def write(self, keys: Sequence[str], host_indices: torch.Tensor, *, keep_until_s: float = 0.0,
              granted: list[Any] | None = None) -> list[bool]:
        """Store the side pools' pages at `host_indices` under `keys` (or answer a twin call's outcome).

        With `keep_until_s`, the Put that stores the last page pins the chain through it in its own
        transaction (docs/RETENTION.md R22: no Lookup after the write); its `PutResult` is appended to
        `granted`, and noted, so the twin call (batch_set_v1 after batch_set_v2) gets it too.
        """
        done = self._take("set", keys, host_indices)
        grants: dict[tuple[str, int], Any] = self._noted.__dict__.setdefault("grants", {})
        last = (keys[-1], self._slot(host_indices, len(keys) - 1)) if keys else None
        if done is None:
            mine: list[Any] = []
            done = self._write(keys, host_indices, keep_until_s, mine)
            self._note("set", keys, host_indices, done)
            if mine and last is not None:
                if len(grants) > MAX_NOTED:
                    grants.clear()
                grants[last] = mine[-1]
        if granted is not None and last is not None and last in grants:
            granted.append(grants.pop(last))
        return done

    def forget_reads(self) -> None:
        """Drop this thread's noted reads: a new anchor read must move its pages again."""
        noted: dict[tuple[str, str, int], bool] = self._noted.__dict__.setdefault("outcomes", {})
        for k in [k for k in noted if k[0] == "get"]:
            del noted[k]

    # -- the pages ---------------------------------------------------------------------

    def _stream(self, client: Client, wanted: Sequence[tuple[int, bytes]],
                chain: tuple[list[bytes], int] | None = None) -> dict[int, list[bytes | memoryview]]:
        """Page -> its blocks found, in order, of (page, block hash) pairs, from `client`. In a fleet (the
        ledger's `run_blocks`) `chain` is the chain from the sequence start through the wanted pages and the
        index of their first block (`KeyLedger.chain_blocks`, `V4Sharing.engine_chain_blocks`): the blocks
        are asked as that part of it (a run is found by its first hash, F29, F58)."""
        got: dict[int, list[bytes | memoryview]] = {}
        hashes = [h for _, h in wanted]
        blocks: Any = client.stream(hashes)
        if self.ledger.run_blocks:
            if chain is not None and hashes and chain[0][chain[1]:] == hashes:
                blocks = stream_part(client, chain[0], chain[1], len(chain[0]))
            else:  # pages the ledger cannot trace to the start: a miss (SGLang recomputes)
                blocks = iter(())
        try:
            for index, status, data in blocks:
                if status == pb.BLOCK_STATUS_FOUND and len(data) == client.block_bytes:
                    got.setdefault(wanted[index][0], []).append(data)
        except KVStoreError as exc:
            logger.warning("kvstore get of V4 pages failed: %s", exc)
        return got

    def _chain(self, keys: Sequence[str]) -> tuple[list[bytes], int] | None:
        """The model chain from the sequence start through `keys` in a fleet (None on one server: unused)."""
        return self.ledger.chain_blocks(keys) if self.ledger.run_blocks and keys else None

    def _read(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        n = self.layout.blocks_per_page
        results = [False] * len(keys)
        wanted: list[tuple[int, bytes]] = []        # (page, block hash) for every page the ledger knows
        for i, key in enumerate(keys):
            hashes = self.ledger.blocks_of([key])
            if hashes is not None and len(hashes) == n:
                wanted.extend((i, h) for h in hashes)
        got = {i: b for i, b in self._stream(self.client, wanted, self._chain(keys)).items() if len(b) == n}
        pages: dict[int, torch.Tensor] = {}
        if self.sharing is not None:
            if got:     # the model's rows, re-encoded into SGLang's (exact: stored only where they are)
                order = sorted(got)
                native = torch.stack([read_only(b) for i in order for b in got[i]])
                engine = self.sharing.to_engine(native).reshape(len(order), n, -1)
                pages = {i: engine[j] for j, i in enumerate(order)}
                self.stats["pages_reencoded"] += len(order)
            rest: list[tuple[int, bytes]] = []
            for i, key in enumerate(keys):
                blocks = self.sharing.engine_blocks(key) if i not in got else None
                if blocks is not None and len(blocks) == n:
                    rest.extend((i, h) for h in blocks)
            # In a fleet the engine chain is asked from its sequence start; the pages it holds follow the
            # ones found in the model's rows (rule 2), so they are the keys from the first of them on.
            tail = keys[rest[0][0]:] if rest and self.ledger.run_blocks else ()
            engine_chain = self.sharing.engine_chain_blocks(tail) if tail else None
            got = {i: b for i, b in self._stream(self.sharing.engine, rest, engine_chain).items() if len(b) == n}
        pages.update({i: torch.stack([read_only(b) for b in found]) for i, found in got.items()})
        for i, joined in pages.items():     # a page stored in part is a miss: SGLang recomputes it
            for name, page in blocks_to_pages(self.layout, joined).items():
                self.pools[name].set_from_flat_data_page(self._slot(host_indices, i), page.reshape(-1))
            results[i] = True
        self.stats["pages_read"] += sum(results)
        return results

    def _write(self, keys: Sequence[str], host_indices: torch.Tensor, keep_until_s: float,
               granted: list[Any]) -> list[bool]:
        pages = []
        for i in range(len(keys)):
            slot = self._slot(host_indices, i)
            side = {name: pool.get_data_page(slot, flat=True) for name, pool in self.pools.items()}
            pages.append(pages_to_blocks(self.layout, side))
        if self.sharing is not None:
            return self.sharing.save(keys, pages, self.write_pages, keep_until_s=keep_until_s, granted=granted)
        return self.write_pages(keys, pages, keep_until_s=keep_until_s, granted=granted)
