"""A real `kvstore serve` records its own trace (`[trace] enabled`) while a trace slice is replayed through the
real client and planner; the files it wrote read back as a trace that says what the calls did, that
`kvstore trace simulate`, `replay` and `export` take."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.errors import InvalidArgument
from kvstore.trace import recorded
from kvstore.trace.load import load_trace
from kvstore.trace.mooncake import read_mooncake
from kvstore.trace.replayer import ReplayTally, replay
from kvstore.trace.requests import Trace
from kvstore.trace.simulate import SimSettings, Simulation
from tests.children import Child, write_config
from tests.waiting import wait_until

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
SWA_TTL_S = 300.0
REQUESTS = 4


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Trace, ReplayTally, Child]]:
    """A weka slice replayed against a `kvstore serve` that records, which is then stopped (SIGTERM: it writes
    what is queued); (trace folder, the slice, the replay's tally, the stopped child)."""
    tmp = tmp_path_factory.mktemp("trace-record")
    folder = tmp / "trace"
    cfg = write_config(tmp / "kvstore.toml", {
        "store": {"data_dir": str(tmp / "store"), "capacity_bytes": 4 << 30},
        "swa": {"ttl_s": SWA_TTL_S},
        "trace": {"flush_s": 0.05}})
    child = Child("serve", ["serve", "--config", str(cfg), "--port", "0", "--trace-dir", str(folder)], tmp / "logs")
    try:
        # The child is ready at its "listening" line; the trace line is printed after it, so wait for it.
        wait_until(lambda: f"kvstore trace: recording to {folder}" in child.out_path.read_text(),
                   "the server's trace line")
        trace = load_trace(FIXTURES / "weka_session.json", requests=REQUESTS)
        tally = replay(trace, target=child.target, swa_ttl_s=SWA_TTL_S, concurrency=1, max_requests=REQUESTS)
        assert not tally.errors and tally.requests == REQUESTS, child.log()
        assert child.stop() == 0, child.log()
        yield folder, trace, tally, child
    finally:
        child.kill_if_alive()


def test_each_call_of_the_replay_is_one_record_with_what_it_did(
        recording: tuple[Path, Trace, ReplayTally, Child]) -> None:
    folder, trace, tally, child = recording
    files = recorded.trace_files(folder)
    assert files, child.log()
    got = [r for _, _, r in recorded.records(folder)]
    ops = [r["op"] for r in got]
    # Each plan's leased Lookup (and its re-probes of the pool, unleased), the Gets of what it
    # fetched, the Puts of new blocks, and each SWA snapshot put (over shared memory: recorded one by one).
    lookups = [r for r in got if r["op"] == "lookup" and r["lease_ms"]]
    assert len(lookups) == REQUESTS
    assert ops.count("put") >= 1 and ops.count("get") == len(tally.latencies_s.get("get", []))
    swa_puts = [r for r in got if r["op"] == "swa_put"]
    assert len(swa_puts) == len(tally.latencies_s["swa_put"]) == REQUESTS
    assert all(r["via"] == "shm" and r["stored"] == r["snapshots"] == 1 for r in swa_puts)
    assert {r["tenant"] for r in got} == {"default"}
    # What was found is what the client was told: the tally's found tokens, in blocks.
    head = next(h for _, h, _ in recorded.records(folder))
    assert sum(r["found"] for r in lookups) * head["block_tokens"] == tally.found_tokens
    assert all(len(r["hashes"]) == 2 * head["hash_bytes"] * (p.input_tokens // head["block_tokens"])
               for r, p in zip(lookups, trace.requests, strict=True))
    assert all("swa" in r for r in lookups)  # the planner asks the pool about snapshot points
    puts = [r for r in got if r["op"] == "put"]
    assert sum(r["written"] for r in puts) == tally.put_blocks
    assert all(r["evicted_blocks"] == 0 for r in puts)  # a 4 GiB store evicts nothing here
    # Never a token: the records hold exactly the format's fields.
    # What it wrote and dropped, said at shutdown (and served as kvstore_trace_* series while it ran).
    assert f"kvstore trace: {len(got):,} records written" in child.err_path.read_text() and ", 0 dropped" in child.log()
    assert set().union(*(r.keys() for r in lookups)) == {"t", "op", "tenant", "geometry", "hashes", "found",
                                                                "lease_ms", "swa"}


def test_the_recorded_trace_reads_as_the_slice_it_recorded(recording: tuple[Path, Trace, ReplayTally, Child]) -> None:
    folder, trace, tally, _ = recording
    got = load_trace(folder)
    assert got.kind == "kvstore" and len(got.requests) == REQUESTS
    # A weka session and its subagent: each turn extends its session's last prompt whole, so the
    # recorded Lookups fall into the same sessions again.
    def sessions(t: Trace) -> list[list[int]]:
        return [[i for i, r in enumerate(t.requests) if r.session == name] for name in t.sessions]

    assert len(got.sessions) == 2 and sessions(got) == sessions(trace)
    bt = got.requests[0].source_block_tokens
    assert [r.input_tokens for r in got.requests] == [r.input_tokens // bt * bt for r in trace.requests]
    # The store's rules on the recorded trace find what the server found.
    sim = Simulation(SimSettings(swa_ttl_s=SWA_TTL_S)).run(got)
    assert sim.total.lookup_hit_rate * sim.total.prompt_tokens == pytest.approx(tally.found_tokens)


def test_simulate_and_export_take_the_recorded_folder(recording: tuple[Path, Trace, ReplayTally, Child],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, _, _, _ = recording
    assert main(["trace", "simulate", str(folder), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert runs[0]["total"]["lookup_hit_rate"] > 0
    out = tmp_path / "exported.jsonl.zst"
    assert main(["trace", "export", str(folder), "--out", str(out)]) == 0
    capsys.readouterr()
    mine, theirs = load_trace(folder).requests, read_mooncake(out)
    assert len(theirs) == len(mine)
    assert [round(r.arrival_s, 3) for r in theirs] == [round(r.arrival_s, 3) for r in mine]
    # 64-token blocks become 512-token ones: two prompts share as many whole 512-token blocks as before.
    def common(a: Sequence[int], b: Sequence[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    for (a, b), (x, y) in zip(itertools.combinations(mine, 2), itertools.combinations(theirs, 2), strict=True):
        assert common(x.block_ids, y.block_ids) == common(a.block_ids, b.block_ids) // 8
    assert any(common(x.block_ids, y.block_ids) for x, y in itertools.combinations(theirs, 2))


def test_the_recorded_trace_replays_against_a_server(recording: tuple[Path, Trace, ReplayTally, Child],
                                                     tmp_path: Path) -> None:
    folder, _, _, _ = recording
    cfg = write_config(tmp_path / "kvstore.toml", {"store": {"data_dir": str(tmp_path / "store"),
                                                             "capacity_bytes": 1 << 30}})
    child = Child("serve", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")
    try:
        trace = load_trace(folder)
        tally = replay(trace, target=child.target, swa_ttl_s=SWA_TTL_S, concurrency=1, max_requests=REQUESTS)
        assert not tally.errors and tally.requests == REQUESTS, child.log()
        sim = Simulation(SimSettings(swa_ttl_s=SWA_TTL_S)).run(Trace(name="r", kind="kvstore", requests=tally.done))
        assert abs(sim.total.usable_hit_rate - tally.usable_hit_rate) <= 0.01
    finally:
        child.kill_if_alive()


def test_a_cut_file_names_the_file_and_line(recording: tuple[Path, Trace, ReplayTally, Child],
                                            tmp_path: Path) -> None:
    folder, _, _, _ = recording
    whole = recorded.trace_files(folder)[0].read_bytes()
    cut = tmp_path / recorded.file_name("20260101T000000Z", 1)
    cut.write_bytes(whole[:-7])
    with pytest.raises(InvalidArgument, match=rf"{cut}: line \d+: the zstd stream is damaged or truncated"):
        load_trace(cut)
