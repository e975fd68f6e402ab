"""The records of a resume plan: what to fetch, what to recompute, where to resume.

A plan is made by `replay.planner.Planner` and executed by a worker
(docs/WORKER.md). It is a value: every field is decided, and `reasons` says
why, one line per decision with its numbers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay.hosts import HostPlan


class Action(enum.Enum):
    """What the worker does before it prefills the new tokens."""

    #: Fetch blocks [0, fetch_tokens) and the SWA snapshot at T; the state is complete at R.
    FETCH_SNAPSHOT = "fetch+snapshot"
    #: Fetch blocks [0, H), recompute [H - k x window, H) with an empty window at its start.
    BOUNDED_REPLAY = "bounded-replay"
    #: The same over layers x window tokens: the window state at H is exact.
    EXACT_REPLAY = "exact-replay"
    #: Nothing usable (or nothing cheaper): compute the whole prompt.
    FULL_PREFILL = "full-prefill"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to resume one prompt.

    Attributes:
        prompt_tokens: the prompt's length.
        action: what the worker does first.
        fetch_tokens: global KV tokens to fetch: blocks [0, fetch_tokens), a multiple of the
            block size (0 for a full prefill).
        fetch_bytes: bytes to fetch: those blocks, plus the snapshot for FETCH_SNAPSHOT.
        snapshot_position: T of the snapshot to load (FETCH_SNAPSHOT), else None.
        resume_tokens: R, where the state is complete; the worker then prefills [R, prompt_tokens).
            At most prompt_tokens - 1: the worker always computes the last token (its logits).
        replay_start: recompute [replay_start, fetch_tokens) first (the replays), else None.
        prefill_tokens: prompt_tokens - resume_tokens.
        usable_tokens: tokens served from cache: R for a snapshot, fetch_tokens for a replay,
            0 for a full prefill (a hit that cannot be used is no hit).
        found_tokens: the store's raw hit.
        lease_id: the Lookup's lease, holding the found blocks while the worker fetches
            (released by the planner for a full prefill; else the caller releases it when the
            worker is done, or lets it lapse).
        block_hashes: the chain hashes of every full block of the prompt (the worker fetches
            the first fetch_tokens / block_tokens of them).
        estimated_s: the cost model's estimate of the chosen action, in seconds.
        reasons: one line per decision, with its numbers.
        lookup_s: seconds the planner spent hashing and in Lookup.
        plan_s: seconds the planner spent on the rest (deciding, reporting): its own overhead.
        hosts: with a planner asked for hosts (`Planner(hosts=PathRates())`): the path and plan of a
            worker on each host holding the found prefix, cheapest first, then any other host's
            (`replay/hosts.py`); else empty.
    """

    prompt_tokens: int
    action: Action
    fetch_tokens: int
    fetch_bytes: int
    snapshot_position: int | None
    resume_tokens: int
    replay_start: int | None
    prefill_tokens: int
    usable_tokens: int
    found_tokens: int
    lease_id: str | None
    block_hashes: Sequence[bytes] = field(repr=False)
    estimated_s: float
    reasons: list[str]
    lookup_s: float = 0.0
    plan_s: float = 0.0
    hosts: list[HostPlan] = field(default_factory=list)

    @property
    def replay_tokens(self) -> int:
        """Tokens recomputed before the resume point (0 unless a replay)."""
        return 0 if self.replay_start is None else self.fetch_tokens - self.replay_start

    def fallback(self, reason: str) -> Plan:
        """This prompt as a full prefill, with `reason` added (for example: the worker is down).

        The lease is not released here: the caller releases `lease_id` (Planner.release).
        """
        return replace(self, action=Action.FULL_PREFILL, fetch_tokens=0, fetch_bytes=0, snapshot_position=None,
                       resume_tokens=0, replay_start=None, prefill_tokens=self.prompt_tokens, usable_tokens=0,
                       lease_id=None, reasons=[*self.reasons, f"fallback to a full prefill: {reason}"])

    def summary(self) -> str:
        """One line: the action and its numbers."""
        parts = [self.action.value, f"fetch {self.fetch_tokens:,} tokens ({self.fetch_bytes:,} B)"]
        if self.snapshot_position is not None:
            parts.append(f"snapshot at {self.snapshot_position:,}")
        if self.replay_start is not None:
            parts.append(f"replay [{self.replay_start:,}, {self.fetch_tokens:,})")
        parts += [f"resume at {self.resume_tokens:,}", f"prefill {self.prefill_tokens:,}",
                  f"usable {self.usable_tokens:,} of {self.prompt_tokens:,}",
                  f"estimated {self.estimated_s * 1e3:,.3f} ms"]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields (the block hashes left out: a 1M-token prompt has 15,625)."""
        return {
            "prompt_tokens": self.prompt_tokens, "action": self.action.value, "fetch_tokens": self.fetch_tokens,
            "fetch_bytes": self.fetch_bytes, "snapshot_position": self.snapshot_position,
            "resume_tokens": self.resume_tokens, "replay_start": self.replay_start,
            "replay_tokens": self.replay_tokens, "prefill_tokens": self.prefill_tokens,
            "usable_tokens": self.usable_tokens, "found_tokens": self.found_tokens, "lease_id": self.lease_id,
            "estimated_s": self.estimated_s, "reasons": list(self.reasons), "lookup_s": self.lookup_s,
            "plan_s": self.plan_s, **({"hosts": [h.to_dict() for h in self.hosts]} if self.hosts else {}),
        }
