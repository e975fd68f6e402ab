"""The values a trace reader produces: one request, and a whole trace in arrival order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        session: the conversation it belongs to ("trace_0004", a subagent "trace_0004/agent_001",
            or, for a trace of independent requests, the line: "line 17").
        scope: the block ids' scope: requests of different scopes never share a block, even
            with equal ids (weka's `hash_id_scope: local` is one scope per session file;
            "" for a trace whose ids are global).
        arrival_s: seconds from the trace's start.
        input_tokens: the prompt's tokens.
        output_tokens: the tokens the model generated.
        block_ids: the prompt's blocks, by id, of `source_block_tokens` tokens each.
        source_block_tokens: tokens per block id in the trace (64 for weka, 512 for Mooncake).
        where: the file and line (or request path) it came from, for messages.
    """

    session: str
    scope: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: Sequence[int]
    source_block_tokens: int
    where: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """A whole trace: its requests sorted by arrival (ties kept in file order).

    Attributes:
        name: what it was read from.
        kind: "weka" or "mooncake".
        requests: every request, in arrival order.
        sessions: sessions (a subagent counts as one), in order of their first request.
    """

    name: str
    kind: str
    requests: list[TraceRequest]
    sessions: list[str] = field(default_factory=list)

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def block_refs(self) -> int:
        """Block ids named over all requests (a block named twice counts twice)."""
        return sum(len(r.block_ids) for r in self.requests)
