"""`kvstore bench replay --parts fidelity` with intervals on the CPU: two weight files (one per training
seed) and two prompt seeds; --json gives every figure with its interval, worst case, resumes and seeds, and
--write-table a table the planner reads (structure only: no timing, no error sizes asserted beyond sanity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

FIELDS = {"mean", "ci_low", "ci_high", "worst", "resumes", "seeds"}
FIGURES = {"one_minus_cosine", "kl_per_token", "top1_agreement", "fastllm_pass"}


def test_bench_replay_prints_intervals_in_json(tmp_path: Path) -> None:
    import dataclasses

    from replay.fidelity_budget import FidelityTable
    from replay.model import TINY_MODEL, ReferenceModel

    weights = []
    for seed in (11, 12):  # two "training seeds": untrained weights of two seeds
        path = tmp_path / f"w{seed}.pt"
        ReferenceModel(dataclasses.replace(TINY_MODEL, seed=seed)).save_weights(path)
        weights.append(str(path))
    table_path = tmp_path / "tiny.json"
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "replay", "--quick", "--json", "--parts", "fidelity",
         "--device", "cpu", "--prompts", "1", "--seeds", "1,2", "--cases", "block boundary", "--spans", "1,2",
         "--tail-prompts", "0", "--weights", ",".join(weights), "--write-table", str(table_path),
         "--write-resumes", str(tmp_path / "resumes.json")],
        capture_output=True, text=True, check=True, timeout=300).stdout
    notes = json.loads(out)["notes"]
    assert notes["fidelity_seeds"] == [1, 2]
    by_label = notes["fidelity_intervals"]["block boundary"]
    assert set(by_label) == {"1x window (8 tokens)", "2x window (16 tokens)", "exact replay vs full prefill (40)"}
    for figures in by_label.values():
        assert set(figures) == FIGURES
        for f in figures.values():
            assert set(f) == FIELDS
            assert f["resumes"] == 4  # 1 prompt x 2 prompt seeds x 2 weight files
            assert f["seeds"] == {"training": weights, "prompt": [1, 2]}
            assert f["ci_low"] <= f["mean"] <= f["ci_high"]
    sanity = by_label["exact replay vs full prefill (40)"]  # exact replay equals the full prefill bit for bit
    assert sanity["kl_per_token"] == {**sanity["kl_per_token"], "mean": 0.0, "ci_high": 0.0, "worst": 0.0}
    assert sanity["fastllm_pass"]["worst"] == 1.0
    bounded = by_label["1x window (8 tokens)"]["kl_per_token"]
    assert bounded["worst"] >= bounded["ci_high"] > 0.0  # the worst resume bounds the mean's interval
    assert "Fidelity with 95% bootstrap intervals" in notes["tables"]["intervals"]

    table = FidelityTable.load(table_path)
    assert sorted(table.spans) == [1, 2] and table.meta["prompt_seeds"] == [1, 2]
    assert table.meta["training"] == weights and "--seeds 1,2" in table.meta["command"]
    assert table.meta["training_logs"] == {w: {} for w in weights}  # no train_tiny log beside these files
    assert table.spans[1]["block boundary"] == by_label["1x window (8 tokens)"]
    # One shard's resumes, merged (scripts/merge_fidelity.py), give the same intervals as the table.
    from kvstore.bench.replay_fidelity import merge_resumes

    merged = merge_resumes([tmp_path / "resumes.json"])
    assert merged["spans"] == json.loads(table_path.read_text())["spans"]
    assert merged["geometry"] == "v41-tiny-fixture" and merged["prompt_seeds"] == [1, 2]


def test_train_seed_reuses_weights_trained_with_the_same_arguments(tmp_path: Path) -> None:
    import argparse

    from kvstore.bench.replay_fidelity import weight_sources
    from replay.model import TINY_MODEL, ReferenceModel

    path = tmp_path / "tiny-seed3-steps5.pt"
    ReferenceModel(TINY_MODEL).save_weights(path)
    path.with_suffix(".json").write_text(json.dumps({"args": {"seed": 3, "steps": 5, "max_minutes": 1.0}}))
    args = argparse.Namespace(weights="", train_seed="3", train_steps=5, train_minutes=1.0, train_dir=tmp_path,
                              device="cpu")
    assert weight_sources(args) == [("train_tiny seed 3 (5 steps)", path)]  # no training ran: it would take minutes
    with pytest.raises(SystemExit, match="--train-seed must be comma-separated integers"):
        weight_sources(argparse.Namespace(**{**vars(args), "train_seed": "x"}))
    with pytest.raises(SystemExit, match="no such file"):
        weight_sources(argparse.Namespace(**{**vars(args), "train_seed": "", "weights": str(tmp_path / "none.pt")}))
