"""`kvstore trace simulate`: text charts, a sweep, --json, and one line for a bad trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_a_sweep_prints_each_run_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "simulate", str(FIXTURES / "weka_session.json"), "--swa-ttl", "0,300"]) == 0
    out = capsys.readouterr().out
    assert out.count("hit rate (tokens): lookup 40.7%") == 2
    assert "cap unlimited ttl 0s ret 72h nodes 1" in out and "cap unlimited ttl 300s ret 72h nodes 1" in out


def test_json_holds_every_run_with_its_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "simulate", str(FIXTURES / "mooncake.jsonl"), "--capacity", "200MB,0", "--nodes", "1,2",
                 "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["settings"]["capacity_bytes"], r["settings"]["nodes"]) for r in runs] == [
        (2 * 10**8, 1), (2 * 10**8, 2), (None, 1), (None, 2)]
    assert all(r["buckets"] and 0 < r["total"]["usable_hit_rate"] < 1 for r in runs)
    assert runs[0]["total"]["refused_puts"] > 0 == runs[2]["total"]["refused_puts"]


def test_a_bad_trace_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "simulate", str(FIXTURES / "mooncake_bad_line.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mooncake_bad_line.jsonl: line 4" in err[0]
