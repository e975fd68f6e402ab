"""A RunRequest the worker cannot run is refused with INVALID_ARGUMENT naming the field and its limit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.client.worker import WorkerClient
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY
from replay.worker.spec import Limits, RunSpec, check_run, segments, snapshot_points

pytest.importorskip("torch")

LIMITS = Limits(vocab_size=128, block_tokens=16, max_prompt_tokens=200, max_new_tokens=20)
PROMPT = list(range(50))


def spec(**fields: Any) -> RunSpec:
    return RunSpec(**{"tokens": PROMPT, **fields})


def snap(**fields: Any) -> RunSpec:
    return spec(**{"action": "fetch+snapshot", "fetch_tokens": 32, "snapshot_position": 32, "resume_tokens": 32,
                   **fields})


def replay(**fields: Any) -> RunSpec:
    return spec(**{"action": "bounded-replay", "fetch_tokens": 32, "resume_tokens": 32, "replay_start": 24,
                   **fields})


@pytest.mark.parametrize(("bad", "words"), [
    (spec(tokens=[]), "tokens is empty"),
    (spec(tokens=[0] * 201), "limit of 200"),
    (spec(tokens=[1, 2, 128]), "tokens[2] = 128 is not below the model's vocab_size = 128"),
    (spec(max_new_tokens=21), "max_new_tokens = 21 is over this worker's limit of 20"),
    (spec(snapshot_every=24), "snapshot_every = 24 is not a multiple of block_tokens = 16"),
    (spec(action="sideways"), "action is unset or unknown"),
    (spec(fetch_tokens=16), "fetch_tokens = 16: a full prefill"),
    (spec(snapshot_position=16), "snapshot_position is set: a full prefill"),
    (snap(fetch_tokens=24, resume_tokens=24, snapshot_position=24), "multiple of block_tokens = 16"),
    (snap(tokens=PROMPT[:30]), "fetch_tokens = 32 is past the prompt's 30 tokens"),
    (snap(tokens=PROMPT[:32]), "resume_tokens = 32 must be in [1, len(tokens) - 1 = 31]"),
    (snap(resume_tokens=0), "resume_tokens = 0 must be in [1,"),
    (snap(fetch_tokens=16, snapshot_position=16, resume_tokens=17), "past fetch_tokens = 16"),
    (snap(snapshot_position=None), "snapshot_position is unset"),
    (snap(snapshot_position=33, resume_tokens=32), "not served by the snapshot at 33"),
    (snap(resume_tokens=30), "resume_tokens = 30 is not served by the snapshot at 32"),
    (snap(replay_start=16), "replay_start is set"),
    (replay(replay_start=None), "replay_start is unset"),
    (replay(replay_start=32), "replay_start = 32 must be below fetch_tokens = 32"),
    (replay(resume_tokens=31), "resume_tokens = 31 must equal fetch_tokens = 32"),
    (replay(snapshot_position=32), "snapshot_position is set"),
])
def test_refused_naming_the_field_and_limit(bad: RunSpec, words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_run(bad, TINY, LIMITS)
    assert words in caught.value.message


@pytest.mark.parametrize("good", [spec(), snap(), snap(resume_tokens=31), replay(), replay(replay_start=0),
                                  spec(snapshot_every=32, max_new_tokens=20)])
def test_valid_runs_pass(good: RunSpec) -> None:
    check_run(good, TINY, LIMITS)


def test_snapshot_points_and_segments() -> None:
    assert snapshot_points(start=0, prompt_tokens=41, total_tokens=51, block_tokens=16, every=0) == [32, 48]
    assert snapshot_points(start=32, prompt_tokens=41, total_tokens=41, block_tokens=16, every=0) == []
    assert snapshot_points(start=0, prompt_tokens=70, total_tokens=70, block_tokens=16, every=32) == [32, 64]
    assert snapshot_points(start=0, prompt_tokens=10, total_tokens=12, block_tokens=16, every=0) == []
    assert segments(0, 41, [32, 48]) == [(0, 32), (32, 41)]
    assert segments(31, 45, [32]) == [(31, 32), (32, 45)]


def test_refused_on_the_wire_before_anything_runs(workers: WorkerClient, store: Any) -> None:
    with pytest.raises(InvalidArgument, match="vocab_size = 128"):
        workers.run([5, 500], None)
    bad = SimpleNamespace(action="bounded-replay", fetch_tokens=20, snapshot_position=None, resume_tokens=20,
                          replay_start=4, lease_id=None)
    with pytest.raises(InvalidArgument, match="fetch_tokens = 20 must be a positive multiple of block_tokens = 16"):
        workers.run(list(range(40)), bad)


def test_refused_at_once_not_queued_behind_a_run(worker: Any, workers: WorkerClient) -> None:
    busy = threading.Thread(target=workers.run, args=(list(range(20)), None), kwargs={"store": False})
    with worker.servicer.runner.device_lock:
        busy.start()  # takes the device thread, and waits there for the device
        deadline = time.monotonic() + 30
        while worker.servicer._pending < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(InvalidArgument, match="vocab_size"):
            workers.run([999], None, timeout_s=5)
    busy.join(60)


def test_worker_limits_come_from_its_settings(start_worker: Any) -> None:
    small = start_worker(max_prompt_tokens=10, max_new_tokens=2)
    with WorkerClient(small.target) as w:
        with pytest.raises(InvalidArgument, match="limit of 10"):
            w.run(list(range(11)), None)
        with pytest.raises(InvalidArgument, match="limit of 2"):
            w.run(list(range(5)), None, max_new_tokens=3)


def test_cuda_graphs_follow_the_settings(server: Any) -> None:
    """The runner sets the model's graph path from `cuda_graphs`: off turns it off, and on the CPU it is never on."""
    from replay.model import TINY_MODEL, ReferenceModel
    from replay.worker.runner import Runner
    from replay.worker.settings import WorkerSettings
    from replay.worker.stores import StoreClients

    model = ReferenceModel(TINY_MODEL, device="cpu")
    stores = StoreClients(server.target, geometry=TINY.name)
    for on in (True, False):
        model.graphs = True
        Runner(model, stores, WorkerSettings(store_target=server.target, cuda_graphs=on))
        assert model.graphs is False
    stores.close()
    assert WorkerSettings().cuda_graphs
