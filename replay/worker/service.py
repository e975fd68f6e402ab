"""The kvstore.v1.Worker service: one grpc.aio server with Worker, health and reflection on one port.

The servicer only translates messages: a RunRequest becomes a `RunSpec`, the
runner executes it on a single device thread (model calls never run on the
event loop), and its `RunOutcome` becomes a RunResponse. Runs queue for the
device one at a time, at most `max_queued_runs` waiting; a Run whose deadline
passes while it waits or computes ends DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway.status import unary
from gateway.undecodable import UndecodableRequests
from kvstore.errors import DeadlineExceeded, ResourceExhausted
from kvstore.v1 import worker_pb2 as pb
from kvstore.v1 import worker_pb2_grpc as pb_grpc
from replay.worker.runner import Runner, RunOutcome
from replay.worker.settings import WorkerSettings
from replay.worker.spec import RunSpec

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name

#: The wire's action enum and the plan's action names (replay.plan.Action values).
ACTION_NAMES: dict[int, str] = {
    pb.RUN_ACTION_FULL_PREFILL: "full-prefill",
    pb.RUN_ACTION_FETCH_SNAPSHOT: "fetch+snapshot",
    pb.RUN_ACTION_BOUNDED_REPLAY: "bounded-replay",
    pb.RUN_ACTION_EXACT_REPLAY: "exact-replay",
}


def spec_of(request: pb.RunRequest) -> RunSpec:
    """The runner's view of a RunRequest (checked later, by the runner)."""
    return RunSpec(
        tokens=list(request.tokens), extra_keys=list(request.extra_keys), namespace=request.namespace,
        action=ACTION_NAMES.get(request.action, f"RunAction {request.action}"),
        fetch_tokens=request.fetch_tokens,
        snapshot_position=request.snapshot_position if request.HasField("snapshot_position") else None,
        resume_tokens=request.resume_tokens,
        replay_start=request.replay_start if request.HasField("replay_start") else None,
        max_new_tokens=request.max_new_tokens, store=request.store, snapshot_every=request.snapshot_every,
        tail_prefill=request.tail_prefill, lease_id=request.lease_id, keep_until_s=request.keep_until_s)


def response_of(out: RunOutcome) -> pb.RunResponse:
    """The RunResponse of a Run's outcome."""
    t = out.timings
    return pb.RunResponse(
        logits=out.logits.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4").tobytes(),
        output_tokens=out.output_tokens, tokens_computed=out.tokens_computed, tokens_replayed=out.tokens_replayed,
        blocks_fetched=out.blocks_fetched, blocks_stored=out.blocks_stored,
        snapshot_positions=out.snapshot_positions, snapshot_loaded=out.snapshot_loaded,
        resume_tokens=out.resume_tokens, vocab_size=int(out.logits.numel()), store_error=out.store_error,
        kept_in_put=out.kept_in_put, kept_until_s=out.kept_until_s, keep_note=out.keep_note,
        timings=pb.RunTimings(**{k: t.get(k, 0.0) for k in pb.RunTimings.DESCRIPTOR.fields_by_name}))


class WorkerServicer(pb_grpc.WorkerServicer):
    """Translates Worker calls into runner calls.

    Args:
        runner: executes plans on the model.
        settings: the worker's bounds (queue length).
    """

    def __init__(self, runner: Runner, settings: WorkerSettings) -> None:
        self.runner = runner
        self.settings = settings
        #: The device thread: Runs execute one after another, never on the event loop.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-worker-device")
        self._pending = 0

    @unary
    async def GetInfo(self, request: pb.WorkerInfoRequest, context: grpc.aio.ServicerContext
                      ) -> pb.WorkerInfoResponse:
        model, geometry = self.runner.model, self.runner.geometry
        return pb.WorkerInfoResponse(
            model_config_json=json.dumps(model.config.to_dict(), sort_keys=True), geometry=geometry.name,
            geometry_fingerprint=geometry.fingerprint, device=str(self.runner.device),
            block_tokens=self.runner.limits.block_tokens, tokens_per_s=self.runner.tokens_per_s,
            store_target=self.runner.stores.target, max_prompt_tokens=self.settings.max_prompt_tokens,
            max_new_tokens=self.settings.max_new_tokens, vocab_size=model.config.vocab_size,
            window=geometry.window, batch_invariant=bool(getattr(model, "batch_invariant", False)))

    @unary
    async def Run(self, request: pb.RunRequest, context: grpc.aio.ServicerContext) -> pb.RunResponse:
        start = time.perf_counter()
        spec = spec_of(request)
        self.runner.check(spec)  # a bad request is refused before it queues
        if self._pending > self.settings.max_queued_runs:
            raise ResourceExhausted(f"{self._pending} Runs are waiting for the device "
                                    f"(worker max_queued_runs = {self.settings.max_queued_runs})",
                                    hint="retry later, or send the request to another worker")
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        gone = threading.Event()  # the call ended (cancelled, or its deadline passed): stop computing
        context.add_done_callback(lambda _: gone.set())

        def should_stop() -> bool:
            return gone.is_set() or (deadline is not None and time.monotonic() > deadline)

        self._pending += 1
        future = asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: self.runner.run(spec, should_stop=should_stop))
        future.add_done_callback(self._done)  # counted until the device thread is done with it
        try:
            out = await asyncio.wait_for(asyncio.shield(future), timeout=remaining)
        except TimeoutError:
            raise DeadlineExceeded("the Run passed its deadline (it stops at its next model call)") from None
        out.timings["queued_s"] = max(time.perf_counter() - start - out.timings.get("total_s", 0.0), 0.0)
        out.timings["total_s"] = time.perf_counter() - start
        return response_of(out)

    def _done(self, future: asyncio.Future[RunOutcome]) -> None:
        self._pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a Run whose caller left ends quietly

    def close(self) -> None:
        """Stop the device thread once the Run on it ends."""
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class RunningWorker:
    """A started worker: its port, its gRPC server, the servicer and its health service."""

    port: int
    server: grpc.aio.Server
    servicer: WorkerServicer
    health: health_aio.HealthServicer
    host: str = "127.0.0.1"
    stopped: bool = False

    @property
    def target(self) -> str:
        """Where clients on this host reach it."""
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls, let in-flight ones finish for `grace_s`, close the store connections."""
        if self.stopped:
            return
        self.stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        self.servicer.close()
        self.servicer.runner.stores.close()


async def start(settings: WorkerSettings, runner: Runner) -> RunningWorker:
    """Serve `runner` as kvstore.v1.Worker (with health and reflection) on `settings.host:port`.

    Raises:
        OSError: the address cannot be bound.
    """
    limit = settings.max_message_bytes
    server = grpc.aio.server(interceptors=[UndecodableRequests()], options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),
    ])
    servicer = WorkerServicer(runner, settings)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # newer grpcio raises instead of returning 0
        servicer.close()
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        servicer.close()
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return RunningWorker(port=port, server=server, servicer=servicer, health=health, host=settings.host)
