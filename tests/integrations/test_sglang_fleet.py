"""The SGLang HiCache backend over a fleet (docs/FLEET.md F58): made by SGLang's real dynamic factory with the fleet's
`etcd://` address as the storage backend's `target`, keyed by SGLang's own page hash (`get_hash_str`, which the
backend answers), against one real etcd and three real `kvstore serve` nodes at replication 2 (fleet_support.py).

Skips only when SGLang cannot be imported (test_sglang_support.py says why). The test that kills a node runs last
in the module and leaves two.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from integrations.sglang_backend import KVStoreHiCacheStorage
from integrations.sglang_keys import SEED_KEY_PREFIX, KeyLedger
from kvstore.client.fleet_chain import fleet_hashes
from kvstore.prefix import HASH_BYTES
from tests.integrations import test_sglang_support as support
from tests.integrations.fleet_support import REPLICATION, Fleet, failovers, fleet_fixture, node_errors, spread_prompt
from tests.integrations.test_sglang_support import (
    BLOCK,
    PAGE,
    HiCacheStorageExtraInfo,
    PagePool,
    StorageBackendFactory,
    config,
    fill,
    prompt,
    sg_utils,
)

python_tree_core = support.python_tree_core
#: Full pages (one kvstore block each) of the stored prompt: runs of 3, 3 and 2.
PAGES = 8
#: Blocks per run: not a divisor of a DeepSeek-V4 page's 4 blocks, so pages and calls start inside runs.
RUN_BLOCKS = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from fleet_fixture(tmp_path_factory.mktemp("sglang-fleet"), block_tokens=PAGE, run_blocks=RUN_BLOCKS)


def attach(fleet: Fleet, pages: int = 16) -> tuple[KVStoreHiCacheStorage, PagePool]:
    """A backend as SGLang makes it from `--hicache-storage-backend-extra-config` naming the fleet, its host pool
    registered (what SGLang's cache controller does next)."""
    pool = PagePool(pages, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(fleet.address), pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KVStoreHiCacheStorage)
    return made, pool


def spread(fleet: Fleet, base: int) -> list[int]:
    """A prompt of PAGES pages and a partial one whose runs lie on every node (a test's own: seeds from `base`)."""
    with fleet.client() as client:
        return spread_prompt(fleet, lambda seed: prompt(base + seed, PAGES), client.hashes)[1]


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


def test_f58_a_node_killed_after_the_store_costs_sglang_nothing(fleet: Fleet) -> None:
    """F58, F31, F33: the node the next backend's client reads run 0 from first is SIGKILLed after the store (still in
    the view: its lease has not ended); that backend still finds every page and reads them byte for byte from
    the other replicas."""
    tokens = spread(fleet, 300)
    pages = store_through_sglang(fleet, tokens, seed=9)
    backend, pool = attach(fleet)
    try:
        client = backend.client
        chain = client.hashes(tokens)
        run0 = client.placement(chain)[0]
        victim = client.pool.read_order(chain[0], list(run0.replicas))[0]  # type: ignore[attr-defined]
        next(n for n in fleet.nodes if n.node_id == victim).child.kill9()
        failed = node_errors(victim)
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:PAGES]
        assert backend.batch_exists(keys) == PAGES
        assert read_back(backend, pool, keys, 0) == [True] * PAGES
        assert [pool.page_bytes(i) for i in range(PAGES)] == pages
        assert node_errors(victim) > failed  # the dead node was asked first, and the reads moved on
    finally:
        backend.close()
