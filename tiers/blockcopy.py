"""Verify-and-copy of stored blocks into caller memory: the transfer path's inner loop.

Given each block's meta record and bytes (views into LMDB's map) and a
destination view, check the block against its checksum and copy it. The
native form (`tiers._blockcopy`, built from `tiers/_blockcopy.c` when the
package is installed) does the whole batch with the GIL released, so executor
threads copy in parallel; this module's Python form gives the same results
one thread at a time, for installs without a C compiler. `NATIVE` says which
one runs; `kvstore serve` logs it.
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from tiers.records import META_STRUCT

#: Result codes (the first three are `ReadStatus` values).
NOT_REACHED, FOUND, MISSING, CORRUPT, WRONG_SIZE = 0, 1, 2, 3, 4

VerifyCopy = Callable[[list, list, list, float, bool], tuple[bytes, list[int]]]


def verify_copy_python(metas: list, datas: list, dests: list, due_before: float,
                       stop_at_missing: bool) -> tuple[bytes, list[int]]:
    """Check and copy each block whose dest is not None, in order.

    Args:
        metas: each block's meta record (`META_STRUCT` bytes), None if it has none.
        datas: each block's stored bytes, None if absent.
        dests: writable views, one per block, or None to skip it.
        due_before: a FOUND block last accessed before this time is due a touch.
        stop_at_missing: stop at the first block not FOUND.

    Returns:
        A result code per block (NOT_REACHED where skipped or not reached), and
        the indices of FOUND blocks due a touch. A block that fails its checksum
        is CORRUPT and its dest is left untouched; a dest whose size differs from
        the block's is WRONG_SIZE, and the loop stops there.
    """
    codes = bytearray(len(dests))
    due: list[int] = []
    unpack, digest = META_STRUCT.unpack, xxhash.xxh3_64_intdigest
    for i, (meta, data, dest) in enumerate(zip(metas, datas, dests, strict=True)):
        if dest is None:
            continue
        if meta is None:
            code = MISSING
        elif len(meta) != META_STRUCT.size:
            code = CORRUPT
        else:
            _parent, _depth, size, checksum, _created, last_access_s = unpack(meta)
            if data is None or len(data) != size or digest(data) != checksum:
                code = CORRUPT
            elif len(dest) != size:
                code = WRONG_SIZE
            else:
                dest[:] = data
                code = FOUND
                if last_access_s < due_before:
                    due.append(i)
        codes[i] = code
        if code == WRONG_SIZE or (stop_at_missing and code != FOUND):
            break
    return bytes(codes), due


def _load_native() -> VerifyCopy | None:
    try:
        from tiers._blockcopy import verify_copy as native
    except ImportError:
        return None
    return native  # type: ignore[no-any-return]


#: The native form, or None where it was not built.
verify_copy_native: VerifyCopy | None = _load_native()
#: True when the native form runs (copies proceed in parallel across threads).
NATIVE = verify_copy_native is not None
#: The form in use: native when built, else Python.
verify_copy: VerifyCopy = verify_copy_native or verify_copy_python
