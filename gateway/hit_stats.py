"""Hit counters per tenant in time buckets, summed over windows that end now, kept in the data dir.

The store's own counters (tiers/accounting.py) are totals since the store was
created, all tenants together: a restart mixes the earlier runs into every
rate, and one large miss moves the rate for good. These counters are bucketed
by wall-clock time per tenant (minutes for the last hour, half-hours for the
last day: about 110 small buckets per busy tenant), so a rate can be read over
a window that ends now:

- "5m", "1h": the last 5 or 60 minute buckets, the current (partly elapsed)
  minute included; "24h": the last 48 half-hour buckets, the current one
  included (23.5 to 24 h). Buckets are kept across restarts, so a window after
  a restart holds the previous run's traffic inside it, and nothing older;
  the time the server was down holds nothing.
- "start": since this server process started; zero at every start.
- "all": since the counters were first kept in this data dir (its
  `stats/hits.json`), across every run.

Counting is an in-memory increment under a lock (no I/O on the call's path).
The file is written off the event loop by one writer thread: when the first
call of a new minute arrives (so at most once a minute, and never while idle)
and at `close()`; each write replaces the file atomically (temporary file,
fsync, rename, fsync of the folder), so a crash loses at most the minute
since the last write and never leaves a torn file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstore.clock import Clock
from kvstore.errors import ConfigError
from kvstore.side_files import read_json

log = logging.getLogger(__name__)

#: The counters of one bucket, in this order (the HitCounts message's field names).
FIELDS: tuple[str, ...] = (
    "lookups", "lookup_blocks_asked", "lookup_blocks_found", "lookup_tokens_asked", "lookup_tokens_found",
    "gets", "get_blocks_asked", "get_blocks_returned", "get_tokens_asked", "get_tokens_returned",
    "swa_gets", "swa_snapshots_asked", "swa_snapshots_found",
    "resume_plans", "resume_prompt_tokens", "resume_found_tokens", "resume_usable_tokens",
    "resume_fetch_snapshot_plans", "resume_bounded_replay_plans", "resume_exact_replay_plans",
    "resume_full_prefill_plans",
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
#: Per kind of call: the indexes of (calls, units asked, units found) and, for blocks, (tokens asked, found).
_KINDS: dict[str, tuple[int, ...]] = {
    kind: tuple(_INDEX[f] for f in fields) for kind, fields in {
        "lookup": ("lookups", "lookup_blocks_asked", "lookup_blocks_found", "lookup_tokens_asked",
                   "lookup_tokens_found"),
        "get": ("gets", "get_blocks_asked", "get_blocks_returned", "get_tokens_asked", "get_tokens_returned"),
        "swa": ("swa_gets", "swa_snapshots_asked", "swa_snapshots_found"),
    }.items()
}
_RESUME = tuple(_INDEX[f] for f in ("resume_plans", "resume_prompt_tokens", "resume_found_tokens",
                                    "resume_usable_tokens"))
_GET_FIELDS = _KINDS["get"]
_NO_GETS = (0,) * len(_GET_FIELDS)
#: Bucket sizes in seconds, and how many of each are kept (the longest window of that size).
LEVELS: dict[int, int] = {60: 60, 1800: 48}
#: Windows by name: (bucket seconds, buckets summed); None: the run's or all-time totals.
WINDOWS: dict[str, tuple[int, int] | None] = {"5m": (60, 5), "1h": (60, 60), "24h": (1800, 48),
                                              "start": None, "all": None}
#: Most points of a 24-hour series (one a half-hour bucket).
MAX_SERIES_POINTS = LEVELS[1800]
FILE_NAME = "hits.json"
_FORMAT = 2
#: The most of the file read at start: about 10 KiB a busy tenant, so some 10,000 tenants. A larger file is
#: damaged as far as the start is concerned: set aside, and counting starts from zero.
MAX_FILE_BYTES = 128 << 20
#: A stored counter is below this (the Stats reply's uint64 fields, with room for the sums).
MAX_COUNT = 1 << 63
#: The latest time a file may name (year 2286): anything later is damage.
MAX_TIME_S = 1e10


@dataclass(frozen=True, kw_only=True)
class Window:
    """One window's counters: `counts` by FIELDS name over `seconds` ending now."""

    name: str
    seconds: float
    counts: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class Point:
    """One slice of a series: `counts` over [start_s, start_s + seconds)."""

    start_s: float
    seconds: float
    counts: dict[str, int]


def _zeros() -> list[int]:
    return [0] * len(FIELDS)


def _named(counts: list[int]) -> dict[str, int]:
    return dict(zip(FIELDS, counts, strict=True))


def _sum_into(total: list[int], counts: Iterable[list[int]]) -> list[int]:
    for c in counts:
        for i, v in enumerate(c):
            total[i] += v
    return total


def _count(value: object) -> int:
    """A stored counter: a whole number in [0, 2^63) (what the Stats reply's fields hold)."""
    if type(value) is not int or not 0 <= value < MAX_COUNT:
        raise ValueError(f"a counter is {str(value)[:40]!r}, not a whole number in [0, 2^63)")
    return value


def _parse(state: dict[str, object]) -> tuple[dict[str, list[int]], dict[int, dict[str, dict[int, list[int]]]], float]:
    """(all-time totals, buckets, counted_since_s) of a parsed hits file, every value checked.

    Counters are matched by name (`fields`), so a file of another version keeps the ones both know.

    Raises:
        ValueError: naming what is missing or of the wrong type or range.
    """
    names, totals, by_size, since = (state.get(k) for k in ("fields", "all", "buckets", "counted_since_s"))
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("'fields' is not a list of names")
    if not isinstance(totals, dict) or not isinstance(by_size, dict):
        raise ValueError("'all' or 'buckets' is not an object")
    if isinstance(since, bool) or not isinstance(since, int | float) or not 0 <= since <= MAX_TIME_S:
        raise ValueError(f"counted_since_s is {str(since)[:40]!r}, not a time")
    at = [(_INDEX[n], j) for j, n in enumerate(names) if n in _INDEX]  # fields of another version: dropped

    def counts(values: object) -> list[int]:
        if not isinstance(values, list) or len(values) != len(names):
            raise ValueError(f"a counter list is not a list of {len(names)} counters")
        out = _zeros()
        for i, j in at:
            out[i] = _count(values[j])
        return out

    def tenants(by_tenant: object) -> dict[str, dict[int, list[int]]]:
        if not isinstance(by_tenant, dict) or not all(isinstance(by, dict) for by in by_tenant.values()):
            raise ValueError("a bucket level is not an object of tenants")
        return {str(t): {int(i): counts(c) for i, c in by.items()} for t, by in by_tenant.items()}

    buckets = {size: tenants(by_size.get(str(size), {})) for size in LEVELS}
    return {str(t): counts(c) for t, c in totals.items()}, buckets, float(since)


class HitStats:
    """Hit counters per tenant: minute buckets for an hour, half-hour buckets for a day, this run's
    totals and all-time totals.

    Args:
        folder: where `hits.json` lives (`<data_dir>/stats`); None keeps nothing on disk.
        clock: wall-clock time names the buckets of each count (a ManualClock in tests).
        block_tokens: tokens per block, to count lookups and gets in tokens too.
    """

    def __init__(self, folder: Path | None, clock: Clock, *, block_tokens: int) -> None:
        self.folder = folder
        self.clock = clock
        self.block_tokens = block_tokens
        self.started_s = clock.now()
        self._lock = threading.Lock()
        #: Bucket seconds -> tenant -> bucket index (time // seconds) -> counters.
        self._buckets: dict[int, dict[str, dict[int, list[int]]]] = {size: {} for size in LEVELS}
        self._run: dict[str, list[int]] = {}
        #: Tenant -> its counter lists of the minute `_minute` (totals and buckets), for `record_get`.
        self._hot: dict[str, list[list[int]]] = {}
        #: Tenant -> the get counters (`_GET_FIELDS` order) `record_get` added this minute and not yet
        #: folded into `_hot`'s lists; every read and the minute's roll fold them first (`_fold`).
        self._pending: dict[str, list[int]] = {}
        self._all: dict[str, list[int]] = {}
        self.counted_since_s = self.started_s
        self._minute = int(self.started_s // 60)
        self._writer: ThreadPoolExecutor | None = None
        self._write_pending = False
        if folder is not None:
            self._load(folder / FILE_NAME)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="hit-stats")

    # -- counting (the servicers' hot path) --------------------------------

    def record(self, tenant: str, kind: str, asked: int, found: int) -> None:
        """Count one call of `kind` ("lookup", "get": blocks; "swa": snapshots) by `tenant`."""
        if kind == "get":
            self.record_get(tenant, asked, found)
            return
        where = _KINDS[kind]
        if len(where) == 3:
            self._add(tenant, where, (1, asked, found))
        else:
            self._add(tenant, where, (1, asked, found, asked * self.block_tokens, found * self.block_tokens))

    def record_get(self, tenant: str, asked: int, found: int) -> None:
        """Count one get of `asked` blocks, `found` returned, by `tenant`: `record(tenant, "get", ...)`
        without its per-call lookups (the request ring counts every read with it before answering).

        The four counter lists a tenant's counts go to (run, all-time, this minute's and this
        half-hour's buckets) are kept per tenant for the minute they were found in; a call within
        that minute adds to one pending list under the lock, which every read and the minute's
        roll fold into the four first, so nothing reads a count without it.
        """
        now = self.clock.now()
        minute = int(now // 60)
        with self._lock:
            pending = self._pending.get(tenant) if minute == self._minute else None
            if pending is not None:
                tokens = self.block_tokens
                pending[0] += 1
                pending[1] += asked
                pending[2] += found
                pending[3] += asked * tokens
                pending[4] += found * tokens
                return
        tokens = self.block_tokens
        self._add(tenant, _KINDS["get"], (1, asked, found, asked * tokens, found * tokens), now)

    def record_resume(self, tenant: str, *, prompt_tokens: int, found_tokens: int, usable_tokens: int,
                      action_field: str) -> None:
        """Count one resume plan a planner reported (ReportResume); `action_field` names its action's
        counter (gateway.resume_counters.ACTION_FIELDS)."""
        self._add(tenant, (*_RESUME, _INDEX[action_field]), (1, prompt_tokens, found_tokens, usable_tokens, 1))

    def _add(self, tenant: str, where: tuple[int, ...], values: tuple[int, ...], now: float | None = None) -> None:
        """Add `values` to the counters at indexes `where` of `tenant`'s buckets at `now` (None: the
        clock's now) and its totals."""
        if now is None:
            now = self.clock.now()
        minute = int(now // 60)
        with self._lock:
            targets = [self._run.get(tenant) or self._run.setdefault(tenant, _zeros()),
                       self._all.get(tenant) or self._all.setdefault(tenant, _zeros())]
            for size, by_tenant in self._buckets.items():
                by_index = by_tenant.get(tenant)
                if by_index is None:
                    by_index = by_tenant[tenant] = {}
                index = int(now // size)
                bucket = by_index.get(index)
                targets.append(bucket if bucket is not None else by_index.setdefault(index, _zeros()))
            pairs = tuple(zip(where, values, strict=True))
            for counts in targets:
                for i, v in pairs:
                    counts[i] += v
            rolled = minute != self._minute
            if rolled:
                self._minute = minute
                self._prune(now)
            # The targets of `minute` (now the counters' minute): `record_get`'s until the minute rolls.
            if tenant not in self._hot:
                self._hot[tenant] = targets
                self._pending[tenant] = [0] * len(_GET_FIELDS)
        if rolled:
            self._write_soon()

    def _prune(self, now: float) -> None:
        """Drop buckets past the longest window of their size (under the lock, once a minute at most)."""
        self._fold()
        self._hot.clear()  # the targets kept were the previous minute's
        self._pending.clear()
        for size, by_tenant in self._buckets.items():
            oldest = int(now // size) - LEVELS[size]
            for by_index in by_tenant.values():
                for index in [i for i in by_index if i <= oldest]:
                    del by_index[index]

    def _fold(self) -> None:
        """Add `record_get`'s pending counts into their counter lists (under the lock, before any read)."""
        for tenant, pending in self._pending.items():
            if pending[0]:
                for counts in self._hot[tenant]:
                    for i, v in zip(_GET_FIELDS, pending, strict=True):
                        counts[i] += v
                pending[:] = _NO_GETS

    # -- reading -----------------------------------------------------------

    def tenants(self) -> list[str]:
        """Every tenant counted since the counters began, sorted."""
        with self._lock:
            return sorted(self._all)

    def windows(self, tenant: str | None, names: Iterable[str] = WINDOWS) -> list[Window]:
        """`tenant`'s counters (None: every tenant's summed) over each window in `names`."""
        now = self.clock.now()
        tenants = None if tenant is None else {tenant}
        out = []
        with self._lock:
            self._fold()
            for name in names:
                span = WINDOWS[name]
                if span is None:
                    totals = self._run if name == "start" else self._all
                    counts = _sum_into(_zeros(), (c for t, c in totals.items() if tenants is None or t in tenants))
                    since = self.started_s if name == "start" else self.counted_since_s
                    out.append(Window(name=name, seconds=max(now - since, 0.0), counts=_named(counts)))
                    continue
                size, count = span
                last = int(now // size)
                first = last - count + 1
                counts = _sum_into(_zeros(), (c for _, c in self._in_range(size, tenants, first, last)))
                out.append(Window(name=name, seconds=now - first * size, counts=_named(counts)))
        return out

    def series(self, tenant: str | None, points: int) -> list[Point]:
        """The last 24 h in `points` equal slices of whole half-hours (at most 48; the last one holds now)."""
        size = 1800
        per = LEVELS[size] // max(min(points, MAX_SERIES_POINTS), 1)
        count = LEVELS[size] // per
        last = int(self.clock.now() // size)
        first = last - count * per + 1
        tenants = None if tenant is None else {tenant}
        slices = [_zeros() for _ in range(count)]
        with self._lock:
            self._fold()
            for index, c in self._in_range(size, tenants, first, last):
                _sum_into(slices[(index - first) // per], [c])
        return [Point(start_s=(first + i * per) * float(size), seconds=per * float(size), counts=_named(c))
                for i, c in enumerate(slices)]

    def _in_range(self, size: int, tenants: set[str] | None, first: int, last: int) -> Iterable[tuple[int, list[int]]]:
        """(index, counters) of the `size`-second buckets from `first` to `last` of `tenants` (None: all)."""
        for t, by_index in self._buckets[size].items():
            if tenants is None or t in tenants:
                yield from ((i, c) for i, c in by_index.items() if first <= i <= last)

    # -- persistence -------------------------------------------------------

    def _write_soon(self) -> None:
        """Have the writer thread write the file, unless a write is already waiting."""
        with self._lock:
            writer = self._writer
            if writer is None or self._write_pending:
                return
            self._write_pending = True
            # Under the lock: close() takes the writer away under it too, so this never submits after shutdown.
            writer.submit(self._write_logged)

    def _write_logged(self) -> None:
        try:
            self.write()
        except OSError as exc:  # the next minute tries again; serving goes on
            log.warning("could not write the hit counters to %s: %s", self.folder, exc)

    def write(self) -> None:
        """Write the counters to `<folder>/hits.json`, atomically (blocking: call off the event loop)."""
        if self.folder is None:
            return
        with self._lock:
            self._fold()
            self._write_pending = False
            state = {
                "format": _FORMAT, "fields": list(FIELDS), "counted_since_s": self.counted_since_s,
                "all": {t: list(c) for t, c in self._all.items()},
                "buckets": {str(size): {t: {str(i): list(c) for i, c in by.items()} for t, by in by_tenant.items()}
                            for size, by_tenant in self._buckets.items()},
            }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / FILE_NAME
        tmp = path.with_name(FILE_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    def _load(self, path: Path) -> None:
        """Read the counters an earlier run wrote; a damaged file is set aside (logged) and counting starts anew.

        Damaged is anything `_parse` refuses, whatever the bytes (issue 29: binary content and
        `1e400` killed the start with a traceback); at most MAX_FILE_BYTES are read.

        Raises:
            ConfigError: the damaged file (or a file where the stats folder should be) cannot be moved aside.
        """
        if self.folder is not None and self.folder.exists() and not self.folder.is_dir():
            self._set_aside(self.folder, "it is a file, not a folder")
            return
        try:
            state = read_json(path, max_bytes=MAX_FILE_BYTES)
            if state is None:
                return
            totals, buckets, since = _parse(state)
        except (OSError, ValueError) as exc:  # DamagedFile is a ValueError; OSError: it cannot be read at all
            self._set_aside(path, str(exc))
            return
        self._all, self._buckets, self.counted_since_s = totals, buckets, since
        self._prune(self.started_s)

    def _set_aside(self, path: Path, why: str) -> None:
        """Move the damaged `path` to `<path>.damaged` (replacing an earlier one), so the counters start from zero."""
        damaged = path.with_name(path.name + ".damaged")
        try:
            os.replace(path, damaged)
        except OSError as exc:
            raise ConfigError(f"hit counters {path} are damaged ({why}) and cannot be moved to {damaged}: "
                              f"{exc.strerror or exc}", hint=f"move {path} away by hand; the counters restart "
                              "from zero, the cache's blocks are not affected") from None
        log.warning("%s is damaged (%s): moved to %s, hit counters start from zero", path, why, damaged)

    def close(self) -> None:
        """Write the counters a last time and stop the writer thread (at server stop)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.shutdown(wait=True)
        self._write_logged()
