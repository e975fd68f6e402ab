"""The audit entries of what `kvstore check --repair` changed in pins (docs/RETENTION.md R30, R27).

A repair runs on a stopped store and drops the pin of every block it drops (and every pin whose block is not
stored). Each such pin is a change to a tenant's pins, so each is written to the store's audit log (the one
`kvstore policy log` reads, `<data_dir>/admin/`) once the repair is committed: action `pin-dropped`, actor
`kvstore-check`, `old` the block, its time and the bytes it charged. Written after the repair's transaction
(a stop between the two loses the entries, not the repair), as a copied pin's grant is (R31).
"""

from __future__ import annotations

from pathlib import Path

from gateway.admin_servicer import ADMIN_DIR
from gateway.audit import AuditLog
from tiers.integrity_report import CheckReport

#: Who a repair's changes are audited as: the check command, not a tenant.
REPAIR_ACTOR = "kvstore-check"


def audit_dropped_pins(data_dir: Path, report: CheckReport) -> int:
    """Write one audit entry per pin the repair in `report` dropped; how many were written."""
    audit = AuditLog(data_dir / ADMIN_DIR)
    try:
        for tenant, pin in report.dropped_pins:
            audit.append(actor=REPAIR_ACTOR, action="pin-dropped", tenant=tenant,
                         old={"block": pin.key[-32:].hex(), "until_s": pin.until_s, "charged_bytes": pin.charged_bytes},
                         new={"why": "kvstore check --repair dropped its block, or found it not stored"})
    finally:
        audit.close()
    return len(report.dropped_pins)
