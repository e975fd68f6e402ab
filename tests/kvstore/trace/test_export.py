"""`kvstore trace export`: Mooncake's line format, read back by the Mooncake reader with the same sharing."""

from __future__ import annotations

from pathlib import Path

from kvstore.cli import main
from kvstore.trace.load import load_trace
from kvstore.trace.simulate import SimSettings, Simulation

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_a_mooncake_trace_exports_to_itself(tmp_path: Path) -> None:
    out = tmp_path / "again.jsonl.zst"
    assert main(["trace", "export", str(FIXTURES / "mooncake.jsonl"), "--out", str(out)]) == 0
    before, after = load_trace(FIXTURES / "mooncake.jsonl"), load_trace(out)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens, len(r.block_ids)) for r in after.requests] == [
        (r.arrival_s, r.input_tokens, r.output_tokens, len(r.block_ids)) for r in before.requests]
    sim = SimSettings(swa_ttl_s=0)
    assert Simulation(sim).run(after).total.found_tokens == Simulation(sim).run(before).total.found_tokens


def test_weka_sessions_export_with_their_sharing_at_512_tokens(tmp_path: Path) -> None:
    out = tmp_path / "weka.jsonl"
    main(["trace", "export", str(FIXTURES / "weka_session.json"), "--out", str(out)])
    before, after = load_trace(FIXTURES / "weka_session.json"), load_trace(out)
    assert [r.input_tokens for r in after.requests] == [r.input_tokens for r in before.requests]
    assert all(len(a.block_ids) == -(-len(b.block_ids) // 8) for a, b in zip(after.requests, before.requests,
                                                                              strict=True))
    # found tokens of the export: the original's, rounded down to whole 512-token blocks per request
    sim = SimSettings(swa_ttl_s=0)
    found = Simulation(sim).run(after).total.found_tokens
    assert found % 512 == 0 and 0 < found <= Simulation(sim).run(before).total.found_tokens
