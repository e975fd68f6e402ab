"""R15: Lookup counts only stored blocks that form the chain asked for: what it finds, Get finds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tiers.lmdb_tier import ReadStatus

Kit = Any  # tests/tiers/conftest.py


def leading_found(kit: Kit, hashes: list[bytes]) -> int:
    got = kit.tier.read(kit.keys(hashes))
    return next((i for i, (s, _) in enumerate(got) if s is not ReadStatus.FOUND), len(hashes))


def test_r15_lookup_of_hashes_that_are_not_a_chain(kit: Kit) -> None:
    a = kit.chain(0, 4)
    kit.put(a)
    branch = kit.chain(500, 2, parent=a[1])
    kit.tier.put(kit.scope, a[1], branch, [kit.data(0), kit.data(1)], False)
    cases = {
        "absent first, then stored": ([kit.chain(9000, 1)[0], *a[1:]], 0),
        "one hash repeated": ([a[0], a[0], a[0]], 1),
        "a stored block repeated after its prefix": ([*a[:2], a[1], *a[2:]], 2),
        "stored, but not from the chain's start": (a[1:], 0),
        "reversed": (a[::-1], 0),
        "a block of another branch after the prefix": (a[:2] + branch[1:], 2),
        "the branch itself": (a[:2] + branch, 4),
        "the chain": (a, 4),
    }
    for name, (hashes, want) in cases.items():
        found, lease = kit.tier.lookup(kit.scope, hashes, lease_s=30)
        assert found == want, name
        assert found <= leading_found(kit, hashes), name
        assert (lease is not None) == (found > 0), name
        if lease is not None:
            assert lease.key == kit.scope.key(hashes[found - 1])


def test_r15_lookup_of_a_million_tokens(make_kit: Callable[..., Kit]) -> None:
    n = 1_000_000 // 64  # 15,625 blocks: a 1M-token prompt at 64 tokens a block
    kit = make_kit(n + 1)
    hashes = kit.chain(0, n)
    for start in range(0, n, 2048):
        end = min(start + 2048, n)
        parent = kit.root if start == 0 else hashes[start - 1]
        kit.tier.put(kit.scope, parent, hashes[start:end], [b"\x01" * 8] * (end - start), start == 0)
    assert kit.found(hashes) == n
    assert kit.found([*hashes[:-1], hashes[0]]) == n - 1
