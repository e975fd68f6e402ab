"""The tenant export file's format (gateway/tenant_export.py writes and reads it; issue 12 item 5).

The file (format version 1), every integer little-endian:

    header   MAGIC (16 B) | u32 n | n bytes of JSON | u64 xxh3-64 of the JSON
             JSON: {"format", "version", "tenant", "created_s",
                    "geometries": [{"name", "fingerprint", "block_tokens", "block_bytes"}]}
    frame    b"F" | u32 index | u32 records | u32 raw bytes | u32 compressed bytes
             | u64 xxh3-64 of (the 17 bytes before it + the compressed bytes) | compressed bytes
             the compressed bytes: one zstandard frame of `records` block records:
             fingerprint (8) | hash (32) | parent hash (32) | u32 depth | u64 xxh3-64 of the
             data | u32 data bytes | data
    trailer  b"T" | u32 n | n bytes of JSON | u64 xxh3-64 of the JSON
             JSON: {"frames", "records", "data_bytes", "by_fingerprint": {hex: records},
                    "digest": xxh3-64 (hex) over the header's and every frame's checksums}

Records come in chain order, parents first (the tier's `export_records`), so any
prefix of the frames is prefix-closed (R6): an import that stops early leaves no
block whose parent is missing. Only the geometries the exporting server serves
are written (the header lists them; blocks of an older codec age out instead).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
import zstandard

from kvstore.errors import DataLoss, FailedPrecondition, InvalidArgument
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES

MAGIC = b"KVSTORE-EXPORT\r\n"
FORMAT = "kvstore-tenant-export"
FORMAT_VERSION = 1
#: Largest frame an import reads (raw or compressed): a damaged length cannot claim more memory.
MAX_FRAME_BYTES = 256 << 20
#: zstandard level. FP4 codes barely compress: on the codec's blocks of random-normal KV, level 1
#: kept 98.3% of the bytes at about 1 GB/s on one core, level 3 99.7% at about 230 MB/s.
ZSTD_LEVEL = 1

LEN = struct.Struct("<I")
SUM = struct.Struct("<Q")
FRAME_HEAD = struct.Struct("<cIIII")
RECORD_HEAD = struct.Struct(f"<{FINGERPRINT_BYTES}s{HASH_BYTES}s{HASH_BYTES}sIQI")
FRAME, TRAILER = b"F", b"T"


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockRecord:
    """One block as the file holds it (its tenant is the file's)."""

    fingerprint: bytes
    block_hash: bytes
    parent_hash: bytes
    depth: int
    checksum: int
    data: bytes


@dataclass(frozen=True, kw_only=True)
class ExportHeader:
    """What a file says about itself (its header)."""

    version: int
    tenant: str
    created_s: float
    #: {"name", "fingerprint" (hex), "block_tokens", "block_bytes"} of each geometry the exporter served.
    geometries: list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Frame:
    index: int
    records: int
    raw_bytes: int
    payload: bytes


def sealed(tag: bytes, doc: Mapping[str, Any]) -> bytes:
    """`tag | u32 n | JSON | u64 xxh3-64 of the JSON`: the header's and the trailer's shape."""
    raw = json.dumps(doc, sort_keys=True).encode()
    return tag + LEN.pack(len(raw)) + raw + SUM.pack(xxhash.xxh3_64_intdigest(raw))


def pack_frame(index: int, records: list[BlockRecord]) -> bytes:
    """One frame's bytes: the records compressed, with its head and checksum (runs in a thread)."""
    parts: list[bytes] = []
    for r in records:  # joined once: growing a bytearray frame by frame cost as much as compressing it
        parts.append(RECORD_HEAD.pack(r.fingerprint, r.block_hash, r.parent_hash, r.depth, r.checksum, len(r.data)))
        parts.append(r.data)
    raw = b"".join(parts)
    payload = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    head = FRAME_HEAD.pack(FRAME, index, len(records), len(raw), len(payload))
    checksum = xxhash.xxh3_64(head)
    checksum.update(payload)
    return head + SUM.pack(checksum.intdigest()) + payload


class FrameReader:
    """Reads a file's parts in order, checking each; every error names the part and its offset."""

    def __init__(self, f: Any, path: Path) -> None:
        self.f, self.path, self.offset = f, path, 0
        self.digest = xxhash.xxh3_64()

    def damaged(self, what: str) -> DataLoss:
        return DataLoss(f"export file {self.path} is damaged: {what}",
                        hint="export the tenant again; a frame that fails its checksum is never imported")

    async def exactly(self, n: int, what: str) -> bytes:
        data: bytes = await self.f.read(n)
        if len(data) < n:
            raise self.damaged(f"cut short in {what} at offset {self.offset}: {n} bytes needed, {len(data)} left")
        self.offset += n
        return data

    async def sealed_json(self, what: str) -> dict[str, Any]:
        (n,) = LEN.unpack(await self.exactly(LEN.size, what))
        if n > MAX_FRAME_BYTES:
            raise self.damaged(f"{what} claims {n} bytes")
        raw = await self.exactly(n, what)
        checksum = await self.exactly(SUM.size, what)
        if SUM.unpack(checksum)[0] != xxhash.xxh3_64_intdigest(raw):
            raise self.damaged(f"{what} fails its checksum")
        self.digest.update(checksum)
        try:
            doc = json.loads(raw)
        except ValueError:
            raise self.damaged(f"{what} is not JSON") from None
        if not isinstance(doc, dict):
            raise self.damaged(f"{what} is not a JSON object")
        return doc

    async def header(self) -> ExportHeader:
        magic = await self.f.read(len(MAGIC))
        self.offset += len(magic)
        if magic != MAGIC:
            raise InvalidArgument(f"{self.path} is not a kvstore export file (no {MAGIC!r} at its start)",
                                  hint="name a file written by `kvstore export`")
        doc = await self.sealed_json("the header")
        if doc.get("format") != FORMAT or not isinstance(doc.get("version"), int):
            raise self.damaged("the header does not name the format and its version")
        if doc["version"] > FORMAT_VERSION:
            raise FailedPrecondition(f"{self.path} is format version {doc['version']}; this server reads up to "
                                     f"{FORMAT_VERSION}", hint="import it with the newer kvstore that wrote it")
        try:
            return ExportHeader(version=doc["version"], tenant=str(doc["tenant"]), created_s=float(doc["created_s"]),
                                geometries=[dict(g) for g in doc["geometries"]])
        except (KeyError, TypeError, ValueError):
            raise self.damaged("the header lacks the tenant, its time or its geometries") from None

    async def frames(self) -> Any:
        """Each frame, its checksum verified; then the trailer checked against them (an async iterator)."""
        index = records = 0
        while True:
            at = self.offset
            tag = await self.exactly(1, f"frame {index}")
            if tag == TRAILER:
                break
            if tag != FRAME:
                raise self.damaged(f"frame {index} at offset {at} does not start as a frame")
            head = tag + await self.exactly(FRAME_HEAD.size - 1, f"frame {index}")
            _, got_index, n, raw_bytes, size = FRAME_HEAD.unpack(head)
            if got_index != index or max(raw_bytes, size) > MAX_FRAME_BYTES:
                raise self.damaged(f"frame {index} at offset {at} has a damaged head")
            checksum = await self.exactly(SUM.size, f"frame {index}")
            payload = await self.exactly(size, f"frame {index}")
            if not await asyncio.to_thread(frame_checks, head, payload, SUM.unpack(checksum)[0]):
                raise self.damaged(f"frame {index} at offset {at} fails its checksum")
            self.digest.update(checksum)
            yield Frame(index=index, records=n, raw_bytes=raw_bytes, payload=payload)
            index, records = index + 1, records + n
        digest = self.digest.hexdigest()
        trailer = await self.sealed_json("the trailer")
        if (trailer.get("frames"), trailer.get("records"), trailer.get("digest")) != (index, records, digest):
            raise self.damaged(f"the trailer counts {trailer.get('frames')} frames and {trailer.get('records')} "
                               f"records; the file holds {index} and {records}, or frames were reordered")
        if await self.f.read(1):
            raise self.damaged(f"bytes follow the trailer at offset {self.offset}")


def frame_checks(head: bytes, payload: bytes, expected: int) -> bool:
    checksum = xxhash.xxh3_64(head)
    checksum.update(payload)
    return checksum.intdigest() == expected


def unpack_frame(frame: Frame, path: Path) -> list[BlockRecord]:
    """A frame's records, each block's data checked against its checksum (runs in a thread)."""
    def damaged(what: str) -> DataLoss:
        return DataLoss(f"export file {path} is damaged: frame {frame.index}: {what}",
                        hint="export the tenant again")

    try:
        raw = zstandard.ZstdDecompressor().decompress(frame.payload, max_output_size=frame.raw_bytes)
    except zstandard.ZstdError as exc:
        raise damaged(f"does not decompress ({exc})") from None
    if len(raw) != frame.raw_bytes:
        raise damaged(f"decompresses to {len(raw)} bytes, its head says {frame.raw_bytes}")
    view, at, out = memoryview(raw), 0, []
    for i in range(frame.records):
        if at + RECORD_HEAD.size > len(raw):
            raise damaged(f"record {i} is cut short")
        fingerprint, block_hash, parent, depth, checksum, size = RECORD_HEAD.unpack_from(raw, at)
        at += RECORD_HEAD.size
        data = bytes(view[at:at + size])
        at += size
        if len(data) != size or xxhash.xxh3_64_intdigest(data) != checksum:
            raise damaged(f"record {i} (block {block_hash.hex()[:16]}) fails its checksum")
        out.append(BlockRecord(fingerprint=fingerprint, block_hash=block_hash, parent_hash=parent, depth=depth,
                               checksum=checksum, data=data))
    if at != len(raw):
        raise damaged(f"{len(raw) - at} bytes follow its last record")
    return out
