"""What `kvstore check` found: one `Problem` per finding, counted and listed in a `CheckReport`.

docs/OPERATIONS.md says what each kind of problem means; `tiers.integrity` fills the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.counted import counted
from tiers.lmdb_pages import short_key
from tiers.pins import Pin

#: Problems of one kind listed in a report; the rest are counted only.
LISTED_PER_KIND = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One thing the walk found wrong."""

    kind: str
    detail: str
    key: str = ""  # hex storage key of the block concerned, when there is one


@dataclass(kw_only=True)
class CheckReport:
    """What `check_store` found, and what a repair drops (or dropped).

    Attributes:
        data_dir: the store checked.
        repair: whether a repair was asked for; `repaired` whether one was written.
        live: a server held the store while it was checked (read-only).
        blocks_checked / bytes_checked: blocks whose records were read.
        blocks_kept / bytes_kept: blocks a repair keeps (the usage totals after it).
        blocks_dropped / bytes_dropped: damaged blocks, their descendants and orphans.
        entries_dropped / entries_added: index and child entries a repair removes or adds.
        usage_recorded: (blocks, bytes) the state records say; None when absent.
        unreadable: key ranges on pages LMDB could not read.
        leaves_recovered: records leaves no tree reached (a branch page or root above them
            lost), read by scanning the file.
        pins_dropped: pins a repair removes (their block is not kept or not stored; tenants' totals
            recounted).
        dropped_pins: those pins, each (tenant name, or the namespace id in hex when its name is not known;
            the pin), for the audit log (`kvstore check --repair` records each, docs/RETENTION.md R30).
        run_entries_dropped: run-index entries a repair removes (their block is not kept, or is no run root).
        removal_batches: BlockRemoved batches a repair appended to the event log (one per tenant).
        not_carried: what a rebuild could not carry into the fresh file, one line each.
        counts: problems per kind; `problems` lists up to LISTED_PER_KIND of each.
        fatal: why the walk could not run at all (None when it ran).
        notes: what the repair did beyond the counts.
    """

    data_dir: str
    repair: bool
    repaired: bool = False
    live: bool = False
    blocks_checked: int = 0
    bytes_checked: int = 0
    blocks_kept: int = 0
    bytes_kept: int = 0
    blocks_dropped: int = 0
    bytes_dropped: int = 0
    entries_dropped: int = 0
    entries_added: int = 0
    usage_recorded: tuple[int, int] | None = None
    unreadable: list[str] = field(default_factory=list)
    leaves_recovered: int = 0
    pins_dropped: int = 0
    dropped_pins: list[tuple[str, Pin]] = field(default_factory=list, repr=False)
    run_entries_dropped: int = 0
    removal_batches: int = 0
    not_carried: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    fatal: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The store is sound: nothing to drop, add or fix."""
        return self.fatal is None and not self.counts

    def add(self, kind: str, detail: str, key: bytes = b"") -> None:
        """Count a problem, listing it while its kind has fewer than LISTED_PER_KIND listed."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.counts[kind] <= LISTED_PER_KIND:
            self.problems.append(Problem(kind=kind, detail=detail, key=key.hex()))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able values."""
        out = asdict(self)
        out["dropped_pins"] = [{"tenant": tenant, "block": pin.key[-32:].hex(), "until_s": pin.until_s,
                                "charged_bytes": pin.charged_bytes} for tenant, pin in self.dropped_pins]
        out["ok"] = self.ok
        out["usage_recorded"] = list(self.usage_recorded) if self.usage_recorded else None
        return out

    def lines(self) -> list[str]:
        """The report for a person, one line each."""
        head = f"kvstore check {self.data_dir}"
        if self.live:
            head += " (live: a server holds it; read-only)"
        out = [head]
        if self.fatal:
            out.append(f"cannot check: {self.fatal}")
        out.append(f"blocks checked: {self.blocks_checked} ({self.bytes_checked} bytes)")
        for kind, n in sorted(self.counts.items()):
            out.append(f"{kind}: {n}")
            out.extend(f"  {short_key(bytes.fromhex(p.key)) + ' ' if p.key else ''}{p.detail}"
                       for p in self.problems if p.kind == kind)
        if self.ok:
            out.append("OK: every record is intact and consistent")
        elif self.fatal is None:
            verb = "dropped" if self.repaired else "a repair drops"
            out.append(f"{verb}: {counted(self.blocks_dropped, 'block')} ({self.bytes_dropped} bytes), "
                       f"{counted(self.entries_dropped, 'index entry', 'index entries')}; adds "
                       f"{self.entries_added}; keeps {counted(self.blocks_kept, 'block')} ({self.bytes_kept} bytes)")
            if self.pins_dropped or self.run_entries_dropped:
                out.append(f"{verb} with them: {counted(self.pins_dropped, 'pin')} (the tenants' pin totals "
                           f"recounted), {counted(self.run_entries_dropped, 'run-index entry', 'run-index entries')}")
            if self.removal_batches:
                out.append(f"logged {counted(self.removal_batches, 'BlockRemoved batch', 'BlockRemoved batches')} "
                           "of the blocks dropped in the event log")
            if not self.repaired:
                out.append(f"to repair: kvstore check --data-dir {self.data_dir} --repair (with no server running)")
        out.extend(self.notes)
        out.extend(f"not carried: {line}" for line in self.not_carried)
        return out
