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
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvstore.clock import Clock, SystemClock

log = logging.getLogger("kvstore.audit")

#: File name inside the admin folder of the data dir.
AUDIT_NAME = "audit.jsonl"


@dataclass(frozen=True, kw_only=True)
class AuditEntry:
    """One admin change."""

    time_s: float
    actor: str
    action: str
    tenant: str
    old: Any
    new: Any


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a file created or renamed in it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AuditLog:
    """Appends admin changes to `<folder>/audit.jsonl` and reads them back.

    Args:
        folder: where the log lives (created if missing).
        clock: the time written into each entry.
    """

    def __init__(self, folder: Path, *, clock: Clock | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / AUDIT_NAME
        self.clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if created:
            fsync_dir(folder)
        elif self._torn():
            os.write(self._fd, b"\n")  # end the torn line, so the next entry starts a line of its own
            os.fsync(self._fd)

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
        record = asdict(entry)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            written = os.write(self._fd, line)
            if written != len(line):  # O_APPEND writes of a few hundred bytes are whole; say so if not
                raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
            os.fsync(self._fd)
        log.info(json.dumps({"event": "admin_change", **record}, sort_keys=True), extra={"audit": record})
        return entry

    def entries(self, *, tenant: str = "", limit: int = 0) -> list[AuditEntry]:
        """The entries, oldest first: only `tenant`'s when given, only the last `limit` when not 0."""
        out: list[AuditEntry] = []
        with self._lock, self.path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    entry = AuditEntry(**json.loads(raw))
                except (ValueError, TypeError):
                    log.warning("%s line %d does not parse (a write torn by a crash?): skipped", self.path, number)
                    continue
                if not tenant or entry.tenant == tenant:
                    out.append(entry)
        return out[-limit:] if limit else out

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
