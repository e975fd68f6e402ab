"""One Run as the runner takes it (`RunSpec`), and the checks a request passes before any work.

The service turns a `kvstore.v1.RunRequest` into a RunSpec; `check_run` refuses
one the worker cannot run with InvalidArgument naming the field and its limit,
before anything is fetched or computed (docs/WORKER.md "Validation").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.prefix import encode_extra_keys
from kvstore.swa_snapshot import serves

#: The plan actions, named as replay.plan.Action's values (the wire carries an enum).
FULL_PREFILL = "full-prefill"
FETCH_SNAPSHOT = "fetch+snapshot"
BOUNDED_REPLAY = "bounded-replay"
EXACT_REPLAY = "exact-replay"
ACTIONS = (FULL_PREFILL, FETCH_SNAPSHOT, BOUNDED_REPLAY, EXACT_REPLAY)
REPLAYS = (BOUNDED_REPLAY, EXACT_REPLAY)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What one Run asks: the prompt, the plan's fields and what to do after the prompt."""

    tokens: list[int] = field(repr=False)
    extra_keys: list[bytes] = field(default_factory=list)
    namespace: str = ""  # the tenant; empty: the worker's token's ("default" without auth)
    action: str = FULL_PREFILL
    fetch_tokens: int = 0
    snapshot_position: int | None = None
    resume_tokens: int = 0
    replay_start: int | None = None
    max_new_tokens: int = 0
    store: bool = True
    snapshot_every: int = 0
    tail_prefill: bool = False
    lease_id: str = ""
    #: The request's retention hint (a Unix time; 0: none): the Run's Put pins its last block (R22).
    keep_until_s: float = 0.0

    @property
    def replay_span(self) -> int:
        """Positions the replay recomputes: fetch_tokens - replay_start (0 without a replay)."""
        return self.fetch_tokens - self.replay_start if self.replay_start is not None else 0


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What bounds a Run on this worker."""

    vocab_size: int
    block_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, hint="fix the request (docs/WORKER.md); nothing was fetched or computed")


def check_run(spec: RunSpec, geometry: ModelGeometry, limits: Limits) -> None:
    """Refuse a Run this worker cannot execute as asked.

    Raises:
        InvalidArgument: naming the field, its value and the limit it breaks.
    """
    n = len(spec.tokens)
    if n < 1:
        raise _bad("tokens is empty: a Run needs at least one token")
    if n > limits.max_prompt_tokens:
        raise _bad(f"tokens: {n} tokens is over this worker's limit of {limits.max_prompt_tokens} "
                   "(worker max_prompt_tokens)")
    top = max(spec.tokens)
    if top >= limits.vocab_size:
        at = spec.tokens.index(top)
        raise _bad(f"tokens[{at}] = {top} is not below the model's vocab_size = {limits.vocab_size}")
    if spec.max_new_tokens > limits.max_new_tokens:
        raise _bad(f"max_new_tokens = {spec.max_new_tokens} is over this worker's limit of "
                   f"{limits.max_new_tokens}")
    b = limits.block_tokens
    if spec.snapshot_every % b:
        raise _bad(f"snapshot_every = {spec.snapshot_every} is not a multiple of block_tokens = {b} "
                   "(snapshots are taken at block boundaries)")
    encode_extra_keys(spec.extra_keys)  # raises InvalidArgument naming the key
    if spec.action not in ACTIONS:
        raise _bad(f"action is unset or unknown ({spec.action!r}); one of {', '.join(ACTIONS)}")
    if spec.action == FULL_PREFILL:
        _check_full_prefill(spec)
        return
    _check_fetch(spec, n, b)
    if spec.action == FETCH_SNAPSHOT:
        _check_snapshot(spec, geometry, n)
    else:
        _check_replay(spec)


def _check_full_prefill(spec: RunSpec) -> None:
    for name in ("fetch_tokens", "resume_tokens"):
        if getattr(spec, name):
            raise _bad(f"{name} = {getattr(spec, name)}: a full prefill fetches nothing and resumes at 0")
    for name in ("snapshot_position", "replay_start"):
        if getattr(spec, name) is not None:
            raise _bad(f"{name} is set: a full prefill has none")


def _check_fetch(spec: RunSpec, n: int, b: int) -> None:
    if spec.fetch_tokens <= 0 or spec.fetch_tokens % b:
        raise _bad(f"fetch_tokens = {spec.fetch_tokens} must be a positive multiple of block_tokens = {b} "
                   f"for {spec.action}")
    if spec.fetch_tokens > n:
        raise _bad(f"fetch_tokens = {spec.fetch_tokens} is past the prompt's {n} tokens")
    if not 1 <= spec.resume_tokens <= n - 1:
        raise _bad(f"resume_tokens = {spec.resume_tokens} must be in [1, len(tokens) - 1 = {n - 1}]: "
                   "the worker computes at least the last prompt token, for its logits")
    if spec.resume_tokens > spec.fetch_tokens:
        raise _bad(f"resume_tokens = {spec.resume_tokens} is past fetch_tokens = {spec.fetch_tokens}: a resume "
                   "at R needs the global rows of every position below R")


def _check_snapshot(spec: RunSpec, geometry: ModelGeometry, n: int) -> None:
    t = spec.snapshot_position
    if t is None:
        raise _bad("snapshot_position is unset: fetch+snapshot loads the snapshot taken there")
    if not 1 <= t <= min(n, spec.fetch_tokens + 1):
        raise _bad(f"snapshot_position = {t} must be in [1, min(len(tokens), fetch_tokens + 1) = "
                   f"{min(n, spec.fetch_tokens + 1)}]")
    if not serves(geometry, t, spec.resume_tokens):
        raise _bad(f"resume_tokens = {spec.resume_tokens} is not served by the snapshot at {t} (resume rules: "
                   f"T itself; T - 1 too for an even T; any shorter length below the window = {geometry.window})")
    if spec.replay_start is not None:
        raise _bad("replay_start is set: fetch+snapshot replays nothing")


def _check_replay(spec: RunSpec) -> None:
    if spec.snapshot_position is not None:
        raise _bad(f"snapshot_position is set: {spec.action} starts from an empty window, not a snapshot")
    if spec.replay_start is None:
        raise _bad(f"replay_start is unset: {spec.action} recomputes [replay_start, fetch_tokens)")
    if spec.replay_start >= spec.fetch_tokens:
        raise _bad(f"replay_start = {spec.replay_start} must be below fetch_tokens = {spec.fetch_tokens}")
    if spec.resume_tokens != spec.fetch_tokens:
        raise _bad(f"resume_tokens = {spec.resume_tokens} must equal fetch_tokens = {spec.fetch_tokens} "
                   f"after {spec.action}: the state is rebuilt at the end of the fetched blocks")


def snapshot_points(*, start: int, prompt_tokens: int, total_tokens: int, block_tokens: int,
                    every: int) -> list[int]:
    """Positions in (start, total_tokens] where the worker snapshots, ascending.

    The block boundary at or below the prompt end and at or below the output end
    (the two points DeepSeek keeps), and every `every` tokens when it is not 0.
    """
    b = block_tokens
    points = {prompt_tokens // b * b, total_tokens // b * b}
    if every:
        points.update(range(every, total_tokens + 1, every))
    return sorted(p for p in points if start < p <= total_tokens)


def segments(start: int, end: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    """[a, b) runs covering [start, end), cut at every position of `cuts` inside it."""
    bounds = [start, *sorted(c for c in cuts if start < c < end), end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
