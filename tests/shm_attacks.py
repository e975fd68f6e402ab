"""Every way the holder of a descriptor of an SWA arena might try to write it (docs/SECURITY.md, "Shared memory").

`routes_that_write(target, size)` tries each and returns the names of those that
worked: a test asserts the list is empty; `routes_as_nobody` tries them as
another user. `target` is a descriptor number or a
path (`/proc/<pid>/fd/<n>` of another process). Standard library only, and
runnable as a script (`python tests/shm_attacks.py TARGET SIZE` prints the
list as JSON), so a child of another user or another process can run it
without this repository on its path.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import sys
from collections.abc import Callable

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def _worked(attempt: Callable[[], object]) -> bool:
    """Whether `attempt` went through (an OSError, or a failed libc call returning False, is a refusal)."""
    try:
        return attempt() is not False
    except OSError:
        return False


def _mprotect_write(libc: ctypes.CDLL, fd: int, size: int) -> bool:
    """Map `fd` read-only and shared, then ask mprotect() for write access: True if granted."""
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return False
    try:
        return bool(libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == 0)
    finally:
        libc.munmap(addr, size)


def _shared_writable_map(fd: int, size: int) -> bool:
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE):
        return True


def routes_that_write(target: int | str, size: int) -> list[str]:
    """The names of the routes by which `target` (a descriptor, or a path to open) could be written."""
    libc = _libc()
    page = mmap.PAGESIZE
    worked: list[str] = []
    fds: list[int] = []
    try:
        if isinstance(target, str):
            # Another process's descriptor, reopened through /proc: read-only first, then read-write.
            with contextlib.suppress(OSError):
                fds.append(os.open(target, os.O_RDONLY))
            path = target
        else:
            fds.append(target)
            path = f"/proc/self/fd/{target}"
        try:
            rw = os.open(path, os.O_RDWR)  # the attack: the memfd's mode is 0777
        except OSError:
            rw = -1
        if rw >= 0:
            fds.append(rw)
            if _worked(lambda: os.pwrite(rw, b"x", 0)):
                worked.append("reopened read-write: pwrite")
            if _worked(lambda: libc.fallocate(rw, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, page) == 0):
                worked.append("reopened read-write: punched a hole")
            if _worked(lambda: os.ftruncate(rw, page)):
                worked.append("reopened read-write: truncated")
        for i, fd in enumerate(fds):
            name = "reopened read-write" if fd == rw else f"descriptor {i}"
            if _worked(lambda fd=fd: _shared_writable_map(fd, size)):  # type: ignore[misc]
                worked.append(f"{name}: mmap PROT_WRITE MAP_SHARED")
            if _mprotect_write(libc, fd, size):
                worked.append(f"{name}: mmap PROT_READ then mprotect PROT_WRITE")
    finally:
        for fd in fds:
            if fd != target:
                os.close(fd)
    return worked


def routes_as_nobody(fd: int, size: int) -> list[str]:
    """`routes_that_write(fd, size)` in a forked child that became user and group 65534 (nobody) first
    (forked, not run: nobody may not execute this test's interpreter), holding `fd` as the reader would."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            assert os.geteuid() == 65534
            os.write(write, json.dumps(routes_that_write(fd, size)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    routes: list[str] = json.loads(out)
    return routes


if __name__ == "__main__":
    where, nbytes = sys.argv[1], int(sys.argv[2])
    print(json.dumps(routes_that_write(int(where) if where.isdigit() else where, nbytes)))
