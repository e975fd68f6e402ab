"""The tests' child processes (tests/children.py): a child forked from the zygote runs as a fresh one would."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import children
from tests.children import Child, ForkedProcess, fork_safe

#: Prints what the child sees before the command runs (safe after the imports: it reads, it patches nothing).
_REPORT = fork_safe(
    'import json\nprint(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv,'
    ' "ppid": os.getppid(), "fds": sorted(os.listdir("/proc/self/fd"))}), flush=True)\n')


def _serve(tmp_path: Path) -> list[str]:
    return ["serve", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(tmp_path / "store")]


#: What the server's imports add to the environment (gateway/transfer_bulk.py's default log level for
#: Mooncake): a forked child has it from the start, a fresh one once it has imported the server.
_SET_BY_IMPORTS = ("GLOG_minloglevel",)


def test_a_forked_child_sees_what_a_fresh_one_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_OF_THE_TEST", "1")  # the test's own KVSTORE_* never reach a child
    assert children._Zygote.get() is not None  # started here, before the test moves to its own directory
    monkeypatch.chdir(tmp_path)
    reports = {}
    for fork in ("1", "0"):
        monkeypatch.setenv("KVSTORE_TEST_FORK", fork)
        child = Child("serve", _serve(tmp_path / fork), tmp_path / "logs", prelude=_REPORT, env={"KVSTORE_GIVEN": "x"})
        try:
            assert isinstance(child.proc, ForkedProcess if fork == "1" else subprocess.Popen)
            reports[fork] = json.loads(child.out_path.read_text().splitlines()[0])
        finally:
            child.kill_if_alive()
    forked, fresh = reports["1"], reports["0"]
    for name in _SET_BY_IMPORTS:  # (the test process has them too once it imported the server's code)
        forked["env"].pop(name, None)
        fresh["env"].pop(name, None)
    assert forked["env"] == fresh["env"] and fresh["env"]["KVSTORE_GIVEN"] == "x"
    assert "KVSTORE_OF_THE_TEST" not in forked["env"] and "KVSTORE_TEST_FORK" not in forked["env"]
    assert forked["cwd"] == fresh["cwd"] == str(tmp_path)
    assert forked["argv"] == ["-c", *_serve(tmp_path / "1")]
    # Its first parent is gone: this process is its parent (and can wait for it); it holds no fd of the zygote's.
    assert forked["ppid"] == fresh["ppid"] == os.getpid()
    assert forked["fds"] == fresh["fds"]


def test_this_process_sees_a_forked_childs_exit_as_a_subprocess_s(tmp_path: Path) -> None:
    child = Child("serve", _serve(tmp_path), tmp_path / "logs")
    assert isinstance(child.proc, ForkedProcess) and child.proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.proc.wait(timeout=0.01)
    assert child.stop() == 0  # SIGTERM: the server's own clean exit
    killed = Child("serve", _serve(tmp_path), tmp_path / "logs")
    killed.kill9()  # asserts the status is -SIGKILL
    assert killed.proc.returncode == -9 and "listening on" in killed.out_path.read_text()


def test_a_start_that_fails_fails_the_same_forked_or_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = ["serve", "--port", "0", "--config", str(tmp_path / "missing.toml")]
    errors = []
    for fork in ("1", "0"):
        monkeypatch.setenv("KVSTORE_TEST_FORK", fork)
        with pytest.raises(AssertionError, match=r"did not start \(exit (\d+)\)") as failed:
            Child("serve", bad, tmp_path / f"logs-{fork}")
        errors.append((str(failed.value).split(":")[0], (tmp_path / f"logs-{fork}" / "serve-0.err").read_text()))
    assert errors[0] == errors[1] and "missing.toml" in errors[0][1]


def test_a_prelude_not_marked_safe_runs_in_a_fresh_interpreter(tmp_path: Path) -> None:
    child = Child("serve", _serve(tmp_path), tmp_path / "logs", prelude="import kvstore.transfer_ring as r\n")
    try:
        assert isinstance(child.proc, subprocess.Popen)
        assert "zygote" not in Path(f"/proc/{child.proc.pid}/cmdline").read_text()
    finally:
        child.kill_if_alive()
