"""docs/RETENTION.md names, for each rule, the tests that fail without it: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_named_in_retention_md_exists() -> None:
    doc = (ROOT / "docs" / "RETENTION.md").read_text()
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b", doc)) - {"test_"}
    defined = {m for path in (ROOT / "tests").rglob("test_*.py")
               for m in re.findall(r"^def (test_[a-z0-9_]+)", path.read_text(), flags=re.M)}
    files = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}
    assert named, "RETENTION.md names no test"
    assert sorted(named - defined - files) == []
