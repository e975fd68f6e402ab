"""kvstore's own trace read as a `Trace` (kvstore/trace/recorded.py): requests from Lookups, sessions from
prompts that extend each other, the planner's re-probes left out, Mooncake export; and a bad or cut file
is one error naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kvstore.errors import InvalidArgument
from kvstore.trace import recorded
from kvstore.trace.export import write_mooncake
from kvstore.trace.load import load_trace, trace_kind
from kvstore.trace.mooncake import read_mooncake

HEAD = recorded.header(block_tokens=64, hash_bytes=4, node="n1", started_s=1000.0)


def h(*ids: int) -> str:
    """Hashes of 4 bytes as the format writes them (one hex string)."""
    return "".join(f"{i:08x}" for i in ids)


def lookup(t: float, hashes: str, found: int = 0, *, lease_ms: int = 30_000, tenant: str = "acme") -> dict[str, Any]:
    return {"t": t, "op": "lookup", "tenant": tenant, "geometry": "g", "hashes": hashes, "found": found,
            "lease_ms": lease_ms}


def write(path: Path, *frames: list[Any], head: dict[str, Any] | None = HEAD) -> Path:
    """A trace file of one zstd frame per list of records (the header in the first)."""
    out = b""
    for i, frame in enumerate(frames):
        lines = ([head] if i == 0 and head is not None else []) + frame
        out += zstandard.ZstdCompressor(write_checksum=True).compress(
            b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines))
    path.write_bytes(out)
    return path


def test_lookups_become_requests_with_sessions_and_shared_ids(tmp_path: Path) -> None:
    write(tmp_path / recorded.file_name("20260101T000000Z", 1),
          [lookup(1000.5, h(1, 2)), {"t": 1000.6, "op": "put", "tenant": "acme", "geometry": "g",
                                     "hashes": h(1, 2), "written": 2, "existing": 0, "evicted_blocks": 0,
                                     "evicted_bytes": 0}],
          [lookup(1001.0, h(7, 8, 9)),
           lookup(1002.0, h(1, 2, 3), found=2),         # extends the first prompt whole: its next turn
           lookup(1002.1, h(1, 2), found=2, lease_ms=0),  # the planner's re-probe of that found prefix
           lookup(1003.0, h(1, 2, 3), tenant="other")])   # the same hashes of another tenant: never shared
    assert trace_kind(tmp_path) == "kvstore"
    t = load_trace(tmp_path)
    assert [r.arrival_s for r in t.requests] == [0.0, 0.5, 1.5, 2.5]
    assert [r.block_ids for r in t.requests] == [[0, 1], [2, 3, 4], [0, 1, 5], [0, 1, 2]]
    assert [r.scope for r in t.requests] == ["acme/g"] * 3 + ["other/g"]
    assert t.requests[0].session == t.requests[2].session != t.requests[1].session
    assert len(t.sessions) == 3 and all(r.input_tokens == 64 * len(r.block_ids) for r in t.requests)
    assert t.requests[2].where.endswith(": line 5")
    assert [r.block_ids for r in load_trace(tmp_path, requests=2).requests] == [[0, 1], [2, 3, 4]]


def test_export_round_trips_through_the_mooncake_reader(tmp_path: Path) -> None:
    first = list(range(1, 17))  # 16 blocks of 64 tokens: two of Mooncake's 512
    f = write(tmp_path / recorded.file_name("20260101T000000Z", 1),
              [lookup(1000.0, h(*first)), lookup(1000.25, h(*first, *range(100, 108)), found=16),
               lookup(1001.0, h(*first[:8], *range(200, 208)))])
    out = tmp_path / "out.jsonl"
    assert write_mooncake(load_trace(f), out) == 3
    back = read_mooncake(out)
    assert [r.arrival_s for r in back] == [0.0, 0.25, 1.0]
    assert [r.input_tokens for r in back] == [1024, 1536, 1024]
    assert [list(r.block_ids) for r in back] == [[0, 1], [0, 1, 2], [0, 3]]


@pytest.mark.parametrize(("frames", "line", "what"), [
    ([[lookup(1, h(1)), "{not json"]], 3, "not valid JSON"),
    ([[lookup(1, "abc")]], 2, "hashes must be lowercase hex, 8 digits a block"),
    ([[lookup(1, h(1, 2), found=3)]], 2, "found 3 blocks of 2 hashes"),
    ([[{"t": 1, "op": "scan", "tenant": "a", "geometry": "g"}]], 2, "op 'scan' is not one of"),
    ([[{"op": "lookup", "tenant": "a", "geometry": "g", "hashes": "", "found": 0}]], 2, "missing field 't'"),
])
def test_a_bad_record_names_the_file_and_line(tmp_path: Path, frames: list[list[Any]], line: int,
                                              what: str) -> None:
    f = write(tmp_path / recorded.file_name("20260101T000000Z", 1), *frames)
    with pytest.raises(InvalidArgument, match=f"{f}: line {line}: {what}"):
        load_trace(f)


def test_a_file_without_the_header_or_of_another_version_is_refused(tmp_path: Path) -> None:
    f = write(tmp_path / recorded.file_name("20260101T000000Z", 1), [lookup(1, h(1))], head=None)
    with pytest.raises(InvalidArgument, match=f"{f}: line 1: the first line is not a kvstore_trace header"):
        load_trace(f)
    g = write(tmp_path / recorded.file_name("20260101T000000Z", 2), [lookup(1, h(1))],
              head={**HEAD, "kvstore_trace": 2})
    with pytest.raises(InvalidArgument, match=f"{g}: line 1: kvstore_trace version 2: this kvstore reads version 1"):
        load_trace(g)
    empty = tmp_path / recorded.file_name("20260101T000000Z", 3)
    empty.write_bytes(b"")
    with pytest.raises(InvalidArgument, match=f"{empty}: line 1: empty: no kvstore_trace header"):
        load_trace(empty)


def test_a_file_cut_inside_its_last_frame_names_the_file_and_the_line_after_the_last_whole_one(
        tmp_path: Path) -> None:
    f = write(tmp_path / recorded.file_name("20260101T000000Z", 1),
              [lookup(1, h(1)), lookup(2, h(1, 2), found=1)], [lookup(3, h(1, 2, 3), found=2)])
    whole = f.read_bytes()
    f.write_bytes(whole[:-5])
    with pytest.raises(InvalidArgument, match=f"{f}: line 4: the zstd stream is damaged or truncated"):
        load_trace(f)
    f.write_bytes(whole[:20] + b"\xff" * 8 + whole[28:])
    with pytest.raises(InvalidArgument, match=f"{f}: line 1: the zstd stream is damaged or truncated"):
        load_trace(f)
