"""The audit log of admin changes: append-only, fsync'd JSON lines in the data dir.

Every change an admin makes (a policy field, a purge, an export, an import) is
one line: when (wall-clock seconds), who (the caller's tenant, its token's
name), what (the action and the tenant acted on) and the value before and after.
A line is on disk (written, flushed, fsync'd) before the call that made the
change answers, and the same record goes to the `kvstore.audit` logger as one
structured line, so a log collector sees admin changes without reading the file.

The file is only ever appended to (O_APPEND). A crash in the middle of a write
can leave a torn last line: opening the log ends it with a newline, and reading
skips a line that does not parse and logs it, so every other entry stays readable.
Whatever else is in the file (binary, a line of the wrong shape, a line longer
than MAX_LINE_BYTES, JSON nested too deeply) is skipped the same way: the server
starts and appends after it, and reading holds at most one line and the last
`limit` entries in memory, however long the file (issue 29).

`AuditTrail` is what the Admin service records to: this file (`AuditLog`), or in a
fleet the log in etcd (`gateway.shared_tables.EtcdAudit`, docs/FLEET.md F26, F28).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from kvstore.clock import Clock, SystemClock
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.audit")

#: File name inside the admin folder of the data dir.
AUDIT_NAME = "audit.jsonl"
#: The longest line read back; an entry is a few hundred bytes (a policy's fields before and after).
MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class AuditEntry:
    """One admin change."""

    time_s: float
    actor: str
    action: str
    tenant: str
    old: Any
    new: Any


_ENTRY_FIELDS = {f.name for f in fields(AuditEntry)}
#: A time_s past this is no time an entry was written at (and would not fit a double as a big integer).
_MAX_TIME_S = 1e12


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a file created or renamed in it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def log_entry(entry: AuditEntry) -> None:
    """Send a written entry to the `kvstore.audit` logger as one structured line (for log collectors)."""
    record = asdict(entry)
    log.info(json.dumps({"event": "admin_change", **record}, sort_keys=True), extra={"audit": record})


def entry_json(entry: AuditEntry) -> bytes:
    """One entry as stored: a JSON object on one line, without its newline."""
    return json.dumps(asdict(entry), sort_keys=True).encode()


class AuditTrail(ABC):
    """Where admin changes are recorded and read back, as the servicer sees it: `AuditLog` (the data dir's
    file, a single node) or `gateway.shared_tables.EtcdAudit` (etcd, a fleet: docs/FLEET.md)."""

    @abstractmethod
    async def record(self, *, actor: str, action: str, tenant: str, old: Any, new: Any) -> AuditEntry:
        """Record one change durably before returning it.

        Raises:
            Unavailable: it cannot be written now (etcd away).
        """

    @abstractmethod
    async def read(self, *, tenant: str = "", limit: int = 0) -> list[AuditEntry]:
        """The entries, oldest first: only `tenant`'s when given, only the last `limit` when not 0."""

    @abstractmethod
    async def check_writable(self) -> None:
        """Raise unless a change could be recorded now (before a change that cannot be undone, as a purge).

        Raises:
            Unavailable: the trail cannot be written now.
        """

    @abstractmethod
    def close(self) -> None:
        """Release what the trail holds."""


class AuditLog(AuditTrail):
    """Appends admin changes to `<folder>/audit.jsonl` and reads them back.

    Args:
        folder: where the log lives (created if missing).
        clock: the time written into each entry.

    Raises:
        ConfigError: the log cannot be opened for appending, or is not a regular file.
    """

    def __init__(self, folder: Path, *, clock: Clock | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / AUDIT_NAME
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        created = not self.path.exists()
        self._fd = self._open()
        if created:
            fsync_dir(folder)
        elif self._torn():
            os.write(self._fd, b"\n")  # end the torn line, so the next entry starts a line of its own
            os.fsync(self._fd)

    def _open(self) -> int:
        """The log opened for appending (O_NONBLOCK: a FIFO in its place is refused, not waited on)."""
        why = "it is not a regular file"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # a FIFO without a reader fails with ENXIO: say what it is instead
            if not self.path.is_fifo():
                why = exc.strerror or str(exc)
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
        raise ConfigError(f"cannot open the audit log {self.path} for appending: {why}",
                          hint="move away what is there (a new log is started) or fix its permissions")

    def _torn(self) -> bool:
        """Whether the file's last line lacks its newline (a write cut by a crash)."""
        with self.path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"

    def append(self, *, actor: str, action: str, tenant: str, old: Any, new: Any) -> AuditEntry:
        """Write one entry durably (fsync) and log it; return it.

        Blocking (an fsync): servicers call it off the event loop.
        """
        entry = AuditEntry(time_s=self.clock.now(), actor=actor, action=action, tenant=tenant, old=old, new=new)
        line = entry_json(entry) + b"\n"
        with self._lock:
            written = os.write(self._fd, line)
            if written != len(line):  # O_APPEND writes of a few hundred bytes are whole; say so if not
                raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
            os.fsync(self._fd)
        log_entry(entry)
        return entry

    async def record(self, *, actor: str, action: str, tenant: str, old: Any, new: Any) -> AuditEntry:
        """`append`, off the event loop (it fsyncs)."""
        return await asyncio.to_thread(self.append, actor=actor, action=action, tenant=tenant, old=old, new=new)

    async def read(self, *, tenant: str = "", limit: int = 0) -> list[AuditEntry]:
        """`entries`, off the event loop (it reads the file)."""
        return await asyncio.to_thread(self.entries, tenant=tenant, limit=limit)

    async def check_writable(self) -> None:
        """Nothing to check: a write that fails fails the call (P4)."""

    def entries(self, *, tenant: str = "", limit: int = 0) -> list[AuditEntry]:
        """The entries, oldest first: only `tenant`'s when given, only the last `limit` when not 0.

        A line that is not an entry (torn, binary, of the wrong shape, past MAX_LINE_BYTES) is
        skipped and logged; only the last `limit` entries are held while the file is read.
        """
        out: collections.deque[AuditEntry] = collections.deque(maxlen=limit or None)
        with self._lock, self.path.open("rb") as f:
            for number, raw in enumerate(_lines(f), start=1):
                entry = parse_entry(raw)
                if entry is None:
                    log.warning("%s line %d is not an audit entry (a write torn by a crash?): skipped",
                                self.path, number)
                elif not tenant or entry.tenant == tenant:
                    out.append(entry)
        return list(out)

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """The lines of `f`, each at most MAX_LINE_BYTES; None for a longer one (read past in pieces, never held)."""
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_LINE_BYTES)
        yield None


def parse_entry(raw: bytes | None) -> AuditEntry | None:
    """The entry on one line (or in one etcd value), or None when it is not one (any content)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(record, dict) or set(record) != _ENTRY_FIELDS:
        return None
    time_s = record["time_s"]
    if isinstance(time_s, bool) or not isinstance(time_s, int | float) or not 0 <= time_s <= _MAX_TIME_S \
            or not all(isinstance(record[k], str) for k in ("actor", "action", "tenant")):
        return None
    return AuditEntry(**record)
