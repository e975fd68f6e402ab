"""Memory helpers of the same-host reader: where this process mapped the store's file, and
caller memory as writable bytes (kvstore.client.colocated, kvstore.client.restore)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, InvalidArgument


def mapping_base(path: Path) -> tuple[int, int]:
    """(start, length) of this process's mapping of `path` from file offset 0 (/proc/self/maps).

    LMDB maps the whole file once; `env.info()["map_addr"]` reports it only for
    fixed-address maps (it is 0 otherwise), so the kernel's list is asked.
    """
    st = path.stat()
    best: tuple[int, int] | None = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or int(parts[2], 16) != 0:
                continue
            dev, inode = parts[3], int(parts[4])
            if inode != st.st_ino:
                continue
            major, minor = (int(x, 16) for x in dev.split(":"))
            if os.makedev(major, minor) != st.st_dev and parts[5].strip() != str(path):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if best is None or hi - lo > best[1]:
                best = (lo, hi - lo)
    if best is None:
        raise ConfigError(f"{path} is open through LMDB but not found mapped in this process",
                          hint="the same-host reader needs Linux's /proc/self/maps")
    return best


def writable_bytes(dest: Any, nbytes: int) -> memoryview:
    """A writable byte view of `dest`'s first `nbytes`.

    Raises:
        InvalidArgument: not writable contiguous CPU memory, or smaller than `nbytes`.
    """
    if hasattr(dest, "data_ptr") and hasattr(dest, "device"):  # a torch tensor (torch not imported here)
        if dest.device.type != "cpu":
            raise InvalidArgument(f"dest is on {dest.device}: copy_into writes CPU memory (see kvstore.client.restore)")
        if not dest.is_contiguous():
            raise InvalidArgument("dest must be a contiguous tensor")
        size = dest.numel() * dest.element_size()
        if size < nbytes:
            raise InvalidArgument(f"dest holds {size} bytes; these blocks need {nbytes}")
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_char * nbytes).from_address(dest.data_ptr())).cast("B")
    try:
        view = memoryview(dest)
    except TypeError:
        raise InvalidArgument(f"dest must be a writable buffer or a CPU tensor, got {type(dest).__name__}") from None
    if view.readonly or not view.contiguous:
        raise InvalidArgument("dest must be writable and contiguous")
    view = view.cast("B")
    if view.nbytes < nbytes:
        raise InvalidArgument(f"dest holds {view.nbytes} bytes; these blocks need {nbytes}")
    return view[:nbytes]
