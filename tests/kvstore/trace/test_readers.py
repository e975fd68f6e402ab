"""The trace readers against small files cut from the shipped traces (tests/fixtures/traces/)."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
import zstandard

from kvstore.errors import InvalidArgument
from kvstore.prefix import chain_hashes, root_hash
from kvstore.trace.load import load_trace
from kvstore.trace.requests import TraceRequest
from kvstore.trace.tokens import prompt_tokens

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
WEKA = FIXTURES / "weka_session.json"


def _unplaced(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The requests without `where` (which names the file they were read from)."""
    return [replace(r, where="") for r in requests]

MOONCAKE = FIXTURES / "mooncake.jsonl"


def test_weka_subagent_is_its_own_session_at_the_parents_time() -> None:
    trace = load_trace(WEKA)
    doc = json.loads(WEKA.read_text())
    sub = doc["requests"][1]
    assert sub["type"] == "subagent"
    sessions = {r.session for r in trace.requests}
    assert sessions == {"trace_0277", f"trace_0277/{sub['agent_id']}"}
    subs = [r for r in trace.requests if r.session != "trace_0277"]
    assert [r.arrival_s for r in subs] == [sub["t"] + x["t"] for x in sub["requests"]]
    assert [list(r.block_ids) for r in subs] == [x["hash_ids"] for x in sub["requests"]]
    # local ids: one scope for the file, subagents included; arrivals in order across sessions
    assert {r.scope for r in trace.requests} == {"trace_0277"}
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    assert len(trace.requests) == 3 + len(sub["requests"])
    assert all(r.source_block_tokens == 64 for r in trace.requests)


def test_weka_sessions_start_apart_in_a_folder_and_an_archive(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    doc = json.loads(WEKA.read_text())
    for i in range(2):
        (folder / f"trace_{i:04d}.json").write_text(json.dumps(dict(doc, id=f"s{i}")))
    trace = load_trace(folder, session_every_s=100.0)
    firsts = {s: min(r.arrival_s for r in trace.requests if r.session == s) for s in ("s0", "s1")}
    assert firsts == {"s0": 0.0, "s1": 100.0}
    assert {r.scope for r in trace.requests} == {"s0", "s1"}  # local ids: never shared across sessions
    archive = tmp_path / "sessions.tar.zst"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f"traces/{f.name}")
    archive.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    assert _unplaced(load_trace(archive, session_every_s=100.0).requests) == _unplaced(trace.requests)
    assert {r.session for r in load_trace(archive, sessions=1).requests} == {"s0", "s0/agent_001"}


def test_mooncake_lines_in_ms_plain_and_zstd() -> None:
    trace = load_trace(MOONCAKE)
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert trace.kind == "mooncake" and len(trace.requests) == 60
    r = trace.requests[0]
    assert (r.input_tokens, r.output_tokens, list(r.block_ids), r.source_block_tokens) == (
        first["input_length"], first["output_length"], first["hash_ids"], 512)
    last = json.loads(MOONCAKE.read_text().splitlines()[-1])
    assert trace.requests[-1].arrival_s == last["timestamp"] / 1000
    assert _unplaced(load_trace(FIXTURES / "mooncake.jsonl.zst").requests) == _unplaced(trace.requests)
    assert len(load_trace(MOONCAKE, requests=7).requests) == 7


def test_shared_ids_share_our_prefix_hashes_and_512_is_8_blocks() -> None:
    a, b, c = load_trace(MOONCAKE).requests[:3]   # ids [0, 1..13], [0, 14..], [0, 28..]: block 0 shared
    root = root_hash(b"\0" * 8, 64)
    ha, hb = (chain_hashes(list(prompt_tokens(r)), block_tokens=64, parent=root) for r in (a, b))
    assert len(ha) == a.input_tokens // 64
    assert ha[:8] == hb[:8] and ha[8] != hb[8]     # one 512-token id = 8 of our blocks, shared exactly
    assert prompt_tokens(a)[:512] == prompt_tokens(c)[:512]


def test_local_scopes_do_not_share_equal_ids() -> None:
    r = load_trace(WEKA).requests[0]
    other = replace(r, scope="trace_9999")
    assert prompt_tokens(r)[:64] != prompt_tokens(other)[:64]
    assert len(prompt_tokens(r)) == r.input_tokens


def test_a_malformed_mooncake_line_is_named_by_file_and_line() -> None:
    with pytest.raises(InvalidArgument, match=r"mooncake_bad_line\.jsonl: line 4: input_length must be an integer"):
        load_trace(FIXTURES / "mooncake_bad_line.jsonl")


def test_a_truncated_mooncake_file_is_named_by_its_last_line(tmp_path: Path) -> None:
    cut = tmp_path / "cut.jsonl"
    data = MOONCAKE.read_bytes()
    cut.write_bytes(data[: len(data) - 40])
    with pytest.raises(InvalidArgument, match=r"cut\.jsonl: line 60: not valid JSON"):
        load_trace(cut)
    zst = tmp_path / "cut.jsonl.zst"
    packed = (FIXTURES / "mooncake.jsonl.zst").read_bytes()
    zst.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(InvalidArgument, match=r"cut\.jsonl\.zst: line \d+: "):
        load_trace(zst)


def test_a_truncated_weka_file_names_its_line_and_column(tmp_path: Path) -> None:
    cut = tmp_path / "trace_0277.json"
    cut.write_bytes(WEKA.read_bytes()[:5000])
    with pytest.raises(InvalidArgument, match=r"trace_0277\.json: line 1, column \d+: not valid JSON"):
        load_trace(cut)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["requests"][1]["requests"][2].update(hash_ids=[1, "x"]),
     r"requests\[1\]\.requests\[2\]: hash_ids\[1\] must be an integer block id"),
    (lambda d: d["requests"][2].pop("t"), r"requests\[2\]: missing field 't'"),
    (lambda d: d["requests"][0].update(hash_ids=[1, 2.5]), r"requests\[0\]: hash_ids\[1\]"),
    (lambda d: d.update(block_size="64"), r"block_size must be an integer"),
])
def test_a_bad_weka_field_names_the_request(tmp_path: Path, change: object, message: str) -> None:
    doc = json.loads(WEKA.read_text())
    change(doc)  # type: ignore[operator]
    path = tmp_path / "trace_0277.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidArgument, match=message):
        load_trace(path)


def test_an_unknown_path_says_which_forms_are_read(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_trace(tmp_path / "nothing.jsonl")
    (tmp_path / "x.csv").write_text("")
    with pytest.raises(InvalidArgument, match="unknown format"):
        load_trace(tmp_path / "x.csv")
