"""Damage a stored block in place, for the tests of what a checksum catches."""

from __future__ import annotations

import os
from pathlib import Path


def corrupt(data_file: Path, block: bytes) -> None:
    """Flip one byte of `block`'s stored bytes in `data_file` (an LMDB data.mdb), in place, under a running
    store if there is one: the block's checksum then fails. The block is found by its first 64 bytes."""
    raw = data_file.read_bytes()
    at = raw.find(block[:64])
    assert at >= 0, "block not found in the data file"
    fd = os.open(data_file, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([raw[at + 100] ^ 0xFF]), at + 100)
    finally:
        os.close(fd)
