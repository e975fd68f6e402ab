"""Protobuf's wire format, for the few messages written or read by hand where protobuf would
copy block bytes again (a Fetch or Get reply, a ring request): varints and length prefixes."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """A non-negative int as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(field: int, length: int) -> bytes:
    """A length-delimited field's key and length: what precedes its `length` bytes."""
    return bytes([field << 3 | 2]) + varint(length)


def read_varint(message: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` in `message`, and where the next field starts.

    Raises:
        ValueError: it runs past 64 bits. IndexError: past the message.
    """
    value = shift = 0
    while True:
        byte = message[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint runs past 64 bits")
