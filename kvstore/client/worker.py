"""The client of a worker (kvstore.v1.Worker): run a resume plan on an inference engine.

A worker is the engine that computes the cache (docs/WORKER.md): the reference
worker (`kvstore worker`) or a production engine speaking the same protocol.
`WorkerClient.run` sends a prompt and a plan (replay.plan.Plan, or anything with
its fields) and returns a `RunResult`; every gRPC failure surfaces as a
`kvstore.errors` class (UNAVAILABLE -> Unavailable, DEADLINE_EXCEEDED ->
DeadlineExceeded, ...), never a raw `grpc.RpcError`.

This module imports nothing of replay/ (the core never imports outer layers):
a plan is read by its attributes, its action by its string value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np

from kvstore.client import arguments
from kvstore.client.blocks import encode_extra_keys
from kvstore.client.connection import status_error
from kvstore.errors import InvalidArgument
from kvstore.prefix import ExtraKey
from kvstore.v1 import worker_pb2 as pb
from kvstore.v1 import worker_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

#: A plan's action value (replay.plan.Action.value) -> the wire's enum.
ACTIONS: dict[str, pb.RunAction] = {
    "full-prefill": pb.RUN_ACTION_FULL_PREFILL,
    "fetch+snapshot": pb.RUN_ACTION_FETCH_SNAPSHOT,
    "bounded-replay": pb.RUN_ACTION_BOUNDED_REPLAY,
    "exact-replay": pb.RUN_ACTION_EXACT_REPLAY,
}


class PlanFields(Protocol):
    """What the worker reads of a plan (replay.plan.Plan has these fields)."""

    @property
    def action(self) -> Any: ...  # an enum whose .value is one of ACTIONS, or that string
    @property
    def fetch_tokens(self) -> int: ...
    @property
    def snapshot_position(self) -> int | None: ...
    @property
    def resume_tokens(self) -> int: ...
    @property
    def replay_start(self) -> int | None: ...
    @property
    def lease_id(self) -> str | None: ...


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What a worker runs and what bounds a Run on it."""

    model_config: dict[str, Any]
    geometry: str
    geometry_fingerprint: bytes
    device: str
    block_tokens: int
    #: Measured prefill rate over the Runs so far; None before any Run.
    tokens_per_s: float | None
    store_target: str
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int
    window: int
    batch_invariant: bool


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a Run computed and stored (RunResponse, docs/WORKER.md)."""

    #: float32 [vocab_size] on the CPU: the next-token logits after the prompt (bit-exact as the worker computed them).
    logits: torch.Tensor = field(repr=False)
    output_tokens: list[int]
    tokens_computed: int
    tokens_replayed: int
    blocks_fetched: int
    blocks_stored: int
    snapshot_positions: list[int]
    snapshot_loaded: bool
    resume_tokens: int
    timings: dict[str, float]
    #: Why storing failed (the results stand); "" when stored or not asked.
    store_error: str
    #: `run(keep_until_s=)` was asked in the Run's Put (docs/RETENTION.md R22): the pin it granted (0: none),
    #: why less. False: no Put was made (nothing new to store) or the worker predates the field.
    kept_in_put: bool = False
    kept_until_s: float = 0.0
    keep_note: str = ""


def request_of(tokens: Sequence[int], plan: PlanFields | None, *, extra_keys: Sequence[ExtraKey] = (),
               namespace: str = "", max_new_tokens: int = 0, store: bool = True, snapshot_every: int = 0,
               tail_prefill: bool = False, keep_until_s: float = 0.0) -> pb.RunRequest:
    """The RunRequest of a prompt and a plan (None: a full prefill).

    Raises:
        InvalidArgument: a bad argument, or a plan whose action is unknown.
    """
    request = pb.RunRequest(
        tokens=arguments.token_ids(tokens), extra_keys=encode_extra_keys(arguments.extra_keys(extra_keys)),
        namespace=arguments.text(namespace, "namespace"),
        max_new_tokens=arguments.integer(max_new_tokens, "max_new_tokens", most=2**32 - 1), store=bool(store),
        snapshot_every=arguments.integer(snapshot_every, "snapshot_every"), tail_prefill=bool(tail_prefill),
        keep_until_s=arguments.keep_time(keep_until_s), action=pb.RUN_ACTION_FULL_PREFILL)
    if plan is None:
        return request
    name = getattr(plan.action, "value", plan.action)
    if name not in ACTIONS:
        raise InvalidArgument(f"plan action {name!r} is unknown; one of {', '.join(ACTIONS)}")
    request.action = ACTIONS[name]
    request.fetch_tokens = arguments.integer(plan.fetch_tokens, "plan.fetch_tokens")
    request.resume_tokens = arguments.integer(plan.resume_tokens, "plan.resume_tokens")
    if plan.snapshot_position is not None:
        request.snapshot_position = arguments.integer(plan.snapshot_position, "plan.snapshot_position")
    if plan.replay_start is not None:
        request.replay_start = arguments.integer(plan.replay_start, "plan.replay_start")
    request.lease_id = plan.lease_id or ""
    return request


def result_of(reply: pb.RunResponse) -> RunResult:
    """The RunResult of a RunResponse (its logits as a torch tensor: torch is imported here)."""
    import torch

    logits = torch.from_numpy(np.frombuffer(reply.logits, dtype="<f4").astype(np.float32))
    return RunResult(
        logits=logits, output_tokens=list(reply.output_tokens),
        tokens_computed=reply.tokens_computed, tokens_replayed=reply.tokens_replayed,
        blocks_fetched=reply.blocks_fetched, blocks_stored=reply.blocks_stored,
        snapshot_positions=list(reply.snapshot_positions), snapshot_loaded=reply.snapshot_loaded,
        resume_tokens=reply.resume_tokens, store_error=reply.store_error, kept_in_put=reply.kept_in_put,
        kept_until_s=reply.kept_until_s, keep_note=reply.keep_note,
        timings={f.name: getattr(reply.timings, f.name) for f in reply.timings.DESCRIPTOR.fields})


class WorkerClient:
    """A connection to one worker.

    Args:
        target: "host:port" of the worker.
        namespace: the tenant whose blocks and snapshots its Runs use (empty: the worker's token's tenant,
            "default" on a server without auth).
        timeout_s: deadline of each call (a Run that passes it raises DeadlineExceeded
            and the worker stops computing it).
    """

    def __init__(self, target: str, *, namespace: str = "", timeout_s: float = 120.0) -> None:
        self.target = arguments.text(target, "target")
        self.namespace = arguments.text(namespace, "namespace")
        self.timeout_s = arguments.seconds(timeout_s, "timeout_s")
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ])
        self._stub = pb_grpc.WorkerStub(self.channel)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout_s: float | None) -> Any:
        timeout = self.timeout_s if timeout_s is None else arguments.seconds(timeout_s, "timeout_s")
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def info(self, *, timeout_s: float | None = None) -> WorkerInfo:
        """The worker's model, geometry, device, block size, measured rate and limits."""
        r = self._call(self._stub.GetInfo, pb.WorkerInfoRequest(), timeout_s)
        return WorkerInfo(model_config=json.loads(r.model_config_json or "{}"), geometry=r.geometry,
                          geometry_fingerprint=r.geometry_fingerprint, device=r.device, block_tokens=r.block_tokens,
                          tokens_per_s=r.tokens_per_s or None, store_target=r.store_target,
                          max_prompt_tokens=r.max_prompt_tokens, max_new_tokens=r.max_new_tokens,
                          vocab_size=r.vocab_size, window=r.window, batch_invariant=r.batch_invariant)

    def run(self, tokens: Sequence[int], plan: PlanFields | None = None, *, extra_keys: Sequence[ExtraKey] = (),
            max_new_tokens: int = 0, store: bool = True, snapshot_every: int = 0, tail_prefill: bool = False,
            namespace: str | None = None, timeout_s: float | None = None, keep_until_s: float = 0.0) -> RunResult:
        """Run `plan` for the prompt `tokens` (None: a full prefill) on the worker.

        Args:
            tokens: the whole prompt.
            plan: what to fetch, restore and replay (replay.plan.Plan).
            extra_keys: the keys the prompt's blocks are hashed with.
            max_new_tokens: greedy tokens to decode after the prompt.
            store: put the new full blocks and the snapshots into the store.
            snapshot_every: also snapshot every N tokens (a multiple of block_tokens).
            tail_prefill: decoder-side tail prefill.
            namespace: the tenant of this Run (default: the client's).
            timeout_s: this call's deadline (default: the client's).
            keep_until_s: the request's retention hint (a Unix time; 0: none): the Run's Put pins the blocks it
                stores (its last block, and so its prefix) in its own transaction; the result says what was granted.

        Raises:
            InvalidArgument: a bad argument or plan (nothing ran).
            FailedPrecondition: a block or snapshot of the plan vanished since it was made (plan again).
            Unavailable: the worker (or its store) cannot be reached.
            DeadlineExceeded: the Run did not finish in time.
            ResourceExhausted: too many Runs wait for the worker's device.
        """
        request = request_of(tokens, plan, extra_keys=extra_keys,
                             namespace=self.namespace if namespace is None else namespace,
                             max_new_tokens=max_new_tokens, store=store, snapshot_every=snapshot_every,
                             tail_prefill=tail_prefill, keep_until_s=keep_until_s)
        return result_of(self._call(self._stub.Run, request, timeout_s))


__all__ = ["PlanFields", "RunResult", "WorkerClient", "WorkerInfo"]
