"""`kvstore trace export`: any trace this package reads, written in Mooncake's line format.

One JSON object a line, in arrival order: `timestamp` (ms from the first arrival),
`input_length`, `output_length`, `hash_ids` of 512-token blocks with ids shared
across requests, the format other replay tools read. A 512-token block's id stands
for its whole prefix (the previous block's id and the ids of the trace blocks inside
it), so two exported prompts share a leading run of ids exactly where their prompts
share whole 512-token blocks; weka's per-session ids become global ones that never
meet across sessions. Written plain, or zstd-compressed when the name ends in .zst.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.trace.mooncake import MOONCAKE_BLOCK_TOKENS
from kvstore.trace.requests import Trace


def mooncake_lines(trace: Trace, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[str]:
    """The trace's requests as Mooncake JSON lines (without newlines).

    Raises:
        InvalidArgument: a trace block does not divide the exported block (or the reverse).
    """
    ids: dict[tuple[str, int, tuple[int, ...]], int] = {}
    t0 = trace.requests[0].arrival_s if trace.requests else 0.0
    for r in trace.requests:
        src = r.source_block_tokens
        if block_tokens % src:
            raise InvalidArgument(f"{r.where}: {src}-token trace blocks do not fit {block_tokens}-token blocks")
        per = block_tokens // src
        out, parent = [], -1
        for i in range(0, len(r.block_ids), per):
            key = (r.scope, parent, tuple(r.block_ids[i:i + per]))
            parent = ids.setdefault(key, len(ids))
            out.append(parent)
        yield json.dumps({"timestamp": round((r.arrival_s - t0) * 1000), "input_length": r.input_tokens,
                          "output_length": r.output_tokens, "hash_ids": out})


def write_mooncake(trace: Trace, path: Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """Write the trace to `path` (.jsonl, or .jsonl.zst compressed); the lines written."""
    lines = 0
    if path.name.endswith(".zst"):
        import zstandard

        with path.open("wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as f:
            for line in mooncake_lines(trace, block_tokens=block_tokens):
                f.write(line.encode() + b"\n")
                lines += 1
        return lines
    with path.open("w") as out:
        for line in mooncake_lines(trace, block_tokens=block_tokens):
            out.write(line + "\n")
            lines += 1
    return lines
