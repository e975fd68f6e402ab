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


def read_mooncake(path: Path, *, limit: int | None = None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """The requests of a Mooncake trace file, in file order (at most `limit`).

    Raises:
        InvalidArgument: a line that is not JSON or whose fields are not as the format says,
            or a damaged or truncated zstd stream, each naming the file and line.
    """
    out: list[TraceRequest] = []
    name = str(path)
    line_no = 0
    try:
        for line_no, line in enumerate(_lines(path), start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{name}: line {line_no}"
            try:
                r = json.loads(line)
            except json.JSONDecodeError as exc:
                raise fields.bad(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            except UnicodeDecodeError as exc:
                raise fields.bad(where, f"not UTF-8 text ({exc.reason})") from None
            out.append(TraceRequest(session=f"line {line_no}", scope="",
                                    arrival_s=fields.seconds(r, "timestamp", where, scale=1e-3),
                                    input_tokens=fields.count(r, "input_length", where),
                                    output_tokens=fields.count(r, "output_length", where),
                                    block_ids=fields.block_ids(r, "hash_ids", where),
                                    source_block_tokens=block_tokens, where=where))
    except Exception as exc:
        import zstandard

        if isinstance(exc, zstandard.ZstdError | _Truncated):
            raise fields.bad(f"{name}: line {line_no + 1}",
                             f"the zstd stream is damaged or truncated: {exc}") from None
        raise
    return out
