"""A small real LMDB tier and helpers to build chains in it (retention tests move the clock)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.block_txn import read_meta
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus

HOUR = 3600.0
KIT_BLOCK = 1024  # the tier stores opaque bytes; sizes are checked at the gateway
KIT_TOKENS = 16


class Kit:
    """Chains of 1 KiB blocks in one scope of a small tier, and ways to look at them."""

    block_bytes = KIT_BLOCK
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    root = root_hash(V4_1_FLASH.fingerprint, KIT_TOKENS)

    def __init__(self, tier: LmdbBlockTier) -> None:
        self.tier = tier

    @classmethod
    def chain(cls, seed: int, n: int, parent: bytes | None = None) -> list[bytes]:
        """Hashes of an n-block chain whose tokens start at `seed` (from the root, or `parent`)."""
        return chain_hashes(list(range(seed, seed + KIT_TOKENS * n)), block_tokens=KIT_TOKENS,
                            parent=parent or cls.root)

    @staticmethod
    def data(i: int) -> bytes:
        return bytes([i % 256]) * KIT_BLOCK

    def put(self, hashes: list[bytes], start: int = 0, end: int | None = None) -> tuple[int, int]:
        """Put hashes[start:end] (on hashes[start - 1]); (written, existing)."""
        end = len(hashes) if end is None else end
        parent = self.root if start == 0 else hashes[start - 1]
        r = self.tier.put(self.scope, parent, hashes[start:end], [self.data(i) for i in range(start, end)],
                          start == 0)
        return r.written_blocks, r.existing_blocks

    def keys(self, hashes: list[bytes]) -> list[bytes]:
        return [self.scope.key(h) for h in hashes]

    def stored(self, hashes: list[bytes]) -> list[bool]:
        """Which blocks a Get finds."""
        return [s is ReadStatus.FOUND for s, _ in self.tier.read(self.keys(hashes))]

    def found(self, hashes: list[bytes]) -> int:
        """What a Lookup reports."""
        return self.tier.lookup(self.scope, hashes)[0]

    def meta(self, block_hash: bytes) -> BlockMeta:
        with self.tier.env.begin() as txn:
            meta = read_meta(txn, self.tier._dbs, self.scope.key(block_hash))
        assert meta is not None
        return meta


@pytest.fixture
def open_tier(clock: ManualClock) -> Iterator[Callable[..., LmdbBlockTier]]:
    """Opens tiers on `clock`; each still open at the end is closed."""
    opened: list[LmdbBlockTier] = []

    def _open(settings: StoreSettings) -> LmdbBlockTier:
        tier = LmdbBlockTier(settings, clock=clock)
        opened.append(tier)
        return tier

    yield _open
    for t in opened:
        if not t.executor._shutdown:
            t.close()


@pytest.fixture
def make_kit(open_tier: Callable[..., LmdbBlockTier], tmp_path: Path) -> Callable[..., Kit]:
    """Opens a Kit on the store in tmp_path holding `blocks` blocks (again after a close: a restart)."""

    def _make(blocks: int = 10) -> Kit:
        settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=blocks * KIT_BLOCK,
                                 block_tokens=KIT_TOKENS)
        return Kit(open_tier(settings))

    return _make


@pytest.fixture
def kit(make_kit: Callable[..., Kit]) -> Kit:
    """A Kit on a fresh 10-block tier."""
    return make_kit()


@pytest.fixture
def zero_leaves() -> Callable[[Path, bytes], list[int]]:
    """Zero every leaf page of a data file that holds a byte string (old copies too); their page numbers."""
    def zero(path: Path, needle: bytes) -> list[int]:
        raw = path.read_bytes()
        hit = [off // 4096 for off in range(0, len(raw), 4096)
               if raw[off + 10] & 0x02 and needle in raw[off:off + 4096]]
        with path.open("r+b") as f:
            for page in hit:
                f.seek(page * 4096)
                f.write(bytes(4096))
        return hit

    return zero
