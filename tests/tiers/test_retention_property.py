"""Random sequences of put, get, lookup, fill, clock and restart steps on a real LMDB tier,
checked after every step against a plain model of the rules (docs/RETENTION.md):

- R6: stored blocks are prefix-closed (every stored block's parent is stored).
- R4/R5: no block goes while it, or a descendant, was used within `retention_s`.
- R12: a Put that succeeds leaves every block it named stored.
- R8: a Put that is refused changes nothing.
- R15: Lookup reports exactly the leading blocks Get finds.
- R14, R17: the usage totals, and each namespace's, equal the blocks stored.
- R18: a block of the "long" namespace (200 h) stays 200 h after its last use.
- R20: a purge removes the named block and everything below it, and nothing else.
- R23: no block goes while a live pin holds it or a block below it (R6); R24: a pin is granted
  no later than asked nor past the tenant's longest; R22: pins survive restarts (the model keeps them).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus
from tiers.pins import PinLimits

HOUR = 3600.0
BLOCK = 1024
TOKENS = 16
CAPACITY_BLOCKS = 8
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
LONG = BlockScope(V4_1_FLASH.fingerprint, "long")  # a namespace whose retention is 200 h (R18)
LONG_RETENTION_S = 200 * HOUR
ROOT = root_hash(V4_1_FLASH.fingerprint, TOKENS)
PIN_LIMITS = PinLimits(max_s=150 * HOUR, budget_bytes=6 * BLOCK)


def _chain(seed: int, n: int, parent: bytes = ROOT) -> list[bytes]:
    return chain_hashes(list(range(seed, seed + TOKENS * n)), block_tokens=TOKENS, parent=parent)


# Named chains the steps pick from: two trunks, a branch off trunk 0's second block, and a
# chain of the "long" namespace.
_TRUNK0 = _chain(0, 6)
CHAINS: list[list[bytes]] = [_TRUNK0, _chain(1000, 5), _TRUNK0[:2] + _chain(7000, 3, parent=_TRUNK0[1]),
                             _chain(3000, 4)]
SCOPES = [SCOPE, SCOPE, SCOPE, LONG]

_chain_index = st.integers(0, len(CHAINS) - 1)
step = st.one_of(
    st.tuples(st.just("extend"), _chain_index, st.integers(1, 6)),  # a Put after the stored prefix
    st.tuples(st.just("reput"), _chain_index, st.integers(0, 6)),  # the stored prefix again, and more
    st.tuples(st.just("put"), _chain_index, st.integers(0, 5), st.integers(1, 6)),  # anywhere
    st.tuples(st.just("get"), st.integers(0, len(CHAINS) - 1), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("lookup"), st.integers(0, len(CHAINS) - 1)),
    st.tuples(st.just("fill"), st.integers(0, 4)),  # a new chain of n blocks; 0: as many as fit
    st.tuples(st.just("advance"), st.sampled_from([1.0, 59.0, HOUR, 40 * HOUR, 73 * HOUR, 100 * HOUR])),
    st.tuples(st.just("restart"),),
    st.tuples(st.just("purge"), _chain_index, st.integers(0, 5)),  # a block and everything below it
    # A pin on a stored block (a Lookup's ask), or a Put of a chain's first n blocks asking one (R22-R24).
    st.tuples(st.just("pin"), _chain_index, st.integers(0, 5), st.sampled_from([1.0, 50.0, 120.0, 500.0])),
    st.tuples(st.just("pinput"), _chain_index, st.integers(1, 6), st.sampled_from([1.0, 50.0, 120.0, 500.0])),
)


class Model:
    """What the rules say: each known block's parent, and its last use (raised by its descendants' uses)."""

    def __init__(self, retention_s: float) -> None:
        self.retention_s = retention_s
        self.parent: dict[bytes, bytes | None] = {}
        self.last_use: dict[bytes, float] = {}
        self.scope: dict[bytes, BlockScope] = {}
        self.purged: set[bytes] = set()  # removed on purpose (R20), not evicted
        self.pin_until: dict[bytes, float] = {}  # the latest expiry granted on each block (R22)

    def retention(self, h: bytes) -> float:
        return LONG_RETENTION_S if self.scope[h] is LONG else self.retention_s

    def learn(self, hashes: list[bytes], scope: BlockScope = SCOPE) -> None:
        for i, h in enumerate(hashes):
            self.parent[h] = hashes[i - 1] if i else None
            self.scope[h] = scope

    def descends(self, h: bytes, ancestor: bytes) -> bool:
        node: bytes | None = h
        while node is not None and node != ancestor:
            node = self.parent[node]
        return node == ancestor

    def use(self, h: bytes, now: float) -> None:
        node: bytes | None = h
        while node is not None:
            self.last_use[node] = max(self.last_use.get(node, now), now)
            node = self.parent[node]


class Run:
    """One tier under test, its clock and the model."""

    def __init__(self, data_dir: Path) -> None:
        self.clock = ManualClock()
        self.settings = StoreSettings(data_dir=data_dir, capacity_bytes=CAPACITY_BLOCKS * BLOCK, block_tokens=TOKENS)
        self.tier = self.open()
        self.model = Model(self.settings.retention_s)
        self.fills = 0
        for c, scope in zip(CHAINS, SCOPES, strict=True):
            self.model.learn(c, scope)

    def open(self) -> LmdbBlockTier:
        tier = LmdbBlockTier(self.settings, clock=self.clock)
        tier.set_retention_provider(lambda ns: LONG_RETENTION_S if ns == LONG.namespace else 0.0)
        tier.set_pin_limits_provider(lambda ns: PIN_LIMITS)
        return tier

    def granted(self, h: bytes, asked_s: float, until_s: float, now: float) -> None:
        """Check a grant against R24 and remember it."""
        # A block pinned already keeps the later of its two times (R24): the answer may be that earlier grant.
        bound = max(asked_s, self.model.pin_until.get(h, 0.0))
        assert until_s <= bound and until_s <= now + PIN_LIMITS.max_s, "a pin past what was asked or allowed (R24)"
        if until_s:
            self.model.pin_until[h] = max(self.model.pin_until.get(h, 0.0), until_s)

    def stored(self) -> set[bytes]:
        known = list(self.model.parent)
        found = self.tier.read([self.model.scope[h].key(h) for h in known])
        return {h for h, (s, _) in zip(known, found, strict=True) if s is ReadStatus.FOUND}

    def now(self) -> float:
        return self.tier.retention_clock.now()

    def put(self, hashes: list[bytes], start: int, keep_until_s: float | None = None) -> None:
        parent = hashes[start - 1] if start else ROOT
        before = self.stored()
        try:
            result = self.tier.put(self.model.scope[hashes[-1]], parent, hashes[start:],
                                   [bytes([i % 256]) * BLOCK for i in range(len(hashes[start:]))], start == 0,
                                   keep_until_s=keep_until_s)
        except ResourceExhausted:
            assert self.stored() == before, "a refused Put changed the store (R8)"
            return
        except Exception as exc:
            assert "put the prefix first" in str(exc) and hashes[start - 1] not in before
            return
        now = self.now()
        after = self.stored()
        assert set(hashes) <= after, "a Put left a block it named unstored (R12)"
        for h in hashes:
            self.model.use(h, now)
        if keep_until_s is not None:
            assert result.pin is not None
            self.granted(hashes[-1], keep_until_s, result.pin.until_s, now)

    def step(self, op: tuple) -> None:  # type: ignore[type-arg]
        kind = op[0]
        before = self.stored()
        if kind in ("extend", "reput"):
            hashes = CHAINS[op[1]]
            have = self.tier.lookup(SCOPES[op[1]], hashes)[0]
            start = 0 if kind == "reput" or have == len(hashes) else have
            self.put(hashes[: max(min(have + op[2], len(hashes)), start + 1)], start)
        elif kind == "put":
            hashes = CHAINS[op[1]]
            start = min(op[2], len(hashes) - 1)
            self.put(hashes[: max(start + op[3], start + 1)], start)
        elif kind == "fill":
            self.fills += 1
            free = CAPACITY_BLOCKS - self.tier.stats().blocks_stored
            hashes = _chain(100_000 + 1000 * self.fills, op[1] or max(free, 1))
            self.model.learn(hashes)
            self.put(hashes, 0)
        elif kind == "get":
            hashes = CHAINS[op[1]][op[2]: op[2] + op[3]]
            keys = [SCOPES[op[1]].key(h) for h in hashes]
            found = [k for k, (s, _) in zip(keys, self.tier.read(keys), strict=True) if s is ReadStatus.FOUND]
            if found:
                self.tier.touch_soon(found).result(timeout=30)  # as the Get servicer does
                now = self.now()
                for h, k in zip(hashes, keys, strict=True):
                    if k in found:
                        self.model.use(h, now)
        elif kind == "lookup":
            hashes, scope = CHAINS[op[1]], SCOPES[op[1]]
            due: list[bytes] = []
            n = self.tier.lookup(scope, hashes, touch_due=due)[0]
            got = self.tier.read([scope.key(h) for h in hashes])
            leading = next((i for i, (s, _) in enumerate(got) if s is not ReadStatus.FOUND), len(hashes))
            assert n == leading, f"Lookup found {n}, Get finds {leading} leading blocks (R15)"
            if n:
                assert due in ([], [scope.key(hashes[n - 1])])
                self.tier.touch_soon(due).result(timeout=30)  # as the Lookup servicer does
                self.model.use(hashes[n - 1], self.now())
        elif kind == "pin":
            hashes, scope = CHAINS[op[1]], SCOPES[op[1]]
            h = hashes[min(op[2], len(hashes) - 1)]
            asked = self.now() + op[3] * HOUR
            grant = self.tier.pin(scope, h, asked)
            assert grant.until_s or h not in before or grant.why, "a refused pin says why (R24)"
            self.granted(h, asked, grant.until_s, self.now())
        elif kind == "pinput":
            hashes = CHAINS[op[1]][:op[2]]
            self.put(hashes, 0, keep_until_s=self.now() + op[3] * HOUR)
        elif kind == "advance":
            self.clock.advance(op[1])
        elif kind == "restart":
            self.tier.close()
            self.tier = self.open()
        elif kind == "purge":
            hashes = CHAINS[op[1]]
            named = hashes[min(op[2], len(hashes) - 1)]
            below = {h for h in before if self.model.descends(h, named)}
            assert self.tier.purge(self.model.scope[named], [named]) == len(below)
            assert not below & self.stored() and before - self.stored() == below, "purge (R20)"
            self.model.purged |= below
        self.check(before)

    def check(self, before: set[bytes]) -> None:
        after = self.stored()
        for h in after:
            parent = self.model.parent[h]
            assert parent is None or parent in after, "a stored block's parent is gone (R6)"
        now = self.now()
        for h in before - after - self.model.purged:
            assert self.model.last_use[h] <= now - self.model.retention(h), "a block went within retention (R4, R18)"
            held = [g for g, until in self.model.pin_until.items() if until > now and self.model.descends(g, h)]
            assert not held, "a block went while a live pin held it or a block below it (R23, R6)"
        for h in self.model.purged:
            self.model.pin_until.pop(h, None)  # a purged block takes its pin (R26)
        self.model.purged.clear()
        stats = self.tier.stats()
        assert (stats.blocks_stored, stats.bytes_stored) == (len(after), len(after) * BLOCK), "usage totals (R14)"
        for scope in (SCOPE, LONG):
            mine = sum(self.model.scope[h] is scope for h in after)
            usage = self.tier.namespace_usage(scope.namespace)
            assert (usage.blocks, usage.stored_bytes) == (mine, mine * BLOCK), "usage per namespace (R17)"


# Issue 9's two scenarios, always run beside the random ones.
PUT_ON_AN_OLD_PARENT = [("extend", 0, 2), ("advance", HOUR), ("fill", 0), ("advance", 100 * HOUR), ("extend", 0, 4)]
#: A pinned chain past retention, the least recently used, when room is needed (R23).
PINNED_PAST_RETENTION = [("extend", 1, 5), ("pin", 1, 4, 120.0), ("advance", HOUR), ("fill", 0),
                         ("advance", 100 * HOUR), ("fill", 4)]
#: A second, shorter pin on a pinned block: the answer is the first, later time (R24).
PIN_AGAIN_SHORTER = [("pinput", 0, 1, 50.0), ("pinput", 0, 1, 1.0)]
REPUT_WITH_OLD_TAIL = [("extend", 0, 5), ("advance", HOUR), ("fill", 0), ("advance", 100 * HOUR), ("reput", 0, 1)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=30))
@example(steps=PUT_ON_AN_OLD_PARENT)
@example(steps=REPUT_WITH_OLD_TAIL)
@example(steps=PINNED_PAST_RETENTION)
@example(steps=PIN_AGAIN_SHORTER)
def test_r6_r4_r12_random_steps_keep_the_rules(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(Path(tmp) / "store")
        try:
            for op in steps:
                run.step(op)
        finally:
            run.tier.close()
