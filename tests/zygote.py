"""A process that has imported `kvstore serve`'s code once and forks a ready child per start (tests/children.py).

Why: the suite is CPU-bound on CI's two cores, and a `kvstore serve` child spends
about 1.2 s of CPU before it listens, most of it importing the server's ~550
modules. Forked from here, a child skips that and runs the same code from
`kvstore.cli.main` on: its own argv, environment, working directory, stdin
(/dev/null), stdout and stderr files, prelude, and a normal interpreter exit.

Protocol (one test process, one request at a time): a request is one JSON line on
stdin ({"args", "env", "cwd", "out", "err", "prelude"}); the reply is the child's
pid on one line of stdout. The child is forked twice, and its first parent has
exited (and the child waited for that) before the reply goes, so it is already the child of the nearest
subreaper: the test process, which made itself one (PR_SET_CHILD_SUBREAPER), and
so can wait for it, see its exit status and its death by a signal, as with a
subprocess it started itself. The first line this process writes is `ready`, or
`no-fork: WHY` when forking would be unsafe (a thread started by an import).

Only code that is safe to run after the import may go in a prelude (tests/children.py
says which): one that sets a module's constant before the server's modules read it
must run in a fresh process.
"""

import importlib
import json
import os
import sys
import threading

# As `python -c` has it (the working directory first), not this file's folder: tests/kvstore would shadow kvstore.
sys.path[0] = ""
_before = dict(os.environ)
# `kvstore serve`'s code (all of it is imported at its start) and `kvstore gateway`'s.
for _module in ("kvstore.cli", "gateway.server", "gateway.gateway_main"):
    importlib.import_module(_module)

#: Variables the imports set (e.g. a library's log level); a child gets them unless its environment has them.
_ADDED = {k: v for k, v in os.environ.items() if _before.get(k) != v}
_threads = len(os.listdir("/proc/self/task"))
if threading.active_count() != 1 or _threads != 1:
    os.write(1, f"no-fork: {_threads} threads after the imports\n".encode())
    sys.exit(0)
os.write(1, b"ready\n")

while True:
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)
    request = json.loads(line)
    pid_r, pid_w = os.pipe()
    gate_r, gate_w = os.pipe()  # the child waits on it until this process has reaped its first parent
    first = os.fork()
    if first == 0:
        os.close(pid_r)
        second = os.fork()
        if second == 0:
            os.close(pid_w)
            os.close(gate_w)
            os.read(gate_r, 1)
            os.close(gate_r)
            break  # the child: out of the loop, to the code below
        os.write(pid_w, f"{second}\n".encode())
        os._exit(0)
    os.close(pid_w)
    os.close(gate_r)
    with os.fdopen(pid_r, "rb") as reader:
        child_pid = reader.read().strip()
    os.waitpid(first, 0)  # the child's first parent is gone: the child is now the test process's
    os.write(gate_w, b"g")
    os.close(gate_w)
    os.write(1, child_pid + b"\n")

# The child, as `python -c PRELUDE MAIN ARGS` would run.
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
for _fd, _path in ((1, request["out"]), (2, request["err"])):
    _file = os.open(_path, os.O_WRONLY | os.O_APPEND)  # created empty by the test process
    os.dup2(_file, _fd)
    os.close(_file)
sys.stdin = open(0, closefd=False)  # noqa: SIM115
sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
os.environ.clear()
os.environ.update({**_ADDED, **request["env"]})
os.chdir(request["cwd"])
sys.argv = ["-c", *request["args"]]
exec(request["prelude"], {"__name__": "__main__"})
