"""`kvstore bench transcode` (issue 27 item 4): its figures, on the CPU, over a few blocks and a real serve child."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transcode_reports_against_a_real_restore_and_the_exact_shares() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "transcode", "--device", "cpu", "--tokens",
                          "256", "--repeat", "1", "--json", "--no-progress"],
                         capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.stdout)
    figures = {(f["name"], f["baseline"]): f for f in report["figures"]}
    names = {name for name, _ in figures}
    assert {"load transcode against the restore", "load transcode against the kvstore restore",
            "transcode share of a restore", "transcode share of the kvstore restore",
            "save transcode share of a restore"} <= names
    restore = next(f for (name, _), f in figures.items() if name == "load transcode against the kvstore restore")
    assert "direct-cpu" in restore["baseline"] and restore["baseline_value"] > 0
    load = "load transcode (model rows -> v4 blocks, eager)"
    assert (load, "copy of the model-rows bytes (on the device)") in figures
    by_name = {f["name"]: f["value"] for f in report["figures"]}
    assert by_name["exact blocks (SGLang rows of realistic latents)"] == 100.0
    assert by_name["exact blocks (raw-latent rows, vLLM-like)"] == 0.0
    assert report["notes"]["exact_blocks"] == "4 of 4" and report["notes"]["path"] == "eager"
