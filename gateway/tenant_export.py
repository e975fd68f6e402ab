"""A tenant's cache as one file: export it, import it here or on another node (issue 12 item 5).

The format: gateway/export_format.py.

Records come in chain order, parents first (the tier's `export_records`), so any
prefix of the frames is prefix-closed (R6): an import that stops early leaves no
block whose parent is missing. Only the geometries the exporting server serves
are written (the header lists them; blocks of an older codec age out instead).

Both directions run on the server's event loop, so the service keeps answering
while they work: file I/O through aiofiles, LMDB reads and writes in the tier's
executor, compression and checksums in threads. Memory is bounded by a few frames
(writing: two frames' records of `frame_bytes` and one compressed frame; reading: one
frame, at most `MAX_FRAME_BYTES`).

An export writes `<path>.partial` and renames it to `path` once complete and
fsync'd, so `path` never names half a file. An import first checks every
frame's checksum and the trailer (nothing is written from a damaged or cut
file: the error names the frame and its offset), then writes frame by frame,
each frame's blocks in one tier call (durable when it returns: R1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import xxhash

from gateway import export_format as fmt
from gateway.export_format import (
    FORMAT,
    FORMAT_VERSION,
    MAGIC,
    MAX_FRAME_BYTES,
    SUM,
    TRAILER,
    BlockRecord,
    FrameReader,
)
from gateway.validate import Layout
from kvstore import geometry as geometries
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound
from tiers.store import ManagedStore

#: Block data per frame when exporting: about 140 V4.1-Flash blocks of 64 tokens.
DEFAULT_FRAME_BYTES = 8 << 20


@dataclass(frozen=True, kw_only=True)
class ExportCounts:
    """What an export wrote: `records` blocks in `frames` frames, `file_bytes` on disk."""

    tenant: str
    frames: int
    records: int
    data_bytes: int
    file_bytes: int
    by_fingerprint: dict[str, int] = field(default_factory=dict)
    #: Blocks of geometries this server does not serve (an older codec's): not written.
    skipped: int = 0

    @property
    def bytes(self) -> int:
        """The file's size (ExportTenantResponse.bytes)."""
        return self.file_bytes


@dataclass(frozen=True, kw_only=True)
class ImportCounts:
    """What an import read (`records`) and wrote (`written`: blocks not already stored)."""

    tenant: str
    frames: int
    records: int
    written: int
    #: Records of geometries this server does not serve: not written.
    skipped: int = 0


# -- writing --


def served_layouts(tier: ManagedStore, layouts: Mapping[str, Layout] | None) -> list[Layout]:
    """The layouts given, or those the server builds: every registered geometry in the tier's block size."""
    if layouts is not None:
        return list(layouts.values())
    return [Layout.of(g, tier.settings.block_tokens) for g in geometries.REGISTRY.values()]


async def export_tenant(tier: ManagedStore, tenant: str, path: Path | str, *,
                        layouts: Mapping[str, Layout] | None = None,
                        frame_bytes: int = DEFAULT_FRAME_BYTES) -> ExportCounts:
    """Write `tenant`'s blocks of every served geometry (`layouts`, default: every registered
    geometry in the tier's block size, as the server serves them) to a new file at `path`.

    Raises:
        FailedPrecondition: `path` (or `<path>.partial`) exists already.
        NotFound: `path`'s folder does not exist.
        InvalidArgument: `frame_bytes` is not in [1, MAX_FRAME_BYTES].
    """
    if not 1 <= frame_bytes <= MAX_FRAME_BYTES:
        raise InvalidArgument(f"frame_bytes = {frame_bytes} is not in [1, {MAX_FRAME_BYTES}]")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    await _check_new_file(path, partial)
    served = {layout.geometry.fingerprint: layout for layout in served_layouts(tier, layouts)}
    header = _header_json(tenant, served.values())
    digest = xxhash.xxh3_64()
    try:
        async with aiofiles.open(partial, "xb") as f:
            head = fmt.sealed(MAGIC, header)
            digest.update(head[-SUM.size:])
            await f.write(head)
            tally = await _write_frames(f, tier, tenant, served, frame_bytes, digest)
            trailer = {"frames": tally.frames, "records": tally.records, "data_bytes": tally.data_bytes,
                       "by_fingerprint": tally.by_fingerprint, "digest": digest.hexdigest()}
            await f.write(fmt.sealed(TRAILER, trailer))
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
            file_bytes = await f.tell()
        await aiofiles.os.rename(partial, path)
    except BaseException:
        await _remove_quietly(partial)
        raise
    return ExportCounts(tenant=tenant, frames=tally.frames, records=tally.records, data_bytes=tally.data_bytes,
                        file_bytes=file_bytes, by_fingerprint=tally.by_fingerprint, skipped=tally.skipped)


@dataclass
class _Tally:
    """What the frames written so far hold."""

    frames: int = 0
    records: int = 0
    data_bytes: int = 0
    skipped: int = 0
    by_fingerprint: dict[str, int] = field(default_factory=dict)

    def add(self, batch: list[BlockRecord]) -> None:
        self.frames, self.records = self.frames + 1, self.records + len(batch)
        for r in batch:
            self.data_bytes += len(r.data)
            self.by_fingerprint[r.fingerprint.hex()] = self.by_fingerprint.get(r.fingerprint.hex(), 0) + 1


async def _write_frames(f: Any, tier: ManagedStore, tenant: str, served: Mapping[bytes, Layout], frame_bytes: int,
                        digest: Any) -> _Tally:
    """Every frame of the tenant's blocks, in chain order. The tier reads the next frame's records
    while a thread compresses this one: two frames' records and one compressed frame in memory."""
    tally = _Tally()
    source = await tier.call(tier.export_records, tenant)
    batch, tally.skipped = await tier.call(_take, source, served, frame_bytes)
    while batch:
        packing = asyncio.ensure_future(asyncio.to_thread(fmt.pack_frame, tally.frames, batch))
        try:
            following, passed = await tier.call(_take, source, served, frame_bytes)
        finally:
            frame = await packing  # also when the read failed: no thread is left behind
        digest.update(frame[fmt.FRAME_HEAD.size:fmt.FRAME_HEAD.size + SUM.size])
        await f.write(frame)
        tally.add(batch)
        tally.skipped += passed
        batch = following
    return tally


async def _check_new_file(path: Path, partial: Path) -> None:
    for p in (path, partial):
        if await aiofiles.os.path.exists(p):
            raise FailedPrecondition(f"export file {p} exists already",
                                     hint="name a new file; an export never overwrites one")
    if not await aiofiles.os.path.isdir(path.parent):
        raise NotFound(f"export folder {path.parent} does not exist on the server",
                       hint="create it, or name a file in an existing folder")


def _header_json(tenant: str, layouts: Any) -> dict[str, Any]:
    return {"format": FORMAT, "version": FORMAT_VERSION, "tenant": tenant, "created_s": time.time(),
            "geometries": [{"name": lay.geometry.name, "fingerprint": lay.geometry.fingerprint.hex(),
                            "block_tokens": lay.block_tokens, "block_bytes": lay.block_bytes} for lay in layouts]}


def _take(source: Iterator[Any], served: Mapping[bytes, Layout], frame_bytes: int) -> tuple[list[BlockRecord], int]:
    """The next frame's records from the tier's iterator (runs in the tier's executor)."""
    batch: list[BlockRecord] = []
    size = skipped = 0
    for item in source:
        record = record_of(item)
        if record.fingerprint not in served:
            skipped += 1
            continue
        batch.append(record)
        size += len(record.data)
        if size >= frame_bytes:
            break
    return batch, skipped


async def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        await aiofiles.os.remove(path)


# -- reading --


def _open(path: Path) -> Any:
    if not path.is_file():
        raise NotFound(f"export file {path} does not exist on the server",
                       hint="the path is the server's: copy the file to the server's disk first")
    return aiofiles.open(path, "rb")


async def verify_file(path: Path | str) -> ImportCounts:
    """Read a whole file and check every frame's checksum and the trailer, writing nothing.

    Raises:
        NotFound, InvalidArgument, FailedPrecondition, DataLoss: as `import_tenant`.
    """
    path = Path(path)
    async with _open(path) as f:
        reader = FrameReader(f, path)
        header = await reader.header()
        frames = records = 0
        async for frame in reader.frames():
            frames, records = frames + 1, records + frame.records
    return ImportCounts(tenant=header.tenant, frames=frames, records=records, written=0)


async def import_tenant(tier: ManagedStore, tenant: str | None, path: Path | str, *,
                        layouts: Mapping[str, Layout] | None = None) -> ImportCounts:
    """Write the blocks of an export file into `tenant`'s cache ("" or None: the file's tenant).

    The whole file is checked first (`verify_file`): a damaged or cut file is
    refused with nothing written. Then each frame's blocks go to the tier in one
    call, parents first; should the file change under the import, it stops at
    the first bad frame, and what it wrote (whole frames, chain order) keeps R6.

    Raises:
        NotFound: no such file on the server.
        InvalidArgument: not an export file.
        FailedPrecondition: a newer format, or this server serves none of its geometries.
        DataLoss: a damaged or cut file, naming the frame (or header, trailer) and its offset.
    """
    path = Path(path)
    await verify_file(path)
    served = {layout.geometry.fingerprint for layout in served_layouts(tier, layouts)}
    async with _open(path) as f:
        reader = FrameReader(f, path)
        header = await reader.header()
        target = tenant or header.tenant
        if not served & {bytes.fromhex(str(g.get("fingerprint", ""))) for g in header.geometries}:
            names = ", ".join(str(g.get("name")) for g in header.geometries)
            raise FailedPrecondition(f"{path} holds blocks of geometries this server does not serve ({names})",
                                     hint="import it on a server that serves them")
        done = ImportCounts(tenant=target, frames=0, records=0, written=0)
        try:
            async for frame in reader.frames():
                batch = await asyncio.to_thread(fmt.unpack_frame, frame, path)
                usable = [r for r in batch if r.fingerprint in served]
                written = await tier.call(tier.import_records, usable, target) if usable else 0
                done = dataclasses.replace(done, frames=done.frames + 1, records=done.records + len(batch),
                                           written=done.written + written,
                                           skipped=done.skipped + len(batch) - len(usable))
        except KVStoreError as exc:  # the file changed since the check, a quota, a full store: say what stays
            exc.message = (f"{exc.message}; the import stopped there, after {done.frames} whole frames "
                           f"({done.records} records, {done.written} blocks written, parents first: R6 holds)")
            exc.args = (exc.message,)
            raise
    return done


def record_of(item: Any) -> BlockRecord:
    """A record of the tier's export iterator (`tiers.export.ExportRecord`) as the file holds it."""
    return BlockRecord(fingerprint=item.fingerprint, block_hash=item.block_hash, parent_hash=item.parent_hash,
                       depth=item.depth, checksum=item.checksum, data=bytes(item.data))
