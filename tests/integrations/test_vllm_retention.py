"""A vLLM request's retention hint (docs/RETENTION.md R22): `kv_transfer_params["kvstore_keep_until_s"]` (or
`["kvstore_keep_s"]`) pins the request's prompt: in the Put that stores the prompt's last full block (that Put's
own transaction, no Lookup after it), or, when the prompt was stored already (nothing to Put), by one Lookup
once the request ends. vLLM's REAL v1 Scheduler on CPU against a real `kvstore serve` whose tenants may pin;
the server's own Lookup counter shows no Lookup beyond the planner's one per request.

Harness: test_vllm_support.py (skips, with the reason, only when vLLM cannot be imported).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import kvstore
from tests.children import Child, write_config
from tests.integrations.test_vllm_support import GEO, STORE_BLOCK_TOKENS, Engine, extra, prompt

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


def server_view(store: Child) -> tuple[int, int, int, int]:
    """The server's Lookups answered, and the default tenant's pins and pinned bytes; the block size."""
    with kvstore.Client(store.target, geometry=GEO.name) as client:
        stats = client.stats(tenant="default")
        tenant = next((t for t in stats.tenants if t.tenant == "default"), None)
        pins, pinned = (tenant.pins, tenant.pinned_bytes) if tenant is not None else (0, 0)
        return stats.lookups, pins, pinned, client.block_bytes


def test_a_requests_retention_hint_pins_its_prompt_in_its_put(pinning_store: Child, tmp_path: Path) -> None:
    lookups0, pins0, pinned0, block_bytes = server_view(pinning_store)
    engine = Engine(tmp_path / "model", extra(pinning_store))
    until = time.time() + 200 * 3600.0
    # 90 tokens: 5 full blocks of prompt; 12 outputs complete a 6th block, saved by a later Put (not pinned).
    hinted = engine.add("r1", prompt(90, seed=7), max_tokens=12)
    hinted.kv_transfer_params = {"kvstore_keep_until_s": until}
    engine.add("r2", prompt(60, seed=8), max_tokens=2)  # no hint: no pin
    engine.run()
    engine.drain()  # the puts done: vLLM freed the requests, the worker's grant reported
    side = engine.connector.scheduler
    worker = cast(Any, engine.worker).worker.saves  # the worker-side connector's Saver
    engine.close()
    assert side.kept == {"r1": until}
    assert worker.blocks_saved == 6 + 3  # r1's prompt, its output's block, r2's prompt
    lookups, pins, pinned, _ = server_view(pinning_store)
    assert side.lookups == 2
    assert lookups - lookups0 == side.lookups  # the planner's one per request: the pin asked no Lookup
    assert pins - pins0 == 1  # one pin, r1's, on its prompt's last block (depth 5), not the output's
    assert pinned - pinned0 == 5 * block_bytes


def test_a_hint_for_a_prompt_already_stored_pins_it_by_one_lookup(pinning_store: Child, tmp_path: Path) -> None:
    tokens = prompt(70, seed=11)  # 4 full blocks
    first = Engine(tmp_path / "first", extra(pinning_store))
    first.add("s1", tokens, max_tokens=2)  # stores the prompt, no hint
    first.run()
    first.drain()
    first.close()
    lookups0, pins0, pinned0, block_bytes = server_view(pinning_store)
    engine = Engine(tmp_path / "second", extra(pinning_store))
    hinted = engine.add("s2", tokens, max_tokens=2)
    until = time.time() + 100 * 3600.0
    hinted.kv_transfer_params = {"kvstore_keep_s": until - time.time()}
    engine.run()
    engine.drain()
    side = engine.connector.scheduler
    engine.close()
    assert set(side.kept) == {"s2"} and abs(side.kept["s2"] - until) < 60
    lookups, pins, pinned, _ = server_view(pinning_store)
    assert lookups - lookups0 == side.lookups + 1  # the planner's, and the pin's: nothing was left to Put
    assert pins - pins0 == 1
    assert pinned - pinned0 == 4 * block_bytes
