"""What the SGLang backend's tests share (test_sglang_backend.py, test_sglang_pools.py): the skip when
SGLang is missing, a real `kvstore serve` child, the backend made through SGLang's real factory.

Skips only when SGLang cannot be imported (scripts/install_engines.sh writes why into
VENV/engine-skip-sglang.txt when it could not install it; the reason is in the skip).

The host pools are small page stores with the page interface of SGLang's HostKVCache
(`page_size`, `get_data_page`, `get_dummy_flat_data_page`, `set_from_flat_data_page`),
the only part of a host pool a storage backend touches: SGLang's own pool classes
import its whole model-config tree (transformers, torchvision) on import.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.children import Child


def _sglang_missing() -> str | None:
    try:
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except ImportError as exc:
        reason = f"sglang is not importable here ({exc})"
        note = Path(sys.prefix) / "engine-skip-sglang.txt"
        if note.exists():
            reason += f"; scripts/install_engines.sh: {note.read_text().strip()}"
        return reason
    return None


_MISSING = _sglang_missing()
if _MISSING:
    print(f"SKIP tests/integrations/test_sglang_*.py: {_MISSING}", file=sys.stderr)
    pytest.skip(_MISSING, allow_module_level=True)

from sglang.srt.mem_cache import utils as sg_utils  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvstore  # noqa: E402
from integrations import sglang_keys  # noqa: E402
from integrations.sglang_backend import KVStoreHiCacheStorage  # noqa: E402
from kvstore.errors import ConfigError, Unavailable  # noqa: E402
from kvstore.geometry import V4_1_FLASH as GEO  # noqa: E402

#: What the test modules take from here: SGLang's names only after the skip above.
__all__ = ["BLOCK", "GEO", "PAGE", "SWA_PAGE", "ConfigError", "HiCacheStorageConfig", "HiCacheStorageExtraInfo",
           "KVStoreHiCacheStorage", "PagePool", "PoolHitPolicy", "PoolName", "PoolTransfer", "RadixLike",
           "StorageBackendFactory", "Unavailable", "backend", "client", "config", "fill", "kvstore", "prompt",
           "python_tree_core", "server", "sg_utils", "sglang_keys"]

PAGE = 64
BLOCK = GEO.block_bytes(PAGE)                                # 56,960
SWA_PAGE = GEO.num_layers * PAGE * GEO.window_row_bytes      # 40 x 64 x 528


class PagePool:
    """A host pool of `pages` pages of `page_bytes` (SGLang's HostKVCache page interface)."""

    def __init__(self, pages: int, page_bytes: int, page_size: int = PAGE, dtype: torch.dtype = torch.uint8) -> None:
        self.page_size = page_size
        self.item = torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self.buf = torch.zeros(pages * page_size, page_bytes // page_size // self.item, dtype=dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.buf.shape[1] * self.page_size, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[index:index + self.page_size].flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[index:index + self.page_size] = data_page.reshape(self.page_size, -1)

    def page_bytes(self, page: int) -> bytes:
        return bytes(self.buf[page * self.page_size:(page + 1) * self.page_size].contiguous().view(torch.uint8)
                     .flatten().numpy())


@pytest.fixture(autouse=True)
def python_tree_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's Python radix-tree core: its page hashes go through kvstore's keys (the backend refuses the Rust one)."""
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("sglang")
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(root / "data")], root / "logs")
    try:
        yield child
    finally:
        child.kill_if_alive()


def config(target: str, extra: dict[str, Any] | None = None) -> HiCacheStorageConfig:
    """SGLang's storage config as `--hicache-storage-backend-extra-config` makes it (a None value drops the key)."""
    settings = {"backend_name": "kvstore", "module_path": "integrations.sglang_backend",
                "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "target": target, **(extra or {})}
    settings = {k: v for k, v in settings.items() if v is not None}
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="v41-flash", extra_config=settings)


@pytest.fixture
def backend(server: Child) -> Iterator[tuple[KVStoreHiCacheStorage, PagePool]]:
    pool = PagePool(16, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(server.target), pool)
    made.register_mem_pool_host(pool)   # what SGLang's cache controller does next
    assert isinstance(made, KVStoreHiCacheStorage)
    try:
        yield made, pool
    finally:
        made.close()


@pytest.fixture
def client(server: Child) -> Iterator[kvstore.Client]:
    with kvstore.Client(server.target) as c:
        yield c


class RadixLike(list):  # type: ignore[type-arg]
    """Token ids with the namespace fields of SGLang's RadixKey (extra_key, cache_salt)."""

    def __init__(self, tokens: list[int], *, extra_key: str | None = None, cache_salt: str | None = None) -> None:
        super().__init__(tokens)
        self.extra_key, self.cache_salt = extra_key, cache_salt


def prompt(seed: int, pages: int, extra: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(pages * PAGE + extra)]


def fill(pool: PagePool, first_page: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = pool.buf[first_page * PAGE:(first_page + pages) * PAGE].view(torch.uint8)
    rows.copy_(torch.randint(0, 256, rows.shape, generator=g, dtype=torch.uint8))
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE)
