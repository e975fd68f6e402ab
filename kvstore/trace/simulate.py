"""`Simulation`: a trace run on virtual time through the store's own rules, no bytes stored.

Each request is what a worker does against kvstore (docs/PLANNER.md, docs/WORKER.md):
one Lookup (the found prefix H, the deepest found block refreshed, R5) with the SWA
probes of the planner (the last `snapshot_probes` block boundaries, a reprobe below
them); the planner's own decision (`replay.planner.Planner.decide`: fetch + snapshot,
bounded replay, or full prefill, by its cost model); a Get of the blocks the plan
fetches (each refreshed when due, R5); a Put of the new blocks through the NVMe tier's
own Put transaction (`tiers.puts.commit_puts`: R12's protection, `tiers.eviction.make_room`
under the capacity, `tiers.retention.Retention`'s R4/R6/R7); and a snapshot at the
prompt's end, live for the SWA TTL (the output's end is named only by the next prompt's
ids, so no snapshot is taken there). With N nodes, every run of a chain goes to its
replicas by the fleet's placement (`kvstore.fleet.placement`), each node a store of
`capacity_bytes`.

Virtual time: a request happens at its arrival; nothing waits. Time is never read
from a clock, so a run is a pure function of the trace and the settings.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from gateway.policies import Policy, PolicyTable
from kvstore import geometry as geometries
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.fleet.placement import replicas
from kvstore.lookup_result import LookupResult
from kvstore.prefix import BlockScope
from kvstore.swa_snapshot import resume_length, snapshot_bytes, snapshot_key
from kvstore.trace.chains import ChainKeys
from kvstore.trace.requests import Trace, TraceRequest
from kvstore.trace.sim_index import SimIndex
from kvstore.trace.sim_policies import SimPolicies, SwaQuota
from replay.cost import CostModel
from replay.plan import Action
from replay.planner import Planner
from tiers.block_txn import PutBatch
from tiers.damage import DamagedBlocks
from tiers.eviction import SkippedRuns
from tiers.puts import RoomRules, commit_puts
from tiers.retention import TOUCH_GRANULARITY_S, NamespaceRetention, Retention

#: Capacity that never fills (the default: what the workload would store).
UNLIMITED = 1 << 62
_REPLAYS = (Action.BOUNDED_REPLAY, Action.EXACT_REPLAY)


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """What a simulated deployment is.

    Attributes:
        capacity_bytes: NVMe bytes per node (`store.capacity_bytes`); UNLIMITED: never full.
        retention_hours: the store's retention (R4; at least 72 in a real store, any here).
        swa_ttl_s: how long a snapshot stays live (`swa.ttl_s`); 0: no snapshots.
        nodes: storage nodes; runs are placed over them as the fleet places them.
        replication: copies of each run (fleet replication factor).
        run_blocks: blocks per placement run (`fleet.run_blocks`).
        block_tokens: tokens per block (`store.block_tokens`).
        geometry: the model's layout (block and snapshot sizes).
        cost: the planner's cost model (fetch and recompute rates, replay span).
        snapshot_probes: block boundaries a Lookup asks about for a snapshot (the planner's).
        bucket_s: width of the report's time buckets.
        namespace: the tenant the trace runs as (when `tenants` is 0 and the trace names none).
        tenants: 0: the trace's own tenants (kvstore's recorded trace names each request's), else
            `namespace`; N: the trace's sessions (by id scope, so a subagent stays with its parent) dealt
            in turn to N tenants, "tenant-0" .. "tenant-{N-1}".
        policies: each tenant's own policy fields (`gateway.policies.FIELDS`: retention_hours,
            swa_ttl_s, nvme_quota_bytes, swa_quota_bytes, ...), checked and applied by the gateway's
            policy table (`sim_policies.SimPolicies`); a tenant not named runs on the defaults.
        policies_file: a server's policies.json (`<data_dir>/admin/`), read by the server's reader;
            `policies` are applied over it.
    """

    capacity_bytes: int = UNLIMITED
    retention_hours: float = 72.0
    swa_ttl_s: float = 300.0
    nodes: int = 1
    replication: int = 1
    run_blocks: int = 256
    block_tokens: int = 64
    geometry: geometries.ModelGeometry = geometries.V4_1_FLASH
    cost: CostModel = field(default_factory=CostModel)
    snapshot_probes: int = 4
    bucket_s: float = 3600.0
    namespace: str = "default"
    #: Retentions (hours) whose kept bytes are also reported, from the same run: with room to
    #: spare, retention changes only what a store must keep, not what it finds.
    also_retention_hours: tuple[float, ...] = (168.0,)
    tenants: int = 0
    policies: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    policies_file: Path | None = None

    def __post_init__(self) -> None:
        if self.tenants < 0:
            raise InvalidArgument(f"tenants must be >= 0, got {self.tenants}")
        for name in ("nodes", "replication", "run_blocks", "block_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.capacity_bytes < 0 or self.retention_hours < 0 or self.swa_ttl_s < 0 or self.bucket_s <= 0:
            raise InvalidArgument("capacity, retention and SWA TTL must be >= 0, the bucket > 0")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        return self.geometry.block_bytes(self.block_tokens)


@dataclass(kw_only=True)
class Tally:
    """Counts over one stretch of a run (a bucket, or the whole run). Tokens unless named."""

    requests: int = 0
    prompt_tokens: int = 0
    found_tokens: int = 0
    usable_tokens: int = 0
    replay_tokens: int = 0
    prefill_tokens: int = 0
    resumes: int = 0
    snapshot_resumes: int = 0
    replay_resumes: int = 0
    put_blocks: int = 0
    refused_puts: int = 0
    refused_blocks: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    #: Evicted blocks whose last use was within the store's retention (R4: none; a tenant's longer one, R18,
    #: keeps its own), and within the longest of `also_retention_hours`: what that retention would keep.
    evicted_inside_retention: int = 0
    evicted_inside_longer: int = 0
    swa_refused: int = 0

    def add(self, other: Tally) -> None:
        """Add `other`'s counts into this one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def lookup_hit_rate(self) -> float:
        """Found tokens over prompt tokens."""
        return self.found_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def usable_hit_rate(self) -> float:
        """Tokens the plan served from cache (not computed) over prompt tokens."""
        return self.usable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(kw_only=True)
class Bucket:
    """One stretch of virtual time, and the state at its end."""

    start_s: float
    tally: Tally = field(default_factory=Tally)
    stored_bytes: int = 0
    retained_bytes: int = 0
    swa_bytes: int = 0
    retained_by_hours: dict[float, int] = field(default_factory=dict)
    #: Bytes each tenant stores at the bucket's end (a run with policies).
    tenant_bytes: dict[str, int] = field(default_factory=dict)
    #: Bytes each tenant used within its own retention (R18) at the bucket's end (a run with policies).
    tenant_retained_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class TenantResult:
    """One tenant's part of a run: its policy, its requests' counts, its bytes at the end."""

    policy: Policy
    tally: Tally = field(default_factory=Tally)
    stored_bytes: int = 0
    peak_stored_bytes: int = 0
    #: Its bytes used within its own retention (R18: the policy's, never below the store's), at the end and
    #: at the peak: what the store must keep for it (`SimIndex.bytes_used_since` of its namespace).
    retained_bytes: int = 0
    peak_retained_bytes: int = 0
    #: Its blocks evicted (by any tenant's Put), and their bytes.
    evicted_blocks: int = 0
    evicted_bytes: int = 0


@dataclass(kw_only=True)
class SimResult:
    """What a simulation measured."""

    settings: SimSettings
    trace: str
    sessions: int
    total: Tally
    buckets: list[Bucket]
    peak_stored_bytes: int
    peak_retained_bytes: int
    peak_swa_bytes: int
    peak_retained_by_hours: dict[float, int]
    #: The peak over buckets of the tenants' bytes each within its own retention (R18), summed: what the
    #: store must keep when tenants' policies raise their retention (`peak_retained_bytes` with none).
    peak_retained_by_policy_bytes: int
    node_bytes: dict[str, int]
    node_reads: dict[str, int]
    sessions_past_retention: int
    tenants: dict[str, TenantResult]
    gpu_s: float
    gpu_s_without_store: float
    wall_s: float = 0.0


class _OfflineClient:
    """What the planner reads of its client (`decide` makes no calls)."""

    def __init__(self, settings: SimSettings) -> None:
        self.geometry = settings.geometry.name
        self.namespace = settings.namespace
        self.block_tokens = settings.block_tokens
        self.block_bytes = settings.block_bytes


class _KeyedScope(BlockScope):
    """A `BlockScope` whose `key` is one C call: the same bytes (`prefix + hash`), without the length check
    of hashes the simulation made itself (the tier's Put calls it for every block)."""

    def __init__(self, fingerprint: bytes, namespace: str) -> None:
        super().__init__(fingerprint, namespace)
        self.key = functools.partial(operator.add, self.prefix)  # type: ignore[method-assign]


class _Node:
    """One simulated store: the index, and the tier's Put rules over it, each tenant's retention (R18) and
    NVMe quota (R19) from the policy table, as `gateway.admin_servicer.add_admin_service` wires a tier."""

    def __init__(self, name: str, settings: SimSettings, key_of: list[bytes], policies: PolicyTable | None) -> None:
        self.name = name
        self.index = SimIndex(use_bucket_s=settings.bucket_s, key_of=key_of, per_namespace=policies is not None)
        rule = Retention(retention_s=settings.retention_hours * 3600)
        self.rule = rule
        #: The longest retention reported beside the store's (`also_retention_hours`).
        self.longer_s = 3600 * max((*settings.also_retention_hours, settings.retention_hours))
        retention = NamespaceRetention(rule.retention_s, None if policies is None else policies.retention_s)
        quota_of = (lambda ns: 0) if policies is None else (lambda ns: policies.policy(ns).nvme_quota_bytes)
        self.room = RoomRules(rule=rule, retention=retention, quota_of=quota_of,
                              capacity_bytes=settings.capacity_bytes, skipped=SkippedRuns())
        self.damage = DamagedBlocks(Path("(simulated)"), on_new=lambda: None)
        self.reads = 0

    def found(self, keys: list[bytes], lo: int, hi: int) -> int:
        """How many of keys[lo:hi] are stored as a chain from lo. Leaf-first eviction (R6) keeps a
        stored chain prefix-closed on one node, so a binary search finds its end (as R15's)."""
        blocks = self.index.blocks
        if lo >= hi or keys[lo] not in blocks:
            return 0
        a, b = lo, hi  # keys[a] stored; keys[b] (if < hi) not known
        while b - a > 1:
            mid = (a + b) // 2
            if keys[mid] in blocks:
                a = mid
            else:
                b = mid
        return a + 1 - lo

    def touch_due(self, numbers: np.ndarray, now_s: float) -> None:
        """Refresh the stored ones among the keys numbered `numbers` whose recorded use is due one (R5),
        as a Get does."""
        self.index.refresh(numbers, now_s, Retention.touch_due_before(now_s))

    def put(self, batch: PutBatch, now_s: float, tally: Tally) -> None:
        """The tier's Put transaction; a refusal (every other block within retention) is counted."""
        try:
            # SimIndex answers what the Put asks of a BlockTxn (its interface, not its class)
            _, evicted = commit_puts(self.index.write, self.damage, [batch], now_s=now_s, pinned=tuple,  # type: ignore[arg-type]
                                     room=self.room, data_dir=Path("(simulated)"), on_refused=lambda: None)
        except ResourceExhausted:
            self.index.evicted_uses.clear()
            tally.refused_puts += 1
            tally.refused_blocks += len(batch.hashes)
            return
        tally.put_blocks += len(batch.hashes)
        tally.evicted_blocks += evicted.blocks
        tally.evicted_bytes += evicted.freed_bytes
        if self.index.evicted_uses:  # how long past its last use each went: inside retention never (R4)
            for last in self.index.evicted_uses:
                age = now_s - last
                tally.evicted_inside_retention += age <= self.rule.retention_s + TOUCH_GRANULARITY_S
                tally.evicted_inside_longer += age <= self.longer_s + TOUCH_GRANULARITY_S
            self.index.evicted_uses.clear()


class Simulation:
    """Runs traces through the store's rules on virtual time (see the module docstring)."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.scope = BlockScope(settings.geometry.fingerprint, settings.namespace)
        self.planner = Planner(_OfflineClient(settings), cost=settings.cost,  # type: ignore[arg-type]
                               snapshot_probes=settings.snapshot_probes, report=False)
        self._chains = ChainKeys(self.scope, settings.block_tokens)
        self._tenant_chains: dict[str, ChainKeys] = {settings.namespace: self._chains}
        self._tenant_of_scope: dict[str, str] = {}
        self._kind = ""
        self.policies: SimPolicies | None = None
        self.swa_quota: SwaQuota | None = None
        self.tenants: dict[str, TenantResult] = {}
        self.nodes = {f"node-{i}": _Node(f"node-{i}", settings, self._chains.key_of, None)
                      for i in range(settings.nodes)}
        self._order = list(self.nodes)
        self._placed: dict[bytes, tuple[str, ...]] = {}
        self._block = memoryview(bytes(settings.block_bytes))
        #: Its xxh3-64, for a PutBatch that carries checksums (None: the batch has no such field).
        self._checksum: int | None = (xxhash.xxh3_64_intdigest(self._block)
                                      if "checksums" in PutBatch.__dataclass_fields__ else None)
        self._swa: dict[bytes, float] = {}
        #: The snapshot key of each block a snapshot was kept at (a probe elsewhere finds none).
        self._snapped: dict[bytes, bytes] = {}
        self._keyed: dict[bytes, _KeyedScope] = {}
        self._swa_heap: list[tuple[float, bytes, int]] = []
        self.swa_bytes = 0
        self.swa_peak = 0
        #: The end of the last bucket closed (the time a run's per-tenant bytes are reported at).
        self._last_close_s = 0.0
        if settings.policies or settings.policies_file or settings.tenants:
            self._use_policies()

    def _use_policies(self) -> None:
        """Serve each tenant under its policy (a run of one tenant on the defaults skips this work)."""
        s = self.settings
        defaults = Policy(retention_hours=s.retention_hours, swa_ttl_s=s.swa_ttl_s)
        self.policies = (SimPolicies(defaults=defaults, max_swa_ttl_s=s.swa_ttl_s) if s.policies_file is None
                         else SimPolicies.from_file(s.policies_file, defaults=defaults, max_swa_ttl_s=s.swa_ttl_s))
        for tenant, fields in s.policies.items():
            self.policies.set(tenant, fields)
        self.swa_quota = SwaQuota(self.policies, s.swa_ttl_s)
        self.nodes = {name: _Node(name, s, self._chains.key_of, self.policies) for name in self.nodes}

    # -- placement -----------------------------------------------------------------

    def _runs(self, keys: list[bytes]) -> list[tuple[int, int, tuple[str, ...]]]:
        """(first, end, replicas) of each run of the chain; one run on the only node when N = 1."""
        s = self.settings
        if s.nodes == 1:
            return [(0, len(keys), (self._order[0],))]
        out = []
        for first in range(0, len(keys), s.run_blocks):
            head = keys[first]
            nodes = self._placed.get(head)
            if nodes is None:
                nodes = self._placed[head] = replicas(head[-32:], self._order, s.replication)
            out.append((first, min(first + s.run_blocks, len(keys)), nodes))
        return out

    # -- one request ---------------------------------------------------------------

    def _lookup(self, keys: list[bytes], numbers: np.ndarray, runs: list[tuple[int, int, tuple[str, ...]]],
                now_s: float) -> int:
        """Found blocks (each run read from its first replica), the deepest found block refreshed (R5)."""
        found = 0
        for first, end, nodes in runs:
            got = self.nodes[nodes[0]].found(keys, first, end)
            found += got
            if got < end - first:
                break
        if found:
            for first, end, nodes in runs:
                if first < found <= end:
                    for n in nodes:
                        self.nodes[n].touch_due(numbers[found - 1:found], now_s)
        return found

    # -- tenants -------------------------------------------------------------------

    def tenant_of(self, request: TraceRequest) -> str:
        """The tenant a request runs as (`SimSettings.tenants`)."""
        s = self.settings
        scope = request.scope or request.session
        tenant = self._tenant_of_scope.get(scope)
        if tenant is None:
            if s.tenants:
                tenant = f"tenant-{len(self._tenant_of_scope) % s.tenants}"
            elif self._kind == "kvstore":  # kvstore's own trace: the scope is "tenant/geometry"
                tenant = request.scope.partition("/")[0] or s.namespace
            else:
                tenant = s.namespace
            self._tenant_of_scope[scope] = tenant
        return tenant

    def _chains_of(self, tenant: str) -> ChainKeys:
        chains = self._tenant_chains.get(tenant)
        if chains is None:  # every tenant's keys numbered in one list: the nodes' arrays are shared
            chains = self._tenant_chains[tenant] = ChainKeys(
                BlockScope(self.settings.geometry.fingerprint, tenant), self.settings.block_tokens,
                key_of=self._chains.key_of)
        if self.policies is not None and tenant not in self.tenants:
            self.tenants[tenant] = TenantResult(policy=self.policies.policy(tenant))
        return chains

    def keys_of(self, request: TraceRequest) -> tuple[list[bytes], np.ndarray]:
        """The request's storage keys (in its tenant's namespace) and their numbers."""
        return self._chains_of(self.tenant_of(request)).keys_and_ids(request)

    def _snapshot(self, keys: list[bytes], n: int, found_blocks: int, now_s: float) -> tuple[int | None, int | None]:
        """(T, R) of the live snapshot serving the longest resume, asked as the planner asks."""
        if not self.settings.swa_ttl_s:
            return None, None
        bt, probes = self.settings.block_tokens, self.settings.snapshot_probes
        found = found_blocks * bt
        snapped = self._snapped

        def best(blocks: int) -> tuple[int | None, int | None]:
            positions = [i * bt for i in range(max(1, blocks - probes + 1), blocks + 1)]
            limit = min(found, n - 1)  # the server's rule: R <= H, R <= the resume limit
            usable = []
            for p in positions:
                r = resume_length(self.settings.geometry, p, limit)
                if r is not None:
                    usable.append((-r, p))
            for neg_r, p in sorted(usable):
                kept = snapped.get(keys[p // bt - 1])  # a block's depth names its p: one key each
                if kept is not None and self._swa.get(kept, -math.inf) > now_s:
                    return p, -neg_r
            return None, None

        t, r = best(len(keys))
        first_probe = max(1, len(keys) - probes + 1) * bt
        if t is None and len(keys) and 0 < found < first_probe:  # the planner's reprobe
            t, r = best(found_blocks)
        return t, r

    def _keep_snapshot(self, keys: list[bytes], now_s: float, tenant: str, tally: Tally) -> None:
        """The snapshot at the prompt's end, live for the TTL (the tenant's, capped by the pool's), unless
        the tenant's swa_quota_bytes refuses it (the quota interceptor's ledger)."""
        s = self.settings
        if not s.swa_ttl_s or not keys:
            return
        p = len(keys) * s.block_tokens
        key = self._snapped.get(keys[-1])
        if key is None:  # the namespace's snapshot
            key = self._snapped[keys[-1]] = keys[-1][:16] + snapshot_key(keys[-1][-32:], (), p)
        size = snapshot_bytes(s.geometry, p)
        ttl = s.swa_ttl_s
        if self.swa_quota is not None:
            ttl = self.swa_quota.ttl_s(tenant)
            if not self.swa_quota.admit(tenant, key, size, now_s):
                tally.swa_refused += 1
                return
        if self._swa.get(key, -math.inf) <= now_s:
            self.swa_bytes += size
            self.swa_peak = max(self.swa_peak, self.swa_bytes)
        else:
            self._swa_heap = [e for e in self._swa_heap if e[1] != key]  # rare: the same prompt again in TTL
            heapq.heapify(self._swa_heap)
        self._swa[key] = now_s + ttl
        heapq.heappush(self._swa_heap, (now_s + ttl, key, size))

    def _expire_snapshots(self, now_s: float) -> None:
        heap = self._swa_heap
        while heap and heap[0][0] <= now_s:
            _, key, size = heapq.heappop(heap)
            if self._swa.get(key, math.inf) <= now_s:
                del self._swa[key]
                self.swa_bytes -= size

    def step(self, request: TraceRequest, keys: list[bytes], tally: Tally, numbers: np.ndarray) -> None:
        """One request at its arrival time: Lookup, plan, Get, Put, snapshot (`keys` and their `numbers`
        from `ChainKeys.keys_and_ids`)."""
        s, now = self.settings, request.arrival_s
        self._expire_snapshots(now)
        n = request.input_tokens
        if n == 0:
            return
        tenant = self.tenant_of(request)
        chains = self._chains_of(tenant)
        bucket, tally = tally, tally if self.policies is None else Tally()
        runs = self._runs(keys)
        found = self._lookup(keys, numbers, runs, now)
        t, r = self._snapshot(keys, n, found, now)
        plan = self.planner.decide(n, LookupResult(found_blocks=found, found_tokens=found * s.block_tokens,
                                                   lease_id=None, block_hashes=[], swa_position=t,
                                                   swa_resume_tokens=r), s.cost)
        fetch = -(-plan.fetch_tokens // s.block_tokens)
        for first, end, nodes in runs:
            if first >= fetch:
                break
            part = numbers[first:min(end, fetch)]
            self.nodes[nodes[0]].reads += len(part)
            for name in nodes:  # the read copy, and the others refreshed (F34)
                self.nodes[name].touch_due(part, now)
        self._put(keys, numbers, found, runs, now, tally, chains.scope)
        self._keep_snapshot(keys, now, tenant, tally)
        tally.requests += 1
        tally.prompt_tokens += n
        tally.found_tokens += found * s.block_tokens
        tally.usable_tokens += plan.usable_tokens
        tally.prefill_tokens += plan.prefill_tokens
        if plan.action in _REPLAYS:
            tally.replay_tokens += plan.fetch_tokens - (plan.replay_start or 0)
        if found * s.block_tokens > s.geometry.window:  # a resume: more than a window was found
            tally.resumes += 1
            tally.snapshot_resumes += plan.action is Action.FETCH_SNAPSHOT
            tally.replay_resumes += plan.action in _REPLAYS
        if tally is not bucket:
            bucket.add(tally)
            self.tenants[tenant].tally.add(tally)

    def _put(self, keys: list[bytes], numbers: np.ndarray, found: int, runs: list[tuple[int, int, tuple[str, ...]]],
             now_s: float, tally: Tally, scope: BlockScope) -> None:
        """Put blocks [found, len) to every replica of their runs (a fleet copy names its first depth)."""
        for first, end, nodes in runs:
            lo = max(first, found)
            if lo >= end:
                continue
            hashes = [k[-32:] for k in keys[lo:end]]
            run_keys, run_numbers = keys[lo:end], numbers[lo:end]
            parent = keys[lo - 1][-32:] if lo else self.scope_root
            for name in nodes:
                node = self.nodes[name]
                local_parent = lo > first or self.settings.nodes == 1
                batch = PutBatch(scope=self._keyed_scope(scope), parent_hash=parent, hashes=hashes,
                                 blocks=[self._block] * len(hashes), is_root=lo == 0,
                                 first_depth=None if local_parent or lo == 0 else lo + 1, **self._sums(len(hashes)))
                if local_parent and lo and keys[lo - 1] not in node.index.blocks:
                    tally.refused_puts += 1  # its parent went in between (another replica's order)
                    continue
                node.index.put_run(run_keys, run_numbers, lo + 1)
                node.put(batch, now_s, tally)
                node.index.note_put(numbers[lo:end])
            if self.settings.nodes == 1:
                break

    def _keyed_scope(self, scope: BlockScope) -> BlockScope:
        keyed = self._keyed.get(scope.prefix)
        if keyed is None:
            keyed = self._keyed[scope.prefix] = _KeyedScope(scope.fingerprint, scope.namespace)
        return keyed

    def _sums(self, n: int) -> dict[str, Any]:
        """The blocks' checksums for a Put that takes them (every simulated block is the same zero
        block): the tier need not hash 57 KB per block of bytes the simulation does not keep."""
        if self._checksum is None:
            return {}
        return {"checksums": [self._checksum] * n}

    @property
    def scope_root(self) -> bytes:
        """The chain root of the simulated layout (a first block's parent)."""
        return self._chains.root

    # -- a whole trace -------------------------------------------------------------

    def run(self, trace: Trace, progress: Callable[[int], None] | None = None) -> SimResult:
        """Run every request of `trace` in arrival order; `progress(done)` is called now and then.

        Python's cyclic garbage collector is paused for the run (and resumed as it was): a run
        makes millions of long-lived objects (block records, keys, memo entries) and almost no
        cycles, so the collector's passes over them were a quarter of its time; reference counting
        frees all the run drops, and the few cycles it makes (a refused Put's traceback) are
        collected once the collector runs again.
        """
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(trace, progress)
        finally:
            if was_enabled:
                gc.enable()

    def _run(self, trace: Trace, progress: Callable[[int], None] | None) -> SimResult:
        import time

        start = time.perf_counter()
        s = self.settings
        self._kind = trace.kind
        if trace.kind == "kvstore" and self.policies is None and not any(n.index.blocks for n in self.nodes.values()):
            self._use_policies()  # kvstore's own trace names its tenants: report each
        last_of_session: dict[str, int] = {}
        last_of_scope: dict[str, int] = {}
        first_of_session: dict[str, float] = {}
        for i, r in enumerate(trace.requests):
            last_of_session[r.session] = i
            last_of_scope[r.scope] = i
            first_of_session.setdefault(r.session, r.arrival_s)
        retention_s = s.retention_hours * 3600
        outlive = sum(1 for name, i in last_of_session.items()
                      if trace.requests[i].arrival_s - first_of_session[name] > retention_s)
        total = Tally()
        buckets: list[Bucket] = []
        t0 = trace.requests[0].arrival_s if trace.requests else 0.0
        bucket = Bucket(start_s=t0)
        peaks = [0, 0, 0, 0]
        for i, r in enumerate(trace.requests):
            while r.arrival_s >= bucket.start_s + s.bucket_s:
                self._close(bucket, peaks, bucket.start_s + s.bucket_s)
                buckets.append(bucket)
                bucket = Bucket(start_s=bucket.start_s + s.bucket_s)
            keys, numbers = self.keys_of(r)
            self.step(r, keys, bucket.tally, numbers)
            if last_of_session[r.session] == i:
                self._chains_of(self.tenant_of(r)).forget(
                    r.session, r.scope if r.scope and last_of_scope[r.scope] == i else None)
            if progress is not None and i % 1000 == 0:
                progress(i)
        self._close(bucket, peaks, bucket.start_s + s.bucket_s)
        buckets.append(bucket)
        for b in buckets:
            total.add(b.tally)
        compute_all = s.cost.compute_s(total.prompt_tokens)
        return SimResult(settings=s, trace=trace.name, sessions=len(last_of_session), total=total, buckets=buckets,
                         peak_stored_bytes=peaks[0], peak_retained_bytes=peaks[1], peak_swa_bytes=peaks[2],
                         peak_retained_by_hours={h: max(b.retained_by_hours.get(h, 0) for b in buckets)
                                                 for h in buckets[-1].retained_by_hours},
                         peak_retained_by_policy_bytes=peaks[3] if self.tenants else peaks[1],
                         node_bytes={n: node.index.usage.stored_bytes for n, node in self.nodes.items()},
                         node_reads={n: node.reads for n, node in self.nodes.items()},
                         sessions_past_retention=outlive, tenants=self._tenant_results(),
                         gpu_s=s.cost.compute_s(total.prefill_tokens + total.replay_tokens),
                         gpu_s_without_store=compute_all, wall_s=time.perf_counter() - start)

    def _tenant_bytes(self) -> dict[str, int]:
        """Bytes each tenant stores now, over the nodes."""
        return {tenant: sum((node.index.ns_bytes or {}).get(self._chains_of(tenant).scope.prefix[8:16], 0)
                            for node in self.nodes.values()) for tenant in self.tenants}

    def _tenant_results(self) -> dict[str, TenantResult]:
        for tenant, stored in self._tenant_bytes().items():
            result = self.tenants[tenant]
            result.stored_bytes = stored
            result.policy = self.policies.policy(tenant) if self.policies else result.policy
            result.retained_bytes = self._tenant_retained(tenant, self._last_close_s)
            ns_id = self._chains_of(tenant).scope.prefix[8:16]
            for node in self.nodes.values():
                blocks, nbytes = node.index.ns_evicted.get(ns_id, (0, 0))
                result.evicted_blocks += blocks
                result.evicted_bytes += nbytes
        return dict(sorted(self.tenants.items()))

    def _close(self, bucket: Bucket, peaks: list[int], end_s: float) -> None:
        """The state at a bucket's end: bytes stored (a store evicts only when a Put needs room), and
        bytes used within the retention (what a store must keep: `SimIndex.bytes_used_since`)."""
        self._expire_snapshots(end_s)
        bucket.stored_bytes = sum(n.index.usage.stored_bytes for n in self.nodes.values())
        since = end_s - self.settings.retention_hours * 3600 - TOUCH_GRANULARITY_S
        bucket.retained_bytes = sum(n.index.bytes_used_since(since) for n in self.nodes.values())
        for hours in (self.settings.retention_hours, *self.settings.also_retention_hours):
            since = end_s - hours * 3600 - TOUCH_GRANULARITY_S
            bucket.retained_by_hours[hours] = sum(n.index.bytes_used_since(since) for n in self.nodes.values())
        bucket.swa_bytes = max(self.swa_bytes, 0)
        self._last_close_s = end_s
        if self.tenants:
            bucket.tenant_bytes = self._tenant_bytes()
            for tenant, stored in bucket.tenant_bytes.items():
                result = self.tenants[tenant]
                result.peak_stored_bytes = max(result.peak_stored_bytes, stored)
                kept = bucket.tenant_retained_bytes[tenant] = self._tenant_retained(tenant, end_s)
                result.peak_retained_bytes = max(result.peak_retained_bytes, kept)
            peaks[3] = max(peaks[3], sum(bucket.tenant_retained_bytes.values()))
        peaks[0] = max(peaks[0], bucket.stored_bytes)
        peaks[1] = max(peaks[1], bucket.retained_bytes)
        peaks[2] = max(peaks[2], self.swa_peak)

    def _tenant_retained(self, tenant: str, end_s: float) -> int:
        """Bytes of `tenant` used within its own retention at `end_s`, over the nodes: the retention the
        tier's eviction gives its namespace (`NamespaceRetention.seconds`, R18), so the two cannot differ."""
        scope = self._chains_of(tenant).scope
        total = 0
        for node in self.nodes.values():
            since = end_s - node.room.retention.seconds(scope.namespace) - TOUCH_GRANULARITY_S
            total += node.index.bytes_used_since(since, scope.prefix[8:16])
        return total
