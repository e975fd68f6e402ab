"""Real `kvstore` child processes for the tests that need them (the fault matrix, the end-to-end test).

A child runs `kvstore <command>` on a free loopback port (`--port 0`, read back
from the `listening on HOST:PORT` line it prints), with its stdout and stderr in
files, so a failing test shows the child's own log. A prelude (Python run in the
child before the command) can skew its clock: with `SKEWED_CLOCK`,
`kvstore.clock.SystemClock` (what the tier, leases and the SWA pool read) adds
the seconds written in the file KVSTORE_TEST_CLOCK_FILE to its wall and
monotonic time, so `ServerClock.advance` is time passing for that child alone,
as ManualClock.advance is in-process. Waits are bounded by a deadline only so
that a hung child fails the test instead of the suite.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

#: Longest wait for a child to print where it listens, or to exit.
START_DEADLINE_S = 90.0
PRELUDE = "import os, sys, time\n"
MAIN = "from kvstore.cli import main\nsys.exit(main(sys.argv[1:]))\n"
#: The variable naming the skew file of SKEWED_CLOCK.
CLOCK_FILE_ENV = "KVSTORE_TEST_CLOCK_FILE"
SKEWED_CLOCK = f"""
import kvstore.clock

_file = os.environ["{CLOCK_FILE_ENV}"]

def _skew():
    try:
        with open(_file) as f:
            return float(f.read() or 0)
    except (OSError, ValueError):
        return 0.0

kvstore.clock.SystemClock.now = lambda self: time.time() + _skew()
kvstore.clock.SystemClock.monotonic = lambda self: time.monotonic() + _skew()
"""


#: The commands a Child forks from the zygote (tests/zygote.py, their code imported once) instead of
#: starting a fresh interpreter: about 1 s of CPU less a start. KVSTORE_TEST_FORK=0 starts every child afresh.
FORKED_COMMANDS = frozenset({"serve", "gateway"})
#: Preludes that act the same run after the server's imports as before them (they patch a class's
#: methods, or the process's limits); a prelude holding anything else runs in a fresh interpreter.
_FORK_SAFE_PRELUDES: list[str] = [SKEWED_CLOCK]
_PR_SET_CHILD_SUBREAPER = 36


def fork_safe(prelude: str) -> str:
    """Mark `prelude` as safe to run in a child forked after the server's imports, and return it."""
    _FORK_SAFE_PRELUDES.append(prelude)
    return prelude


def _forkable(args: Sequence[str], prelude: str | None) -> bool:
    if os.environ.get("KVSTORE_TEST_FORK", "1") == "0" or not args or args[0] not in FORKED_COMMANDS:
        return False
    rest = prelude or ""
    for safe in _FORK_SAFE_PRELUDES:
        rest = rest.replace(safe, "")
    return not rest.strip()


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a child the zygote forked (this process reaps it)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit status (negative: the signal that ended it), or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit (subprocess.TimeoutExpired past `timeout`) and return its status."""
        if self.poll() is None:
            # Its pidfd turns readable when it exits: a wait on that condition, not a polling loop.
            pidfd = os.pidfd_open(self.pid)
            try:
                ready, _, _ = select.select([pidfd], [], [], timeout)
            finally:
                os.close(pidfd)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send `sig` unless it has been reaped (as Popen does)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """This test process's zygote (tests/zygote.py): started at the first forked child, one request at a time."""

    _lock = threading.Lock()
    _instance: tuple[int, _Zygote | None] | None = None

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS would start threads: no fork after that
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py"))], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in: IO[bytes] = self.proc.stdin
        self._out: IO[bytes] = self.proc.stdout
        self.ready = self._out.readline().strip() == b"ready"

    @classmethod
    def get(cls) -> _Zygote | None:
        """The zygote of this process, None where it cannot fork (then children start afresh)."""
        with cls._lock:
            if cls._instance is None or cls._instance[0] != os.getpid():  # a forked test process starts its own
                zygote = cls()
                cls._instance = (os.getpid(), zygote if zygote.ready else None)
            return cls._instance[1]

    def fork(self, args: Sequence[str], env: dict[str, str], prelude: str, out: Path, err: Path) -> ForkedProcess:
        """A child running `kvstore ARGS` with `env`, its output in `out` and `err`."""
        request = {"args": list(args), "env": env, "cwd": os.getcwd(), "out": str(out), "err": str(err),
                   "prelude": prelude}
        with self._lock:
            self._in.write(json.dumps(request).encode() + b"\n")
            self._in.flush()
            reply = self._out.readline()
        if not reply.strip().isdigit():
            raise AssertionError(f"the test zygote did not fork kvstore {' '.join(args)}: {reply!r}")
        return ForkedProcess(int(reply), args)


class ServerClock:
    """Time for the children started with it: `advance` is time passing for them (see SKEWED_CLOCK)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.skew_s = 0.0
        path.write_text("0")

    @property
    def env(self) -> dict[str, str]:
        """The variable a child on this clock needs (with SKEWED_CLOCK as its prelude)."""
        return {CLOCK_FILE_ENV: str(self.path)}

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass for every child on this clock, at once (their next reading sees it)."""
        self.skew_s += seconds
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(repr(self.skew_s))
        os.replace(tmp, self.path)  # atomic: a reader sees the old or the new number, never half


class Child:
    """One `kvstore <command>` child process that prints `listening on HOST:PORT`.

    Args:
        name: names its log files.
        args: the command line after `kvstore`.
        logdir: where its stdout and stderr go (one pair of files per start).
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
        zygote = _Zygote.get() if _forkable(args, prelude) else None
        self.proc: subprocess.Popen[bytes] | ForkedProcess
        if zygote is not None:
            self.out_path.write_bytes(b"")  # before the fork: a test may read it before the child writes
            self.err_path.write_bytes(b"")
            self.proc = zygote.fork(args, child_env, PRELUDE + (prelude or "") + MAIN, self.out_path, self.err_path)
        else:
            if prelude:
                cmd = [sys.executable, "-c", PRELUDE + prelude + MAIN, *args]
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

    def stop(self) -> int:
        """SIGTERM it, as an operator would, and return its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=START_DEADLINE_S)

    def kill_if_alive(self) -> None:
        """Kill and reap it unless it already ended (fixtures' clean-up)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        """Its stdout and stderr so far."""
        return (f"--- {self.name} stdout ({self.out_path})\n{self.out_path.read_text(errors='replace')}"
                f"--- {self.name} stderr ({self.err_path})\n{self.err_path.read_text(errors='replace')}")


def write_config(path: Path, sections: dict[str, dict[str, object]]) -> Path:
    """Write a small TOML config ({section: {key: value}}; values are str, int, float or bool)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, int | float):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{key} = {text}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
