"""A transfer session's request ring: small reads through shared memory, no call per read.

A fetch of a few blocks on the shared-memory path is bound by its round trip,
not its bytes: a unary gRPC call costs about a millisecond on a loaded box,
the copy microseconds. So a session may register one more sealed memfd, its
ring (`RegisterRegion` with `ring`), and a server thread answers small read
requests written into it, woken through a futex in the shared page. gRPC stays
the control plane (the session, regions, auth, the ring's lease) and the
fallback.

Layout (little-endian; `RING_BYTES` in all; one request slot):

    0      16 bytes  the registration nonce (zeroed once the server mapped the ring)
    64     u32 state     the futex word: IDLE, REQUEST, BUSY, ANSWERED, CLOSED
    68     u32 seq       the request's number (the client counts; the answer echoes it)
    72     u32 length    bytes of the request at REQUEST_AT
    80     u32 answer_seq
    84     u32 code      0: the answer is a TransferState; else a gRPC status code,
                         and the answer is its message (UTF-8)
    88     u32 answer_length
    92     u32 server_cpu    1 + the CPU the server answered on (0: not told); a hint only
    96     u32 client_cpu    1 + the CPU the client asked from (0: not told); a hint only
    100    u32 server_awake  1 while the server's thread spins on `state` (it needs no wake-up)
    104    u32 client_awake  1 while the client spins for its answer (it needs no wake-up)
    4096   the request: a serialized `SubmitRequest` (a read; session_id not read)
    65536  the answer

The client writes the request, then state = REQUEST, and wakes the futex; the
server sets BUSY, copies the request out of shared memory before reading it,
answers, sets ANSWERED and wakes the futex. The client is untrusted: the server
checks every field it reads (see `gateway/transfer_ring.py`).

Each side spins a little on the state word before its futex, first without yielding
the core; the CPU words let each skip that part when the other side last ran on the
same CPU (a spin there only keeps the peer from running). They steer nothing else.

Wake-ups: a side that stores `state` skips its FUTEX_WAKE (a syscall, a few
microseconds on a VM) while the peer's awake word is set, since a spinning peer sees
the store anyway. A side sets its awake word before it looks at `state` and, before
it sleeps, clears it, fences and looks at `state` once more; the waker stores
`state`, fences and then reads the awake word (both fences full: of two such
sides, one sees the other's store). Only the native code (`kvstore.native._ring`) sets
them; a side that never does (the Python server and client, an older peer) is
always woken. A client that sets the server's word or its own lies only to
itself: its own request or answer then waits for the futex's timeout.

Word order across processes relies on x86-64's store order (TSO): the ring is
offered on x86-64 Linux only (`supported()`), elsewhere Submit serves.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from typing import Any

#: The ring's size: a request area and an answer area.
RING_BYTES = 128 << 10
HEADER_AT = 64
REQUEST_AT = 4096
REQUEST_BYTES = (64 << 10) - REQUEST_AT
ANSWER_AT = 64 << 10
ANSWER_BYTES = RING_BYTES - ANSWER_AT
#: Most descriptors in one ring request: a read's state costs at most
#: TRANSFER_STATE_BYTES_PER_DESCRIPTOR (330) bytes, so 128 always fit the answer area.
RING_DESCRIPTORS = 128
#: How long a ring answers after it was registered or renewed (RegisterRegion with ring).
LEASE_S = 30.0

IDLE, REQUEST, BUSY, ANSWERED, CLOSED = 0, 1, 2, 3, 4

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a shared mapping
_EAGAIN, _EINTR, _ETIMEDOUT = 11, 4, 110


class Header(ctypes.Structure):
    """The ring's header words, read and written in place in the mapping."""

    _fields_ = [("state", ctypes.c_uint32), ("seq", ctypes.c_uint32), ("length", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32), ("answer_seq", ctypes.c_uint32), ("code", ctypes.c_uint32),
                ("answer_length", ctypes.c_uint32), ("server_cpu", ctypes.c_uint32), ("client_cpu", ctypes.c_uint32),
                ("server_awake", ctypes.c_uint32), ("client_awake", ctypes.c_uint32)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether the ring can run here: Linux on x86-64 (futexes, and TSO store order)."""
    return sys.platform == "linux" and platform.machine() in _SYS_FUTEX


_libc: ctypes.CDLL | None = None


def _syscall() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class Futex:
    """Wait and wake on one 32-bit word of a shared mapping (Linux futex, not private).

    ctypes releases the GIL around the call, so a thread waiting here lets the
    rest of its process run.

    Args:
        header: the ring's header in the mapping (`Header.from_buffer`).
    """

    def __init__(self, header: Header) -> None:
        self.header = header
        self._addr = ctypes.c_void_p(ctypes.addressof(header) + Header.state.offset)
        self._call = _syscall()
        self._nr = ctypes.c_long(_SYS_FUTEX.get(platform.machine(), -1))

    def wait(self, expected: int, timeout_s: float) -> None:
        """Sleep while the word holds `expected`, at most `timeout_s` (a wake, a signal or a change ends it)."""
        whole = int(timeout_s)
        spec = _Timespec(whole, int((timeout_s - whole) * 1e9))
        self._call(self._nr, self._addr, ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(expected), ctypes.byref(spec),
                   None, ctypes.c_int(0))

    def wake(self) -> None:
        """Wake every thread (of either process) waiting on the word."""
        self._call(self._nr, self._addr, ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF), None, None,
                   ctypes.c_int(0))


def current_cpu() -> int:
    """The CPU this thread runs on now (-1 where it cannot be told)."""
    global _getcpu
    if _getcpu is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _getcpu = libc.sched_getcpu if hasattr(libc, "sched_getcpu") else (lambda: -1)
        _getcpu.restype = ctypes.c_int  # type: ignore[union-attr]
    return int(_getcpu())


_getcpu: Any = None


def header_in(view: memoryview) -> Header:
    """The header of the ring mapped at `view` (which must stay mapped while the header is used).

    Built from the address, not as a buffer export: an export would keep the
    mapping from being closed for as long as any reference to the header lived.
    The owner (client or server) drops the header before it unmaps the ring.
    """
    if len(view) < RING_BYTES or view.readonly:
        raise ValueError(f"a ring is a writable mapping of {RING_BYTES} bytes")
    probe = ctypes.c_char.from_buffer(view)
    base = ctypes.addressof(probe)
    del probe  # releases the export
    return Header.from_address(base + HEADER_AT)
