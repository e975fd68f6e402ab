"""SGLang's retention hint (docs/RETENTION.md R22): the backend's `keep_s` extra config, or a call's
`extra_info.extra_info["kvstore_keep_until_s"]`, pins the prefix batch_set_v1 stored, in the Put of its last
page (no Lookup: the server's own counter says so). SGLang's real factory and page hash against a real
`kvstore serve` whose tenants may pin.

Skips only when SGLang cannot be imported (test_sglang_support.py says why).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.children import Child, write_config
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import (
    BLOCK,
    PAGE,
    HiCacheStorageExtraInfo,
    PagePool,
    StorageBackendFactory,
    config,
    fill,
    kvstore,
    prompt,
    sg_utils,
)

python_tree_core = support.python_tree_core


@pytest.fixture(scope="module")
def pinning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("sglang-pins")
    conf = write_config(root / "kvstore.toml", {"store": {"pin_max_hours": 1000.0, "pin_budget_bytes": 1 << 30}})
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(root / "data"), "--config", str(conf)],
                  root / "logs")
    yield child
    child.kill_if_alive()


def _backend(server: Child, **extra: Any) -> tuple[Any, PagePool]:
    pool = PagePool(16, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(server.target, extra), pool)
    made.register_mem_pool_host(pool)
    return made, pool


def _view(server: Child) -> tuple[int, int, int]:
    """The server's Lookups answered, and the default tenant's pins and the bytes they charge."""
    with kvstore.Client(server.target) as c:
        stats = c.stats(tenant="default")
        tenant = next((t for t in stats.tenants if t.tenant == "default"), None)
        return stats.lookups, (tenant.pins if tenant else 0), (tenant.pinned_bytes if tenant else 0)


def test_a_calls_hint_and_the_backends_keep_s_pin_what_was_stored(python_tree_core: Any,
                                                                    pinning_server: Child) -> None:
    lookups0, pins0, bytes0 = _view(pinning_server)
    b, pool = _backend(pinning_server)
    try:
        keys = sg_utils.get_hash_str(prompt(3, 2), None, page_size=PAGE)[:2]
        assert b.batch_set_v1(keys, fill(pool, 0, 2, seed=3)) == [True, True]
        assert _view(pinning_server)[1:] == (pins0, bytes0)  # no hint, no pin
        more = sg_utils.get_hash_str(prompt(4, 2), None, page_size=PAGE)[:2]
        hint = HiCacheStorageExtraInfo(extra_info={"kvstore_keep_until_s": time.time() + 3600})
        assert b.batch_set_v1(more, fill(pool, 2, 2, seed=4), extra_info=hint) == [True, True]
        # One pin, on the chain's last page (depth 2), granted in that page's own Put: not one Lookup.
        assert _view(pinning_server) == (lookups0, pins0 + 1, bytes0 + 2 * BLOCK)
        assert b.counters()["pins"] == 1
    finally:
        b.close()
    kept, pool = _backend(pinning_server, keep_s=3600)
    try:
        keys = sg_utils.get_hash_str(prompt(5, 1), None, page_size=PAGE)[:1]
        assert kept.batch_set_v1(keys, fill(pool, 0, 1, seed=5)) == [True]
        assert _view(pinning_server) == (lookups0, pins0 + 2, bytes0 + 3 * BLOCK)
        assert kept.counters()["pins"] == 1
    finally:
        kept.close()
