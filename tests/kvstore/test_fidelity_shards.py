"""Merging `kvstore bench replay --write-resumes` shards into one span table (kvstore.bench.replay_fidelity.
merge_resumes, scripts/merge_fidelity.py; docs/REPLAY.md "The V4.1-shaped table"): every resume pooled per case
and span, intervals recomputed over the pool, weights named by their training logs, mismatched shards refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.bench.replay_fidelity import RESUMES_FORMAT, merge_resumes
from kvstore.geometry import V4_1_FLASH
from replay.fidelity_budget import FidelityTable, choose_span, parse_budget
from replay.fidelity_stats import FIGURES, interval

LABELS = ["1x window (128 tokens)", "2x window (256 tokens)", "exact replay vs full prefill (5120)"]
ROOT = Path(__file__).resolve().parents[2]


def resume(kl: float, passed: bool) -> dict[str, float]:
    return {"one_minus_cosine": kl * 10, "kl_per_token": kl, "top1_agreement": 1.0 - kl, "fastllm_pass": float(passed)}


def shard(path: Path, weights: str, seed: int, kls: list[float], **extra: Any) -> Path:
    """A shard as the bench writes it: one weights file, one prompt seed, the block-boundary case."""
    rows = {LABELS[0]: [resume(k, k < 1e-2) for k in kls], LABELS[1]: [resume(k / 100, True) for k in kls],
            LABELS[2]: [resume(0.0, True) for _ in kls]}
    data = {"format": RESUMES_FORMAT, "model": "reduced_v41-d256", "geometry": V4_1_FLASH.name,
            "geometry_config": V4_1_FLASH.to_config(), "window": 128, "num_layers": 40, "block_tokens": 64,
            "continued_tokens": 32, "spans": [1, 2], "labels": LABELS, "prompt_seeds": [seed], "device": "cuda",
            "command": "kvstore bench replay ...", "cut_by_deadline": False,
            "training_logs": {weights: {"config": "reduced_v41-d256", "seed": int(weights[-4]), "steps_done": 700,
                                        "held_out_loss": 1.2, "device": "NVIDIA H200"}},
            "cases": {"block boundary": {"groups": [[weights, seed]] * len(kls), "values": rows}}}
    data.update(extra)
    path.write_text(json.dumps(data))
    return path


def test_shards_pool_into_one_table_with_intervals_over_every_resume(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.json", "/dev/w/seed0.pt", 1, [1e-3, 2e-2, 5e-3])
    b = shard(tmp_path / "b.json", "/dev/w/seed1.pt", 2, [4e-3, 3e-2])
    table = merge_resumes([a, b])
    one = table["spans"]["1"]["block boundary"]
    names = ["train_tiny --config reduced_v41-d256 seed 0 (700 steps)",
             "train_tiny --config reduced_v41-d256 seed 1 (700 steps)"]
    groups = [(names[0], 1)] * 3 + [(names[1], 2)] * 2
    kls = [1e-3, 2e-2, 5e-3, 4e-3, 3e-2]
    assert one["kl_per_token"] == interval("kl_per_token", kls, groups)  # the pool's interval, not a shard's
    assert one["kl_per_token"]["resumes"] == 5 and set(one) == set(FIGURES)
    assert one["fastllm_pass"]["worst"] == pytest.approx(0.5)  # seed 1's group: 1 of 2 pass
    assert table["training"] == names and table["prompt_seeds"] == [1, 2]
    assert set(table["training_logs"]) == set(names) and table["shards"] == 2
    assert table["geometry"] == V4_1_FLASH.name and table["geometry_config"] == V4_1_FLASH.to_config()
    loaded = FidelityTable.from_dict(table, source="merged")  # the planner reads it
    assert choose_span(parse_budget("kl:1e-3"), loaded).replay_windows == 2
    renamed = merge_resumes([a], labels={"/dev/w/seed0.pt": "seed zero"})
    assert renamed["training"] == ["seed zero"]


def test_shards_of_different_settings_or_not_shards_are_refused(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.json", "/dev/w/seed0.pt", 1, [1e-3])
    b = shard(tmp_path / "b.json", "/dev/w/seed1.pt", 2, [1e-3], continued_tokens=16)
    with pytest.raises(ValueError, match=r"differs from .* in \['continued_tokens'\]"):
        merge_resumes([a, b])
    (tmp_path / "c.json").write_text(json.dumps({"format": 1, "spans": {}}))
    with pytest.raises(ValueError, match="not a --write-resumes file"):
        merge_resumes([tmp_path / "c.json"])
    with pytest.raises(ValueError, match="no shard files"):
        merge_resumes([])


def test_merge_script_writes_the_table_and_says_when_resumes_are_short(tmp_path: Path) -> None:
    a = shard(tmp_path / "a.json", "/dev/w/seed0.pt", 1, [1e-3, 2e-3])
    out = tmp_path / "reduced_v41-d256.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "merge_fidelity.py"), "--out", str(out), str(a)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1  # 2 resumes a case and span, fewer than the 100 asked
    assert ">= 2 resumes a case and span" in run.stdout
    assert "| block boundary | 1x window (128 tokens) | 2 |" in run.stdout
    assert FidelityTable.load(out).spans[2]["block boundary"]["kl_per_token"]["resumes"] == 2
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "merge_fidelity.py"), "--out", str(out),
                          "--min-resumes", "2", str(a)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
