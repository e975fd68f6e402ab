"""A tenant's cache exported to a file and imported elsewhere (gateway/tenant_export.py, issue 12 item 5).

Real LMDB tiers in temporary folders; the export and import run as coroutines on an
event loop, as the Admin service runs them. A damaged, cut or foreign file is refused
naming what is wrong, with nothing written; an import that meets a bad frame anyway
stops there and leaves the store prefix-closed (R6).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import export_format, tenant_export
from gateway.export_format import MAGIC
from gateway.tenant_export import export_tenant, import_tenant, verify_file
from gateway.validate import Layout
from kvstore import geometry
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tiers.integrity import check_store
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus

TOKENS = 16
BLOCK = 1024  # the tier stores opaque bytes; sizes are the gateway's business
LAYOUTS = {V4_1_FLASH.name: Layout.of(V4_1_FLASH, TOKENS)}
ROOT = root_hash(V4_1_FLASH.fingerprint, TOKENS)


@pytest.fixture
def open_tier(tmp_path: Path, clock: ManualClock) -> Iterator[Callable[[str], LmdbBlockTier]]:
    opened: list[LmdbBlockTier] = []

    def _open(name: str) -> LmdbBlockTier:
        tier = LmdbBlockTier(StoreSettings(data_dir=tmp_path / name, capacity_bytes=1 << 28, block_tokens=TOKENS),
                             clock=clock)
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        if tier not in CLOSED:
            tier.close()


#: Tiers a test closed itself (to check their store).
CLOSED: list[LmdbBlockTier] = []


def sound(tier: LmdbBlockTier) -> bool:
    """Close the tier and check its store: every block's parent kept (R6), totals right."""
    tier.close()
    CLOSED.append(tier)
    return check_store(tier.settings.data_dir, repair=False).ok


def chain(seed: int, n: int, parent: bytes = ROOT) -> list[bytes]:
    return chain_hashes(list(range(seed, seed + TOKENS * n)), block_tokens=TOKENS, parent=parent)


def data(h: bytes) -> bytes:
    return (h * (BLOCK // len(h) + 1))[:BLOCK]


def put(tier: LmdbBlockTier, tenant: str, hashes: list[bytes], parent: bytes = ROOT) -> None:
    tier.put(BlockScope(V4_1_FLASH.fingerprint, tenant), parent, hashes, [data(h) for h in hashes], parent == ROOT)


def stored(tier: LmdbBlockTier, tenant: str, hashes: list[bytes]) -> list[bool]:
    scope = BlockScope(V4_1_FLASH.fingerprint, tenant)
    reads = tier.read([scope.key(h) for h in hashes])
    return [status is ReadStatus.FOUND and got == data(h) for (status, got), h in zip(reads, hashes, strict=True)]


def tree(tier: LmdbBlockTier, tenant: str = "acme") -> list[bytes]:
    """Two chains, one branching off the other: 12 blocks, put in a mixed order."""
    trunk = chain(0, 8)
    branch = chain(1000, 4, parent=trunk[3])
    put(tier, tenant, trunk[:4])
    put(tier, tenant, branch, parent=trunk[3])
    put(tier, tenant, trunk[4:], parent=trunk[3])
    return trunk + branch


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def export(tier: LmdbBlockTier, path: Path, tenant: str = "acme", frame_bytes: int = 3 * BLOCK) -> Any:
    return run(export_tenant(tier, tenant, path, layouts=LAYOUTS, frame_bytes=frame_bytes))


def test_round_trip_moves_one_tenant_bit_identical(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path) -> None:
    source = open_tier("a")
    hashes = tree(source)
    other = chain(5000, 3)
    put(source, "other", other)
    counts = export(source, tmp_path / "acme.kvx")
    assert (counts.records, counts.frames) == (12, 4)  # 3 blocks a frame
    assert counts.bytes == (tmp_path / "acme.kvx").stat().st_size
    assert not (tmp_path / "acme.kvx.partial").exists()
    target = open_tier("b")
    imported = run(import_tenant(target, "", tmp_path / "acme.kvx", layouts=LAYOUTS))
    assert (imported.tenant, imported.records, imported.written) == ("acme", 12, 12)
    assert all(stored(target, "acme", hashes))
    assert not any(stored(target, "other", other))  # only the tenant named
    again = run(import_tenant(target, "", tmp_path / "acme.kvx", layouts=LAYOUTS))
    assert (again.records, again.written) == (12, 0)  # already stored
    assert sound(target)


def test_import_under_another_tenant(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path) -> None:
    source = open_tier("a")
    hashes = tree(source)
    export(source, tmp_path / "acme.kvx")
    imported = run(import_tenant(source, "acme-copy", tmp_path / "acme.kvx", layouts=LAYOUTS))
    assert imported.written == 12 and all(stored(source, "acme-copy", hashes))


def test_only_served_geometries_are_exported(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path) -> None:
    """Blocks of a geometry this server does not serve (an older codec's) are counted, not written."""
    tier = open_tier("a")
    tree(tier)
    old = BlockScope(bytes(8), "acme")  # a fingerprint no geometry has
    tier.put(old, root_hash(bytes(8), TOKENS), chain(0, 2), [b"x" * BLOCK] * 2, True)
    counts = export(tier, tmp_path / "acme.kvx")
    assert (counts.records, counts.skipped) == (12, 2)
    assert counts.by_fingerprint == {V4_1_FLASH.fingerprint.hex(): 12}


def test_a_failed_export_leaves_no_file(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier("a")
    tree(tier)
    real = export_format.pack_frame

    def failing(index: int, records: Any) -> bytes:
        if index == 2:
            raise OSError(28, "No space left on device")
        return real(index, records)

    monkeypatch.setattr(export_format, "pack_frame", failing)
    with pytest.raises(OSError, match="No space left"):
        export(tier, tmp_path / "acme.kvx")
    assert list(tmp_path.glob("acme.kvx*")) == []  # neither the file nor its .partial


def test_an_empty_tenant_exports_a_valid_empty_file(open_tier: Callable[[str], LmdbBlockTier],
                                                    tmp_path: Path) -> None:
    counts = export(open_tier("a"), tmp_path / "none.kvx", tenant="nobody")
    assert (counts.records, counts.frames) == (0, 0)
    assert run(verify_file(tmp_path / "none.kvx")).records == 0


def frame_offsets(path: Path) -> list[int]:
    """Where each frame starts (after the header), then where the trailer starts."""
    raw = path.read_bytes()
    at = len(MAGIC)
    n = int.from_bytes(raw[at:at + 4], "little")
    at += 4 + n + 8
    offsets = []
    while raw[at:at + 1] == b"F":
        offsets.append(at)
        size = int.from_bytes(raw[at + 13:at + 17], "little")
        at += 17 + 8 + size
    return [*offsets, at]


@pytest.mark.parametrize("damage", ["flip a payload byte", "cut inside", "drop a frame", "drop the last frame",
                                    "no trailer", "extra bytes"])
def test_a_damaged_file_is_refused_whole_naming_where(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path,
                                                      damage: str) -> None:
    source = open_tier("a")
    tree(source)
    path = tmp_path / "acme.kvx"
    export(source, path)
    raw = bytearray(path.read_bytes())
    offsets = frame_offsets(path)
    if damage == "flip a payload byte":
        raw[offsets[2] + 40] ^= 0x01
        expected = "frame 2 at offset"
    elif damage == "cut inside":
        raw = raw[:offsets[3] + 30]
        expected = "cut short in frame 3"
    elif damage == "drop a frame":
        raw = raw[:offsets[1]] + raw[offsets[2]:]
        expected = "frame 1 at offset"
    elif damage == "drop the last frame":
        raw = raw[:offsets[3]] + raw[offsets[4]:]
        expected = "the trailer counts 4 frames and 12 records; the file holds 3 and 9"
    elif damage == "no trailer":
        raw = raw[:offsets[4]]
        expected = "cut short in frame 4"
    else:
        raw += b"\0"
        expected = "bytes follow the trailer"
    path.write_bytes(bytes(raw))
    target = open_tier("b")
    with pytest.raises(DataLoss, match=expected):
        run(import_tenant(target, "", path, layouts=LAYOUTS))
    assert target.stats().blocks_stored == 0  # nothing half-imported


def test_a_bad_frame_met_during_the_import_stops_it_prefix_closed(open_tier: Callable[[str], LmdbBlockTier],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The file changes after the check (the check is skipped here): whole frames before the bad one stay."""
    source = open_tier("a")
    tree(source)
    path = tmp_path / "acme.kvx"
    export(source, path)
    raw = bytearray(path.read_bytes())
    raw[frame_offsets(path)[2] + 40] ^= 0x01
    path.write_bytes(bytes(raw))

    async def unchecked(path: Path) -> None:
        return None

    monkeypatch.setattr(tenant_export, "verify_file", unchecked)
    target = open_tier("b")
    with pytest.raises(DataLoss, match=r"frame 2 .* stopped there, after 2 whole frames .*6 blocks written"):
        run(import_tenant(target, "", path, layouts=LAYOUTS))
    assert target.stats().blocks_stored == 6  # frames 0 and 1, parents first
    assert sound(target)  # no block without its parent (R6)


def test_refusals_name_the_file(open_tier: Callable[[str], LmdbBlockTier], tmp_path: Path) -> None:
    tier = open_tier("a")
    tree(tier)
    export(tier, tmp_path / "acme.kvx")
    with pytest.raises(FailedPrecondition, match="exists already"):
        export(tier, tmp_path / "acme.kvx")
    with pytest.raises(NotFound, match="does not exist on the server"):
        export(tier, tmp_path / "no-such-folder" / "acme.kvx")
    with pytest.raises(NotFound, match="does not exist on the server"):
        run(import_tenant(tier, "", tmp_path / "missing.kvx", layouts=LAYOUTS))
    (tmp_path / "notes.txt").write_text("not an export")
    with pytest.raises(InvalidArgument, match="not a kvstore export file"):
        run(import_tenant(tier, "", tmp_path / "notes.txt", layouts=LAYOUTS))
    tiny = geometry.REGISTRY["v41-tiny-fixture"]
    with pytest.raises(FailedPrecondition, match="geometries this server does not serve"):
        run(import_tenant(tier, "", tmp_path / "acme.kvx", layouts={tiny.name: Layout.of(tiny, TOKENS)}))
    os.truncate(tmp_path / "acme.kvx", len(MAGIC) + 2)
    with pytest.raises(DataLoss, match="cut short in the header"):
        run(verify_file(tmp_path / "acme.kvx"))


def test_the_server_answers_while_an_export_works(start_server: Callable[..., Any], store_settings: StoreSettings,
                                                  loop_thread: Any, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """A frame held in its compression thread: GetInfo on the same server is answered meanwhile."""
    server = start_server(store_settings)
    tree(server.tier)
    entered, release = threading.Event(), threading.Event()
    real = export_format.pack_frame

    def held(*args: Any) -> bytes:
        entered.set()
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(export_format, "pack_frame", held)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(loop_thread.run, export_tenant(server.tier, "acme", tmp_path / "acme.kvx",
                                                             layouts=LAYOUTS, frame_bytes=3 * BLOCK))
        try:
            assert entered.wait(30)
            with grpc.insecure_channel(server.target) as channel:  # the timeout only ends a loop held for good
                info = pb_grpc.KVStoreStub(channel).GetInfo(pb.GetInfoRequest(), timeout=20)
            assert info.block_tokens == TOKENS and not pending.done()
        finally:
            release.set()
        assert pending.result(60).records == 12
