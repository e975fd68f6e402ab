"""gateway.audit on real files: what is in the log file never stops the start or a read (issue 29)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.audit import AUDIT_NAME, MAX_LINE_BYTES, AuditLog
from kvstore.errors import ConfigError


def test_an_audit_log_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    """A blocking open for writing of a FIFO waits for a reader forever: the start would hang."""
    os.mkfifo(tmp_path / AUDIT_NAME)
    with pytest.raises(ConfigError, match=r"audit\.jsonl for appending: it is not a regular file"):
        AuditLog(tmp_path)


def test_lines_that_are_not_entries_are_skipped_and_the_rest_read(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    log = AuditLog(tmp_path)
    log.append(actor="ops", action="set_policy", tenant="a", old={}, new={"retention_hours": 100.0})
    with open(tmp_path / AUDIT_NAME, "ab") as f:
        f.write(b"\xff\xfe binary\n[1, 2]\nnull\n" + b"[" * 100_000 + b"\n")
        f.write(b'{"time_s": "x", "actor": "a", "action": "b", "tenant": "c", "old": 1, "new": 2}\n')
        f.write(b"{" + b" " * MAX_LINE_BYTES + b"}\n")  # one byte past the bound
    log.append(actor="ops", action="purge", tenant="b", old=None, new=None)
    assert [e.action for e in log.entries()] == ["set_policy", "purge"]
    assert [e.action for e in log.entries(limit=1)] == ["purge"]
    assert caplog.text.count("is not an audit entry") == 2 * 6
    log.close()
