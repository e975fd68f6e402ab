"""Resume a prompt: the planner decides, the worker runs, and a failure falls back cleanly.

`Resumer.resume(tokens)` plans (one leased Lookup, `replay.planner.Planner`),
sends the plan to the worker (`kvstore.client.worker.WorkerClient`), and returns
a `ResumeResult` with the plan and the worker's answer. After a replay the
worker has put the rebuilt snapshot back, so the next turn is a full hit.

When the worker cannot run the plan, the result says so instead of raising
(docs/WORKER.md "Fallbacks"):

- the worker is down (UNAVAILABLE), past its deadline (DEADLINE_EXCEEDED),
  busy (RESOURCE_EXHAUSTED) or failed mid-run (killed: UNAVAILABLE or INTERNAL):
  `fallback` is the prompt as a FULL_PREFILL plan and `reason` says why; the
  plan's lease is released;
- blocks or the snapshot of the plan vanished between the Lookup and the fetch
  (FAILED_PRECONDITION): the prompt is planned once more and run again; a
  second failure falls back;
- the store cannot be asked at all: `fallback` (and `plan`) is a full prefill.

With `raise_on_fallback=True` the same cases raise the cause's kvstore.errors
class with a hint instead. A bad request (INVALID_ARGUMENT) always raises.

The Resumer plans with `report=False` and reports what was finally done (the
plan run, or the fallback) when the planner reports plans (its `report`
setting), so the server's usable-token stats count a fallback as no hit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.client.worker import RunResult, WorkerClient
from kvstore.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
)
from kvstore.prefix import ExtraKey
from replay.cost import CostModel
from replay.plan import Action, Plan
from replay.planner import Planner

log = logging.getLogger(__name__)

#: Worker failures that leave the prompt to a full prefill elsewhere (the worker is gone, slow or busy).
FALLBACK_ERRORS: tuple[type[KVStoreError], ...] = (Unavailable, DeadlineExceeded, Internal, ResourceExhausted)


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """How one prompt was resumed.

    Attributes:
        plan: the plan sent to the worker (after a re-plan, the second one).
        run: the worker's answer (logits, output tokens, counts); None when it fell back.
        fallback: when the worker could not run the plan: the prompt as a FULL_PREFILL plan,
            for the caller to run (on another worker, or this one when it is back); else None.
        reason: why it fell back, else None.
        replanned: whether the plan was made twice (the store changed under the first).
        error: the failure behind the fallback, else None.
        kept_until_s: when `keep_until_s` was asked: the time the store keeps the prompt's stored
            prefix until (a pin, docs/RETENTION.md R22-R27), 0 when none was granted.
        keep_note: why less than asked (the tenant's longest pin, its budget, the store's refusal).
    """

    plan: Plan
    run: RunResult | None
    fallback: Plan | None = None
    reason: str | None = None
    replanned: bool = False
    error: KVStoreError | None = field(default=None, repr=False)
    kept_until_s: float = 0.0
    keep_note: str = ""

    @property
    def ok(self) -> bool:
        """Whether the worker ran the plan."""
        return self.run is not None


class Resumer:
    """Plans prompts of the planner's tenant and runs the plans on one worker.

    Args:
        planner: plans against the store (its client's namespace is the tenant the worker uses).
        worker: the worker's client.
        raise_on_fallback: raise instead of returning a fallback (each call may override it).
        timeout_s: each Run's deadline (default: the worker client's).
    """

    def __init__(self, planner: Planner, worker: WorkerClient, *, raise_on_fallback: bool = False,
                 timeout_s: float | None = None) -> None:
        self.planner = planner
        self.worker = worker
        self.raise_on_fallback = raise_on_fallback
        self.timeout_s = timeout_s

    def resume(self, tokens: Sequence[int], extra_keys: Sequence[ExtraKey] = (), max_new_tokens: int = 0, *,
               store: bool = True, snapshot_every: int = 0, tail_prefill: bool = False,
               cost: CostModel | None = None, raise_on_fallback: bool | None = None,
               keep_until_s: float = 0.0) -> ResumeResult:
        """Plan `tokens`, run the plan on the worker, fall back cleanly when it cannot.

        Args:
            tokens: the whole prompt.
            extra_keys: the keys its blocks are hashed with.
            max_new_tokens: greedy tokens the worker decodes after the prompt.
            store: the worker stores new blocks and snapshots (and the rebuilt one after a replay).
            snapshot_every: also snapshot every N tokens (a multiple of block_tokens).
            tail_prefill: decoder-side tail prefill on the worker.
            cost: this request's cost model (default: the tenant's).
            raise_on_fallback: override the Resumer's setting for this call.
            keep_until_s: the request's retention hint: keep the prompt's stored prefix until this Unix time,
                beyond the tenant's retention (a pin): the worker's Put of the Run's new blocks pins its last
                block in its own transaction (the prompt, and the output it stored); when the Run stores
                nothing (all fetched, or `store` off), a Lookup pins the prompt's stored prefix after it.
                The result says what was granted. 0: none. A refused pin never fails the resume.

        Raises:
            InvalidArgument: a bad prompt or argument (nothing ran).
            KVStoreError: the cause of a fallback, with a hint, when raising on fallback.
        """
        raising = self.raise_on_fallback if raise_on_fallback is None else raise_on_fallback
        try:
            plan = self.planner.plan(tokens, extra_keys=extra_keys, cost=cost, report=False)
        except FALLBACK_ERRORS as exc:
            full = self._store_down_plan(len(tokens), exc)
            return self._fall_back(full, exc, "the store could not be asked", raising)
        replanned = False
        while True:
            try:
                run = self.worker.run(tokens, plan, extra_keys=extra_keys, max_new_tokens=max_new_tokens,
                                      store=store, snapshot_every=snapshot_every, tail_prefill=tail_prefill,
                                      namespace=self.planner.client.namespace, timeout_s=self.timeout_s,
                                      keep_until_s=keep_until_s)
            except FailedPrecondition as exc:
                self._release(plan)
                if replanned or plan.action is Action.FULL_PREFILL:
                    return self._fall_back(plan, exc, "the store changed again after a re-plan", raising)
                log.info("resume: %s; planning again", exc.message)
                replanned = True
                try:
                    plan = self.planner.plan(tokens, extra_keys=extra_keys, cost=cost, report=False)
                except FALLBACK_ERRORS as again:
                    return self._fall_back(plan, again, "the store could not be asked to plan again", raising)
                continue
            except FALLBACK_ERRORS as exc:
                self._release(plan)
                return self._fall_back(plan, exc, _why(exc), raising, replanned=replanned)
            except KVStoreError:
                self._release(plan)
                raise
            self._report(plan)
            if run.kept_in_put:  # the worker's Put pinned its blocks in its own transaction (R22): no Lookup
                kept, note = run.kept_until_s, run.keep_note
            else:  # nothing new to Put (or not stored): the prompt's stored prefix is pinned by a Lookup
                kept, note = self._keep(tokens, extra_keys, keep_until_s) if keep_until_s else (0.0, "")
            return ResumeResult(plan=plan, run=run, replanned=replanned, kept_until_s=kept, keep_note=note)

    def _keep(self, tokens: Sequence[int], extra_keys: Sequence[ExtraKey], until_s: float) -> tuple[float, str]:
        """Pin the prompt's stored prefix until `until_s`: (the time granted, why less); the store's refusal
        is a note, not a failure (the resume itself is done)."""
        try:
            got = self.planner.client.pin(tokens, until_s, extra_keys=extra_keys)
        except KVStoreError as exc:
            log.warning("resume: the prompt's pin was refused: %s", exc.message)
            return 0.0, f"{type(exc).__name__}: {exc.message}"
        return got.kept_until_s, got.keep_note

    def _report(self, plan: Plan) -> None:
        """Report the plan finally done, when the planner reports plans (it did not at plan time)."""
        if self.planner.report_plans:
            self.planner.report(plan)

    def _release(self, plan: Plan) -> None:
        """The worker did not fetch (or not all): let the blocks go now instead of at the lease's end."""
        if plan.lease_id:
            self.planner.release(plan.lease_id)

    def _fall_back(self, plan: Plan, exc: KVStoreError, why: str, raising: bool, *,
                   replanned: bool = False) -> ResumeResult:
        reason = f"{why}: {type(exc).__name__}: {exc.message}"
        log.warning("resume fell back to a full prefill: %s", reason)
        if raising:
            raise type(exc)(f"{reason} (worker {self.worker.target}, plan {plan.action.value})",
                            hint="run the prompt as a full prefill (Resumer.resume(..., raise_on_fallback=False) "
                                 "returns that plan), or retry when the worker is back") from exc
        fallback = plan.fallback(reason)
        self._report(fallback)
        return ResumeResult(plan=plan, run=None, fallback=fallback, reason=reason, replanned=replanned, error=exc)

    def _store_down_plan(self, n: int, exc: KVStoreError) -> Plan:
        """A full prefill made without the store: nothing was looked up, nothing is leased."""
        cost = self.planner.cost
        return Plan(prompt_tokens=n, action=Action.FULL_PREFILL, fetch_tokens=0, fetch_bytes=0,
                    snapshot_position=None, resume_tokens=0, replay_start=None, prefill_tokens=n, usable_tokens=0,
                    found_tokens=0, lease_id=None, block_hashes=[], estimated_s=cost.compute_s(n),
                    reasons=[f"the store could not be asked ({type(exc).__name__}: {exc.message})"])


def _why(exc: KVStoreError) -> str:
    if isinstance(exc, DeadlineExceeded):
        return "the worker did not finish before the deadline"
    if isinstance(exc, ResourceExhausted):
        return "the worker is busy"
    if isinstance(exc, Unavailable):
        return "the worker is down or went away mid-run"
    return "the worker failed mid-run"
