"""Per-tenant policies: retention, SWA TTL and quotas, persisted in the data dir.

A tenant without a policy of its own is served under the defaults, taken from
the configuration (store.retention_hours, swa.ttl_s, no quotas); a tenant's
policy keeps only the fields an admin set, and follows the defaults in the others. A change is
checked, written atomically (a temporary file fsync'd, renamed over
`<data_dir>/admin/policies.json`, the folder fsync'd) and audited before it
answers, so policies persist with the store.

Retention may only be raised. That is what keeps the promise made to every
block already written: a block written under a policy of H hours was promised
H hours after each use, and since a tenant's retention never goes below H
afterwards, applying the tenant's *current* retention to every one of its
blocks (what the tier's eviction does, through `retention_s`) keeps every
earlier promise, with no per-block record of the policy it was written under.
For the same reason the defaults keep the highest store.retention_hours they
were ever opened with (`retention_floor_hours` in the file): a configuration
lowered later does not shorten what tenants on the defaults were promised.

Quotas of 0 are unlimited. A quota lowered below what a tenant holds evicts
nothing (that would break retention): new writes are refused until it fits.

`PolicyTable` holds the rules and the reads; `Policies` stores the tenants' fields in
the data dir's file, `gateway.shared_tables.EtcdPolicies` in etcd for a fleet
(docs/FLEET.md, "Shared tables"), with the same checks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.audit import AuditLog, fsync_dir
from kvstore.api_tokens import TENANT_NAME, check_tenant
from kvstore.config import MAX_BYTES, RETENTION_FLOOR_HOURS
from kvstore.errors import ConfigError, FailedPrecondition, InvalidArgument
from kvstore.prefix import FINGERPRINT_BYTES, NAMESPACE_ID_BYTES, namespace_id
from kvstore.side_files import read_json
from replay.fidelity_budget import DEFAULT_BUDGET, parse_budget

log = logging.getLogger("kvstore.policies")

POLICIES_NAME = "policies.json"
FORMAT_VERSION = 1
#: Highest request rate a policy may name (a sanity bound: far above what one server answers).
MAX_REQUESTS_PER_S = 1e7
#: Longest retention a policy may name: 100 years, as store.retention_hours.
MAX_RETENTION_HOURS = 100 * 365 * 24.0
#: The most of the policies file read at start: about 150 bytes a tenant, so some 400,000 tenants.
MAX_FILE_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class Policy:
    """What one tenant is served under."""

    #: Hours a block is kept after its last use, at least; >= 72 and only raised.
    retention_hours: float
    #: Longest a SWA snapshot of the tenant lives, in seconds.
    swa_ttl_s: float
    #: Block bytes the tenant may keep on NVMe; 0: unlimited.
    nvme_quota_bytes: int = 0
    #: Snapshot bytes the tenant may keep in the SWA pool; 0: unlimited.
    swa_quota_bytes: int = 0
    #: Data RPCs per second (token bucket, one second of burst); 0: unlimited.
    requests_per_s: float = 0.0
    #: Longest a pin of the tenant may run past now, in hours (docs/RETENTION.md R24); 0: no pins.
    pin_max_hours: float = 0.0
    #: Bytes of pinned prefixes the tenant may hold at once (R24); 0: no pins.
    pin_budget_bytes: int = 0
    #: Copies of each of the tenant's runs in a fleet (docs/FLEET.md F51); the defaults' is [fleet]
    #: replication, 1 on a single node. Fewer while fewer nodes are live (F13).
    replication: int = 1
    #: The tenant's replay fidelity: "exact", "windows:N", or an error budget "kl:X" / "fastllm:P" the planner
    #: meets with the smallest measured span (replay/fidelity_budget.py, docs/PLANNER.md "Fidelity budgets").
    replay_fidelity: str = DEFAULT_BUDGET

    @property
    def retention_s(self) -> float:
        """Retention in seconds."""
        return self.retention_hours * 3600.0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON)."""
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(Policy))
#: The byte quotas: whole numbers.
_BYTE_FIELDS = ("nvme_quota_bytes", "swa_quota_bytes", "pin_budget_bytes")
#: The fields held as text (checked by their own parser, not a range).
_TEXT_FIELDS = ("replay_fidelity",)
#: Every whole-number field.
_WHOLE_FIELDS = (*_BYTE_FIELDS, "replication")
#: Most copies of a run a policy may name ([fleet] replication's bound).
MAX_REPLICATION = 5
#: The range of each field as stored (swa_ttl_s must also be above 0). `set` checks the same, and more:
#: the TTL against the pool's, retention against the tenant's current one.
_STORED_RANGES: dict[str, tuple[float, float]] = {
    "retention_hours": (RETENTION_FLOOR_HOURS, MAX_RETENTION_HOURS), "swa_ttl_s": (0.0, MAX_RETENTION_HOURS * 3600),
    "requests_per_s": (0.0, MAX_REQUESTS_PER_S), "nvme_quota_bytes": (0, MAX_BYTES), "swa_quota_bytes": (0, MAX_BYTES),
    "pin_max_hours": (0.0, MAX_RETENTION_HOURS), "pin_budget_bytes": (0, MAX_BYTES),
    "replication": (1, MAX_REPLICATION),
}


def _short(value: object) -> str:
    """`value`'s repr cut to a few words: a damaged file's message stays one short line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: object) -> float | None:
    """`value` when it is a JSON number (not a boolean), else None."""
    return None if isinstance(value, bool) or not isinstance(value, int | float) else value


def _stored_tenant(name: object) -> str:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant {_short(name)} is not a tenant name")
    return name


def _stored_fields(tenant: str, fields: object) -> dict[str, Any]:
    """A tenant's own fields as stored, each in its range; fields this version does not know are kept as they
    are (written back, not applied: `_apply`), as before."""
    if not isinstance(fields, dict):
        raise ValueError(f"tenant {tenant!r}'s policy is a {type(fields).__name__}, not an object")
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in FIELDS:
            out[name] = value
            continue
        if name in _TEXT_FIELDS:
            try:
                out[name] = parse_budget(value).text
            except InvalidArgument as exc:
                raise ValueError(f"tenant {tenant!r}: {name} is {_short(value)}: {exc}") from None
            continue
        number = _number(value)
        low, high = _STORED_RANGES[name]
        if number is None or not low <= number <= high or (name == "swa_ttl_s" and number <= 0) \
                or (name in _WHOLE_FIELDS and not float(number).is_integer()):
            raise ValueError(f"tenant {tenant!r}: {name} is {_short(value)}, out of its range")
        out[name] = int(number) if name in _WHOLE_FIELDS else float(number)
    return out


def parse_fields(tenant: str, fields: object) -> dict[str, Any]:
    """A tenant's own policy fields as stored (the file's or etcd's), each in its range.

    Raises:
        ValueError: naming the tenant and the field.
    """
    return _stored_fields(_stored_tenant(tenant), fields)


def check_floor(value: object) -> float:
    """A stored `retention_floor_hours`, checked.

    Raises:
        ValueError: not hours in [0, MAX_RETENTION_HOURS].
    """
    number = _number(value)
    if number is None or not 0 <= number <= MAX_RETENTION_HOURS:
        raise ValueError(f"retention_floor_hours is {_short(value)}, not hours in [0, {MAX_RETENTION_HOURS:g}]")
    return float(number)


def read_file(path: Path) -> dict[str, Any]:
    """The policies file's content, every value checked as `set` would (but the only-raised rule, which
    compares a change with the policy before it); {} when there is no file.

    At most MAX_FILE_BYTES are read. Anything else (issue 29: `[1,2,3]` or `null` killed the
    start with an AttributeError) stops the start with one ConfigError: serving on the
    defaults instead could shorten a tenant's retention.

    Raises:
        ConfigError: the file cannot be read or is damaged, naming it, why, and what to do.
    """
    try:
        data = read_json(path, max_bytes=MAX_FILE_BYTES)
        if data is None:
            return {}
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {_short(data.get('version'))}; this server reads {FORMAT_VERSION}")
        check_floor(data.get("retention_floor_hours", 0.0))
        tenants = data.get("tenants", {})
        if not isinstance(tenants, dict):
            raise ValueError(f"'tenants' is a {type(tenants).__name__}, not an object")
        data["tenants"] = {_stored_tenant(name): _stored_fields(name, fields) for name, fields in tenants.items()}
    except OSError as exc:
        raise ConfigError(f"cannot read the tenant policies {path}: {exc.strerror or exc}",
                          hint="check its permissions (the server's user must read it)") from None
    except ValueError as exc:  # DamagedFile included
        raise ConfigError(f"tenant policies {path} are damaged: {exc}",
                          hint="restore the file from a backup (it is rewritten whole on every change); moving "
                               "it away puts every tenant on the defaults, a shorter retention for some") from None
    return data


def changed_fields(before: Policy, after: Policy) -> tuple[dict[str, Any], dict[str, Any]]:
    """(old, new) values of the fields a change changed: what the audit log records."""
    old = {k: getattr(before, k) for k in FIELDS if getattr(before, k) != getattr(after, k)}
    return old, {k: getattr(after, k) for k in old}


class PolicyTable(ABC):
    """Every tenant's policy: the rules, and the reads the servers make, over a store of the tenants' own fields.

    Two stores implement it: `Policies`, the data dir's file (a single node), and
    `gateway.shared_tables.EtcdPolicies`, etcd (a fleet, docs/FLEET.md). Reads come from
    memory, on any thread; `change` is a coroutine of the server's loop.

    Args:
        defaults: the policy of tenants without one of their own.
        max_swa_ttl_s: the pool's TTL (swa.ttl_s): no snapshot lives longer.
    """

    #: Whether the policies are a fleet's (a replication above 1 means something only there).
    fleet = False

    def __init__(self, *, defaults: Policy, max_swa_ttl_s: float) -> None:
        self.max_swa_ttl_s = max_swa_ttl_s
        self.defaults = defaults
        #: Each tenant's own fields (those an admin set); the others follow the defaults.
        self._set: dict[str, dict[str, Any]] = {}
        self._own: dict[str, Policy] = {}
        #: namespace id -> replication of the tenants with a policy of their own, and the `_own` it was made of.
        self._copies: tuple[dict[str, Policy] | None, dict[bytes, int]] = (None, {})
        #: namespace id -> retention seconds of the tenants with a policy of their own, and the `_own` it was made of.
        self._retentions: tuple[dict[str, Policy], dict[bytes, float]] = ({}, {})

    @abstractmethod
    async def change(self, tenant: str, changes: Mapping[str, float], *, actor: str) -> tuple[Policy, Policy]:
        """Change some fields of `tenant`'s policy, persist it and audit it; (before, after).

        A change that changes nothing is neither written nor audited.

        Raises:
            InvalidArgument: an unknown field, or a value out of its range (named).
            FailedPrecondition: a retention lower than the tenant's current one.
            Unavailable: the store cannot be written now (etcd away); nothing changed.
        """

    async def close(self) -> None:  # noqa: B027 (a hook: the file holds nothing open; etcd's table a watch)
        """Release what the table holds (the file's: nothing)."""

    def _plan(self, tenant: str, changes: Mapping[str, float],
              fields: Mapping[str, Any] | None) -> tuple[Policy, Policy, dict[str, Any]]:
        """(before, after, the tenant's own fields after) of `changes` to a tenant whose own fields are
        `fields` (None: it is on the defaults), every value checked by the rules (P1, P7)."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise InvalidArgument(f"unknown policy field(s) {sorted(unknown)}; the fields are {list(FIELDS)}")
        before = self.defaults if fields is None else self._apply(fields)
        checked: dict[str, Any] = {k: self._checked(tenant, k, v, before) for k, v in changes.items()}
        return before, dataclasses.replace(before, **checked), {**(fields or {}), **checked}

    # -- reads (any thread; the tier's eviction calls retention_s) ------------

    def policy(self, tenant: str) -> Policy:
        """The policy `tenant` is served under (its own, or the defaults)."""
        return self._own.get(tenant, self.defaults)

    def has_own(self, tenant: str) -> bool:
        """Whether `tenant` has a policy of its own."""
        return tenant in self._own

    def own(self) -> dict[str, Policy]:
        """Tenants with a policy of their own, by name."""
        return dict(sorted(self._own.items()))

    def retention_s(self, tenant: str) -> float:
        """Seconds `tenant`'s blocks are kept after their last use: the tier's retention provider."""
        return self.policy(tenant).retention_s

    def replication_of_key(self, key: bytes) -> int:
        """Copies the run of storage key `key` is kept in: its tenant's replication (F51). The key names the
        tenant by its namespace id (kvstore.prefix), so re-replication can ask without the tenant's name.

        The map is rebuilt when the tenants' policies were replaced (a fleet's table replaces them on every
        change it follows).
        """
        own, by_id = self._copies
        if own is not self._own:
            own = self._own
            by_id = {namespace_id(t): p.replication for t, p in own.items()}
            self._copies = (own, by_id)
        return by_id.get(key[FINGERPRINT_BYTES:FINGERPRINT_BYTES + NAMESPACE_ID_BYTES], self.defaults.replication)

    def retention_of_key(self, key: bytes) -> float:
        """Seconds the blocks of storage key `key`'s tenant are kept after their last use: its retention, named by
        the key's namespace id as `replication_of_key` (re-replication copies and counts what it keeps, F19).

        The map is rebuilt when the tenants' policies changed since it was made (compared with a copy: the file's
        table changes them in place, a fleet's replaces them).
        """
        own, by_id = self._retentions
        if own != self._own:
            own = dict(self._own)
            by_id = {namespace_id(t): p.retention_s for t, p in own.items()}
            self._retentions = (own, by_id)
        return by_id.get(key[FINGERPRINT_BYTES:FINGERPRINT_BYTES + NAMESPACE_ID_BYTES], self.defaults.retention_s)

    async def replication_note(self, tenant: str, policy: Policy) -> str:
        """What a replication of `policy` does now when it cannot yet be that (a fleet's: fewer nodes live
        than it names); empty when it is as set."""
        return ""

    def _apply(self, fields: Mapping[str, Any]) -> Policy:
        """The defaults with a tenant's own fields."""
        return dataclasses.replace(self.defaults, **{k: v for k, v in fields.items() if k in FIELDS})

    def _checked(self, tenant: str, name: str, value: float, before: Policy) -> float:
        """`value` for field `name`, refused with the rule it breaks."""
        if name in _TEXT_FIELDS:  # a fidelity setting: its parser says what is wrong; stored canonical
            if not isinstance(value, str):
                raise InvalidArgument(f"{name} for tenant {tenant!r} must be text, got {_short(value)}")
            try:
                return parse_budget(value).text  # type: ignore[return-value]
            except InvalidArgument as exc:
                raise InvalidArgument(f"{name} for tenant {tenant!r}: {exc}") from None
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{name} = {value!r} for tenant {tenant!r}: a finite value >= 0 is required")
        if name == "retention_hours":
            if value < RETENTION_FLOOR_HOURS:
                raise InvalidArgument(f"retention_hours = {value:g} for tenant {tenant!r} is below the "
                                      f"{RETENTION_FLOOR_HOURS:g}-hour floor", hint="name 72 hours or more")
            if value < before.retention_hours:
                raise FailedPrecondition(
                    f"retention_hours may only be raised: tenant {tenant!r} has {before.retention_hours:g} h, "
                    f"and its stored blocks were promised that long after their last use; {value:g} h would "
                    "break that promise", hint=f"name {before.retention_hours:g} hours or more")
            if value > MAX_RETENTION_HOURS:
                raise InvalidArgument(f"retention_hours = {value:g} for tenant {tenant!r} is above "
                                      f"{MAX_RETENTION_HOURS:g} (100 years)")
            return float(value)
        if name == "swa_ttl_s":
            if not 0 < value <= self.max_swa_ttl_s:
                raise InvalidArgument(f"swa_ttl_s = {value:g} for tenant {tenant!r} is out of range: allowed "
                                      f"(0, {self.max_swa_ttl_s:g}], the server's swa.ttl_s (the pool is sized "
                                      "for it)", hint="raise swa.ttl_s in the server's configuration first")
            return float(value)
        if name == "pin_max_hours":
            if value > MAX_RETENTION_HOURS:
                raise InvalidArgument(f"pin_max_hours = {value:g} for tenant {tenant!r} is above "
                                      f"{MAX_RETENTION_HOURS:g} (100 years); 0 means no pins")
            return float(value)
        if name == "replication":
            if not float(value).is_integer() or not 1 <= value <= MAX_REPLICATION:
                raise InvalidArgument(f"replication = {value!r} for tenant {tenant!r}: copies of each run, a whole "
                                      f"number from 1 to {MAX_REPLICATION}")
            if value > 1 and not self.fleet:
                raise FailedPrecondition(
                    f"replication = {int(value)} for tenant {tenant!r}: this server is a single node (no [fleet] "
                    "etcd), which keeps one copy of every block", hint="set it on a node of a fleet, whose runs "
                    "are kept on that many nodes; 1 is a single node's")
            return int(value)
        if name == "requests_per_s":
            if value > MAX_REQUESTS_PER_S:
                raise InvalidArgument(f"requests_per_s = {value:g} for tenant {tenant!r} is above "
                                      f"{MAX_REQUESTS_PER_S:g}; 0 means unlimited")
            return float(value)
        if not float(value).is_integer() or value > MAX_BYTES:  # the byte quotas
            raise InvalidArgument(f"{name} = {value!r} for tenant {tenant!r}: a whole number of bytes up to "
                                  f"{MAX_BYTES} is required; 0 means unlimited")
        return int(value)


class Policies(PolicyTable):
    """Every tenant's policy, persisted in `folder` (the data dir's admin folder).

    Args:
        folder: where `policies.json` lives (created if missing).
        defaults: the policy of tenants without one of their own (from the configuration).
        max_swa_ttl_s: the pool's TTL (swa.ttl_s): no snapshot lives longer.
        audit: where every change is appended.

    Raises:
        ConfigError: the policies file cannot be read.
    """

    def __init__(self, folder: Path, *, defaults: Policy, max_swa_ttl_s: float, audit: AuditLog) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / POLICIES_NAME
        self.audit = audit
        self._lock = threading.Lock()
        saved = read_file(self.path)
        floor = max(defaults.retention_hours, float(saved.get("retention_floor_hours", 0.0)))
        if floor > defaults.retention_hours:
            log.warning("store.retention_hours is %g but this store was served with %g: tenants on the defaults "
                        "keep %g h (retention is only raised)", defaults.retention_hours, floor, floor)
        super().__init__(defaults=dataclasses.replace(defaults, retention_hours=floor), max_swa_ttl_s=max_swa_ttl_s)
        self._set = {name: dict(fields) for name, fields in saved.get("tenants", {}).items()}
        self._own = {name: self._apply(fields) for name, fields in self._set.items()}
        if floor != saved.get("retention_floor_hours"):
            self._save()

    def _save(self) -> None:
        """Write the file atomically: a temporary file fsync'd, renamed over it, the folder fsync'd."""
        data = {"version": FORMAT_VERSION, "retention_floor_hours": self.defaults.retention_hours,
                "tenants": {name: fields for name, fields in sorted(self._set.items())}}
        tmp = self.path.with_suffix(".json.tmp")
        with tmp.open("w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    # -- changes --------------------------------------------------------------

    def set(self, tenant: str, changes: Mapping[str, float], *, actor: str) -> tuple[Policy, Policy]:
        """Change some fields of `tenant`'s policy, persist it and audit it; (before, after).

        Blocking (fsyncs): servicers call `change`, which runs it off the event loop. A change that
        changes nothing is neither written nor audited.

        Raises:
            InvalidArgument: an unknown field, or a value out of its range (named).
            FailedPrecondition: a retention lower than the tenant's current one.
        """
        tenant = check_tenant(tenant)
        with self._lock:
            earlier = self._set.get(tenant)
            before, after, fields = self._plan(tenant, changes, earlier)
            if after == before:
                return before, after
            self._set[tenant] = fields
            self._own[tenant] = after
            try:
                self._save()
                old, new = changed_fields(before, after)
                self.audit.append(actor=actor, action="set_policy", tenant=tenant, old=old, new=new)
            except BaseException:
                self._restore(tenant, earlier)
                raise
        return before, after

    async def change(self, tenant: str, changes: Mapping[str, float], *, actor: str) -> tuple[Policy, Policy]:
        """`set`, off the event loop (it fsyncs the file and the audit log)."""
        return await asyncio.to_thread(self.set, tenant, changes, actor=actor)

    def _restore(self, tenant: str, earlier: dict[str, Any] | None) -> None:
        """Undo a change that could not be written or audited (best effort on the file)."""
        if earlier is None:
            self._set.pop(tenant, None)
            self._own.pop(tenant, None)
        else:
            self._set[tenant] = earlier
            self._own[tenant] = self._apply(earlier)
        try:
            self._save()
        except OSError:
            log.exception("could not restore %s after a failed change", self.path)
