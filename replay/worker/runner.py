"""Executes one resume plan with the model and the store client (docs/WORKER.md "What a Run does").

1. Fetch blocks [0, fetch_tokens) and, for fetch+snapshot, the snapshot at T;
   one that vanished since the plan is FAILED_PRECONDITION naming it (the
   planner plans again). The plan's lease is released once they are in.
2. Restore the state (replay.model.cache_io.restore_state); for a replay,
   recompute [replay_start, fetch_tokens) with an empty window and put the
   rebuilt snapshot at H back, so the next turn is a full hit.
3. Prefill [resume_tokens, len(tokens)), split at the snapshot points; the last
   position's logits are the answer.
4. Greedy-decode max_new_tokens (each token extended, so the state covers the output).
5. Store the new full blocks (those not fetched) and the snapshots at the block
   boundary at or below the prompt end and the output end (and every N).

The runner is synchronous and holds the device lock for a whole Run; the service
calls it off the event loop. `should_stop` is polled between model calls, so a
Run whose deadline passed stops with DEADLINE_EXCEEDED instead of finishing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.client import Client
from kvstore.counted import counted
from kvstore.errors import DeadlineExceeded, FailedPrecondition, KVStoreError
from replay.model import ReferenceModel
from replay.model.cache_io import restore_state, state_blocks, state_snapshot
from replay.model.state import CacheState
from replay.worker.settings import WorkerSettings
from replay.worker.spec import FETCH_SNAPSHOT, REPLAYS, Limits, RunSpec, check_run, segments, snapshot_points
from replay.worker.stores import StoreClients

log = logging.getLogger("kvstore.worker")


@dataclass
class RunOutcome:
    """What one Run computed and stored."""

    logits: torch.Tensor = field(repr=False)  # float32 [vocab] on the CPU: next-token logits after the prompt
    output_tokens: list[int]
    resume_tokens: int
    snapshot_loaded: bool = False
    tokens_computed: int = 0
    tokens_replayed: int = 0
    blocks_fetched: int = 0
    blocks_stored: int = 0
    snapshot_positions: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    store_error: str = ""
    #: The spec's keep_until_s was asked in the Run's Put (R22), granted until kept_until_s (0: none), why less.
    kept_in_put: bool = False
    kept_until_s: float = 0.0
    keep_note: str = ""


class Runner:
    """Runs plans for one model on one device against one kvstore server.

    Args:
        model: the model (its config names the geometry the store must serve).
        stores: the store connections.
        settings: the request bounds.
    """

    def __init__(self, model: ReferenceModel, stores: StoreClients, settings: WorkerSettings) -> None:
        self.model = model
        # Steps that fit (bounded replays) go through CUDA graphs only on CUDA and when the settings allow.
        model.graphs = settings.cuda_graphs and model.device.type == "cuda"
        self.stores = stores
        self.settings = settings
        self.geometry = model.config.geometry
        self.device = torch.device(settings.device)
        self.limits = Limits(vocab_size=model.config.vocab_size, block_tokens=stores.block_tokens,
                             max_prompt_tokens=settings.max_prompt_tokens, max_new_tokens=settings.max_new_tokens)
        #: Held for a whole Run: one Run at a time on the device.
        self.device_lock = threading.Lock()
        self._computed_tokens = 0
        self._compute_s = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Positions computed per second of model time over every Run so far (0: none yet)."""
        return self._computed_tokens / self._compute_s if self._compute_s > 0 else 0.0

    def check(self, spec: RunSpec) -> None:
        """Refuse a Run this worker cannot execute (InvalidArgument naming the field and its limit)."""
        check_run(spec, self.geometry, self.limits)

    def run(self, spec: RunSpec, *, should_stop: Callable[[], bool] = lambda: False) -> RunOutcome:
        """Execute `spec` (checked first) under the device lock.

        Raises:
            InvalidArgument: a bad request.
            FailedPrecondition: a block or the snapshot of the plan is no longer stored.
            DeadlineExceeded: `should_stop` said so between two model calls.
            KVStoreError: the store could not be asked (its class).
        """
        self.check(spec)
        with self.device_lock:
            _stop_if(should_stop, "before it started (it waited for the device past its deadline)")
            return _Run(self, spec, should_stop).execute()

    def count(self, tokens: int, seconds: float) -> None:
        """Add a model phase to the measured rate."""
        self._computed_tokens += tokens
        self._compute_s += seconds


def _stop_if(should_stop: Callable[[], bool], where: str) -> None:
    if should_stop():
        raise DeadlineExceeded(f"the Run passed its deadline {where}",
                               hint="give the call a longer deadline, or plan a full prefill elsewhere")


class _Run:
    """One Run's steps, sharing the request, the client and the state."""

    def __init__(self, runner: Runner, spec: RunSpec, should_stop: Callable[[], bool]) -> None:
        self.runner, self.spec, self.should_stop = runner, spec, should_stop
        self.model = runner.model
        self.geometry = runner.geometry
        self.client: Client = runner.stores.client(spec.namespace)
        self.b = self.client.block_tokens
        self.seq = list(spec.tokens)
        self.timings: dict[str, float] = {}
        self.snapshots: list[tuple[int, bytes]] = []  # (T, bytes) to put at the end
        self.hashes: list[bytes] = []  # chain hashes of the prompt's full blocks (when blocks are fetched)

    def execute(self) -> RunOutcome:
        spec = self.spec
        start = time.perf_counter()
        state, out = self._load()
        if spec.action in REPLAYS:
            state = self._replay(state, out)
        n = len(spec.tokens)
        points = snapshot_points(start=spec.resume_tokens, prompt_tokens=n, total_tokens=n + spec.max_new_tokens,
                                 block_tokens=self.b, every=spec.snapshot_every) if spec.store else []
        points = [p for p in points if p not in out.snapshot_positions]  # the rebuilt one at H is put already
        out.logits = self._prefill(state, points)
        out.output_tokens = self._decode(state, out.logits, points)
        out.tokens_computed += (n - spec.resume_tokens) + len(out.output_tokens)
        if spec.store:
            self._store(state, out)
        self.timings["total_s"] = time.perf_counter() - start
        out.timings = self.timings
        return out

    # -- 1. fetch and restore ----------------------------------------------

    def _load(self) -> tuple[CacheState, RunOutcome]:
        spec = self.spec
        out = RunOutcome(logits=torch.empty(0), output_tokens=[], resume_tokens=spec.resume_tokens)
        if not spec.fetch_tokens:
            return self.model.new_state(), out
        t0 = time.perf_counter()
        self.hashes = self.client.hashes(spec.tokens, extra_keys=spec.extra_keys)
        wanted = spec.fetch_tokens // self.b
        got = self.client.get_hashes(self.hashes[:wanted])
        for i, (block, status) in enumerate(zip(got.blocks, got.statuses, strict=True)):
            if block is None:
                raise FailedPrecondition(f"block {i} (tokens [{i * self.b}, {(i + 1) * self.b})) of the plan is "
                                         f"no longer stored ({status})", hint="plan again: the store changed")
        snapshot = None
        if spec.action == FETCH_SNAPSHOT:
            assert spec.snapshot_position is not None  # checked
            snapshot = self.client.swa.get(spec.tokens, spec.snapshot_position, extra_keys=spec.extra_keys)
            if snapshot is None:
                raise FailedPrecondition(f"the snapshot at {spec.snapshot_position} of the plan is no longer in "
                                         "the pool (expired, evicted or never stored)",
                                         hint="plan again: the store changed")
        self._release_lease()
        position = spec.snapshot_position if snapshot is not None else spec.fetch_tokens
        state = restore_state(self.geometry, got.blocks, snapshot, position=position,  # type: ignore[arg-type]
                              resume=spec.resume_tokens, device=self.runner.device)
        out.blocks_fetched, out.snapshot_loaded = wanted, snapshot is not None
        self.timings["fetch_s"] = time.perf_counter() - t0
        return state, out

    def _release_lease(self) -> None:
        """The blocks are in: the plan's lease has done its job (an expired one is no error)."""
        if not self.spec.lease_id:
            return
        try:
            self.client.release(self.spec.lease_id)
        except KVStoreError as exc:
            log.warning("could not release lease %s: %s", self.spec.lease_id, exc.message)

    # -- 2. replay -----------------------------------------------------------

    def _replay(self, rows: CacheState, out: RunOutcome) -> CacheState:
        spec = self.spec
        _stop_if(self.should_stop, "before the replay")
        t0 = time.perf_counter()
        state = self.model.replay(spec.tokens, rows, span=spec.replay_span)
        self.timings["replay_s"] = elapsed = time.perf_counter() - t0
        self.runner.count(spec.replay_span, elapsed)
        out.tokens_replayed = out.tokens_computed = min(spec.replay_span, spec.fetch_tokens)
        if spec.store:
            # The next turn of this conversation then finds a snapshot at H: a full hit.
            try:
                self._put_snapshots([(state.length, state_snapshot(self.geometry, state))], out)
            except KVStoreError as exc:
                out.store_error = f"the rebuilt snapshot at {state.length}: {type(exc).__name__}: {exc.message}"
        return state

    # -- 3. prefill and 4. decode -------------------------------------------

    def _snapshot_if(self, state: CacheState, points: list[int]) -> None:
        if state.length in points:
            self.snapshots.append((state.length, state_snapshot(self.geometry, state)))

    def _prefill(self, state: CacheState, points: list[int]) -> torch.Tensor:
        spec = self.spec
        t0 = time.perf_counter()
        logits = torch.empty(0)
        for a, b in segments(spec.resume_tokens, len(spec.tokens), points):
            _stop_if(self.should_stop, f"during the prefill, at position {a}")
            logits = self.model.extend(state, spec.tokens[a:b], tail_prefill=spec.tail_prefill,
                                       chunk=self.runner.settings.chunk_tokens)[-1]
            self._snapshot_if(state, points)
        self.timings["prefill_s"] = elapsed = time.perf_counter() - t0
        self.runner.count(len(spec.tokens) - spec.resume_tokens, elapsed)
        return logits.float().cpu()

    def _decode(self, state: CacheState, logits: torch.Tensor, points: list[int]) -> list[int]:
        t0 = time.perf_counter()
        tokens: list[int] = []
        nxt = logits
        for _ in range(self.spec.max_new_tokens):
            _stop_if(self.should_stop, f"during the decode, after {counted(len(tokens), 'token')}")
            token = int(torch.argmax(nxt))
            tokens.append(token)
            self.seq.append(token)
            nxt = self.model.extend(state, [token], tail_prefill=False)[-1]
            self._snapshot_if(state, points)
        self.timings["decode_s"] = time.perf_counter() - t0
        return tokens

    # -- 5. store ------------------------------------------------------------

    def _store(self, state: CacheState, out: RunOutcome) -> None:
        t0 = time.perf_counter()
        try:
            first, end = self.spec.fetch_tokens // self.b, state.length // self.b
            if end > first:
                blocks = state_blocks(self.geometry, state, self.b, start_block=first)
                parent = self.hashes[first - 1] if first else None
                put = self.client.put(self.seq[:end * self.b], blocks, extra_keys=self.spec.extra_keys,
                                      first_block=first, parent=parent, keep_until_s=self.spec.keep_until_s)
                out.blocks_stored = put.written_blocks
                if self.spec.keep_until_s:  # pinned in this Put's own transaction: the caller asks no Lookup
                    out.kept_in_put, out.kept_until_s, out.keep_note = True, put.kept_until_s, put.keep_note
            self._put_snapshots(self.snapshots, out)
        except KVStoreError as exc:
            # What was computed stands (the logits are right); the caller learns what did not land.
            out.store_error = f"{type(exc).__name__}: {exc.message}"
            log.warning("storing the Run's cache failed: %s", out.store_error)
        self.timings["store_s"] = time.perf_counter() - t0

    def _put_snapshots(self, snapshots: list[tuple[int, bytes]], out: RunOutcome) -> None:
        if not snapshots:
            return
        keys = self.client.swa.keys(self.seq, [t for t, _ in snapshots], extra_keys=self.spec.extra_keys)
        result = self.client.swa.put_many([(k, t, data) for k, (t, data) in zip(keys, snapshots, strict=True)])
        if result.failed:
            raise FailedPrecondition(f"{result.failed} of {len(snapshots)} snapshots were lost: the pool's "
                                     "backend is unreachable")
        out.snapshot_positions.extend(t for t, _ in snapshots)
