"""Usable-token counters: what resume planners report of their plans (ReportResume).

The store sees raw hits only (Lookup's found tokens). A found prefix that
neither an SWA snapshot nor a feasible replay can use is no hit at all
(replay/planner.py), so the hit rate an operator should read is the planner's:
tokens served from cache over prompt tokens. Planners report each plan here;
Stats shows the totals, all tenants together, since the server started.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.v1 import kvstore_pb2 as pb

#: Plan counters by action, named after the StatsResponse field each fills.
ACTION_FIELDS: dict[pb.ResumeAction, str] = {
    pb.RESUME_ACTION_FETCH_SNAPSHOT: "resume_fetch_snapshot_plans",
    pb.RESUME_ACTION_BOUNDED_REPLAY: "resume_bounded_replay_plans",
    pb.RESUME_ACTION_EXACT_REPLAY: "resume_exact_replay_plans",
    pb.RESUME_ACTION_FULL_PREFILL: "resume_full_prefill_plans",
}


@dataclass(frozen=True, kw_only=True)
class ResumeReport:
    """One checked plan report."""

    prompt_tokens: int
    found_tokens: int
    usable_tokens: int
    action: pb.ResumeAction


def check_report(request: pb.ReportResumeRequest, *, max_prompt_tokens: int) -> ResumeReport:
    """The report in `request`, checked.

    Args:
        request: the wire message (geometry and namespace are checked by the caller).
        max_prompt_tokens: the longest prompt one Lookup can cover.

    Raises:
        InvalidArgument: an unknown action, a prompt of 0 tokens or past the bound, more found
            than prompt tokens, more usable than found, or a count that contradicts the action
            (a full prefill serves 0 tokens from cache; any other plan at least 1).
    """
    if request.action not in ACTION_FIELDS:
        names = ", ".join(pb.ResumeAction.Name(a) for a in ACTION_FIELDS)
        raise InvalidArgument(f"action {request.action} is not a known resume action; send one of {names}")
    prompt, found, usable = request.prompt_tokens, request.found_tokens, request.usable_tokens
    if not 1 <= prompt <= max_prompt_tokens:
        raise InvalidArgument(f"prompt_tokens must be in [1, {max_prompt_tokens}] (the longest prompt one Lookup "
                              f"covers), got {prompt}")
    if found > prompt:
        raise InvalidArgument(f"found_tokens {found} exceeds prompt_tokens {prompt}")
    if usable > found:
        raise InvalidArgument(f"usable_tokens {usable} exceeds found_tokens {found}: a plan serves from cache "
                              f"only what the store found")
    full_prefill = request.action == pb.RESUME_ACTION_FULL_PREFILL
    if full_prefill and usable:
        raise InvalidArgument(f"a full prefill serves no tokens from cache; usable_tokens must be 0, got {usable}")
    if not full_prefill and not usable:
        raise InvalidArgument(f"{pb.ResumeAction.Name(request.action)} serves tokens from cache; "
                              f"usable_tokens must be at least 1 (report a plan that uses nothing as FULL_PREFILL)")
    return ResumeReport(prompt_tokens=prompt, found_tokens=found, usable_tokens=usable, action=request.action)


@dataclass
class ResumeCounters:
    """Totals of the reported plans (one event loop updates them: no lock)."""

    plans: int = 0
    prompt_tokens: int = 0
    found_tokens: int = 0
    usable_tokens: int = 0
    by_action: dict[pb.ResumeAction, int] = field(default_factory=lambda: dict.fromkeys(ACTION_FIELDS, 0))

    def add(self, report: ResumeReport) -> None:
        """Count one plan."""
        self.plans += 1
        self.prompt_tokens += report.prompt_tokens
        self.found_tokens += report.found_tokens
        self.usable_tokens += report.usable_tokens
        self.by_action[report.action] += 1

    def stats_fields(self) -> dict[str, int]:
        """The StatsResponse fields these counters fill."""
        fields = {"resume_plans": self.plans, "resume_prompt_tokens": self.prompt_tokens,
                  "resume_found_tokens": self.found_tokens, "resume_usable_tokens": self.usable_tokens}
        fields.update({ACTION_FIELDS[a]: n for a, n in self.by_action.items()})
        return fields
