"""scripts/train_tiny.py's V4.1-shaped config and time schedule (docs/REPLAY.md "The V4.1-shaped table"):
the named config keeps V4.1-Flash's cache geometry; a run cut by --max-minutes ends its cosine at the cap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from replay.model.config import NAMED_CONFIGS, REDUCED_V41_D256, named_config

ROOT = Path(__file__).resolve().parents[2]


def train_script() -> Any:
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_tiny", module)
    spec.loader.exec_module(module)
    return module


def test_the_v41_shaped_config_is_v41_flash_geometry_at_reduced_width() -> None:
    assert REDUCED_V41_D256.geometry == V4_1_FLASH  # 40 layers, its pattern, window 128: the cache byte for byte
    assert (REDUCED_V41_D256.dim, REDUCED_V41_D256.vocab_size) == (256, 128)
    assert named_config("reduced_v41-d256") is REDUCED_V41_D256 and set(NAMED_CONFIGS) >= {"tiny"}
    with pytest.raises(InvalidArgument, match="unknown model config 'v5'; known: tiny, reduced_v41-d256"):
        named_config("v5")


def test_the_time_schedule_ends_the_cosine_at_the_time_cap() -> None:
    t = train_script()
    args = t.arguments(["--out", "x.pt", "--steps", "100000", "--max-minutes", "2", "--warmup", "10",
                        "--lr", "1e-3", "--time-schedule", "--config", "reduced_v41-d256"])
    assert args.config == "reduced_v41-d256"
    assert t.learning_rate(5, args, 0.0) == pytest.approx(1e-3 * 6 / 10)  # warmup by steps, as before
    assert t.learning_rate(50, args, 60.0) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half the time: half-way
    assert t.learning_rate(50, args, 120.0) == pytest.approx(1e-4)  # at the cap: a tenth of the peak
    by_steps = t.arguments(["--out", "x.pt", "--steps", "100000", "--max-minutes", "2", "--warmup", "10",
                            "--lr", "1e-3"])
    assert t.learning_rate(50, by_steps, 120.0) == pytest.approx(1e-3, rel=1e-6)  # without it: by steps only
