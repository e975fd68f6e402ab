"""A vLLM request's retention hint (docs/RETENTION.md R22): `kv_transfer_params["kvstore_keep_until_s"]` (or
`["kvstore_keep_s"]`) pins the prompt's stored prefix once the connector's puts are done. vLLM's REAL v1
Scheduler on CPU against a real `kvstore serve` whose tenants may pin.

Harness: test_vllm_support.py (skips, with the reason, only when vLLM cannot be imported).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore
from tests.children import Child, write_config
from tests.integrations.test_vllm_support import STORE_BLOCK_TOKENS, Engine, extra, prompt

B = STORE_BLOCK_TOKENS


@pytest.fixture(scope="module")
def pinning_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("store")
    config = write_config(root / "kvstore.toml", {"store": {"block_tokens": B, "pin_max_hours": 1000.0,
                                                            "pin_budget_bytes": 1 << 30}})
    child = Child("serve", ["serve", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(root / "data"),
                            "--config", str(config)], root / "logs")
    yield child
    child.kill_if_alive()


def test_a_requests_retention_hint_pins_its_stored_prefix(pinning_store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "model", extra(pinning_store))
    until = time.time() + 200 * 3600.0
    hinted = engine.add("r1", prompt(100, seed=7), max_tokens=3)
    hinted.kv_transfer_params = {"kvstore_keep_until_s": until}
    engine.add("r2", prompt(60, seed=8), max_tokens=2)  # no hint: no pin
    engine.run()
    engine.drain()  # the puts done: vLLM freed the requests, the connector pinned r1's prefix
    side = engine.connector.scheduler
    assert side.kept == {"r1": until}
    engine.close()
    with kvstore.Client(pinning_store.target) as client:
        tenant = next(t for t in client.stats(tenant="default").tenants if t.tenant == "default")
    assert tenant.pins == 1  # in the store: r1's prefix, not r2's
