"""docs/FLEET.md names, for each rule, the tests that fail without it: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_test_named_in_fleet_md_exists() -> None:
    doc = (ROOT / "docs" / "FLEET.md").read_text()
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b", doc)) - {"test_"}
    fleet_tests = ROOT / "tests" / "kvstore" / "fleet"
    client_tests = ROOT / "tests" / "kvstore" / "client"  # the data path's rules (the fleet client)
    gateway_tests = ROOT / "tests" / "gateway"  # re-replication's node side (F16-F20)
    paths = [*fleet_tests.glob("test_*.py"), *client_tests.glob("test_fleet*.py"), client_tests / "test_retry.py",
             client_tests / "test_started_calls.py", client_tests / "test_lookup_check.py",  # F83's calls, one node's
             *gateway_tests.glob("test_fleet*.py"), gateway_tests / "test_token_bucket.py",
             gateway_tests / "test_policies.py",  # F51's rules on the policies
             *(ROOT / "tests" / "integrations").glob("test_*_fleet.py"),  # F58: the engine adapters
             ROOT / "tests" / "integrations" / "test_vllm_worker_gpu.py",  # F61 on a GPU
             ROOT / "tests" / "kvstore" / "test_wire.py",  # F67: the layers' imports
             ROOT / "tests" / "tiers" / "test_chains.py",  # F75: a node's runs in one read txn
             ROOT / "tests" / "tiers" / "test_stale_copies.py",  # F84: a round's stale drops in one txn
             ROOT / "tests" / "kvstore" / "test_fleet_command.py"]  # F85: the drain's NODE
    defined = {m for path in paths for m in re.findall(r"^def (test_[a-z0-9_]+)", path.read_text(), flags=re.M)}
    files = {path.stem for path in paths}
    assert len(named) > 20, "FLEET.md names its rules' tests"
    assert sorted(named - defined - files) == []
    rules = re.findall(r"^\*\*(F\d+)\.", doc, flags=re.M)
    assert rules == [f"F{i}" for i in range(1, len(rules) + 1)], "rules are numbered F1, F2, ... in order"
