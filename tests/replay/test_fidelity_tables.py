"""Which fidelity table a planner reads (replay.fidelity_budget.table_for_geometry, docs/PLANNER.md "Fidelity
budgets"): the one measured on its geometry, found by the geometry the table records, so shipping
replay/fidelity/<model>.json is all a geometry needs; real server on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import replay.fidelity_budget as fb
from kvstore.client import Client
from kvstore.geometry import TINY, V4_1_FLASH
from replay.fidelity_budget import FidelityTable, table_for_geometry
from replay.planner import Planner


def fig(value: float) -> dict[str, Any]:
    return {"mean": value / 2, "ci_low": value / 4, "ci_high": value, "worst": value * 2, "resumes": 108,
            "seeds": {"training": ["a", "b"], "prompt": [1, 2, 3]}}


def write_table(folder: Path, name: str, geometry: Any, kl_by_span: dict[int, float],
                generated: str = "2026-12-02T08:00:00Z") -> Path:
    """A table file as `kvstore bench replay --write-table` writes it, with these KL upper bounds."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps({
        "format": 1, "model": name, "geometry": geometry.name, "geometry_config": geometry.to_config(),
        "window": geometry.window, "prompt_seeds": [1, 2, 3], "training": ["a", "b"], "generated": generated,
        "spans": {str(k): {"block boundary": {"kl_per_token": fig(kl), "fastllm_pass": fig(1.0)}}
                  for k, kl in kl_by_span.items()}}))
    return path


def test_the_shipped_tiny_table_is_found_by_its_geometry() -> None:
    table = table_for_geometry(TINY)
    assert table is not None and table.model == "tiny" and table.source == "replay/fidelity/tiny.json"
    assert table_for_geometry(TINY.with_records(next(iter(_layouts())))) is not None  # the record layout aside


def _layouts() -> Any:
    from kvstore.layout import ENGINE_LAYOUTS

    return ENGINE_LAYOUTS


def test_the_newest_table_of_a_geometry_wins_and_a_damaged_one_is_skipped(tmp_path: Path) -> None:
    write_table(tmp_path, "a-old", V4_1_FLASH, {1: 1e-2}, generated="2026-12-01T00:00:00Z")
    write_table(tmp_path, "b-new", V4_1_FLASH, {1: 1e-3}, generated="2026-12-02T00:00:00Z")
    write_table(tmp_path, "c-tiny", TINY, {1: 1e-6}, generated="2026-12-03T00:00:00Z")
    (tmp_path / "d-broken.json").write_text("{not json")
    table = table_for_geometry(V4_1_FLASH, tmp_path)
    assert table is not None and table.model == "b-new"
    assert table_for_geometry(TINY, tmp_path).model == "c-tiny"  # type: ignore[union-attr]
    (tmp_path / "c-tiny.json").unlink()
    assert table_for_geometry(TINY, tmp_path) is None


def test_a_planner_reads_the_table_of_its_geometry(server: Any, client: Client, store: Client, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fb, "TABLE_FOLDER", tmp_path)
    write_table(tmp_path, "v41-shaped", V4_1_FLASH, {1: 1e-2, 2: 1e-4, 4: 1e-8})
    write_table(tmp_path, "tiny-shaped", TINY, {1: 1e-6, 2: 1e-7})
    with Planner(client, report=False, fidelity="kl:1e-3") as planner:  # V4.1-Flash: 1 window's 1e-2 misses
        assert planner.span_choice is not None and planner.span_choice.replay_windows == 2
        assert "v41-shaped.json (model v41-shaped" in planner.span_choice.reason
    with Planner(store, report=False, fidelity="kl:1e-3") as planner:  # the tiny geometry: its own table
        assert planner.span_choice is not None and planner.span_choice.replay_windows == 1
        assert "(model tiny-shaped" in planner.span_choice.reason
    layout = V4_1_FLASH.with_records(next(iter(_layouts())))
    with Client(server.target, geometry=layout.name) as engine, \
            Planner(engine, report=False, fidelity="kl:1e-3") as planner:  # an engine's layout: the model's table
        assert planner.span_choice is not None and planner.span_choice.replay_windows == 2
    (tmp_path / "v41-shaped.json").unlink()
    with Planner(client, report=False, fidelity="kl:1e-3") as planner:  # none for this geometry: exact, said
        assert planner.span_choice is not None and planner.span_choice.replay_windows is None
        assert "no fidelity table for this model" in planner.span_choice.reason
    table = FidelityTable.load(tmp_path / "tiny-shaped.json")
    with Planner(client, report=False, fidelity="kl:1e-3", fidelity_table=table) as planner:  # given: used as is
        assert planner.span_choice is not None and planner.span_choice.replay_windows == 1


def test_a_case_without_resumes_is_refused(tmp_path: Path) -> None:
    path = write_table(tmp_path, "cut", V4_1_FLASH, {1: 0.0})
    data = json.loads(path.read_text())
    data["spans"]["1"]["block boundary"]["kl_per_token"]["resumes"] = 0  # a shard cut before this case
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="case 'block boundary' has no resumes"):
        FidelityTable.load(path)
    assert table_for_geometry(V4_1_FLASH, tmp_path) is None  # skipped, not a KL of 0 meeting every budget
