"""scripts/test.sh installs vLLM and SGLang beside the main test run; these hold what makes that safe.

The install may only add packages under the running tests (scripts/engines/clash.py says when it
would replace one), and every test that reads an engine runs after it (ENGINE_TESTS).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASH = ROOT / "scripts" / "engines" / "clash.py"


def clash(tmp_path: Path, *lines: str) -> str:
    pins = tmp_path / "pins.txt"
    pins.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(CLASH), str(pins)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_pin_at_another_version_than_the_venvs_is_named(tmp_path: Path) -> None:
    have = importlib.metadata.version("pytest")
    assert clash(tmp_path, "pytest==0.0.1  # a comment") == f"pytest {have} (pinned 0.0.1)"


def test_pins_at_the_venvs_version_or_of_absent_packages_are_not_clashes(tmp_path: Path) -> None:
    have = importlib.metadata.version("pytest")
    assert clash(tmp_path, f"PyTest=={have}", "no-such-package-here==1.0", "# only a comment") == ""


def engine_tests() -> list[str]:
    script = (ROOT / "scripts" / "test.sh").read_text()
    found = re.search(r"^ENGINE_TESTS=\(([^)]*)\)", script, re.MULTILINE)
    assert found, "scripts/test.sh names no ENGINE_TESTS"
    return found.group(1).split()


def test_every_test_that_reads_an_engine_runs_after_the_engines_install() -> None:
    listed = engine_tests()
    # triton too: the engines' install brings it, so a test that looks for it would see it come mid-run.
    reads = re.compile(r"\b(vllm|sglang|events_consumer)\b|^\s*(import|from) triton\b|find_spec\([\"']triton"
                       r"|\btriton_interpret\b")
    outside = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path == Path(__file__).resolve() or any(rel == t or rel.startswith(t + "/") for t in listed):
            continue
        if any(reads.search(line) for line in path.read_text().splitlines() if "import" in line):
            outside.append(rel)
    assert outside == [], f"these import an engine but run beside its install: {outside}"
    assert all((ROOT / t).exists() for t in listed), listed
