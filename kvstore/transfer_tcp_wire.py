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

A put (docs/TRANSFER.md "Put over the one-copy TCP transport") has its own connection:

- put hello, once, first: `KVTP`, u8 grant id length, the grant id, its 16-byte token (from
  `OpenPut` over gRPC);
- put frames: `KVTQ`, u32 header length, u32 block count, u32 bytes a block, then a `PutRequest`
  without blocks (its other fields), then the blocks' bytes, concatenated;
- the server answers each put frame, in order, once its commit is durable: `KVTO`, u32 length,
  a `PutResponse`; or an error frame (`KVTE`) for the first that failed, after the replies of
  the frames before it, and closes. The client closing its side ends the put.
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
PUT_HELLO = b"KVTP"
PUT = b"KVTQ"
PUT_REPLY = b"KVTO"
HASH_BYTES = 32
PREFIX_ONLY = 1
HELLO_HEAD = struct.Struct("<4sB")
REQUEST_HEAD = struct.Struct("<4sIB")
#: A put frame's head: magic, header length, block count, bytes a block.
PUT_HEAD = struct.Struct("<4sIII")
#: Magic and length of a reply header, put reply or error frame.
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


def put_hello(grant_id: str, token: bytes) -> bytes:
    """The put hello frame."""
    gid = grant_id.encode()
    return HELLO_HEAD.pack(PUT_HELLO, len(gid)) + gid + token


def put_head(header: bytes, blocks: int, block_bytes: int) -> bytes:
    """A put frame's head and header (`header`: a serialized PutRequest without blocks); the blocks follow."""
    return PUT_HEAD.pack(PUT, len(header), blocks, block_bytes) + header


def put_reply(reply: bytes) -> bytes:
    """A put frame's answer: its serialized PutResponse."""
    return FRAME_HEAD.pack(PUT_REPLY, len(reply)) + reply


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
