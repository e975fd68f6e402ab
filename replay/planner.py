"""The resume planner: ask the store what a prompt has cached, decide what to fetch and what to recompute.

One leased Lookup carries the prompt's block hashes and the snapshot keys of
its last `snapshot_probes` block boundaries (keys derived from the chain hashes
the lookup computes anyway: no second hashing pass), with the resume limit
len(tokens) - 1. From the answer (found tokens H, and the snapshot T that
serves the longest resume R), the planner prices each feasible action with the
cost model and takes the cheapest (docs/PLANNER.md):

- FETCH_SNAPSHOT: fetch the blocks covering [0, R) and the snapshot at T, prefill [R, n);
- BOUNDED_REPLAY: fetch [0, H), recompute [H - k x window, H), prefill [H, n);
- EXACT_REPLAY: the same over layers x window tokens (the tenant's fidelity is "exact");
- FULL_PREFILL: compute the whole prompt (nothing usable, or nothing cheaper).

Every plan is reported to the server (ReportResume, sent without waiting), so
`kvstore stats` counts usable tokens, not raw hits. torch is never imported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvstore import geometry as geometries
from kvstore.counted import counted
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.lookup_result import LookupResult
from kvstore.prefix import ExtraKey
from kvstore.swa_snapshot import snapshot_bytes, snapshot_key
from replay.cost import CostModel
from replay.fidelity_budget import (
    FidelityBudget,
    FidelityTable,
    SpanChoice,
    choose_span,
    parse_budget,
    table_for_geometry,
)
from replay.hosts import PathRates, host_plans, is_fleet
from replay.plan import Action, Plan

if TYPE_CHECKING:  # the planner calls the client it is handed: `kvstore trace simulate` imports no client
    from kvstore.client import Client

log = logging.getLogger(__name__)
#: The cost model a planner uses unless told otherwise (the documented defaults).
DEFAULT_COST = CostModel()



def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


@dataclass(frozen=True, kw_only=True)
class _Option:
    """One priced way to resume."""

    action: Action
    fetch_tokens: int = 0
    fetch_bytes: int = 0
    snapshot_position: int | None = None
    resume_tokens: int = 0
    replay_start: int | None = None
    estimated_s: float


class Planner:
    """Plans the resume of prompts of one tenant (the client's namespace) and geometry.

    Args:
        client: the store's client (its namespace is the tenant).
        cost: the cost model, unless `tenant_costs` names the client's namespace.
        tenant_costs: cost models (fidelity settings) by tenant; the client's namespace picks one.
        lease_ms: how long the Lookup's lease holds the found blocks for the worker (0: no lease).
        snapshot_probes: block boundaries asked about for a snapshot, the last ones of the prompt.
        report: report every plan to the server (ReportResume), without waiting for it.
        reprobe: when the found prefix ends below every probed boundary and no snapshot
            served, ask once more at the boundaries at or below it (a second Lookup, unleased).
        hosts: ask the Lookup where the found prefix lives, and give each plan the path and time of a
            worker on each host (`Plan.hosts`, replay/hosts.py) at these rates; None: not asked.
        fidelity: the tenant's fidelity as a setting or error budget (replay/fidelity_budget.py: "exact",
            "windows:N", "kl:X", "fastllm:P"), unless `tenant_fidelity` names the client's namespace; it
            sets the cost model's replay span from `fidelity_table`. None: the cost model's span as it is.
        tenant_fidelity: fidelity settings by tenant.
        fidelity_source: reads the tenant's stored setting (`stored_fidelity`: its policy's replay_fidelity,
            by GetInfo) at construction and again at most every `fidelity_refresh_s` when a plan is made;
            it wins over `fidelity` (then the fallback for a server that keeps no policies), not over a
            `tenant_fidelity` entry. A read that fails at construction raises; later, the setting in use
            stays and the failure is logged.
        fidelity_refresh_s: the longest a stored setting is used before it is read again.
        fidelity_table: the worker's measured table for its model; None: the shipped table measured on the
            client's geometry (replay.fidelity_budget.table_for_geometry), if any.

    Raises:
        InvalidArgument: a bad setting.
    """

    def __init__(self, client: Client, *, cost: CostModel = DEFAULT_COST,
                 tenant_costs: Mapping[str, CostModel] | None = None, lease_ms: int = 30_000,
                 snapshot_probes: int = 4, report: bool = True, reprobe: bool = True,
                 hosts: PathRates | None = None, fidelity: FidelityBudget | str | None = None,
                 tenant_fidelity: Mapping[str, FidelityBudget | str] | None = None,
                 fidelity_table: FidelityTable | None = None,
                 fidelity_source: Callable[[], str] | None = None, fidelity_refresh_s: float = 60.0) -> None:
        if isinstance(snapshot_probes, bool) or not isinstance(snapshot_probes, int) or snapshot_probes < 0:
            raise InvalidArgument(f"snapshot_probes must be an integer >= 0, got {snapshot_probes!r}")
        if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or lease_ms < 0:
            raise InvalidArgument(f"lease_ms must be an integer >= 0, got {lease_ms!r}")
        self.client = client
        self.geometry = geometries.resolve(client.geometry)
        self.cost = (tenant_costs or {}).get(client.namespace, cost)
        self.lease_ms = lease_ms
        self.snapshot_probes = snapshot_probes
        self.report_plans = report
        self.reprobe = reprobe
        self.hosts = hosts
        #: Reports and releases that failed (logged, never raised).
        self.background_errors = 0
        self._lock = threading.Lock()
        self._background: ThreadPoolExecutor | None = None
        if isinstance(fidelity_refresh_s, bool) or not isinstance(fidelity_refresh_s, int | float) \
                or not fidelity_refresh_s >= 0:
            raise InvalidArgument(f"fidelity_refresh_s must be a number of seconds >= 0, got {fidelity_refresh_s!r}")
        mapped = (tenant_fidelity or {}).get(client.namespace)
        chosen = fidelity if mapped is None else mapped
        self._base_cost = self.cost
        self._fidelity_table = fidelity_table
        self._fallback = parse_budget(chosen) if isinstance(chosen, str) else chosen
        # A tenant_fidelity entry is this planner's own setting for the tenant: the stored one does not replace it.
        self._source = fidelity_source if mapped is None else None
        self._refresh_s = float(fidelity_refresh_s)
        self._read_at = time.monotonic()
        #: The tenant's stored setting as last read ('': the server keeps none; None: not read).
        self.stored_fidelity: str | None = None
        #: The span the tenant's fidelity resolves to (None: no fidelity setting, the cost model's span).
        self.span_choice: SpanChoice | None = None
        if self._source is not None:
            self.stored_fidelity = self._source()
        self._resolve()

    def close(self) -> None:
        """Wait for the reports and lease releases in flight (the client stays open: it is the caller's)."""
        with self._lock:
            background, self._background = self._background, None
        if background is not None:
            background.shutdown(wait=True)

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the lookup ------------------------------------------------------------

    def _probes(self, hashes: list[bytes], blocks: int,
                extra_keys: Sequence[ExtraKey]) -> tuple[list[int], list[bytes]]:
        """Positions and keys of the snapshots at the last `snapshot_probes` boundaries of `blocks` blocks."""
        b = self.client.block_tokens
        first = max(1, blocks - self.snapshot_probes + 1)
        positions = [i * b for i in range(first, blocks + 1)]
        return positions, [snapshot_key(hashes[p // b - 1], (), p, extra_keys) for p in positions]

    def lookup(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = ()) -> LookupResult:
        """The leased Lookup a plan starts from: found blocks and the snapshot serving the longest resume.

        Raises:
            InvalidArgument: no tokens, a bad token id or extra key.
            KVStoreError: the store could not be asked.
        """
        n = len(tokens)
        if n == 0:
            raise InvalidArgument("tokens is empty: a plan needs at least one prompt token")
        hashes = self.client.hashes(tokens, extra_keys=extra_keys)
        positions, keys = self._probes(hashes, len(hashes), extra_keys)
        found = self.client.lookup_hashes(hashes, lease_ms=self.lease_ms, swa_keys=keys, swa_positions=positions,
                                          swa_resume_limit=n - 1, hosts=self.hosts is not None)
        if (self.reprobe and found.swa_position is None and positions
                and 0 < found.found_tokens < positions[0]):
            positions, keys = self._probes(hashes, found.found_blocks, extra_keys)
            again = self.client.lookup_hashes(hashes[:found.found_blocks], swa_keys=keys, swa_positions=positions,
                                              swa_resume_limit=n - 1)
            if again.swa_position is not None:
                found = LookupResult(found_blocks=found.found_blocks, found_tokens=found.found_tokens,
                                     lease_id=found.lease_id, block_hashes=hashes, swa_position=again.swa_position,
                                     swa_resume_tokens=again.swa_resume_tokens, hosts=found.hosts)
        return found

    # -- the plan ----------------------------------------------------------------

    def plan(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
             cost: CostModel | None = None, report: bool | None = None) -> Plan:
        """The plan to resume `tokens`: one leased Lookup, then the cheapest feasible action.

        Args:
            tokens: the whole prompt's token ids.
            extra_keys: the keys its blocks were stored with.
            cost: this request's cost model (default: the tenant's).
            report: report the plan to the server (default: the planner's `report` setting);
                a caller that runs the plan and may fall back (the Resumer) passes False and
                reports what was done instead.

        Raises:
            InvalidArgument: no tokens, a bad token id or extra key.
            KVStoreError: the store could not be asked.
        """
        start = time.perf_counter()
        found = self.lookup(tokens, extra_keys=extra_keys)
        return self.plan_from_lookup(tokens, found, cost=cost, lookup_s=time.perf_counter() - start, report=report)

    def plan_from_lookup(self, tokens: Sequence[int], found: LookupResult, *, cost: CostModel | None = None,
                         lookup_s: float = 0.0, report: bool | None = None) -> Plan:
        """The plan of `tokens` from a Lookup already made (`lookup`): decide, release an unused
        lease, report.

        O(1) in the prompt's length (only len(tokens) is read; the hashes are passed on, not
        copied), so timing this call alone measures the planner's overhead beyond the lookup.
        """
        start = time.perf_counter()
        if self._source is not None and cost is None:
            self._refresh()
        choice, own_cost = self.span_choice, self.cost
        plan = self.decide(len(tokens), found, cost or own_cost)
        if choice is not None and cost is None:  # which span the tenant's fidelity chose, and why
            plan.reasons.insert(1, choice.reason)
        if self.hosts is not None and found.hosts:  # where the prefix lives: each host's path and plan
            plan = replace(plan, hosts=host_plans(self, len(tokens), found, cost or self.cost, self.hosts,
                                                  fleet=is_fleet(self.client)))
        if plan.action is Action.FULL_PREFILL and found.lease_id:
            self.release(found.lease_id)
            plan.reasons.append(f"lease released: a full prefill fetches nothing (lease {found.lease_id})")
        if self.report_plans if report is None else report:
            self.report(plan)
        return replace(plan, lookup_s=lookup_s, plan_s=time.perf_counter() - start)

    def _resolve(self) -> None:
        """Resolve the fidelity in force (the stored setting, else the fallback) to a span and cost model."""
        stored = self.stored_fidelity
        budget = parse_budget(stored) if stored else self._fallback
        table = self._fidelity_table
        if budget is not None and table is None and budget.kind in ("kl", "fastllm"):
            table = table_for_geometry(self.geometry)  # the shipped table measured on this geometry
        choice = None if budget is None else choose_span(budget, table)
        if choice is not None and stored:
            choice = replace(choice, reason=f"{choice.reason}; the setting is the tenant's stored policy "
                                            f"(replay_fidelity {stored!r}, read again every {self._refresh_s:g} s)")
        elif choice is not None and self._source is not None:
            choice = replace(choice, reason=f"{choice.reason}; the server keeps no policy: the planner's default")
        cost = self._base_cost if choice is None else replace(self._base_cost, replay_windows=choice.replay_windows)
        self.span_choice, self.cost = choice, cost

    def _refresh(self) -> None:
        """Read the tenant's stored setting again once `fidelity_refresh_s` has passed; re-resolve if it
        changed. A failed read keeps the setting in use (logged): a plan never fails for it."""
        now = time.monotonic()
        with self._lock:
            if now - self._read_at < self._refresh_s:
                return
            self._read_at = now
        assert self._source is not None
        try:
            stored = self._source()
            if stored != self.stored_fidelity:
                if stored:
                    parse_budget(stored)  # a setting that does not parse keeps the one in use (InvalidArgument)
                self.stored_fidelity = stored
                self._resolve()
                log.info("replay fidelity of tenant %r is now %r: %s", self.client.namespace, stored,
                         self.span_choice.reason if self.span_choice else "no setting")
        except KVStoreError as exc:
            log.warning("replay fidelity of tenant %r not read again (%s): %r stays in use", self.client.namespace,
                        exc, self.stored_fidelity)

    def decide(self, n: int, found: LookupResult, cost: CostModel) -> Plan:
        """The cheapest feasible plan for a prompt of `n` tokens given `found` (no calls; pure)."""
        b, h = self.client.block_tokens, found.found_tokens
        reasons = [f"found {h:,} of {n:,} prompt tokens ({counted(found.found_blocks, 'block')} of {b}); a resume "
                   f"is at most at {n - 1:,} (the worker computes the last token for its logits)"]
        # In order of fidelity: min() keeps the first of equal costs (exact state before approximate).
        options: list[_Option] = []
        if found.swa_position is not None and found.swa_resume_tokens is not None:
            options.append(self._snapshot_option(n, found.swa_position, found.swa_resume_tokens, cost, reasons))
        else:
            reasons.append("snapshot: none serves this prompt at a probed block boundary")
        replay = self._replay_option(n, h, cost, reasons)
        options.append(_Option(action=Action.FULL_PREFILL, estimated_s=cost.compute_s(n)))
        reasons.append(f"full prefill: compute {counted(n, 'token')} = {_ms(options[-1].estimated_s)} "
                       f"at {cost.recompute_tokens_per_s:,.0f} tokens/s")
        if replay is not None:
            options.append(replay)
        best = min(options, key=lambda o: o.estimated_s)
        others = ", ".join(f"{o.action.value} {_ms(o.estimated_s)}" for o in options if o is not best)
        reasons.append(f"chose {best.action.value}: {_ms(best.estimated_s)}"
                       + (f" (against {others})" if others else ""))
        return Plan(prompt_tokens=n, action=best.action, fetch_tokens=best.fetch_tokens, fetch_bytes=best.fetch_bytes,
                    snapshot_position=best.snapshot_position, resume_tokens=best.resume_tokens,
                    replay_start=best.replay_start, prefill_tokens=n - best.resume_tokens,
                    usable_tokens=best.resume_tokens,
                    found_tokens=h, lease_id=None if best.action is Action.FULL_PREFILL else found.lease_id,
                    block_hashes=found.block_hashes, estimated_s=best.estimated_s, reasons=reasons)

    def _fetch_bytes(self, tokens: int) -> int:
        return tokens // self.client.block_tokens * self.client.block_bytes

    def _snapshot_option(self, n: int, t: int, r: int, cost: CostModel, reasons: list[str]) -> _Option:
        """Fetch the blocks covering [0, R) (rounded up to a block) and the snapshot at T; prefill [R, n)."""
        b = self.client.block_tokens
        fetch = -(-r // b) * b
        blocks_b, snap_b = self._fetch_bytes(fetch), snapshot_bytes(self.geometry, t)
        fetch_s, prefill_s = cost.fetch_s(blocks_b + snap_b), cost.compute_s(n - r)
        reasons.append(f"snapshot at T={t:,} resumes at R={r:,}: fetch {fetch:,} tokens ({blocks_b:,} B) + snapshot "
                       f"{snap_b:,} B = {_ms(fetch_s)} at {cost.fetch_gbps:g} GB/s; "
                       f"prefill {counted(n - r, 'token')} = {_ms(prefill_s)}; total {_ms(fetch_s + prefill_s)}")
        return _Option(action=Action.FETCH_SNAPSHOT, fetch_tokens=fetch, fetch_bytes=blocks_b + snap_b,
                       snapshot_position=t, resume_tokens=r, estimated_s=fetch_s + prefill_s)

    def _replay_option(self, n: int, h: int, cost: CostModel, reasons: list[str]) -> _Option | None:
        """Fetch [0, H), recompute [H - S, H), prefill [H, n); None when not feasible (says why)."""
        b, w = self.client.block_tokens, self.geometry.window
        span, exact = cost.replay_tokens(window=w, num_layers=self.geometry.num_layers)
        name = f"{'exact' if exact else 'bounded'} replay ({span:,} tokens, fidelity {cost.fidelity})"
        # The worker computes the last prompt token itself: a hit reaching the prompt's end
        # resumes one block earlier.
        usable = min(h, (n - 1) // b * b)
        if usable < h:
            reasons.append(f"the hit reaches the prompt's end: a replay resumes at {usable:,}")
        if usable <= w:
            reasons.append(f"{name}: not adopted: a hit of {usable:,} tokens is not above the window ({w})")
            return None
        if usable - span <= 0:
            reasons.append(f"{name}: not feasible: it would start at {usable - span:,} <= 0 (a full recompute)")
            return None
        blocks_b = self._fetch_bytes(usable)
        fetch_s, replay_s, prefill_s = cost.fetch_s(blocks_b), cost.replay_s(span), cost.compute_s(n - usable)
        total = fetch_s + replay_s + prefill_s
        reasons.append(f"{name}: fetch {usable:,} tokens ({blocks_b:,} B) = {_ms(fetch_s)}; recompute "
                       f"[{usable - span:,}, {usable:,}) = {_ms(replay_s)} (with {_ms(cost.replay_overhead_s)} "
                       f"per replay call); prefill {counted(n - usable, 'token')} = "
                       f"{_ms(prefill_s)}; total {_ms(total)}")
        return _Option(action=Action.EXACT_REPLAY if exact else Action.BOUNDED_REPLAY, fetch_tokens=usable,
                       fetch_bytes=blocks_b, resume_tokens=usable, replay_start=usable - span, estimated_s=total)

    # -- in the background --------------------------------------------------------

    def _in_background(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the planner's one background thread (plan() never waits for a call)."""
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
            self._background.submit(fn)

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.background_errors += 1
        log.warning("planner: %s failed: %s", what, exc)

    def report(self, plan: Plan) -> None:
        """Report `plan` to the server's usable-token stats, without waiting; a failure is logged
        and counted (`background_errors`), never raised. A caller that plans with `report=False`
        reports what it finally ran (for example a fallback plan) with this."""
        def send() -> None:
            try:
                self.client.report_resume(prompt_tokens=plan.prompt_tokens, found_tokens=plan.found_tokens,
                                          usable_tokens=plan.usable_tokens, action=plan.action.value)
            except Exception as exc:  # reported, never raised: a stats report must not fail a plan
                self._failed("ReportResume", exc)

        self._in_background(send)

    def release(self, lease_id: str) -> None:
        """Release a lease in the background (a failure is logged and counted, never raised)."""
        def send() -> None:
            try:
                self.client.release(lease_id)
            except Exception as exc:  # logged: the lease lapses on its own (lease_ms)
                self._failed(f"release of lease {lease_id}", exc)

        self._in_background(send)


def stored_fidelity(client: Client) -> str:
    """The replay_fidelity of the policy of `client`'s tenant (its namespace; '' = its token's), by GetInfo:
    '' from a server that keeps no policies (a stateless gateway) or predates the field.

    Raises:
        KVStoreError: the server could not be asked (PermissionDenied: another tenant's name without "admin").
    """
    from kvstore.v1 import kvstore_pb2 as pb

    conn = getattr(client, "connection", None)
    if conn is None:  # a fleet client: any node answers from the fleet's policies
        conn = client._any_node()  # type: ignore[attr-defined]
    reply = conn.call(conn.kvstore.GetInfo, pb.GetInfoRequest(namespace=client.namespace))
    return str(reply.replay_fidelity)
