"""End to end (issue 11 item 6): a real `kvstore serve` and a real `kvstore worker`, as child processes.

The storage server runs on a clock the test moves (`ServerClock`, the fault
matrix's approach: tests/faults/conftest.py): its `kvstore.clock.SystemClock`
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
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

#: Tokens per block: small, so a short conversation spans several blocks (the tiny window is 8).
BLOCK_TOKENS = 16
#: The operator's SWA TTL: short, since the test moves the server's clock past it.
SWA_TTL_S = 60.0
#: Longest wait for a child to print where it listens, or to exit.
START_DEADLINE_S = 90.0

_PRELUDE = "import os, sys, time\n"
_MAIN = "from kvstore.cli import main\nsys.exit(main(sys.argv[1:]))\n"
#: Child-side: kvstore.clock.SystemClock (what the server's tier, leases and SWA pool read) adds the
#: seconds in KVSTORE_E2E_CLOCK_FILE to its wall and monotonic time (tests/faults/conftest.py does the same).
_SKEWED_CLOCK = """
import kvstore.clock

_file = os.environ["KVSTORE_E2E_CLOCK_FILE"]

def _skew():
    try:
        with open(_file) as f:
            return float(f.read() or 0)
    except (OSError, ValueError):
        return 0.0

kvstore.clock.SystemClock.now = lambda self: time.time() + _skew()
kvstore.clock.SystemClock.monotonic = lambda self: time.monotonic() + _skew()
"""
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


class ServerClock:
    """Time for the server started with it: `advance` is time passing for it (see _SKEWED_CLOCK)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.skew_s = 0.0
        path.write_text("0")

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass for the server (its next reading sees it)."""
        self.skew_s += seconds
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(repr(self.skew_s))
        os.replace(tmp, self.path)  # atomic: the server reads the old or the new number, never half


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


class Child:
    """One `kvstore <command>` child process that prints `listening on HOST:PORT`.

    Args:
        name: names its log files.
        args: the command line after `kvstore`.
        logdir: where its stdout and stderr go.
        prelude: Python run in the child before the command (None: plain `python -m kvstore.cli`).
        env: variables added to the environment (KVSTORE_* of the test's own are dropped).
    """

    def __init__(self, name: str, args: Sequence[str], logdir: Path, *, prelude: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        n = len(list(logdir.glob(f"{name}-*.out")))
        self.name = name
        self.out_path = logdir / f"{name}-{n}.out"
        self.err_path = logdir / f"{name}-{n}.err"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        child_env.update(env or {})
        if prelude:
            cmd = [sys.executable, "-c", _PRELUDE + prelude + _MAIN, *args]
        else:
            cmd = [sys.executable, "-m", "kvstore.cli", *args]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env)
        self.port = self._wait_for_port()
        self.target = f"127.0.0.1:{self.port}"

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            match = re.search(r"listening on (?:127\.0\.0\.1|localhost|\[::\]|0\.0\.0\.0):(\d+)",
                              self.out_path.read_text(errors="replace"))
            if match:
                return int(match.group(1))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"kvstore {self.name} did not start (exit {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL it (no clean-up of any kind runs) and reap it."""
        self.proc.kill()
        assert self.proc.wait(timeout=START_DEADLINE_S) == -signal.SIGKILL

    def log(self) -> str:
        """Its stdout and stderr so far."""
        return (f"--- {self.name} stdout ({self.out_path})\n{self.out_path.read_text(errors='replace')}"
                f"--- {self.name} stderr ({self.err_path})\n{self.err_path.read_text(errors='replace')}")


def run_kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a one-shot `kvstore` command (KVSTORE_* of the test's own dropped) and return what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=START_DEADLINE_S, check=False)
    assert done.returncode == 0, f"kvstore {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def write_config(path: Path, sections: dict[str, dict[str, object]]) -> Path:
    """A small TOML config ({section: {key: value}}; values are str, int or float)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {value!r}" if isinstance(value, int | float) else f'{key} = "{value}"')
    path.write_text("\n".join(lines) + "\n")
    return path


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
        if child.alive:
            child.proc.kill()
            child.proc.wait()


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
        child = Child("serve", args, tmp_path / "logs", prelude=_SKEWED_CLOCK,
                      env={"KVSTORE_E2E_CLOCK_FILE": str(server_clock.path)})
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
