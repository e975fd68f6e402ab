"""Mooncake's trace: one JSON object a line, 512-token blocks, ids shared across requests.

Each line holds `timestamp` (milliseconds from the trace's start), `input_length`,
`output_length` and `hash_ids`. Requests are independent (no session is named), so
each is a session of one request; the ids are global, so prompts share blocks across
requests. Read as published (`.jsonl.zst`, streamed) or plain `.jsonl`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstore.trace import fields
from kvstore.trace.requests import TraceRequest

#: Tokens per block id in Mooncake's release.
MOONCAKE_BLOCK_TOKENS = 512


class _Truncated(Exception):
    """The zstd stream ended inside a frame."""


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of every frame in `path`; raises _Truncated when the last frame is cut
    (a stream reader would end quietly, and a cut trace would pass for a shorter one)."""
    import zstandard

    with path.open("rb") as raw:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        in_frame = False
        while chunk := raw.read(1 << 20):
            while chunk:
                in_frame = True
                yield dobj.decompress(chunk)
                chunk = b""
                if dobj.eof:  # a frame ended: what is left starts the next one
                    chunk, dobj, in_frame = dobj.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
        if in_frame and not dobj.eof:
            raise _Truncated("the zstd stream is truncated (its last frame is cut)")


def _lines(path: Path) -> Iterator[bytes]:
    if not path.name.endswith(".zst"):
        with path.open("rb") as f:
            yield from f
        return
    rest = b""
    for chunk in _zstd_chunks(path):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def json_records(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, where, record) for every non-blank line of a JSON-lines file, plain or `.zst`; `where` names the
    file and line, for the caller's own errors.

    Raises:
        InvalidArgument: a line that is not JSON or not UTF-8, or a damaged or truncated zstd stream,
            naming the file and line.
    """
    import zstandard

    name, line_no = str(path), 0
    try:
        for line_no, line in enumerate(_lines(path), start=1):
            if not line.strip():
                continue
            where = f"{name}: line {line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise fields.bad(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            except UnicodeDecodeError as exc:
                raise fields.bad(where, f"not UTF-8 text ({exc.reason})") from None
            yield line_no, where, record
    except (zstandard.ZstdError, _Truncated) as exc:
        raise fields.bad(f"{name}: line {line_no + 1}", f"the zstd stream is damaged or truncated: {exc}") from None


def read_mooncake(path: Path, *, limit: int | None = None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """The requests of a Mooncake trace file, in file order (at most `limit`).

    Raises:
        InvalidArgument: a line that is not JSON or whose fields are not as the format says,
            or a damaged or truncated zstd stream, each naming the file and line.
    """
    out: list[TraceRequest] = []
    for line_no, where, r in json_records(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(TraceRequest(session=f"line {line_no}", scope="",
                                arrival_s=fields.seconds(r, "timestamp", where, scale=1e-3),
                                input_tokens=fields.count(r, "input_length", where),
                                output_tokens=fields.count(r, "output_length", where),
                                block_ids=fields.block_ids(r, "hash_ids", where),
                                source_block_tokens=block_tokens, where=where))
    return out
