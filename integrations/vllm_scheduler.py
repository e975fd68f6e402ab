"""The scheduler side of the vLLM connector: what to load and save, decided from the planner.

vLLM-free (it reads only the attributes of vLLM's objects it is handed), so the rules
are testable without the engine; `integrations.vllm_connector` wires it into
`KVConnectorBase_V1`.

Rules (docs/ENGINES.md, tests/integrations/test_vllm_connector.py):
1. One leased planner Lookup per request (`replay.planner`), cached: vLLM may ask again.
2. Only usable tokens are reported (`integrations.common.usable_tokens`): a bounded replay's
   hit minus its span, rounded down to vLLM's block, less what vLLM's own prefix cache holds.
3. A load covers [vLLM's local hit, reported end) only: local pages are shared, never rewritten.
4. New full store blocks are saved as soon as a step computes them, from the first block the
   store did not already hold; a request with saves is held at its end (`request_finished`
   returns True) until the worker says its puts are done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from integrations.common import usable_tokens
from kvstore.swa_snapshot import snapshot_key
from replay.plan import Action, Plan
from replay.planner import Planner

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Fill positions [start, end) of a request's pages from the store's blocks `hashes`."""

    req_id: str
    hashes: list[bytes]
    start: int
    end: int
    block_ids: tuple[list[int], ...]
    lease_id: str | None = None
    asynchronous: bool = False
    #: A fetch+snapshot resume: also load the SWA snapshot at this T (its key) into the window pages.
    snapshot_at: int | None = None
    snapshot_key: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class SaveSpec:
    """Put store blocks [first_block, len(tokens) // block_tokens) of a request from its pages."""

    req_id: str
    tokens: list[int]
    first_block: int
    block_ids: tuple[list[int], ...]
    #: Also take the SWA snapshot at this T (a block boundary) from the window pages, when they still hold it.
    snapshot_at: int | None = None
    #: Keep that snapshot on the worker and put it only when the request ends (the output's last boundary:
    #: by then vLLM has freed the window pages below the last token's window).
    snapshot_at_end: bool = False
    #: The request's kvstore extra keys (LoRA adapter, cache salt), mixed into every block's hash.
    extra_keys: tuple[str, ...] = ()
    #: The request's retention hint, on the save that stores the prompt's last full block: that Put pins
    #: it in its own transaction (docs/RETENTION.md R22; 0: none), the grant reported back (`granted`).
    keep_until_s: float = 0.0


@dataclass
class ConnectorMeta:
    """One step's work for the worker side (a `KVConnectorMetadata` in the connector)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Any
    plan: Plan | None = None
    load_end: int = 0
    stored_blocks: int = 0
    block_ids: list[list[int]] = field(default_factory=list)
    held: bool = False
    lease_used: bool = False
    snapshot_at: int = 0
    extra_keys: tuple[str, ...] = ()
    #: A save of this request carried its retention hint (the Put pins; no Lookup at its end).
    pin_in_put: bool = False


#: How many hinted requests' pins `SchedulerSide.kept` remembers.
KEPT_RESULTS = 1024


def keep_until(request: Any) -> float:
    """A request's retention hint (docs/RETENTION.md R22): `kv_transfer_params["kvstore_keep_until_s"]`, a Unix
    time, or `["kvstore_keep_s"]`, seconds from now; 0 for none (or a value that is not a positive number)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if not isinstance(params, dict):
        return 0.0
    absolute, relative = params.get("kvstore_keep_until_s"), params.get("kvstore_keep_s")
    for value, base in ((absolute, 0.0), (relative, time.time())):
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value) + base
    return 0.0


class SchedulerSide:
    """Per-request bookkeeping of the scheduler-side connector.

    Args:
        planner: the tenant's planner (leased Lookup, usable tokens, reports).
        block_tokens: the store's tokens per block.
        engine_block: vLLM's tokens per page (`cache_config.block_size`).
        load: load from the store (False for a producer-only role).
        save: save to the store (False for a consumer-only role).
        asynchronous: declare loads asynchronous (needed with several KV cache groups, whose
            block-level load errors vLLM cannot map back; failures then recompute the request).
        snapshots: vLLM has a window cache for every layer: put SWA snapshots at the block boundary
            at or below the prompt's end and the output's end (docs/WORKER.md rule 8).
    """

    def __init__(self, planner: Planner, *, block_tokens: int, engine_block: int, load: bool = True,
                 save: bool = True, asynchronous: bool = False, snapshots: bool = False) -> None:
        self.planner = planner
        self.block_tokens = block_tokens
        self.engine_block = engine_block
        self.load, self.save, self.asynchronous, self.snapshots = load, save, asynchronous, snapshots
        self._reqs: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        #: Lookups made (one per request; vLLM's repeated questions are answered from the cache).
        self.lookups = 0
        #: Pins asked by requests' retention hints, waiting for their saves: req id -> (tokens, keys, until).
        self._to_pin: dict[str, tuple[list[int], tuple[str, ...], float]] = {}
        #: The pin each hinted request got (Unix time, 0: none), the last KEPT_RESULTS of them.
        self.kept: dict[str, float] = {}

    @staticmethod
    def extra_keys(request: Any) -> tuple[str, ...] | None:
        """The kvstore extra keys of a request vLLM keys by more than its tokens: its LoRA adapter
        (`vllm-lora:<name>`) and its cache salt (`vllm-salt:<salt>`), mixed into every block's hash so
        its KV never serves another request. None for multimodal inputs (not supported: neither
        loaded nor saved)."""
        if getattr(request, "mm_features", None):
            return None
        keys = []
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            keys.append(f"vllm-lora:{lora.lora_name}")
        salt = getattr(request, "cache_salt", None)
        if salt:
            keys.append(f"vllm-salt:{salt}")
        return tuple(keys)

    def _tracked(self, request: Any) -> _Tracked:
        t = self._reqs.get(request.request_id)
        if t is None:
            t = self._reqs[request.request_id] = _Tracked(request=request)
        return t

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: tokens loadable beyond vLLM's local hit, and whether async."""
        keys = self.extra_keys(request)
        if keys is None:
            return 0, False
        t = self._tracked(request)
        t.extra_keys = keys
        tokens = list(request.prompt_token_ids or [])
        if t.plan is None:
            if not self.load or len(tokens) < self.block_tokens:
                return 0, False
            try:
                t.plan = self._plan(tokens, keys)
            except Exception as exc:  # a store outage must not fail the request: it is a miss
                log.warning("kvstore: lookup of request %s failed, computing it: %s", request.request_id, exc)
                return 0, False
            self.lookups += 1
            t.stored_blocks = t.plan.found_tokens // self.block_tokens
            usable = usable_tokens(t.plan)
            t.load_end = usable - usable % self.engine_block
        external = max(t.load_end - num_computed_tokens, 0)
        return external, self.asynchronous and external > 0

    def _plan(self, tokens: list[int], keys: tuple[str, ...]) -> Plan:
        """The planner's plan, reported; a snapshot resume vLLM cannot take (R not on one of its pages)
        is planned again without the snapshot (a replay or a full prefill)."""
        found = self.planner.lookup(tokens, extra_keys=keys)
        plan = self.planner.plan_from_lookup(tokens, found, report=False)
        if plan.action is Action.FETCH_SNAPSHOT and plan.resume_tokens % self.engine_block:
            plan = self.planner.plan_from_lookup(tokens, replace(found, swa_position=None, swa_resume_tokens=None),
                                                 report=False)
        self.planner.report(plan)
        return plan

    def load_failed(self, req_ids: Any) -> None:
        """`update_connector_output`: these requests' asynchronous loads failed; vLLM recomputes them,
        so they are offered nothing more from the store (vLLM asks again when it requeues them)."""
        for req_id in req_ids or ():
            t = self._reqs.get(req_id)
            if t is not None:
                t.load_end = 0

    def allocated(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        """`update_state_after_alloc`: queue the load into the pages just allocated."""
        if self.extra_keys(request) is None:
            return
        t = self._tracked(request)
        if num_external_tokens <= 0 or t.plan is None:
            return
        start = t.load_end - num_external_tokens
        b = self.block_tokens
        hashes = t.plan.block_hashes[:-(-t.load_end // b)]
        at = t.plan.snapshot_position if t.plan.action is Action.FETCH_SNAPSHOT else None
        key = None if at is None else snapshot_key(t.plan.block_hashes[at // b - 1], (), at, t.extra_keys)
        self._loads.append(LoadSpec(req_id=request.request_id, hashes=list(hashes), start=start, end=t.load_end,
                                    block_ids=tuple(list(g) for g in block_ids),
                                    lease_id=None if t.lease_used else t.plan.lease_id,
                                    asynchronous=self.asynchronous, snapshot_at=at, snapshot_key=key))
        # A request preempted and requeued is offered its hit again: it loads again, without the lease.
        t.lease_used = True

    def build(self, so: Any) -> ConnectorMeta:
        """`build_connector_meta`: this step's loads, and saves of the blocks it completes."""
        meta = ConnectorMeta(loads=self._loads)
        self._loads = []
        for new in so.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = [list(g) for g in new.block_ids]
            self._save(t, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = [list(g) for g in new_ids or ()]
            elif new_ids is not None:
                for group, ids in zip(t.block_ids, new_ids, strict=False):
                    group.extend(ids)
            self._save(t, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0), meta)
        return meta

    def _save(self, t: _Tracked, computed: int, meta: ConnectorMeta) -> None:
        """Save the blocks complete at `computed` tokens. With snapshots: the one at the block boundary
        at or below the prompt's end once the prompt is computed, and, as the output crosses each
        boundary, the one there, kept by the worker until the request ends (the output's last)."""
        if not self.save:
            return
        tokens = list(t.request.all_token_ids)
        b = self.block_tokens
        full = min(computed, len(tokens)) // b
        at, at_end = None, False
        prompted = computed >= t.request.num_prompt_tokens
        if self.snapshots and prompted:
            at_end = t.snapshot_at > 0 or full * b > t.request.num_prompt_tokens
            boundary = full * b if at_end else t.request.num_prompt_tokens // b * b
            # Never at or below where the state came from the store (docs/WORKER.md rule 8).
            if boundary > max(t.snapshot_at, t.load_end, 0):
                at = t.snapshot_at = boundary
        if full <= t.stored_blocks and at is None:
            return
        # The save that stores the prompt's last full block pins it in its Put (R22): one pin per prompt.
        until, prompt_blocks = keep_until(t.request), t.request.num_prompt_tokens // b
        keep = until if until and not t.pin_in_put and t.stored_blocks < prompt_blocks <= full else 0.0
        t.pin_in_put = t.pin_in_put or keep > 0
        meta.saves.append(SaveSpec(req_id=t.request.request_id, tokens=tokens[:max(full * b, at or 0)],
                                   first_block=min(t.stored_blocks, full),
                                   block_ids=tuple(list(g) for g in t.block_ids), snapshot_at=at,
                                   snapshot_at_end=at is not None and at_end, extra_keys=t.extra_keys,
                                   keep_until_s=keep))
        t.stored_blocks = max(full, t.stored_blocks)
        t.held = True

    def finished(self, request: Any) -> bool:
        """`request_finished`: True holds the request's pages until the worker's puts (and the kept
        snapshot's) are done. An unused lease (the request ended before its load) is released here.
        A retention hint (`keep_until`) whose prompt no Put of the request stored (found stored, or a
        consumer-only role) pins the stored prefix by a Lookup once those puts are done (`sent`)."""
        t = self._reqs.pop(request.request_id, None)
        if t is None:
            return False
        if t.plan is not None and t.plan.lease_id and not t.lease_used:
            self.planner.release(t.plan.lease_id)
        until = keep_until(request)
        # The prompt's stored blocks (as a Put's pin would have been): the same block pinned by every turn.
        stored = min(t.stored_blocks, request.num_prompt_tokens // self.block_tokens) * self.block_tokens
        if until and stored and not t.pin_in_put:
            self._to_pin[request.request_id] = (list(request.all_token_ids)[:stored], t.extra_keys, until)
            if not t.held:
                self.sent([request.request_id])
        return t.held

    def sent(self, req_ids: Any) -> None:
        """`update_connector_output`'s finished sending: these requests' puts are done; pin what they asked."""
        for req_id in req_ids or ():
            ask = self._to_pin.pop(req_id, None)
            if ask is None:
                continue
            tokens, keys, until = ask
            try:
                got = self.planner.client.pin(tokens, until, extra_keys=keys)
            except Exception as exc:  # a store outage costs the pin, never the request
                log.warning("kvstore: pin of request %s failed: %s", req_id, exc)
                continue
            self._record(req_id, got.kept_until_s, got.keep_note, until)

    def granted(self, kept: Any) -> None:
        """`update_connector_output`'s worker metadata: the pins the worker's Puts were granted
        (req id -> (time granted, note); `SaveSpec.keep_until_s`)."""
        for req_id, (until, note) in dict(kept or {}).items():
            self._record(req_id, until, note, None)

    def _record(self, req_id: str, until: float, note: str, asked: float | None) -> None:
        if note:
            log.info("kvstore: request %s kept until %.0f, not %s: %s", req_id, until,
                     "as asked" if asked is None else f"{asked:.0f}", note)
        self.kept[req_id] = until
        if len(self.kept) > KEPT_RESULTS:
            del self.kept[next(iter(self.kept))]

    def plan_of(self, req_id: str) -> Plan | None:
        """The plan made for a request still tracked (for logs and tests)."""
        t = self._reqs.get(req_id)
        return None if t is None else t.plan
