"""The data dir's side files (JSON beside LMDB's): read whole, bounded, and parsed, or refused with why.

The tenants file, the tenant policies, the hit counters and the store's
identity are small JSON files a server reads at start (the tenants file also
while it runs). A disk, a crash or an operator can leave anything there, so
`read_json` turns every kind of damage into one `DamagedFile` that says what
was wrong, and never reads more than the caller's bound:

- not a regular file (a folder, a FIFO: opened non-blocking, so a FIFO never hangs the start);
- larger than `max_bytes` (checked on the open file before reading, and the read stops one
  byte past the bound, so a file that grows while read is refused too);
- not UTF-8 text;
- not JSON, or JSON nested deeper than Python's parser recurses (a RecursionError otherwise);
- NaN or Infinity, which JSON itself does not allow, and numbers past a double's range (`1e400`:
  Python's parser would take them as infinite);
- anything but a JSON object at the top (every side file is one).

What the parsed value must hold is the caller's check: each caller says what it
does with a damaged file (refuse to start with a ConfigError naming the file, or
set it aside) in its own docstring and in docs/OPERATIONS.md.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["DamagedFile", "read_bounded", "read_json"]


class DamagedFile(ValueError):
    """A side file whose content cannot be used; the message says why (without the path)."""


#: JSON's names for the Python types json.loads gives.
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _no_constant(name: str) -> Any:
    raise DamagedFile(f"it holds {name}, which JSON does not allow")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a float past the double range parses as inf
        raise DamagedFile(f"it holds the number {text[:40]}, past the range of a double")
    return value


def read_bounded(path: Path, *, max_bytes: int) -> bytes | None:
    """The bytes of the regular file at `path`, at most `max_bytes`; None when there is no such file.

    Raises:
        DamagedFile: not a regular file, or larger than `max_bytes`.
        OSError: the file exists but cannot be opened or read (permissions, I/O error).
    """
    try:
        # O_NONBLOCK: opening a FIFO put in the file's place returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DamagedFile("it is a folder, not a file" if stat.S_ISDIR(st.st_mode) else "it is not a regular file")
        if st.st_size > max_bytes:
            raise DamagedFile(f"it is {st.st_size} bytes, more than the {max_bytes} bytes read at most")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise DamagedFile(f"it grew past the {max_bytes} bytes read at most while it was read")
    return data


def read_json(path: Path, *, max_bytes: int) -> dict[str, Any] | None:
    """The JSON object in the file at `path` (read as `read_bounded` does); None when there is no such file.

    Every side file holds one JSON object: any other value (`null`, a list, a
    number) is damage too.

    Raises:
        DamagedFile: not a regular file, too large, not UTF-8, not JSON, nested too deeply,
            holding NaN, Infinity or a number past a double's range, or not a JSON object.
        OSError: the file exists but cannot be opened or read.
    """
    data = read_bounded(path, max_bytes=max_bytes)
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFile(f"it is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None
    if not text.strip():
        raise DamagedFile(f"it is empty ({len(data)} bytes of white space)" if data else "it is empty (0 bytes)")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise DamagedFile("its JSON is nested too deeply") from None
    except DamagedFile:
        raise
    except ValueError as exc:  # JSONDecodeError, and an integer past Python's digit limit
        raise DamagedFile(f"it is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"it holds a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}, not an object")
    return value
