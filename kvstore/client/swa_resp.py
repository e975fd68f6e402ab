"""RESP for the SWA direct path's gets: GET replies received straight into buffers of their own.

redis-py's parser (without hiredis) receives a reply in 64 KiB pieces, writes
them into a BytesIO, reads the bulk string back out and slices its CRLF off:
four passes over every 2.7 MB snapshot, in Python. A direct get instead sends
its GETs as one packed pipeline (`pack_gets`) and receives each bulk reply with
`recv_into` into a buffer of the reply's size (`GetReplies`): the kernel's copy
is the only pass before the record's checksum. Only reply lines (`$<size>`,
`-<error>`) go through a small buffer of their own.

The socket is redis-py's (its connection pool connects, authenticates and
checks the connection is clean before handing it out); the caller owns the
connection for the whole exchange and disconnects it on any failure, since a
reply read halfway leaves it out of step.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from redis.exceptions import ConnectionError, InvalidResponse, ResponseError

#: Bytes asked of the socket while looking for a reply line: a header (`$2703400`) or an error
#: (`-NOPERM ...`), not the payload behind it, which goes into its own buffer.
LINE_READ_BYTES = 256
#: The longest reply line taken (Redis's error replies are far shorter).
MAX_LINE_BYTES = 64 << 10
#: Pieces in which a reply over the caller's limit is read and dropped.
DRAIN_BYTES = 256 << 10


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """GET of each key, packed as RESP arrays, to be sent in one write."""
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key) for key in keys)


class GetReplies:
    """Reads the replies of pipelined GETs off a socket, in order.

    Args:
        sock: the connection's socket (blocking, with its timeout: a stalled Redis raises
            `TimeoutError`, an OSError).
        max_bytes: the largest value taken; a longer one is read and dropped (returned empty,
            which no record check accepts), so a hostile writer cannot make a reader allocate it.
    """

    def __init__(self, sock: socket.socket, *, max_bytes: int) -> None:
        self._sock = sock
        self._max_bytes = max_bytes
        self._scratch = bytearray(LINE_READ_BYTES)
        #: Bytes received past the last reply consumed (at most a line read's worth).
        self._pending = bytearray()

    def read_all(self, count: int) -> list[bytearray | None]:
        """The values of `count` GET replies (None for a missing key); each value is a bytearray of
        its own (the value, then the reply's CRLF: slice `[:-2]` through a memoryview, no copy).

        Every reply is read before an error reply is raised, so the connection stays in step.

        Raises:
            ResponseError: Redis answered a GET with an error (the first one; NOPERM for a key
                outside the user's pattern, for example).
            ConnectionError: Redis closed the connection mid-reply.
            InvalidResponse: a reply that is not a GET's.
            OSError: the socket failed or timed out.
        """
        values: list[bytearray | None] = []
        refused: ResponseError | None = None
        for _ in range(count):
            line = self._line()
            if line == b"_":  # RESP3's null, should the connection speak RESP3
                values.append(None)
                continue
            if line[:1] == b"-":
                refused = refused or ResponseError(line[1:].decode(errors="replace"))
                values.append(None)
                continue
            try:
                size = int(line[1:]) if line[:1] == b"$" else None
            except ValueError:
                size = None
            if size is None:
                raise InvalidResponse(f"SWA direct get: not a GET reply: {bytes(line[:64])!r}")
            values.append(None if size < 0 else self._value(size) if size <= self._max_bytes else self._drop(size))
        if refused is not None:
            raise refused
        return values

    def _recv_into(self, view: memoryview) -> int:
        received = self._sock.recv_into(view)
        if not received:
            raise ConnectionError("SWA direct get: Redis closed the connection mid-reply")
        return received

    def _line(self) -> bytearray:
        """The next reply line, without its CRLF."""
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > MAX_LINE_BYTES:
                raise InvalidResponse(f"SWA direct get: a reply line over {MAX_LINE_BYTES} bytes")
            received = self._recv_into(memoryview(self._scratch))
            self._pending += memoryview(self._scratch)[:received]
        line = self._pending[:end]
        del self._pending[:end + 2]
        return line

    def _take_pending(self, view: memoryview) -> int:
        """Move what was received past the reply line into the front of `view`; how many bytes."""
        taken = min(len(self._pending), len(view))
        view[:taken] = memoryview(self._pending)[:taken]
        del self._pending[:taken]
        return taken

    def _value(self, size: int) -> bytearray:
        """A bulk value of `size` bytes and its CRLF, received into a buffer of their own."""
        buf = bytearray(size + 2)
        view = memoryview(buf)
        got = self._take_pending(view)
        while got < len(buf):
            got += self._recv_into(view[got:])
        if buf[size:] != b"\r\n":
            raise InvalidResponse("SWA direct get: a bulk reply without its CRLF")
        return buf

    def _drop(self, size: int) -> bytearray:
        """Read a bulk value too large to take, and its CRLF, in pieces; an empty value."""
        drain = memoryview(bytearray(min(DRAIN_BYTES, size + 2)))
        left = size + 2 - self._take_pending(drain)
        while left:
            left -= self._recv_into(drain[:min(left, len(drain))])
        return bytearray()
