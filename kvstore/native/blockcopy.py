"""Verify-and-copy of stored blocks into caller memory: the transfer path's inner loop.

Given each block's meta record and bytes (views into LMDB's map) and a
destination view, check the block against its checksum and copy it. The
native form (`kvstore.native._blockcopy`, built from `kvstore/native/_blockcopy.c` when the
package is installed) does the whole batch with the GIL released, so executor
threads copy in parallel; this module's Python form gives the same results
one thread at a time, for installs without a C compiler. `NATIVE` says which
one runs; `kvstore serve` logs it.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from kvstore.host import usable_cpus
from kvstore.native.records import META_STRUCT

#: Result codes (the first three are `ReadStatus` values).
NOT_REACHED, FOUND, MISSING, CORRUPT, WRONG_SIZE = 0, 1, 2, 3, 4

VerifyCopy = Callable[[list, list, list, float, bool], tuple[bytes, list[int]]]
Verify = Callable[[list, list], bytes]
T = TypeVar("T")


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
        from kvstore.native._blockcopy import verify_copy as native
    except ImportError:
        return None
    return native  # type: ignore[no-any-return]


#: The native form, or None where it was not built.
verify_copy_native: VerifyCopy | None = _load_native()
#: True when the native form runs (copies proceed in parallel across threads).
NATIVE = verify_copy_native is not None
#: The form in use: native when built, else Python.
verify_copy: VerifyCopy = verify_copy_native or verify_copy_python


def verify_python(datas: list, checksums: list) -> bytes:
    """1 where the xxh3-64 of `datas[i]` equals `checksums[i]`, else 0 (0 for a None data).

    Raises:
        ValueError: the lists differ in length.
    """
    if len(datas) != len(checksums):
        raise ValueError("datas and checksums must be lists of the same length")
    digest = xxhash.xxh3_64_intdigest
    return bytes(int(d is not None and digest(d) == c) for d, c in zip(datas, checksums, strict=True))


def _load_native_verify() -> Verify | None:
    try:
        from kvstore.native._blockcopy import verify as native
    except ImportError:  # not built, or built before `verify` existed
        return None
    return native  # type: ignore[no-any-return]


def _load_blank_bytes() -> Callable[[int], tuple[bytes, memoryview]] | None:
    try:
        from kvstore.native._blockcopy import blank_bytes as native
    except ImportError:  # not built, or built before `blank_bytes` existed
        return None
    return native  # type: ignore[no-any-return]


_blank_bytes = _load_blank_bytes()


def fill_bytes(size: int, fill: Callable[[memoryview], T]) -> tuple[bytes, T]:
    """A new `size`-byte bytes object written by `fill` through a writable view, and what `fill` returned.

    gRPC sends only bytes, and a reply's blocks are copied in by the native loop:
    natively they land in the bytes object itself, which saves a copy of the whole
    reply (one per Fetch call, on the hot path). Without the native module the
    view is a bytearray's, copied to bytes after. `fill` must not keep the view.
    """
    if _blank_bytes is None or size < 2:
        buffer = bytearray(size)
        with memoryview(buffer) as view:
            result = fill(view)
        return bytes(buffer), result
    out, view = _blank_bytes(size)
    try:
        result = fill(view)
    finally:
        view.release()  # no writer is left once `out` is handed on
    return out, result


def digests_python(datas: list) -> list[int]:
    """The xxh3-64 of each buffer in `datas` (the checksum a block's meta record keeps)."""
    digest = xxhash.xxh3_64_intdigest
    return [digest(d) for d in datas]


def _load_native_digests() -> Callable[[list], list[int]] | None:
    try:
        from kvstore.native._blockcopy import digests as native
    except ImportError:  # not built, or built before `digests` existed
        return None
    return native  # type: ignore[no-any-return]


#: The native form of `digests` (one call for a batch, without the GIL), or None where it was not built.
digests_native: Callable[[list], list[int]] | None = _load_native_digests()


def digests(datas: Sequence[Any]) -> list[int]:
    """The xxh3-64 of each of `datas` (bytes-like), as `digests_python` gives them: natively where built."""
    native = digests_native
    return native(list(datas)) if native is not None else digests_python(list(datas))


#: The native checksum loop (run without the GIL), or None where it was not built.
verify_native: Verify | None = _load_native_verify()
#: The form in use: native when built, else Python.
verify: Verify = verify_native or verify_python

#: Threads `verify_many` and `copy_many` spread a batch over by default: the CPUs, at most 8
#: (past that the memory bus, not the hashing, bounds a 57 KB block's check).
DEFAULT_THREADS = max(1, min(8, usable_cpus()))
#: Fewer blocks than this per thread are not worth a hop to the pool.
_MIN_PER_THREAD = 8
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One pool for the process (made on first use): a restore per request must not start threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=DEFAULT_THREADS, thread_name_prefix="kvstore-verify")
        return _pool


def _slices(n: int, threads: int | None) -> list[tuple[int, int]]:
    parts = max(1, min(threads or DEFAULT_THREADS, n // _MIN_PER_THREAD))
    step = -(-n // parts) if n else 1
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _spread(fn: Callable[[int, int], Any], n: int, threads: int | None) -> list[Any]:
    """`fn(lo, hi)` over slices of range(n), on the pool when there is more than one; results in order."""
    parts = _slices(n, threads)
    if len(parts) <= 1 or not NATIVE_VERIFY:  # the Python forms hold the GIL: threads would only queue
        return [fn(lo, hi) for lo, hi in parts]
    return [f.result() for f in [_executor().submit(fn, lo, hi) for lo, hi in parts]]


#: True when `verify_many` and `copy_many` hash without the GIL, over several threads.
NATIVE_VERIFY = verify_native is not None and verify_copy_native is not None


def verify_many(datas: Sequence[Any], checksums: Sequence[int], threads: int | None = None) -> list[bool]:
    """Whether each block's xxh3-64 equals its checksum, hashed over `threads` threads (default
    `DEFAULT_THREADS`) without the GIL where the native module is built.

    Raises:
        ValueError: the sequences differ in length.
        TypeError: a data is not a buffer.
        OverflowError: a checksum is not a uint64.
    """
    datas, checksums = list(datas), list(checksums)
    if len(datas) != len(checksums):
        raise ValueError("datas and checksums must have the same length")
    parts = _spread(lambda lo, hi: verify(datas[lo:hi], checksums[lo:hi]), len(datas), threads)
    return [bool(b) for part in parts for b in part]


def copy_many(metas: Sequence[Any], datas: Sequence[Any], dests: Sequence[Any],
              threads: int | None = None) -> bytes:
    """`verify_copy` of a batch spread over threads (every block checked and copied; none stops it).

    Returns:
        A result code per block (FOUND, MISSING, CORRUPT or WRONG_SIZE; NOT_REACHED where dest is None).
    """
    metas, datas, dests = list(metas), list(datas), list(dests)
    parts = _spread(lambda lo, hi: verify_copy(metas[lo:hi], datas[lo:hi], dests[lo:hi], 0.0, False)[0],
                    len(dests), threads)
    return b"".join(parts)


def addresses_python(buffers: list) -> list[int]:
    """The address of each buffer's first byte (0 for None), through numpy.

    Raises:
        TypeError: an item is not a buffer.
    """
    import numpy as np

    out = []
    for b in buffers:
        if b is None:
            out.append(0)
            continue
        try:
            out.append(int(np.frombuffer(b, dtype=np.uint8).ctypes.data) if len(memoryview(b)) else 0)
        except ValueError as exc:  # numpy's word for a non-buffer
            raise TypeError(str(exc)) from None
    return out


def _load_native_addresses() -> Callable[[list], list[int]] | None:
    try:
        from kvstore.native._blockcopy import addresses as native
    except ImportError:
        return None
    return native  # type: ignore[no-any-return]


#: Addresses of buffers' first bytes: native when built (a list of 15,625 in about a millisecond).
addresses: Callable[[list], list[int]] = _load_native_addresses() or addresses_python


# -- the same-host reader's record lookups in a mapping of data.mdb ----------------------------

#: LMDB's meta record after a meta page's 16-byte header, and a database record (mdb.c; the
#: layouts tiers/lmdb_pages.py reads): magic, version, address, map size, free and main
#: databases, last page, transaction id.
_MDB_META = struct.Struct("<IIQQ48s48sQQ")
_MDB_DB = struct.Struct("<IHHQQQQQ")
_MDB_MAGIC, _PAGE_HEADER, _NODE_HEADER = 0xBEEFC0DE, 16, 8
_P_BRANCH, _P_LEAF, _F_SUBDATA = 0x01, 0x02, 0x02
_P_INVALID = 2**64 - 1


def _small_search(base: int, length: int, psize: int, root: int, key: bytes) -> tuple[int, bytes] | None:
    """(node flags, inline value) of `key` in a small tree (the main database's few names), or None."""
    pgno = root
    for _ in range(8):
        if pgno < 2 or (pgno + 1) * psize > length:
            return None
        page = ctypes.string_at(base + pgno * psize, psize)
        head_pgno, _pad, flags, lower, _upper = struct.unpack_from("<QHHHH", page)
        if head_pgno != pgno:
            return None
        nodes = []
        for i in range((lower - _PAGE_HEADER) // 2):
            (at,) = struct.unpack_from("<H", page, _PAGE_HEADER + 2 * i)
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", page, at)
            k = page[at + _NODE_HEADER:at + _NODE_HEADER + ksize]
            nodes.append((k, lo | hi << 16, nflags, at + _NODE_HEADER + ksize))
        if flags & _P_BRANCH:
            pick = max((i for i, n in enumerate(nodes) if i == 0 or n[0] <= key), default=0)
            _, lohi, nflags, _ = nodes[pick]
            pgno = lohi | nflags << 32
            continue
        if not flags & _P_LEAF:
            return None
        for k, size, nflags, at in nodes:
            if k == key:
                return nflags, page[at:at + size]
        return None
    return None


def named_root(base: int, length: int, psize: int, txn_id: int, name: bytes) -> int | None:
    """Root page of database `name` in the snapshot `txn_id`, read from a mapping of data.mdb.

    None when it cannot be told for sure (the caller then reads through py-lmdb): neither
    meta page is that snapshot's (the writer committed twice since), the meta page was
    rewritten while it was read, or the database is not a plain one.
    """
    for i in (0, 1):
        at = base + i * psize + _PAGE_HEADER
        magic, _version, _addr, _mapsize, _free, main, _last, txnid = _MDB_META.unpack(
            ctypes.string_at(at, _MDB_META.size))
        if magic != _MDB_MAGIC or txnid != txn_id:
            continue
        found = _small_search(base, length, psize, _MDB_DB.unpack(main)[-1], name)
        # Still this snapshot's meta page: what was read of it was not being rewritten.
        if struct.unpack("<Q", ctypes.string_at(at + _MDB_META.size - 8, 8))[0] != txn_id:
            return None
        if found is None or not found[0] & _F_SUBDATA or len(found[1]) != _MDB_DB.size:
            return None
        _pad, flags, _depth, _b, _l, _o, _entries, root = _MDB_DB.unpack(found[1])
        return None if flags or root == _P_INVALID else int(root)
    return None


def _load_native_resolve() -> Callable[..., tuple[int, int, bytes, bytes, bytes, bytes]] | None:
    try:
        from kvstore.native._blockcopy import resolve as native
    except ImportError:
        return None
    return native  # type: ignore[no-any-return]


#: The native record lookups (`kvstore.native._blockcopy.resolve`), or None where not built: the reader
#: then looks its records up through py-lmdb.
resolve = _load_native_resolve()


#: Fewer records than this per thread are looked up on the caller's thread: a pool hop costs
#: more than the B-tree searches it would spread.
_MIN_RESOLVE_PER_THREAD = 512


def resolve_many(base: int, length: int, psize: int, root: int, prefix: bytes, hashes: list[bytes],
                 threads: int | None = None) -> tuple[int, int, Any, Any, Any, Any] | None:
    """`resolve` of a long key list spread over the pool's threads (each slice searched without
    the GIL), with the one-call answer: the prefix stops at the first hash, in asked order, whose
    records are missing or damaged, and a page that does not parse before that raises ValueError.

    Returns:
        (found, damaged, offsets, sizes, meta_offsets, checksums) as numpy columns (int64,
        int64, int64, uint64) of `found` rows; None where the native module is not built.
    """
    native = resolve
    if native is None:
        return None
    import numpy as np

    n = len(hashes)
    parts = _slices(n, max(1, min(threads or DEFAULT_THREADS, n // _MIN_RESOLVE_PER_THREAD)))
    if len(parts) <= 1:
        answers: list[Any] = [native(base, length, psize, root, prefix, hashes)]
        parts = [(0, n)]
    else:
        futures = [_executor().submit(native, base, length, psize, root, prefix, hashes[lo:hi]) for lo, hi in parts]
        answers = []
        for future in futures:  # every slice is waited for, so none outlives the caller's txn
            try:
                answers.append(future.result())
            except ValueError as exc:
                answers.append(exc)
    found, damaged = 0, 0
    columns: list[list[Any]] = [[], [], [], []]
    for (lo, hi), answer in zip(parts, answers, strict=True):
        if isinstance(answer, ValueError):  # before any stop: the one call would have raised here too
            raise answer
        got, damaged = answer[0], answer[1]
        for column, raw, dtype in zip(columns, answer[2:], (np.int64, np.int64, np.int64, np.uint64), strict=True):
            column.append(np.frombuffer(raw, dtype=dtype, count=got))
        found += got
        if got < hi - lo:  # this slice stopped: the later slices' records are past the prefix
            break
    offs, sizes, metas, sums = (np.concatenate(c) if len(c) > 1 else c[0] for c in columns)
    return found, damaged, offs, sizes, metas, sums


def _load_native_verify_spans() -> Callable[[int, int, bytes, bytes, bytes], bytes] | None:
    try:
        from kvstore.native._blockcopy import verify_spans as native
    except ImportError:
        return None
    return native  # type: ignore[no-any-return]


_verify_spans_native = _load_native_verify_spans()


def verify_spans(base: int, length: int, offsets: Any, sizes: Any, checksums: Any,
                 threads: int | None = None) -> list[bool] | None:
    """Whether each block at `base + offsets[i]` (`sizes[i]` bytes, inside `length`) matches
    `checksums[i]`: int64, int64 and uint64 numpy arrays; hashed over threads without the GIL.

    Returns:
        None where the native module is not built (the caller checks views with `verify_many`).
    """
    native = _verify_spans_native
    if native is None:
        return None
    import numpy as np

    offs = np.ascontiguousarray(offsets, dtype=np.int64)
    szs = np.ascontiguousarray(sizes, dtype=np.int64)
    sums = np.ascontiguousarray(checksums, dtype=np.uint64)
    parts = _spread(lambda lo, hi: native(base, length, offs[lo:hi].tobytes(), szs[lo:hi].tobytes(),
                                          sums[lo:hi].tobytes()), len(offs), threads)
    return [bool(b) for part in parts for b in part]
