"""Run a test module's `run_checks` in a child under Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter must be on before triton is imported, so the checks cannot run in the test process;
skipped where triton is not installed (the engines' install brings it: scripts/test.sh ENGINE_TESTS).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run_in_interpreter(module: str) -> None:
    """Run `module.run_checks()` in a child under the interpreter; fail with its output unless it passed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (PYTHONPATH=/tmp/triton_site, or any triton >= 3.6)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"from {module} import run_checks; run_checks()"
    child = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-6000:]
    assert "interpreter checks passed" in child.stdout
