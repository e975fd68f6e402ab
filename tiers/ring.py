"""The request ring's native server work (`kvstore.native._ring`), and what it needs of the LMDB tier.

`gateway/transfer_ring.py` runs each ring on a Python thread. Where the native module
is built, that thread only waits (`kvstore.native.ring.wait`: a short spin, then the futex, without the
GIL) and, per request, opens a read txn and calls `serve`, which parses and checks the
request, finds the blocks in the tier's mapping of data.mdb, verifies and copies them
and writes the answer, all without the GIL; the thread counts the read and `publish`es (`kvstore.native.ring`)
the answer. `serve` answers the plain case only and hands any
other request back with its bytes (read once from the ring): the Python server then
answers it as before. `NATIVE` says whether this runs; without it the Python server
does all of it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lmdb

from kvstore.native import blockcopy
from kvstore.native.ring import native

#: `serve`'s first answer: the answer is written, to `publish` (with the descriptors' count), the
#: request is handed back (with its bytes), or (given a plan) every block is verified, to `finish`.
READY, HANDED_BACK, PLANNED = 0, 1, 2
#: `take`'s other answers: no request within the spin; a request whose length or lease the caller
#: judges; one the readied txn is too old for (a write committed since); one of more than `PLAN_MOST`
#: descriptors (nothing read).
IDLE, CHECK, STALE, LARGE = 3, 4, 5, 6
#: The most descriptors `serve` plans (kvstore/native/_ring.c's PLAN_MOST).
PLAN_MOST = 16
#: Bytes of a plan (`serve`'s `plan`) per descriptor.
PLAN_BYTES_PER_DESCRIPTOR = 16

#: A server spins this long on the ring's word before its futex: a client's next request within it
#: is taken without a wake-up (tens of microseconds on a loaded VM). Bounded, so an idle ring costs
#: at most this much CPU after each request.
SERVER_SPIN_S = 100e-6
#: ... of which the first part without yielding the core (a yield on a loaded box may hand it to
#: another process for a whole time slice; a spin that never yields may hold the core the client needs).
SERVER_HOT_SPIN_S = 50e-6


#: `take` itself (None where not built): the ring thread's loop calls it without the wrapper's frame.
take_native: Callable[..., tuple[int, int, int, Any]] | None = None if native is None else native.take
#: `finish` itself (None where not built): the ring thread's answer path calls it without the wrapper's frame.
finish_native: Callable[..., None] | None = None if native is None else native.finish
#: True when the ring's native server work is built (`kvstore.native.ring.NATIVE`).
NATIVE = native is not None


def serve(ring: int, seq: int, length: int, regions: bytes, block_bytes: int, limit: int, prefix: bytes,
          mapping: Mapping, txn: lmdb.Transaction, due_before: float, plan: bytearray | None = None
          ) -> tuple[int, Any]:
    """Answer one ring request natively, or hand its bytes back.

    Args:
        ring: the ring's address (its mapping kept alive by the caller).
        seq, length: the header's request number and length, read once by the caller.
        regions: the session's regions (`region_table`), kept mapped by the caller.
        block_bytes, limit: the geometry's block size; the most descriptors a request holds.
        prefix: the tenant's key prefix.
        mapping: the tier's mapping of data.mdb.
        txn: a read txn of the tier, open for the whole call.
        due_before: a block last used before this is due a retention refresh (handed back).
        plan: given (`PLAN_BYTES_PER_DESCRIPTOR` * `limit` bytes at least), a request of at most
            `PLAN_MOST` descriptors stops once every block is found and verified, and where each goes
            is written into it: (PLANNED, descriptors), for `finish`. A larger one is READY as without.

    Returns:
        (READY, descriptors): every block verified and copied, and the answer (all DONE) and its
        header words written, but not `state`: `publish` it once the read is counted; or
        (HANDED_BACK, the request's bytes as read from the ring).
    """
    assert native is not None
    if plan is None:
        return native.serve(ring, seq, length, regions, block_bytes, limit, prefix, mapping.base, mapping.length,
                          mapping.psize, txn.id(), due_before)
    return native.serve(ring, seq, length, regions, block_bytes, limit, prefix, mapping.base, mapping.length,
                      mapping.psize, txn.id(), due_before, plan)


def take(ring: int, expected: int, hot_s: float, spin_s: float, expires: float, regions: bytes, block_bytes: int,
         limit: int, prefix: bytes, mapping: Mapping, txn: lmdb.Transaction, due_before: float, plan: bytearray
         ) -> tuple[int, int, int, Any]:
    """Spin for the ring's next request and plan it, in one call without the GIL.

    The ring thread readies what a request needs while none is there (a read txn, the region
    table, `due_before`, the plan), then calls this: it spins while the state word holds
    `expected` (`hot_s` without yielding unless the client last ran on this CPU, then yielding
    until `spin_s`; never the futex), and once a request is there stores BUSY, reads its seq
    and length once and runs `serve`'s first half with `plan`.

    Args:
        ring, regions, block_bytes, limit, prefix, mapping, txn, due_before, plan: as `serve`'s.
        expected: the state word's value while no request is there (not REQUEST).
        expires: the ring's lease end, in `time.monotonic` seconds (CLOCK_MONOTONIC).

    Returns:
        (kind, seq, length, value): (IDLE, 0, 0, the word's value) when no request came within the
        spin; (CHECK, ...) a length past the request area or an ended lease, (STALE, ...) a write
        committed since `txn` began, (LARGE, ...) more than `PLAN_MOST` descriptors (nothing read):
        the caller serves these as without `take`; (PLANNED, seq, length, n): every block found and
        verified, for `finish`; (HANDED_BACK, seq, length, the request's bytes as read).
    """
    assert native is not None
    return native.take(ring, expected, hot_s, spin_s, expires, regions, block_bytes, limit, prefix, mapping.base,
                      mapping.length, mapping.psize, txn.id(), due_before, plan)


def finish(ring: int, seq: int, plan: bytearray, n: int, block_bytes: int) -> None:
    """The rest of a request `serve` answered PLANNED, without the GIL: copy its n verified blocks,
    write the all-DONE answer and its header words, store ANSWERED and wake the client. The
    caller keeps `serve`'s read txn open and the regions mapped until it returns, and passes the
    plan untouched."""
    assert native is not None
    native.finish(ring, seq, plan, n, block_bytes)


_TRIPLE = struct.Struct("<QQQ")


def region_table(regions: Iterable[tuple[int, int, int]]) -> bytes:
    """(region id, address, length) triples packed as `serve` reads them."""
    return b"".join(_TRIPLE.pack(*r) for r in regions)


class Mapping:
    """Where this process maps an LMDB environment's data.mdb (LMDB maps the file once, at open).

    `env.info()["map_addr"]` is 0 unless the map is fixed, so the kernel's list is asked, for
    the mapping of data.mdb that holds a record py-lmdb hands out of `env` (another mapping of
    the same file, such as a same-host reader's in this process, may come and go). The tier
    never resizes its map, so the address holds for the environment's life.

    Raises:
        LookupError: the environment's map is not found (not Linux, or an empty environment).
    """

    def __init__(self, env: lmdb.Environment) -> None:
        path = Path(env.path()) / "data.mdb"
        st = path.stat()
        with env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            if not cursor.first():
                raise LookupError(f"{path} holds no record to find its mapping by")
            inside = blockcopy.addresses([cursor.value()])[0]
        found: tuple[int, int] | None = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or int(parts[2], 16) != 0 or int(parts[4]) != st.st_ino:
                    continue
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                if os.makedev(major, minor) != st.st_dev and parts[5].strip() != str(path):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= inside < hi:
                    found = (lo, hi - lo)
        if found is None:
            raise LookupError(f"{path}: the environment's map is not found in this process")
        self.base, self.length = found
        self.psize: int = env.stat()["psize"]
