"""Usage totals per geometry (layout fingerprint): kept with every write, recounted at open,
so blocks an earlier codec wrote show under their own fingerprint until they age out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lmdb

from kvstore.prefix import BlockScope
from tiers.usage import LAYOUT_USAGE_PREFIX

Kit = Any  # tests/tiers/conftest.py
OLD = bytes.fromhex("2d76cb51b8017512")  # the V4.1 fingerprint of the earlier codec


def put_old(kit: Kit, n: int) -> list[bytes]:
    """n blocks under the old fingerprint, as a store written before the formats changed holds them."""
    scope = BlockScope(OLD, "default")
    hashes = kit.chain(7000, n)
    kit.tier.put(scope, kit.root, hashes, [kit.data(i) for i in range(n)], True)
    return [scope.key(h) for h in hashes]


def test_totals_per_geometry_follow_puts_and_drops(kit: Kit) -> None:
    current = kit.scope.fingerprint
    kit.put(kit.chain(0, 3))
    old = put_old(kit, 2)
    assert kit.tier.stats().by_layout == {current: (3, 3 * kit.block_bytes), OLD: (2, 2 * kit.block_bytes)}
    kit.tier.drop_corrupt(old[:1])  # the old chain goes, tail included
    assert kit.tier.stats().by_layout == {current: (3, 3 * kit.block_bytes)}  # no empty entry left
    assert sum(b for b, _ in kit.tier.stats().by_layout.values()) == kit.tier.stats().blocks_stored


def test_totals_per_geometry_survive_a_restart_and_are_recounted_at_open(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit()
    kit.put(kit.chain(0, 2))
    put_old(kit, 3)
    want = kit.tier.stats().by_layout
    kit.tier.close()
    again = make_kit()
    assert again.tier.stats().by_layout == want
    again.tier.close()
    # A store written before per-geometry totals were kept: recounted from the records at open.
    env = lmdb.open(str(kit.tier.settings.data_dir), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"state")) as txn:
        for fingerprint in want:
            assert txn.delete(LAYOUT_USAGE_PREFIX + fingerprint)
    env.close()
    assert make_kit().tier.stats().by_layout == want
