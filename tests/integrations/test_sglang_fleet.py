"""The SGLang HiCache backend over a fleet (docs/FLEET.md F58-F60): made by SGLang's real dynamic factory with the
fleet's `etcd://` address (or its gateway's host:port) as the storage backend's `target`, keyed by SGLang's own
page hash (`get_hash_str`, which the backend answers), against one real etcd, three real `kvstore serve` nodes at
replication 2 whose SWA pool is one real Redis Cluster, and a real `kvstore gateway` in front of them
(fleet_support.py).

Skips only when SGLang cannot be imported (test_sglang_support.py says why). The test that kills a node runs last
in the module and leaves two.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from integrations import sglang_swa
from integrations.sglang_backend import KVStoreHiCacheStorage
from integrations.sglang_keys import SEED_KEY_PREFIX, KeyLedger
from kvstore.client.fleet_chain import fleet_hashes
from kvstore.prefix import HASH_BYTES
from tests.integrations import test_sglang_support as support
from tests.integrations.fleet_support import (
    REPLICATION,
    Fleet,
    failovers,
    first_reads,
    fleet_fixture,
    node_errors,
    spread_prompt,
)
from tests.integrations.test_sglang_pools import swa_transfer
from tests.integrations.test_sglang_support import (
    BLOCK,
    GEO,
    PAGE,
    SWA_PAGE,
    HiCacheStorageExtraInfo,
    PagePool,
    PoolName,
    StorageBackendFactory,
    config,
    fill,
    kvstore,
    prompt,
    sg_utils,
)

python_tree_core = support.python_tree_core
#: Full pages (one kvstore block each) of the stored prompt: runs of 3, 3 and 2.
PAGES = 8
#: Blocks per run: not a divisor of a DeepSeek-V4 page's 4 blocks, so pages and calls start inside runs.
RUN_BLOCKS = 3


#: SWA host pages of a snapshot (the window's trailing pages at a prefix end): 128 tokens of 64-token pages.
WINDOW_PAGES = GEO.window // PAGE
#: The prefix end the stored prompts' window is written at: their last full page.
AT = PAGES * PAGE


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_cluster_session: Any) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("sglang-fleet"), block_tokens=PAGE, run_blocks=RUN_BLOCKS,
                             swa_nodes=redis_cluster_session.startup_nodes, gateway=True)


def attach(fleet: Fleet, pages: int = 16, target: str = "") -> tuple[KVStoreHiCacheStorage, PagePool]:
    """A backend as SGLang makes it from `--hicache-storage-backend-extra-config` naming the fleet (or `target`), its
    host pool registered (what SGLang's cache controller does next)."""
    pool = PagePool(pages, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(target or fleet.address), pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KVStoreHiCacheStorage)
    return made, pool


def attach_hybrid(fleet: Fleet, target: str = "") -> tuple[KVStoreHiCacheStorage, PagePool, PagePool]:
    """A backend of a hybrid model: its KV host pool and its SWA host pool registered through SGLang's per-pool
    interface (v2), as its cache controller does for a sliding-window model."""
    backend, kv = attach(fleet, target=target)
    swa = PagePool(4, SWA_PAGE)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    return backend, kv, swa


def spread(fleet: Fleet, base: int, also: Any = None) -> list[int]:
    """A prompt of PAGES pages and a partial one whose runs lie on every node (a test's own: seeds from `base`)."""
    with fleet.client() as client:
        return spread_prompt(fleet, lambda seed: prompt(base + seed, PAGES), client.hashes, also=also)[1]


def store_hybrid(fleet: Fleet, tokens: list[int], seed: int, target: str = "") -> tuple[list[bytes], bytes]:
    """One hybrid backend writes the prompt's KV pages in two calls (the second from inside a run) and the window's
    trailing SWA pages at its end; returns the KV pages' bytes and the snapshot those SWA pages are."""
    backend, kv, swa = attach_hybrid(fleet, target)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:PAGES]
        assert backend.batch_set_v1(keys[:4], fill(kv, 0, 4, seed=seed)) == [True] * 4
        assert backend.batch_set_v1(keys[4:], fill(kv, 4, PAGES - 4, seed=seed + 1)) == [True] * (PAGES - 4)
        fill(swa, 0, WINDOW_PAGES, seed=seed + 2)
        done = backend.batch_set_v2([swa_transfer(keys[-WINDOW_PAGES:], 0)])
        assert done == {PoolName.SWA.value: [True] * WINDOW_PAGES}
        assert backend.counters()["write_failures"] == 0
        window = sglang_swa.join_pages(GEO, [swa.get_data_page(i * PAGE) for i in range(WINDOW_PAGES)], PAGE)
        return [kv.page_bytes(i) for i in range(PAGES)], bytes(window.numpy())
    finally:
        backend.close()


def assert_resumes(fleet: Fleet, tokens: list[int], pages: list[bytes], window: bytes, target: str = "") -> None:
    """A second hybrid backend finds the prompt restorable at its end (the KV pages and the window there) and reads
    both back byte for byte: the KV pages from the start and from inside run 1, the SWA pages from the snapshot."""
    backend, kv, swa = attach_hybrid(fleet, target)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:PAGES]
        probe = [swa_transfer(keys[-WINDOW_PAGES:], 0)]
        hit = backend.batch_exists_v2(keys, probe)
        assert hit.kv_hit_pages == PAGES and hit.restorable_prefix_pages == [PAGES]
        assert read_back(backend, kv, keys, 0) == [True] * PAGES
        assert [kv.page_bytes(i) for i in range(PAGES)] == pages
        assert read_back(backend, kv, keys, 4) == [True] * (PAGES - 4)  # from block 4: inside run 1
        assert [kv.page_bytes(i) for i in range(PAGES - 4)] == pages[4:]
        assert backend.batch_get_v2(probe) == {PoolName.SWA.value: [True] * WINDOW_PAGES}
        got = sglang_swa.join_pages(GEO, [swa.get_data_page(i * PAGE) for i in range(WINDOW_PAGES)], PAGE)
        assert bytes(got.numpy()) == window
        assert backend.counters()["snapshots_read"] == 1
    finally:
        backend.close()


def store_through_sglang(fleet: Fleet, tokens: list[int], seed: int) -> list[bytes]:
    """One backend writes the prompt's pages back in two calls, as SGLang's controller writes a chain (the second
    starting inside a run); returns the pages' bytes."""
    backend, pool = attach(fleet)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:PAGES]
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys[:4], fill(pool, 0, 4, seed=seed)) == [True] * 4
        assert backend.batch_set_v1(keys[4:], fill(pool, 4, PAGES - 4, seed=seed + 1)) == [True] * (PAGES - 4)
        assert backend.counters()["write_failures"] == 0
        return [pool.page_bytes(i) for i in range(PAGES)]
    finally:
        backend.close()


def read_back(backend: KVStoreHiCacheStorage, pool: PagePool, keys: list[str], first: int,
              extra_info: Any = None) -> list[bool]:
    """batch_get_v1 of keys[first:] into the pool's pages from 0 (as SGLang's prefetch after a host hit)."""
    indices = torch.arange(0, (len(keys) - first) * PAGE)
    return backend.batch_get_v1(keys[first:], indices, extra_info)


def test_f58_the_ledgers_page_keys_are_the_fleets_hashes_wherever_pages_and_runs_are_cut() -> None:
    """F58 (no server): pages of 4 blocks over runs of 3, so pages straddle runs; a chain hashed in one call and
    continued from a page key (SGLang's prior_hash), and a salted chain (its seed an extra key): every key is the
    fleet hash of its page's last block, and the ledger gives back the prompt's tokens and blocks from block 0."""
    root, b, rb, n = bytes(range(HASH_BYTES)), 16, 3, 4
    ledger = KeyLedger(root, b, run_blocks=rb)
    tokens = [(i * 37 + 11) % 50_000 for i in range(7 * n * b + 5)]
    want = fleet_hashes(tokens, root=root, block_tokens=b, run_blocks=rb)
    keys = ledger.hash(tokens[:3 * n * b], None, page_size=n * b)
    keys += ledger.hash(tokens[3 * n * b:], keys[-1], page_size=n * b)
    assert keys[:7] == [h.hex() for h in want[n - 1::n]] and len(keys) == 8  # + the partial page
    assert list(ledger.tokens_to(keys[4]) or []) == tokens[:5 * n * b]
    assert ledger.chain_blocks(keys[2:5]) == (want[:5 * n], 2 * n)
    assert ledger.page(keys[4]).first_block == 4 * n  # type: ignore[union-attr]
    seed = "ab" * 32
    ledger.note_seed(seed)
    salted = ledger.hash(tokens[:2 * n * b], seed, page_size=n * b)
    assert salted == [h.hex() for h in fleet_hashes(tokens[:2 * n * b], root=root, block_tokens=b, run_blocks=rb,
                                                    extra_keys=[SEED_KEY_PREFIX + seed])[n - 1::n]]
    single = KeyLedger(root, b)
    one_server = single.hash(tokens[:3 * n * b], None, page_size=n * b)
    # Run 0's blocks alike, then bridged (F29): every page's last block here is past run 0.
    assert single.page(one_server[0]).blocks[:rb] == tuple(want[:rb])  # type: ignore[union-attr]
    assert not set(one_server) & set(keys)


def test_f58_pages_set_through_sglang_on_a_fleet_are_found_and_read_back_by_another_backend(fleet: Fleet) -> None:
    """F58: SGLang's page keys are the fleet's hashes (run r > 0 bridged, F29); the pages, written in two calls (the
    second from inside a run), land on each run's 2 replicas, over every node; a second backend (its own ledger,
    SGLang hashing the prompt again) finds them all and reads any part of the chain back byte for byte, with
    SGLang's prefix_keys or from its ledger."""
    tokens = spread(fleet, 100)
    with fleet.client() as client:
        chain = client.hashes(tokens)
        pages = store_through_sglang(fleet, tokens, seed=7)
        assert [bytes(b or b"") for b in client.get(tokens).blocks] == pages
        held = fleet.held_by(chain)
        for r, run in enumerate(client.placement(chain)):
            assert len(run.replicas) == REPLICATION
            assert {n for n, found in held.items() if found[r]} == set(run.replicas), f"run {r}"
        assert sum(1 for found in held.values() if any(found)) == 3

    backend, pool = attach(fleet)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:PAGES]
        assert keys == [h.hex() for h in chain]  # SGLang's keys are the fleet's hashes
        moved = failovers()
        assert backend.batch_exists(keys) == PAGES
        assert backend.batch_exists(keys[5:], HiCacheStorageExtraInfo(prefix_keys=keys[:5])) == PAGES - 5
        # From inside run 0, with SGLang's prefix_keys, then from inside run 1 by the ledger's parents.
        assert read_back(backend, pool, keys, 2, HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [True] * 6
        assert [pool.page_bytes(i) for i in range(6)] == pages[2:]
        assert read_back(backend, pool, keys, 4) == [True] * 4
        assert [pool.page_bytes(i) for i in range(4)] == pages[4:]
        page = backend.get(keys[6])  # SGLang's older one-page interface
        assert page is not None and bytes(page.numpy()) == pages[6]
        # Each run was read from a node its placement names: a read placed from the middle of the chain asks
        # nodes that do not hold the run, and finds it only by moving on.
        assert failovers() == moved
    finally:
        backend.close()


def test_f58_deepseek_v4_pages_over_a_fleet_round_trip_byte_identical(fleet: Fleet,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """F58: SGLang's real DeepSeek-V4 pools (256-token pages of 4 blocks over runs of 3: pages start inside runs)
    written through batch_set_v2/v1 over the fleet are the fleet client's blocks, and a second backend finds and
    reads them back into its side pools byte for byte, each run from a node its placement names."""
    from tests.integrations.test_sglang_v4 import V4_PAGE, v41_group
    from tests.integrations.test_sglang_v4 import attach as attach_v4
    from tests.integrations.test_sglang_v4_pages import SIDE, model_blocks, page_bytes, put_pages, side_transfers
    from tests.integrations.test_sglang_v4_pages import slots as v4_slots
    from tests.integrations.test_sglang_v4_pages import tokens_of as v4_tokens

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    n = V4_PAGE // PAGE
    tokens, blocks = v4_tokens(41, 3), model_blocks(41, 3)
    group = v41_group(pages=6)
    backend = attach_v4(fleet.address, group)
    try:
        put_pages(group, blocks, 0)
        saved = [page_bytes(group, p) for p in range(3)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert backend.batch_set_v2(side_transfers(keys, v4_slots(0, 3))) == {str(p): [True] * 3 for p in SIDE}
        assert backend.batch_set_v1(keys, v4_slots(0, 3)) == [True] * 3
    finally:
        backend.close()
    with fleet.client() as client:
        assert keys == [h.hex() for h in client.hashes(tokens)][n - 1::n]
        assert client.get(tokens).blocks == [bytes(b.numpy()) for b in blocks]
    group = v41_group(pages=6)
    backend = attach_v4(fleet.address, group)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        moved = failovers()
        assert backend.batch_exists_v2(keys, side_transfers(keys, v4_slots(3, 3))).kv_hit_pages == 3
        assert backend.batch_get_v1(keys[1:], v4_slots(4, 2)) == [True] * 2  # from page 1: block 4, inside run 1
        assert backend.batch_get_v2(side_transfers(keys[1:], v4_slots(4, 2))) == {str(p): [True] * 2 for p in SIDE}
        assert [page_bytes(group, 4 + p) for p in range(2)] == saved[1:]
        assert failovers() == moved
    finally:
        backend.close()


def test_f58_sglang_v4_rows_shared_as_the_models_over_a_fleet_are_read_by_hopper_and_blackwell(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """F58, share_model_rows: a Hopper backend (SGLang's `v4` rows) stores a prompt of 3 pages (12 blocks over runs of
    3) in two calls, the second from inside run 1, as the model's rows: they are the fleet client's blocks of the
    model geometry and nothing is kept in SGLang's layout; a second Hopper backend finds them and reads them back
    as its own rows byte for byte, from the start and from inside a run, and a Blackwell one (`v41`) reads the
    model's rows, each run from a node its placement names."""
    from tests.integrations.test_sglang_v4 import V4_PAGE, v41_group
    from tests.integrations.test_sglang_v4 import attach as attach_v4
    from tests.integrations.test_sglang_v4_layout import ENGINE, v4_group
    from tests.integrations.test_sglang_v4_pages import N, page_bytes, slots
    from tests.integrations.test_sglang_v4_pages import tokens_of as v4_tokens
    from tests.integrations.test_sglang_v4_share import GEO, codec, fill_v4, load, store, v41_page_bytes

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    tokens = v4_tokens(161, 3)
    group = v4_group(pages=6)
    hopper = attach_v4(fleet.address, group)
    try:
        engine_blocks = fill_v4(group, 0, 3, seed=15)
        saved = [page_bytes(group, p) for p in range(3)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert store(hopper, keys[:1], 0) == [True]
        assert store(hopper, keys[1:], 1) == [True, True]      # from block 4: inside run 1
        c = hopper.counters()
        assert (c["blocks_shared"], c["blocks_engine"], c["write_failures"]) == (3 * N, 0, 0)
    finally:
        hopper.close()
    native = codec.v4_blocks_to_native(GEO, engine_blocks, 64).native
    with fleet.client() as model, fleet.client(geometry=ENGINE.name) as engine:
        assert keys == [h.hex() for h in model.hashes(tokens)][N - 1::N]
        assert model.get(tokens[:3 * V4_PAGE]).blocks == [bytes(b.numpy()) for b in native]
        assert engine.lookup(tokens).found_blocks == 0          # nothing kept twice
    moved = failovers()
    group = v4_group(pages=6)
    hopper = attach_v4(fleet.address, group)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert load(hopper, keys, 0) == 3
        assert [page_bytes(group, p) for p in range(3)] == saved
        assert hopper.batch_get_v1(keys[1:], slots(3, 2)) == [True] * 2   # from page 1: block 4, inside run 1
        assert [page_bytes(group, 3 + p) for p in range(2)] == saved[1:]
        assert hopper.counters()["pages_reencoded"] == 5
    finally:
        hopper.close()
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    bw_group = v41_group(pages=3)
    blackwell = attach_v4(fleet.address, bw_group)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert load(blackwell, keys, 0) == 3
        assert [page_bytes(bw_group, p) for p in range(3)] == v41_page_bytes(native)
    finally:
        blackwell.close()
    assert failovers() == moved


def test_f58_a_sglang_v4_chain_that_turns_inexact_over_a_fleet_moves_to_sglangs_layout_and_is_read_back(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """F58, share_model_rows: two exact pages stored as the model's rows, then an inexact third: the chain moves to
    SGLang's layout whole, hashed there run by run as the fleet does (the fleet client's blocks of the `+sglang-v4`
    geometry); a second Hopper backend finds all 3 pages and reads them back byte for byte (from the start and
    from inside a run), and Blackwell finds only the exact pages."""
    from tests.integrations.test_sglang_v4 import V4_PAGE, v41_group
    from tests.integrations.test_sglang_v4 import attach as attach_v4
    from tests.integrations.test_sglang_v4_layout import ENGINE, v4_group
    from tests.integrations.test_sglang_v4_pages import N, page_bytes, slots
    from tests.integrations.test_sglang_v4_pages import tokens_of as v4_tokens
    from tests.integrations.test_sglang_v4_share import fill_v4, load, store

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    tokens = v4_tokens(171, 3)
    group = v4_group(pages=6)
    hopper = attach_v4(fleet.address, group)
    try:
        exact = fill_v4(group, 0, 2, seed=16)
        raw = fill_v4(group, 2, 1, seed=17, raw=True)            # the third page: no FP4 image
        saved = [page_bytes(group, p) for p in range(3)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert store(hopper, keys[:2], 0) == [True, True]
        assert store(hopper, keys[2:], 2) == [True]              # from block 8: inside run 2
        c = hopper.counters()
        assert (c["blocks_shared"], c["blocks_engine"], c["engine_prefix_moves"]) == (2 * N, N, 1)
    finally:
        hopper.close()
    with fleet.client(geometry=ENGINE.name) as engine:
        assert engine.get(tokens[:3 * V4_PAGE]).blocks == [bytes(b.numpy()) for b in torch.cat((exact, raw))]
    group = v4_group(pages=6)
    hopper = attach_v4(fleet.address, group)
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert load(hopper, keys, 0) == 3                        # the longer chain: SGLang's
        assert [page_bytes(group, p) for p in range(3)] == saved
        assert hopper.batch_get_v1(keys[1:], slots(3, 2)) == [True] * 2   # from page 1: block 4, inside run 1
        assert [page_bytes(group, 3 + p) for p in range(2)] == saved[1:]
    finally:
        hopper.close()
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    blackwell = attach_v4(fleet.address, v41_group(pages=3))
    try:
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:3]
        assert blackwell.batch_exists(keys) == 2                 # the exact pages only, never the inexact one
    finally:
        blackwell.close()
    # No failovers are asserted here: a read asks the model's rows first (rule 3), and page 2, which is only in
    # SGLang's layout, is a miss there that each replica is asked for.


def test_f59_sglang_swa_pages_over_a_fleet_are_one_snapshot_in_the_nodes_shared_pool(fleet: Fleet) -> None:
    """F59: a hybrid backend's trailing SWA pages at the prompt's end are one snapshot in the nodes' shared pool,
    keyed on the fleet hash of the last page (its key), the snapshot a fleet client names there and a hit through
    every node; a second backend finds the prefix restorable there and reads the KV and SWA pages back byte for
    byte."""
    tokens = spread(fleet, 500)
    pages, window = store_hybrid(fleet, tokens, seed=21)
    with fleet.client() as client:
        key = client.swa.key(tokens[:AT], AT)
        assert key == sglang_swa.key_at(client.hashes(tokens)[PAGES - 1], AT)
        for node in fleet.nodes:  # the pool is the nodes' one (F44)
            with kvstore.Client(node.child.target) as direct:
                got = direct.swa.get_many([key])[0]
                assert got is not None and bytes(got) == window, node.node_id
    moved = failovers()
    assert_resumes(fleet, tokens, pages, window)
    assert failovers() == moved


def test_f60_sglang_through_a_gateway_stores_and_reads_back_kv_and_swa_pages(fleet: Fleet) -> None:
    """F60: backends with the gateway's host:port as their target: the KV pages (the second call from inside a run)
    and the window stored through the gateway are the fleet's (a fleet client finds the blocks and the snapshot
    where it names them), and a second backend through the gateway reads both back byte for byte, from inside a
    run too (each Get says where its run starts, F37)."""
    assert fleet.gateway is not None
    gateway = fleet.gateway.target
    tokens = spread(fleet, 600)
    pages, window = store_hybrid(fleet, tokens, seed=31, target=gateway)
    with fleet.client() as client:
        assert [bytes(b or b"") for b in client.get(tokens).blocks] == pages
        got = client.swa.get(tokens[:AT], AT)
        assert got is not None and bytes(got) == window
    assert_resumes(fleet, tokens, pages, window, target=gateway)


def test_f58_a_node_killed_after_the_store_costs_sglang_nothing(fleet: Fleet) -> None:
    """F58, F59, F31, F33, F45: the node the next hybrid backend's client reads run 0 from first, and reaches the SWA
    pool through, is SIGKILLed after the store (still in the view: its lease has not ended); that backend still
    finds every page restorable with its window and reads the KV pages from the other replicas and the window
    through another node of the pool, byte for byte."""
    backend, kv, swa = attach_hybrid(fleet)
    try:
        client = backend.client
        victim = client.swa.node_id  # type: ignore[attr-defined]  # the pool's node it asks first (F45)
        tokens = spread(fleet, 300, also=lambda chain: first_reads(client, chain)[0] == victim)  # type: ignore[arg-type]
        pages, window = store_hybrid(fleet, tokens, seed=9)
        fleet.node(victim).child.kill9()
        failed = node_errors(victim)
        # SGLang's get_hash_str as this backend answers it (the storing backend's close gave SGLang back its own).
        keys = backend.ledger.hash(tokens, None, page_size=PAGE)[:PAGES]
        probe = [swa_transfer(keys[-WINDOW_PAGES:], 0)]
        hit = backend.batch_exists_v2(keys, probe)
        assert hit.kv_hit_pages == PAGES and hit.restorable_prefix_pages == [PAGES]
        assert read_back(backend, kv, keys, 0) == [True] * PAGES
        assert [kv.page_bytes(i) for i in range(PAGES)] == pages
        assert backend.batch_get_v2(probe) == {PoolName.SWA.value: [True] * WINDOW_PAGES}
        got = sglang_swa.join_pages(GEO, [swa.get_data_page(i * PAGE) for i in range(WINDOW_PAGES)], PAGE)
        assert bytes(got.numpy()) == window
        assert node_errors(victim) > failed  # the dead node was asked first, and the reads moved on
        assert client.swa.node_id != victim  # type: ignore[attr-defined]
    finally:
        backend.close()
