"""Byte-level text from the Python standard library's own sources, for the tiny model.

The tiny configuration has a 128-token vocabulary, so a token is one ASCII byte:
every source file is read as bytes and its non-ASCII bytes are dropped. The
files are split by a hash of their path (not at random), so training
(scripts/train_tiny.py) and measuring (`kvstore bench replay`) see disjoint
files on any machine with the same Python version: the held-out share is
`HELD_OUT_PERCENT`. Torch-free: the planner's import path may load it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

#: Percent of the files kept out of training, for measuring.
HELD_OUT_PERCENT = 10
#: Folders of the standard library left out: the test suite (huge, repetitive) and vendored code.
_SKIPPED = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"})


def stdlib_root() -> Path:
    """The folder of this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(split: str, root: Path | None = None) -> list[Path]:
    """The standard library's .py files of one split ("train" or "eval"), in path order.

    Args:
        split: "train" for the files scripts/train_tiny.py learns from, "eval" for the rest.
        root: the library folder (default: this interpreter's).

    Raises:
        ValueError: for another split name.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED & set(relative.parts[:-1]):
            continue
        held_out = hashlib.sha256(str(relative).encode()).digest()[0] * 100 < HELD_OUT_PERCENT * 256
        if held_out == (split == "eval"):
            files.append(path)
    return files


def ascii_bytes(path: Path) -> bytes:
    """A file's bytes with every non-ASCII byte dropped (each is then a token below 128)."""
    return path.read_bytes().decode("latin-1").encode("ascii", errors="ignore")


def corpus(split: str, *, max_bytes: int | None = None, root: Path | None = None) -> bytes:
    """The split's files joined (each ending in a newline), cut at `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    for path in source_files(split, root):
        data = ascii_bytes(path)
        if not data.endswith(b"\n"):
            data += b"\n"
        parts.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    joined = b"".join(parts)
    return joined if max_bytes is None else joined[:max_bytes]
