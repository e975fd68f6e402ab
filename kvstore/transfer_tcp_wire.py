"""The frames of the one-copy TCP transport (docs/TRANSFER.md "The one-copy TCP transport").

Client to server, little-endian:

- hello, once, first: `KVTH`, u8 session id length, the session id (UTF-8), its 16-byte token
  (from `OpenBulk(transport="tcp")`);
- request: `KVTR`, u32 block count, u8 flags (1: prefix only), then 32 bytes a block hash.

Server to client, per request in order:

- reply: `KVTA`, u32 header length, a `FetchReply` without data (statuses, failures), then the
  DONE blocks' bytes in order, then `KVTD` once their retention refresh is durable;
- or, at any frame boundary, an error: `KVTE`, u32 length, `CODE: message` (UTF-8), after which
  the server closes the connection.
"""

from __future__ import annotations

import socket
import struct

HELLO = b"KVTH"
REQUEST = b"KVTR"
REPLY = b"KVTA"
END = b"KVTD"
ERROR = b"KVTE"
#: The session's token for the listener: random, given over the authenticated gRPC channel.
TOKEN_BYTES = 16
#: Longest session id a hello may name.
MAX_SESSION_ID = 128
HASH_BYTES = 32
PREFIX_ONLY = 1
HELLO_HEAD = struct.Struct("<4sB")
REQUEST_HEAD = struct.Struct("<4sIB")
#: Magic and length of a reply header or error frame.
FRAME_HEAD = struct.Struct("<4sI")
#: Longest error message or reply header a client reads (a reply's failures: about 330 bytes a block).
MAX_HEAD_BYTES = 8 << 20


def hello(session_id: str, token: bytes) -> bytes:
    """The hello frame."""
    sid = session_id.encode()
    return HELLO_HEAD.pack(HELLO, len(sid)) + sid + token


def request(hashes: bytes, prefix_only: bool) -> bytes:
    """A request frame for the concatenated 32-byte `hashes`."""
    return REQUEST_HEAD.pack(REQUEST, len(hashes) // HASH_BYTES, PREFIX_ONLY if prefix_only else 0) + hashes


def reply_head(header: bytes) -> bytes:
    """A reply's first frame: its `FetchReply` header (statuses, failures)."""
    return FRAME_HEAD.pack(REPLY, len(header)) + header


def error_frame(code: str, message: str) -> bytes:
    """An error frame: `code` is a gRPC status name (INVALID_ARGUMENT, UNAUTHENTICATED, ...)."""
    text = f"{code}: {message}".encode()[:MAX_HEAD_BYTES]
    return FRAME_HEAD.pack(ERROR, len(text)) + text


#: Most buffers one sendmsg takes (Linux's IOV_MAX is 1,024).
IOV = 64


def send_views(conn: socket.socket, views: list[memoryview]) -> None:
    """Send `views` in order with scatter sends (`IOV` buffers a call), resuming after a partial one."""
    at = 0
    while at < len(views):
        part = views[at : at + IOV]
        sent = conn.sendmsg(part)
        for v in part:  # drop what went whole, cut the first that went in part
            if sent >= len(v):
                sent -= len(v)
                at += 1
            else:
                views[at] = v[sent:]
                break
