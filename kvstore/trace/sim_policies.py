"""Tenants' policies in a simulation: the gateway's own policy table and SWA ledger, on virtual time.

A server serves each tenant under its policy (`gateway.policies.Policy`): the tier's
eviction asks the table for the tenant's retention (R18) and its NVMe quota (R19), as
`gateway.admin_servicer.add_admin_service` wires them; the quota interceptor
(`gateway.quotas`) caps each snapshot's TTL at the tenant's `swa_ttl_s` and charges it
to the tenant's `SwaLedger` entry, refusing a Put past `swa_quota_bytes`. The
simulation uses the same objects: `SimPolicies` is the `PolicyTable` with its checks
(`_plan`: retention only raised and at least 72 h, TTL within the pool's) over an
in-memory store of the tenants' fields, and `SwaQuota` is a `SwaLedger` on a clock the
simulation moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.policies import Policy, PolicyTable, read_file
from gateway.quotas import QuotaExceeded, SwaLedger
from kvstore.errors import InvalidArgument


class SimPolicies(PolicyTable):
    """Every tenant's policy, held in memory (a simulation persists nothing).

    Args:
        defaults: the policy of tenants without one of their own (the simulated store's settings).
        max_swa_ttl_s: the pool's TTL: no tenant's snapshot lives longer.
    """

    def __init__(self, *, defaults: Policy, max_swa_ttl_s: float) -> None:
        super().__init__(defaults=defaults, max_swa_ttl_s=max_swa_ttl_s)

    def set(self, tenant: str, changes: Mapping[str, float]) -> Policy:
        """Change `tenant`'s fields by the table's own rules; the policy it is now served under.

        Raises:
            InvalidArgument: an unknown field or a value out of range (named).
            FailedPrecondition: a retention below the tenant's current one.
        """
        _, after, fields = self._plan(tenant, changes, self._set.get(tenant))
        self._set[tenant] = fields
        self._own[tenant] = after
        return after

    async def change(self, tenant: str, changes: Mapping[str, float], *, actor: str) -> tuple[Policy, Policy]:
        """`set` (a simulation has no audit log); (before, after)."""
        before = self.policy(tenant)
        return before, self.set(tenant, changes)

    @classmethod
    def from_file(cls, path: Path, *, defaults: Policy, max_swa_ttl_s: float) -> SimPolicies:
        """The tenants' policies of a server's `<data_dir>/admin/policies.json`, read by the server's own
        reader (every value checked; the file's retention floor kept, as a server keeps it).

        Raises:
            ConfigError: the file cannot be read or is damaged.
        """
        saved = read_file(path)
        floor = max(defaults.retention_hours, float(saved.get("retention_floor_hours", 0.0)))
        table = cls(defaults=dataclasses.replace(defaults, retention_hours=floor), max_swa_ttl_s=max_swa_ttl_s)
        for tenant, fields in saved.get("tenants", {}).items():
            table._set[tenant] = dict(fields)
            table._own[tenant] = table._apply(fields)
        return table


class _VirtualClock:
    """The simulation's time, for the ledger (both faces: only differences matter to it)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t


class SwaQuota:
    """Each tenant's live snapshot bytes and TTL cap, as the quota interceptor applies them to SwaPool.Put."""

    def __init__(self, policies: PolicyTable, pool_ttl_s: float) -> None:
        self.policies = policies
        self.pool_ttl_s = pool_ttl_s
        self._clock = _VirtualClock()
        self.ledger = SwaLedger(self._clock)

    def ttl_s(self, tenant: str) -> float:
        """The TTL a tenant's snapshot lives (the pool's, capped at the tenant's `swa_ttl_s`)."""
        return min(self.pool_ttl_s, self.policies.policy(tenant).swa_ttl_s)

    def admit(self, tenant: str, key: bytes, size: int, now_s: float) -> bool:
        """Charge one snapshot to `tenant` at `now_s`; False when its `swa_quota_bytes` refuses it."""
        self._clock.t = now_s
        try:
            self.ledger.reserve(tenant, {key: size}, self.ttl_s(tenant), self.policies.policy(tenant).swa_quota_bytes)
        except QuotaExceeded:
            return False
        return True


def parse_policy(text: str, size: Any) -> tuple[str, dict[str, float]]:
    """`TENANT:field=value,field=value` (byte fields take sizes such as 500GB, via `size`) as (tenant, fields).

    Raises:
        InvalidArgument: the text has no tenant, or a field is not `name=value`.
    """
    tenant, sep, rest = text.partition(":")
    if not sep or not tenant.strip() or not rest.strip():
        raise InvalidArgument(f"--policy {text!r}: expected TENANT:field=value[,field=value]",
                              hint="e.g. --policy acme:retention_hours=168,nvme_quota_bytes=2T")
    fields: dict[str, float] = {}
    for part in rest.split(","):
        name, eq, value = part.partition("=")
        if not eq:
            raise InvalidArgument(f"--policy {text!r}: {part!r} is not field=value")
        name = name.strip()
        try:
            zero = value.strip() in ("0", "0.0")
            fields[name] = float(size(value)) if name.endswith("_bytes") and not zero else float(value)
        except (ValueError, InvalidArgument) as exc:
            raise InvalidArgument(f"--policy {text!r}: {name} = {value!r} is not a number ({exc})") from None
    return tenant.strip(), fields
