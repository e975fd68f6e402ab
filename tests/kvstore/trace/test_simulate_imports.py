"""`kvstore trace simulate` starts without the clients (docs/BENCHMARKS.md, `kvstore bench trace`): the
simulation runs the planner's decision on virtual time and makes its own Lookup answers
(`kvstore.lookup_result`), so it never needs `kvstore.client`, whose gRPC stubs, fleet routing and the SWA
pool's Redis path were 0.3 s of a 10 s target. A fresh interpreter, so no other test's imports count."""

from __future__ import annotations

import subprocess
import sys

import kvstore.client
from kvstore.lookup_result import LookupResult


def test_the_simulation_imports_no_client() -> None:
    """Seen failing with replay/planner.py importing `Client` from kvstore.client outside TYPE_CHECKING."""
    code = ("import sys, kvstore.trace.simulate, kvstore.trace.command\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvstore.client', 'redis'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_client_hands_back_the_same_lookup_result() -> None:
    assert kvstore.client.LookupResult is LookupResult
