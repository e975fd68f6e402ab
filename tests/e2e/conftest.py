"""End to end (issue 11 item 6): a real `kvstore serve` and a real `kvstore worker`, as child processes.

The storage server runs on a clock the test moves (`ServerClock` of
tests/children.py, shared with the fault matrix): its `kvstore.clock.SystemClock`
adds the seconds written in a file to both its wall and its monotonic time, so
an SWA TTL or the 72-hour retention passes for the server in one call, while
nothing else in the process or the test is skewed.

The worker runs the tiny model on the CPU against that server. A test may start
it with a replay gate (`WorkerGate`): once the test arms it, the worker's
`ReferenceModel.replay` says it has started (a file appears) and waits for a
file that never comes, so the test can kill the worker -9 while it is inside a
replay with no timing assumption (the test waits for the first file, bounded
only by a deadline).

Each child listens on a free loopback port (`--port 0`, read back from the line
it prints), with stdout and stderr in files beside the test's tmp_path, so a
failing test shows the child's own log. Every child still running at the end
is killed. Waits are bounded by deadlines only so that a hung child fails the
test instead of the suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.children import SKEWED_CLOCK, START_DEADLINE_S, Child, ServerClock, write_config

#: Tokens per block: small, so a short conversation spans several blocks (the tiny window is 8).
BLOCK_TOKENS = 16
#: The operator's SWA TTL: short, since the test moves the server's clock past it.
SWA_TTL_S = 60.0
#: Child-side: while KVSTORE_E2E_GATE/armed exists, ReferenceModel.replay touches .../entered and waits
#: for .../release (bounded, so an orphaned worker still ends its call); unarmed, it just replays.
_REPLAY_GATE = """
import replay.model.model as _model

_gate = os.environ["KVSTORE_E2E_GATE"]
_replay = _model.ReferenceModel.replay

def _gated_replay(self, *args, **kwargs):
    if os.path.exists(os.path.join(_gate, "armed")):
        open(os.path.join(_gate, "entered"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(_gate, "release")) and time.monotonic() < deadline:
            time.sleep(0.01)
    return _replay(self, *args, **kwargs)

_model.ReferenceModel.replay = _gated_replay
"""


class WorkerGate:
    """A replay gate for a worker: once `arm`ed, a replay makes `entered` appear and waits for `release`."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.entered = folder / "entered"
        self.release = folder / "release"

    def arm(self) -> None:
        """From now on, a replay stops at the gate."""
        (self.folder / "armed").touch()

    def wait_entered(self, deadline_s: float = START_DEADLINE_S, *, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait until the worker is inside a replay (bounded by a deadline, never a timing assumption)."""
        deadline = time.monotonic() + deadline_s
        while not self.entered.exists():
            assert alive(), "the worker exited before it started a replay"
            assert time.monotonic() < deadline, f"the worker did not start a replay within {deadline_s} s"
            time.sleep(0.01)

    def open(self) -> None:
        """Let a waiting replay go on."""
        self.release.touch()


def run_kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a one-shot `kvstore` command (KVSTORE_* of the test's own dropped) and return what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=START_DEADLINE_S, check=False)
    assert done.returncode == 0, f"kvstore {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture
def server_clock(tmp_path: Path) -> ServerClock:
    """A clock for this test's server, at the real time until the test advances it."""
    return ServerClock(tmp_path / "clock-skew")


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    """Every child a test starts; those still running at the end are killed (and their logs printed)."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill_if_alive()


@pytest.fixture
def start_serve(tmp_path: Path, server_clock: ServerClock, children: list[Child]) -> Callable[..., Child]:
    """`start_serve(capacity_bytes=...)`: `kvstore serve` on `server_clock`, 16-token blocks, a 60 s SWA TTL."""

    def _start(*, capacity_bytes: int, **sections: dict[str, object]) -> Child:
        merged: dict[str, dict[str, object]] = {
            "store": {"block_tokens": BLOCK_TOKENS, "capacity_bytes": capacity_bytes},
            "swa": {"ttl_s": SWA_TTL_S},
        }
        for name, values in sections.items():
            merged.setdefault(name, {}).update(values)
        config = write_config(tmp_path / "kvstore.toml", merged)
        args = ["serve", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(tmp_path / "store"),
                "--config", str(config)]
        child = Child("serve", args, tmp_path / "logs", prelude=SKEWED_CLOCK, env=server_clock.env)
        children.append(child)
        return child

    return _start


@pytest.fixture
def start_worker(tmp_path: Path, children: list[Child]) -> Callable[..., Child]:
    """`start_worker(target, gate=None)`: `kvstore worker --model tiny --device cpu` against `target`."""

    def _start(target: str, *, gate: WorkerGate | None = None, extra_args: Sequence[str] = ()) -> Child:
        args = ["worker", "--target", target, "--model", "tiny", "--port", "0", "--device", "cpu", *extra_args]
        env: dict[str, str] = {}
        prelude = None
        if gate is not None:
            env["KVSTORE_E2E_GATE"] = str(gate.folder)
            prelude = _REPLAY_GATE
        child = Child("worker", args, tmp_path / "logs", prelude=prelude, env=env)
        children.append(child)
        return child

    return _start


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The test's own model on one torch thread, restored after: the tiny model's ops are too small to
    split, and two threads on a loaded 2-core machine are about ten times slower (docs/MODEL.md). The
    worker keeps torch's default, so the test also checks that threads never change results."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def e2e(tmp_path: Path) -> SimpleNamespace:
    """This folder's helpers for test modules (with --import-mode=importlib they cannot import conftest)."""
    return SimpleNamespace(WorkerGate=WorkerGate, BLOCK_TOKENS=BLOCK_TOKENS, SWA_TTL_S=SWA_TTL_S,
                           gate=lambda name="gate": WorkerGate(tmp_path / name), run_kvstore=run_kvstore)


def pytest_runtest_makereport(item: pytest.Item, call: Any) -> None:
    """On a failure, append the children's logs to the report (what the server and worker said)."""
    if call.when != "call" or call.excinfo is None:
        return
    started = getattr(item, "funcargs", {}).get("children")
    if started:
        item.add_report_section("call", "children", "\n".join(c.log()[-20000:] for c in started))
