"""kvstore's own access trace (`[trace] enabled`): its file format, and the reader that makes it a `Trace`.

The server writes it (gateway/trace_recorder.py); this module says what it writes, so the
writer and the reader cannot drift apart. A trace folder holds files named
`trace-<sequence>-<UTC start>.kvtrace.zst` (the sequence goes on across restarts, so names sort
oldest first), each a run of zstd frames of JSON lines
(one frame per batch the writer wrote: a crash cuts at most the last one). The first
line of each file is its header, then one record per call (docs/CAPACITY.md, "Recording"):

    {"kvstore_trace": 1, "block_tokens": 64, "hash_bytes": 8, "node": "...", "started_s": 1764650000.0}
    {"t": 1764650001.25, "op": "lookup", "tenant": "acme", "geometry": "deepseek-v4", "hashes": "<hex>",
     "found": 12, "lease_ms": 30000, "swa": {"asked": 2, "found": true, "position": 768, "resume_tokens": 768}}
    {"t": ..., "op": "get", "tenant": ..., "geometry": ..., "blocks": 12, "found": 12, "last": "<hex>"}
    {"t": ..., "op": "put", ..., "hashes": "<hex>", "written": 3, "existing": 0, "evicted_blocks": 0,
     "evicted_bytes": 0}
    {"t": ..., "op": "resume", ..., "prompt_tokens": 1000, "found_tokens": 768, "usable_tokens": 768,
     "action": "fetch_snapshot"}
    {"t": ..., "op": "swa_put", ..., "via": "shm", "snapshots": 2, "stored": 2, "hashes": "<hex>"}
    {"t": ..., "op": "swa_get", ..., "via": "grpc", "asked": 1, "found": 1, "hashes": "<hex>"}

`hashes` is the prompt's (or the Put's) block hashes, or an SWA call's snapshot keys, each
cut to its first `hash_bytes` bytes, as one hex string. `via` says how the snapshots went:
"grpc" (SwaPool.Put, Get), "shm" (a same-host client's shared-memory session) or
"redis-direct" (a client's own call in Redis, reported to the server: its `t` is the client's
clock, and `keys_cut`, when there, says how many keys past the first it left out). Never a
token, never a block's bytes.

As a `Trace`, each Lookup is one request: its blocks' ids are its hashes numbered in order
of first appearance per tenant and geometry (a chain hash names its whole prefix, so two
prompts share a leading run of ids exactly where they shared stored blocks), its prompt the
blocks' tokens (`input_tokens` = blocks x block_tokens). A Lookup whose hashes extend an
earlier Lookup's whole prompt continues that one's session (a conversation's next turn);
any other starts a session of its own. A Lookup without a lease whose hashes are exactly
the found prefix of an earlier, longer one is the planner asking the SWA pool again about
that prefix (`replay.planner`'s re-probe), part of the earlier request, not a request.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.trace import fields
from kvstore.trace.mooncake import json_records
from kvstore.trace.requests import TraceRequest

#: The header's key, and the format's version (a reader refuses a version it does not know).
MAGIC = "kvstore_trace"
VERSION = 1
#: How a trace file's name ends.
SUFFIX = ".kvtrace.zst"
#: The record kinds (`op`).
OPS = ("lookup", "get", "put", "resume", "swa_put", "swa_get")
_HEX = re.compile(r"[0-9a-f]*")


def file_name(started: str, sequence: int) -> str:
    """The name of the `sequence`th file of a folder (`started`: its UTC time, YYYYmmddTHHMMSSZ)."""
    return f"trace-{sequence:06d}-{started}{SUFFIX}"


def trace_files(path: Path) -> list[Path]:
    """The trace files at `path` (a file, or a folder's files in name order: oldest first)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    return [path]


def is_recorded(path: Path) -> bool:
    """Whether `path` is one of kvstore's trace files, or a folder holding some."""
    if path.is_dir():
        return any(p.name.endswith(SUFFIX) for p in path.iterdir())
    return path.name.endswith(SUFFIX)


def header(*, block_tokens: int, hash_bytes: int, node: str, started_s: float) -> dict[str, Any]:
    """A file's first line."""
    return {MAGIC: VERSION, "block_tokens": block_tokens, "hash_bytes": hash_bytes, "node": node,
            "started_s": started_s}


def records(path: Path) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(where, header, record) for every record of the trace at `path`, file by file.

    Raises:
        InvalidArgument: a file without its header, a line that is not JSON, a damaged or truncated
            zstd stream, each naming the file and line.
    """
    for file in trace_files(path):
        name = str(file)
        head: dict[str, Any] | None = None
        for _, where, record in json_records(file):
            if head is None:
                head = _header(record, where)
                continue
            yield where, head, record
        if head is None:
            raise fields.bad(f"{name}: line 1", f"empty: no {MAGIC} header (not one of kvstore's trace files?)")


def _header(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or MAGIC not in record:
        raise fields.bad(where, f"the first line is not a {MAGIC} header (not one of kvstore's trace files?)")
    if record[MAGIC] != VERSION:
        raise fields.bad(where, f"{MAGIC} version {record[MAGIC]!r}: this kvstore reads version {VERSION}")
    tokens, width = fields.count(record, "block_tokens", where), fields.count(record, "hash_bytes", where)
    if not tokens or not width:
        raise fields.bad(where, "block_tokens and hash_bytes must be > 0")
    return record


def _text(record: dict[str, Any], name: str, where: str) -> str:
    value = fields.field(record, name, where)
    if not isinstance(value, str):
        raise fields.bad(where, f"{name} must be a string, got {value!r}")
    return value


def _chunks(record: dict[str, Any], width: int, where: str) -> list[str]:
    """The record's hashes, one hex string each."""
    text = _text(record, "hashes", where)
    step = 2 * width
    if len(text) % step or not _HEX.fullmatch(text):
        raise fields.bad(where, f"hashes must be lowercase hex, {step} digits a block; got {len(text)} characters")
    return [text[i:i + step] for i in range(0, len(text), step)]


def read_recorded(path: Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The Lookups of kvstore's own trace at `path` (a file or a folder) as requests, in file order
    (at most `limit`); `arrival_s` counts from the first Lookup. See the module docstring.

    Raises:
        InvalidArgument: a bad file or record (`records`), a Lookup whose fields are not as the format says.
    """
    out: list[TraceRequest] = []
    ids: dict[str, dict[str, int]] = {}
    ends: dict[tuple[str, str], str] = {}  # (scope, a prompt's last hash) -> its session
    found_ends: dict[tuple[str, str], int] = {}  # (scope, a found prefix's last hash) -> its prompt's blocks
    t0: float | None = None
    for where, head, record in records(path):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(record, dict):
            raise fields.bad(where, f"expected a JSON object, got {type(record).__name__}")
        op = _text(record, "op", where)
        if op not in OPS:
            raise fields.bad(where, f"op {op!r} is not one of {', '.join(OPS)}")
        t = fields.seconds(record, "t", where)
        if op != "lookup":
            continue
        scope = f"{_text(record, 'tenant', where)}/{_text(record, 'geometry', where)}"
        chunks = _chunks(record, head["hash_bytes"], where)
        found = fields.count(record, "found", where)
        if found > len(chunks):
            raise fields.bad(where, f"found {found} blocks of {len(chunks)} hashes")
        if not chunks:
            continue  # a prompt shorter than a block (or an SWA-only ask): nothing for the store
        if not record.get("lease_ms") and found_ends.get((scope, chunks[-1]), 0) > len(chunks) == found:
            del found_ends[(scope, chunks[-1])]
            continue  # the planner's re-probe of an earlier prompt's found prefix
        if found:
            found_ends[(scope, chunks[found - 1])] = len(chunks)
        numbered = ids.setdefault(scope, {})
        session = next((ends.pop((scope, c)) for c in reversed(chunks) if (scope, c) in ends), None)
        if session is None:
            session = f"{scope} #{len(out) + 1}"
        ends[(scope, chunks[-1])] = session
        t0 = t if t0 is None else min(t0, t)
        out.append(TraceRequest(session=session, scope=scope, arrival_s=t,
                                input_tokens=len(chunks) * head["block_tokens"], output_tokens=0,
                                block_ids=[numbered.setdefault(c, len(numbered)) for c in chunks],
                                source_block_tokens=head["block_tokens"], where=where))
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in out] if t0 is not None else out
