"""SGLang's DeepSeek-V4 pages through the kvstore backend: 256-token pages as 4 blocks, one cache for every client.

Through SGLang's real factory, its real V4 host pools (test_sglang_v4.py builds them) and a
real `kvstore serve` child, called as SGLang's hybrid cache controller calls a backend:
write-back `batch_set_v2` (side pools, KV-derived) then `batch_set_v1` (the anchor); prefetch
`batch_exists_v2`, then `batch_get_v1` (the anchor) then `batch_get_v2` (the side pools).
The blocks are kvstore's own, made from model rows by `kvstore.codec.block_codec.encode_blocks`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from integrations.sglang_v4 import V4PageLayout, blocks_to_pages
from kvstore.codec.block_codec import encode_blocks
from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import GEO, PoolHitPolicy, PoolName, PoolTransfer, kvstore, sg_utils
from tests.integrations.test_sglang_v4 import V4_PAGE, attach, v41_group

# The shared fixtures: pytest finds them by name in this module.
python_tree_core = support.python_tree_core
server = support.server
client = support.client


@pytest.fixture(autouse=True)
def v41_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang keeps V4.1 rows (SGLANG_DSV4_KV_LAYOUT=v41, SM100): these pools are V4.1's. Its default, v4, keeps
    584-B rows, served under their own layout (test_sglang_v4_layout.py)."""
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")

SIDE = [PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C2_INDEXER, PoolName.DEEPSEEK_V4_C1,
        PoolName.DEEPSEEK_V4_C1_INDEXER]
N = V4_PAGE // 64   # kvstore blocks per page


def tokens_of(seed: int, pages: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(pages * V4_PAGE + 5)]


def model_blocks(seed: int, pages: int) -> torch.Tensor:
    """`pages` x 4 kvstore blocks of the model's rows, from random values (uint8 [n, block_bytes])."""
    g = torch.Generator().manual_seed(seed)
    n = pages * N
    layers = {s: (torch.randn(n * GEO.block_rows(s, 64), GEO.head_dim, generator=g),
                  torch.randn(n * GEO.block_rows(s, 64), GEO.index_head_dim, generator=g))
              for s in GEO.kv_source_layers}
    return encode_blocks(GEO, layers, 64)


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * V4_PAGE, (first_page + pages) * V4_PAGE)


def side_transfers(keys: list[str], host_indices: torch.Tensor) -> list[PoolTransfer]:
    """The KV-derived side pools' transfers, as the controller resolves them (the anchor's keys and indices)."""
    return [PoolTransfer(name=n, keys=keys, host_indices=host_indices, indices_from_pool=PoolName.KV) for n in SIDE]


def put_pages(group: Any, blocks: torch.Tensor, first_page: int, interleaved: bool = False) -> None:
    """Lay kvstore blocks into the side pools as SGLang's pages (sglang_v4.blocks_to_pages, tested against
    SGLang's own readers in test_sglang_v4_rows.py)."""
    layout = V4PageLayout(GEO, interleaved=interleaved)
    for p in range(blocks.shape[0] // N):
        for name, page in blocks_to_pages(layout, blocks[p * N:(p + 1) * N]).items():
            group.get_pool(PoolName(name)).set_from_flat_data_page((first_page + p) * V4_PAGE, page.flatten())


def page_bytes(group: Any, page: int) -> dict[str, bytes]:
    return {str(n): bytes(group.get_pool(n).get_data_page(page * V4_PAGE).numpy()) for n in SIDE}


@pytest.fixture
def v4(server: Child) -> Iterator[tuple[Any, Any]]:
    group = v41_group(pages=6, swa=True)
    backend = attach(server.target, group)
    try:
        yield backend, group
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["v41", "v41_new"])
def test_v4_pages_round_trip_byte_identical_and_are_the_clients_blocks(
        server: Child, client: kvstore.Client, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", layout)
    tokens, blocks = tokens_of(hash(layout) % 1000, 3), model_blocks(1, 3)
    group = v41_group(pages=6)
    backend = attach(server.target, group)
    try:
        put_pages(group, blocks, 0, interleaved=layout == "v41_new")
        saved = [page_bytes(group, p) for p in range(3)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]   # SGLang's page keys, hashed here
        assert keys == [h.hex() for h in client.hashes(tokens)][N - 1::N]    # ... each page's last block
        written = backend.batch_set_v2(side_transfers(keys, slots(0, 3)))
        assert written == {str(n): [True] * 3 for n in SIDE}
        assert backend.batch_set_v1(keys, slots(0, 3)) == [True] * 3
        assert backend.counters()["pages_written"] == 3    # the anchor's call answered from the side pools' Put
        # kvstore.Client finds and reads the same blocks: the model's rows, as any client stores them.
        assert client.lookup(tokens).found_blocks == 3 * N
        assert client.get(tokens).blocks == [bytes(b.numpy()) for b in blocks]
        # Prefetch into pages 3..5, as the controller does.
        assert backend.batch_exists_v2(keys, side_transfers(keys, slots(3, 3))).kv_hit_pages == 3
        assert backend.batch_get_v1(keys, slots(3, 3)) == [True] * 3
        assert backend.batch_get_v2(side_transfers(keys, slots(3, 3))) == {str(n): [True] * 3 for n in SIDE}
        assert backend.counters()["pages_read"] == 3       # the side pools' call answered from the anchor's read
        assert [page_bytes(group, 3 + p) for p in range(3)] == saved
    finally:
        backend.close()


def test_pages_stored_by_kvstore_client_are_read_by_sglang_v4(v4: Any, client: kvstore.Client) -> None:
    backend, group = v4
    tokens, blocks = tokens_of(2, 2), model_blocks(2, 2)
    assert client.put(tokens, blocks).written_blocks == 2 * N
    keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, slots(1, 2)) == [True, True]
    expected = v41_group(pages=2)
    put_pages(expected, blocks, 0)
    assert [page_bytes(group, 1), page_bytes(group, 2)] == [page_bytes(expected, 0), page_bytes(expected, 1)]


def test_a_page_stored_in_part_is_a_miss(v4: Any, client: kvstore.Client) -> None:
    backend, group = v4
    tokens, blocks = tokens_of(3, 2), model_blocks(3, 2)
    assert client.put(tokens[:6 * 64], blocks[:6]).written_blocks == 6      # page 0 whole, page 1: 2 of 4 blocks
    keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
    assert backend.batch_exists(keys) == 1
    assert backend.batch_exists_v2(keys, side_transfers(keys, slots(0, 2))).kv_hit_pages == 1
    assert backend.batch_get_v1(keys, slots(0, 2)) == [True, False]
    assert all(v == bytes(len(v)) for v in page_bytes(group, 1).values())   # nothing half written
    # The client stores the rest: now a whole page, found and read.
    assert client.put(tokens, blocks[6:], first_block=6).written_blocks == 2
    assert backend.batch_exists(keys) == 2
    assert backend.batch_get_v1(keys, slots(2, 2)) == [True, True]


def swa_transfer(keys: list[str], first_page: int) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES,
                        host_indices=slots(first_page, len(keys)))


def test_the_v4_swa_page_ending_a_prefix_is_the_snapshot_of_its_window(v4: Any, client: kvstore.Client) -> None:
    backend, group = v4
    tokens, blocks = tokens_of(4, 2), model_blocks(4, 2)
    keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
    put_pages(group, blocks, 0)
    assert backend.batch_set_v1(keys, slots(0, 2)) == [True, True]
    swa = group.get_pool(PoolName.SWA)
    g = torch.Generator().manual_seed(4)
    window_page = torch.randint(0, 256, (40, V4_PAGE * 528), generator=g, dtype=torch.uint8)
    swa.set_from_flat_data_page(V4_PAGE, window_page.flatten())            # host page 1: positions [256, 512)
    probe = [*side_transfers(keys, slots(0, 2)), swa_transfer(keys[1:], 1)]
    before = backend.batch_exists_v2(keys, probe)
    assert before.kv_hit_pages == 0 and before.extra_pool_hit_pages[PoolName.KV] == 2   # no window yet
    assert backend.batch_set_v2([swa_transfer(keys[1:], 1)]) == {PoolName.SWA.value: [True]}
    # kvstore's snapshot at T = 512: the last 128 rows of every layer, each row [512 B data][16 B scales].
    snap = client.swa.get(tokens[:2 * V4_PAGE])
    assert snap is not None and len(snap) == client.swa.snapshot_bytes(2 * V4_PAGE)
    rows = torch.cat([window_page[:, :V4_PAGE * 512].view(40, V4_PAGE, 512),
                      window_page[:, V4_PAGE * 512:].view(40, V4_PAGE, 16)], dim=-1)
    assert bytes(snap) == bytes(rows[:, V4_PAGE - 128:].contiguous().numpy())
    hit = backend.batch_exists_v2(keys, probe)
    assert hit.kv_hit_pages == 2 and hit.restorable_prefix_pages == [2]
    assert hit.extra_pool_hit_pages[PoolName.SWA] == 2 and hit.extra_pool_hit_pages[str(SIDE[0])] == 2
    # Read back into host page 4: the window's rows as written, the older rows of the page zero.
    assert backend.batch_get_v2([swa_transfer(keys[1:], 4)]) == {PoolName.SWA.value: [True]}
    back = swa.get_data_page(4 * V4_PAGE).view(40, -1)
    back_rows = torch.cat([back[:, :V4_PAGE * 512].view(40, V4_PAGE, 512),
                           back[:, V4_PAGE * 512:].view(40, V4_PAGE, 16)], dim=-1)
    assert torch.equal(back_rows[:, V4_PAGE - 128:], rows[:, V4_PAGE - 128:])
    assert back_rows[:, :V4_PAGE - 128].count_nonzero() == 0
    # Two trailing pages asked (SGLang's retain window): the older page, all before the window, zero.
    swa.set_from_flat_data_page(3 * V4_PAGE, window_page.flatten())
    assert backend.batch_get_v2([swa_transfer(keys, 3)]) == {PoolName.SWA.value: [True, True]}
    assert swa.get_data_page(3 * V4_PAGE).count_nonzero() == 0
    assert torch.equal(swa.get_data_page(4 * V4_PAGE).view(40, -1), back)
    assert backend.batch_get_v2([swa_transfer(keys[:1], 4)]) == {PoolName.SWA.value: [False]}   # none at T=256
