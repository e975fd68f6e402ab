"""The Worker service: GetInfo, health and reflection, deadlines, the device queue, and `kvstore worker`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import Client
from kvstore.client.worker import WorkerClient
from kvstore.errors import DeadlineExceeded, ResourceExhausted
from kvstore.geometry import TINY

pytest.importorskip("torch")

from replay.model import TINY_MODEL, ModelConfig
from replay.worker.spec import RunSpec
from tests.children import Child

ROOT = Path(__file__).resolve().parents[3]


def test_get_info_names_the_model_store_and_limits(workers: WorkerClient, server: Any) -> None:
    info = workers.info()
    assert ModelConfig.from_dict(info.model_config) == TINY_MODEL
    assert (info.geometry, info.geometry_fingerprint) == (TINY.name, TINY.fingerprint)
    assert info.block_tokens == 16 and info.store_target == server.target
    assert info.device == "cpu" and info.vocab_size == 128 and info.window == 8
    assert info.tokens_per_s is None  # nothing measured before the first Run
    workers.run(list(range(40)), None, store=False)
    measured = workers.info().tokens_per_s
    assert measured is not None and measured > 0


def test_health_and_reflection_answer(worker: Any) -> None:
    with grpc.insecure_channel(worker.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.Worker"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=10)
        names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"kvstore.v1.Worker", "grpc.health.v1.Health"} <= names


def test_a_run_past_its_deadline_while_queued_fetches_nothing(worker: Any, workers: WorkerClient,
                                                               store: Client) -> None:
    prompt = list(range(40))
    longer = [*prompt, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    workers.run(prompt, None)  # blocks 0-1 and a snapshot at 32
    lease = store.lookup(prompt, lease_ms=60_000).lease_id
    fetch = SimpleNamespace(action="fetch+snapshot", fetch_tokens=32, snapshot_position=32, resume_tokens=32,
                            replay_start=None, lease_id=lease)
    with worker.servicer.runner.device_lock, pytest.raises(DeadlineExceeded):  # the device is busy
        workers.run(longer, fetch, timeout_s=0.5)
    # The queued Run met its deadline when the device freed: it fetched nothing (the lease is
    # still held: the worker releases it after fetching) and stored nothing.
    deadline = time.monotonic() + 30
    while worker.servicer._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.servicer._pending == 0
    assert store.stats().active_leases == 1
    assert store.lookup(longer).found_tokens == 32


def stop_after(calls: int) -> Any:
    """A should_stop that says stop from its `calls`-th question on."""
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) >= calls

    return should_stop


def test_a_run_stops_between_model_calls_once_told(worker: Any, store: Client) -> None:
    runner = worker.servicer.runner
    prompt = list(range(20))
    with pytest.raises(DeadlineExceeded, match="during the prefill"):
        runner.run(RunSpec(tokens=prompt), should_stop=stop_after(3))  # start, segment [0, 16), then [16, 20)
    with pytest.raises(DeadlineExceeded, match="during the decode, after 2 tokens"):
        runner.run(RunSpec(tokens=prompt, max_new_tokens=5), should_stop=stop_after(6))
    assert store.lookup(prompt).found_tokens == 0  # a stopped Run stores nothing


def test_runs_beyond_the_queue_are_refused(start_worker: Any) -> None:
    worker = start_worker(max_queued_runs=1)
    results: list[BaseException | None] = []
    with WorkerClient(worker.target, timeout_s=60) as w:
        def call() -> None:
            try:
                w.run(list(range(20)), None, store=False)
                results.append(None)
            except BaseException as exc:
                results.append(exc)

        threads = [threading.Thread(target=call) for _ in range(2)]  # one on the device, one waiting
        with worker.servicer.runner.device_lock:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while worker.servicer._pending < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(ResourceExhausted, match="max_queued_runs = 1"):
                w.run(list(range(20)), None, store=False)
        for t in threads:
            t.join(60)
    assert results == [None, None]


def test_kvstore_worker_command_serves_until_sigterm(server: Any, tmp_path: Path) -> None:
    worker = Child("worker", ["worker", "--target", server.target, "--model", "tiny", "--port", "0",
                              "--device", "cpu"], tmp_path / "logs")
    try:
        with WorkerClient(worker.target, timeout_s=60) as w:
            assert w.info().geometry == TINY.name
            run = w.run(list(range(40)), None)
        assert run.blocks_stored == 2
        with Client(server.target, geometry=TINY.name) as c:
            assert c.lookup(list(range(40))).found_tokens == 32
        assert worker.stop() == 0, worker.log()
    finally:
        worker.kill_if_alive()


def test_kvstore_worker_refuses_a_store_it_cannot_reach(tmp_path: Path) -> None:
    config = tmp_path / "config.json"  # a config.json naming the tiny geometry: the same model as --model tiny
    config.write_text(json.dumps({"name": TINY.name, **TINY.to_config()}))
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "worker", "--target", "127.0.0.1:1",
                           "--port", "0", "--store-timeout", "2", "--model", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "Unavailable" in done.stderr


def test_kvstore_worker_reaches_a_store_with_auth_by_its_token(start_server: Any, store_settings: Any,
                                                                tmp_path: Path) -> None:
    from dataclasses import replace

    from kvstore import api_tokens

    settings = replace(store_settings, block_tokens=16)
    token = api_tokens.create(settings.data_dir / "tenants.json", "alice", frozenset({"read", "write"}))[1]
    server = start_server(settings)
    command = [sys.executable, "-m", "kvstore.cli", "worker", "--target", server.target, "--model", "tiny",
               "--port", "0", "--store-timeout", "10"]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode == 2 and "Unauthenticated" in refused.stderr  # no token: no store, no worker
    worker = Child("worker", [*command[3:], "--token", token], tmp_path / "logs")
    try:
        with WorkerClient(worker.target, timeout_s=60) as w:
            assert w.run(list(range(40)), None).blocks_stored == 2
        with Client(server.target, geometry=TINY.name, token=token) as alice:  # stored in the token's tenant
            assert alice.lookup(list(range(40))).found_tokens == 32
    finally:
        worker.kill_if_alive()
