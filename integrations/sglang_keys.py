"""SGLang's HiCache page keys as kvstore chain hashes, and the ledger that keeps their tokens.

SGLang names every page it offloads by a chain of SHA-256 hex strings that it computes
itself (`sglang.srt.mem_cache.utils.get_hash_str`, over the page's token ids and the
previous page's key); a storage backend only ever sees those strings. kvstore stores
a block under a chain hash the *server* computes from token ids (Put carries tokens,
never bare hashes: kvstore/prefix.py), so a backend that saw only SGLang's strings
could neither store a block nor share one with another client.

So while a kvstore backend is attached, SGLang's page hash is kvstore's:
`install(ledger)` replaces `get_hash_str` in `sglang.srt.mem_cache.utils`
(every caller in SGLang 0.5.23 reaches it there: `get_storage_hash_str`, the cache
controller, the hybrid controller, the radix tree's node hashes) by `KeyLedger.hash`,
which returns, for a full page of n x `block_tokens` tokens (n = 1 on 64-token pages,
4 on SGLang's 256-token DeepSeek-V4 pages),

    blocks = kvstore_chain_hashes(parent, page tokens)       # kvstore.prefix.chain_hashes, n blocks
    key = blocks[-1].hex()                                   # the page's last block
    parent = bytes.fromhex(prior key), or the client's chain root at a sequence start

and remembers (key -> parent, page tokens, blocks) in a bounded ledger, which is what
lets the backend Put a page SGLang asks it to store and Lookup its blocks. A page's
key is kvstore's chain hash at the page's end, so a caller (the one-cache test)
computes the keys of a prompt from token ids with kvstore's own client:

    hashes = kvstore.Client(target).hashes(token_ids)              # one per full 64-token block
    keys = [h.hex() for h in hashes[n - 1::n]]                     # one per full page of n blocks

and those are the keys SGLang itself uses for that prompt (same root: same server
geometry and block size, no extra keys). Over a fleet (`etcd://` or a gateway) `Client.hashes`
gives the fleet's hashes, each run of `run_blocks` blocks a chain of its own bridged to the
prefix (kvstore.client.fleet_chain, docs/FLEET.md F29), and so does the ledger (`run_blocks`):
it keeps each page's block index and its run's bridge to hash the next page on. Not covered
(their pages get a key that the ledger does not know, so they are neither stored nor found, never wrong): a trailing
partial page (SGLang stores only full pages), bigram (EAGLE) keys, and requests with
`extra_key` / `cache_salt` seeded by the PD decode side's offload manager (it imports
SGLang's seed function by name, so its seeds are not noted).

Requests with `extra_key` / `cache_salt` (a LoRA id, a per-user salt): SGLang seeds their
chain with a digest of those (`storage_namespace_seed`), which is no kvstore block. While
installed, the seeds SGLang makes are noted, and a chain starting from one is a kvstore
chain from the root with one extra key, `"sglang-ns:" + seed` (kvstore.prefix extra keys:
mixed into every block's hash), so it is stored and found like any other, and kept apart
from unsalted prompts; another client finds it with `extra_keys=["sglang-ns:" + seed]`.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from kvstore.client.blocks import stream_blocks
from kvstore.client.fleet_chain import run_extra_keys
from kvstore.errors import ConfigError
from kvstore.prefix import HASH_BYTES, chain_hashes

#: Pages whose tokens the ledger keeps by default (about 0.7 KB each on 64-token pages, 1.7 KB on 256-token pages).
DEFAULT_LEDGER_PAGES = 262_144
#: The kvstore extra key a chain seeded by SGLang's namespace digest is hashed with (+ the seed's hex).
SEED_KEY_PREFIX = "sglang-ns:"
#: Namespace seeds remembered (a few per LoRA adapter or salt in use).
MAX_SEEDS = 65_536


class LedgerPage(NamedTuple):
    """What a page key was hashed from: everything a Put of its blocks needs."""

    parent: bytes              # the previous page's key (its last block's chain hash), or the chain root
    tokens: array              # the page's token ids (u32), a whole number of kvstore blocks
    extra_keys: tuple[str, ...]  # kvstore extra keys of the chain (a salted chain's seed key), else ()
    blocks: tuple[bytes, ...] = ()  # the chain hashes of the page's blocks, in order; the last is the key
    first_block: int = -1      # index of the page's first block in its sequence (-1: its start is unknown)
    bridge: bytes | None = None  # in a fleet, the hash before the run of the page's last block (None: run 0)


class KeyLedger:
    """kvstore's chain hash as SGLang's page hash, remembering each full page's parent and tokens.

    Args:
        root: the kvstore chain root of the client's geometry and block size (`Client.root`).
        block_tokens: tokens per kvstore block; SGLang's page size must be the same.
        capacity: most pages remembered (least recently hashed forgotten first).
        fallback: SGLang's own hash, for keys kvstore cannot name (bigram keys).
        run_blocks: a fleet's run length (`FleetClient.run_blocks`, a gateway's GetInfo), 0 for one server: in a
            fleet each run of that many blocks is a chain of its own from the root, bridged to the prefix
            (kvstore.client.fleet_chain, docs/FLEET.md F29), so the keys are the fleet hashes the client names.
    """

    def __init__(self, root: bytes, block_tokens: int, *, capacity: int = DEFAULT_LEDGER_PAGES,
                 fallback: Callable[..., Any] | None = None, run_blocks: int = 0) -> None:
        if len(root) != HASH_BYTES:
            raise ConfigError(f"chain root must be {HASH_BYTES} bytes, got {len(root)}")
        if capacity < 1:
            raise ConfigError(f"ledger_pages must be at least 1, got {capacity}")
        self.root = root
        self.block_tokens = block_tokens
        self.run_blocks = run_blocks
        self.capacity = capacity
        self.fallback = fallback
        self._pages: OrderedDict[str, LedgerPage] = OrderedDict()
        self._seeds: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # SGLang hashes on the scheduler and on its storage threads

    def __len__(self) -> int:
        return len(self._pages)

    def hash(self, token_ids: Any, prior_hash: str | None = None, page_size: int | None = None) -> str | list[str]:
        """SGLang's `get_hash_str(token_ids, prior_hash, page_size)`, answered with kvstore chain hashes.

        With `page_size`, one key per page (a trailing partial page included, as SGLang
        does); without it, one key for all the tokens as one page.
        """
        tokens = _plain_tokens(token_ids)
        if tokens is None:  # bigram or tuple tokens: SGLang's own hash, never stored in kvstore
            if self.fallback is None:
                raise ConfigError("SGLang passed bigram page keys and no fallback hash was given")
            return self.fallback(token_ids, prior_hash, page_size)  # type: ignore[no-any-return]
        parent, extra, first_block, bridge = self._start(prior_hash)
        if not tokens:
            return [] if page_size is not None else hashlib.sha256(parent).hexdigest()
        step = page_size or len(tokens)
        keys: list[str] = []
        for start in range(0, len(tokens), step):
            page = tokens[start:start + step]
            if len(page) == step and step % self.block_tokens == 0:
                # A full page of whole blocks (one block; four on SGLang's 256-token DeepSeek-V4
                # pages): its key is the chain hash of its last block, as kvstore.Client names it.
                blocks, end_bridge = self._page_blocks(page, parent, extra, first_block, bridge)
                digest = blocks[-1]
                self._remember(digest.hex(), LedgerPage(parent, page, extra, tuple(blocks), first_block, end_bridge))
                bridge = end_bridge
                first_block = first_block + len(blocks) if first_block >= 0 else -1
            else:
                # A partial page still gets a distinct key (hashed with its own length), but no
                # ledger entry: it is never stored (SGLang stores only full pages).
                digest = chain_hashes(page, block_tokens=len(page), parent=parent, extra_keys=extra)[0]
                first_block = -1
            keys.append(digest.hex())
            parent = digest
        return keys if page_size is not None else keys[0]

    def _page_blocks(self, page: array, parent: bytes, extra: tuple[str, ...], first_block: int,
                     bridge: bytes | None) -> tuple[list[bytes], bytes | None]:
        """The chain hashes of a full page's blocks from `parent`, and the bridge at its last block
        (`page_blocks` from this ledger's root and runs)."""
        return page_blocks(page, root=self.root, block_tokens=self.block_tokens, run_blocks=self.run_blocks,
                           parent=parent, extra_keys=extra, first_block=first_block, bridge=bridge)

    def _start(self, prior_hash: str | None) -> tuple[bytes, tuple[str, ...], int, bytes | None]:
        """Where a chain continues (parent, extra keys, the next block's index, the run's bridge): the root,
        a known page (its extra keys and run carry on), a namespace seed (the root, with the seed as extra
        key), or an unknown hash (taken as the parent, at an unknown index)."""
        if not prior_hash:
            return self.root, (), 0, None
        with self._lock:
            known = self._pages.get(prior_hash)
            seeded = prior_hash in self._seeds
        if known is not None:
            index = known.first_block + len(known.blocks) if known.first_block >= 0 else -1
            return bytes.fromhex(prior_hash), known.extra_keys, index, known.bridge
        if seeded:
            return self.root, (SEED_KEY_PREFIX + prior_hash,), 0, None
        return bytes.fromhex(prior_hash), (), -1, None

    def note_seed(self, seed: str | None) -> str | None:
        """Remember a namespace seed SGLang made (`storage_namespace_seed`'s result); returns it."""
        if seed:
            with self._lock:
                self._seeds[seed] = None
                self._seeds.move_to_end(seed)
                while len(self._seeds) > MAX_SEEDS:
                    self._seeds.popitem(last=False)
        return seed

    def _remember(self, key: str, page: LedgerPage) -> None:
        with self._lock:
            self._pages[key] = page
            self._pages.move_to_end(key)
            while len(self._pages) > self.capacity:
                self._pages.popitem(last=False)

    def page(self, key: str) -> LedgerPage | None:
        """What the key was hashed from, or None (forgotten, never a full page, or not hashed here)."""
        with self._lock:
            return self._pages.get(key)

    def chain_to_root(self, key: str, *, limit: int = 1 << 20) -> list[bytes] | None:
        """The chain hashes from the sequence start up to `key` (included), walking the ledger's
        parents; None when a link is not in the ledger."""
        chain: list[bytes] = []
        current = bytes.fromhex(key)
        with self._lock:
            while current != self.root:
                entry = self._pages.get(current.hex())
                if entry is None or len(chain) >= limit:
                    return None
                chain.append(current)
                current = entry.parent
        chain.reverse()
        return chain

    def tokens_to(self, key: str) -> array | None:
        """The token ids of every page from the sequence start through `key` (its prompt so far, as a fleet's
        Put takes it: kvstore.client.fleet), or None when a page of that chain is not in the ledger."""
        pages: list[array] = []
        current = bytes.fromhex(key)
        with self._lock:
            while current != self.root:
                entry = self._pages.get(current.hex())
                if entry is None:
                    return None
                pages.append(entry.tokens)
                current = entry.parent
        out = array("I")
        for page in reversed(pages):
            out.extend(page)
        return out

    def chain_blocks(self, keys: Sequence[str]) -> tuple[list[bytes], int] | None:
        """The block hashes from the sequence start through the pages `keys` (consecutive pages of one chain), and
        the index of the first block of `keys[0]`: what a fleet's reads take (a run is found by its first hash).
        None when a page of that chain is not in the ledger."""
        first = self.page(keys[0]) if keys else None
        if first is None:
            return None
        above = [] if first.parent == self.root else self.chain_to_root(first.parent.hex())
        before = self.blocks_of([h.hex() for h in above]) if above is not None else None
        mine = self.blocks_of(keys)
        if before is None or mine is None:
            return None
        return before + mine, len(before)

    def blocks_of(self, keys: Sequence[str]) -> list[bytes] | None:
        """The block chain hashes of the pages `keys`, in order; None when a page is not in the ledger."""
        out: list[bytes] = []
        with self._lock:
            for key in keys:
                entry = self._pages.get(key)
                if entry is None:
                    return None
                out.extend(entry.blocks)
        return out


def _plain_tokens(token_ids: Any) -> array | None:
    """The page's token ids as an array of u32 (what kvstore hashes), or None for bigram/tuple keys."""
    if getattr(token_ids, "is_bigram", False):
        return None
    raw = getattr(token_ids, "token_ids", token_ids)
    n = len(token_ids)
    items = raw[:n]
    if n and isinstance(items[0], tuple):
        return None
    return array("I", items)


_installed: dict[str, Any] = {}
_install_lock = threading.Lock()


def install(ledger: KeyLedger) -> None:
    """Make `ledger.hash` SGLang's page hash in this process (the last attached backend's ledger wins).

    Raises:
        ConfigError: SGLang's `mem_cache.utils` has no `get_hash_str` (another SGLang version).
    """
    from sglang.srt.mem_cache import utils  # SGLang is imported only where it is installed

    with _install_lock:
        if "original" not in _installed:
            original = getattr(utils, "get_hash_str", None)
            if original is None:
                raise ConfigError("sglang.srt.mem_cache.utils.get_hash_str not found: this SGLang version "
                                  "is not supported (tested: 0.5.23)")
            _installed["original"] = original
            _installed["original_seed"] = getattr(utils, "storage_namespace_seed", None)
        ledger.fallback = ledger.fallback or _installed["original"]
        utils.get_hash_str = ledger.hash  # type: ignore[attr-defined]
        seed_fn = _installed["original_seed"]
        if seed_fn is not None:
            utils.storage_namespace_seed = lambda *a, **k: ledger.note_seed(seed_fn(*a, **k))  # type: ignore[attr-defined]
        _installed["ledger"] = ledger


def uninstall() -> None:
    """Give SGLang back its own page hash (a detached backend)."""
    from sglang.srt.mem_cache import utils

    with _install_lock:
        if "original" in _installed:
            utils.get_hash_str = _installed.pop("original")  # type: ignore[attr-defined]
            seed_fn = _installed.pop("original_seed", None)
            if seed_fn is not None:
                utils.storage_namespace_seed = seed_fn  # type: ignore[attr-defined]
            _installed.pop("ledger", None)


def installed_ledger() -> KeyLedger | None:
    """The ledger SGLang hashes with now, if a kvstore backend installed one."""
    ledger = _installed.get("ledger")
    return ledger if isinstance(ledger, KeyLedger) else None


def page_blocks(page: Sequence[int], *, root: bytes, block_tokens: int, run_blocks: int, parent: bytes,
                extra_keys: Sequence[str], first_block: int, bridge: bytes | None) -> tuple[list[bytes], bytes | None]:
    """The chain hashes of a full page's blocks from `parent` (the hash of block `first_block` - 1), and the
    bridge in force at its last block. One server (`run_blocks` 0): one chain. A fleet: a block at a run's
    start restarts from `root`, its run bridged to the hash before it (F29); a page of unknown start
    (`first_block` -1) stays one chain (its key is distinct, and it is never stored: its chain cannot be
    traced to the start). Shared by the ledger and by `sglang_share`'s chain of SGLang's own layout.
    """
    b, rb = block_tokens, run_blocks
    if not rb or first_block < 0:
        return chain_hashes(page, block_tokens=b, parent=parent, extra_keys=extra_keys), bridge
    out: list[bytes] = []
    done, total, block = 0, len(page) // b, first_block
    while done < total:
        if block % rb == 0:   # a run starts here: from the root, bridged to the block before (none at 0)
            bridge, parent = (parent if block else None), root
        take = min(rb - block % rb, total - done)
        out += chain_hashes(page[done * b:(done + take) * b], block_tokens=b, parent=parent,
                            extra_keys=run_extra_keys(extra_keys, bridge))
        parent, done, block = out[-1], done + take, block + take
    return out, bridge


def stream_part(client: Any, chain: Sequence[bytes], first_block: int,
                end_block: int) -> Iterator[tuple[int, int, bytes]]:
    """(index from `first_block`, status, data) of blocks [first_block, end_block) of `chain` (fleet hashes from
    block 0), asked so that each run is found by its placement (F29): a fleet client's `stream_part`; a gateway's
    plain client says in each Get where it starts (F37, F60), which the hashes alone do not."""
    part = getattr(client, "stream_part", None)
    if part is not None:
        return part(chain, first_block, end_block)  # type: ignore[no-any-return]
    return stream_blocks(client.connection, chain[first_block:end_block], chain=chain, first_block=first_block)


def run_blocks_of(client: Any) -> int:
    """The run length `client` hashes with (F29): a fleet client's, a gateway's (GetInfo, F36), 0 for one server."""
    own = getattr(client, "run_blocks", None)
    if isinstance(own, int):
        return own
    return int(getattr(getattr(client, "connection", None), "run_blocks", 0) or 0)


def page_keys(root: bytes, block_tokens: int, token_ids: Sequence[int], page_tokens: int | None = None) -> list[str]:
    """The SGLang page keys of a sequence's full pages of `page_tokens` (default: one block): hex of
    kvstore's chain hash of each page's last block, from `root`."""
    n = (page_tokens or block_tokens) // block_tokens
    return [h.hex() for h in chain_hashes(token_ids, block_tokens=block_tokens, parent=root)[n - 1::n]]
