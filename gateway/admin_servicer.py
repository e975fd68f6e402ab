"""The Admin gRPC service: tenants' policies, the audit log, purge, export and import.

Every method needs the "admin" right (`gateway.auth.require`; the auth
interceptor refuses the others first). A change is checked, persisted and
audited (gateway.audit) before the call answers. The servicer only translates
messages: the rules live in gateway.policies, the quotas in gateway.quotas, the
storage work in the tier (purge) and gateway.tenant_export (export, import).

`open_admin` builds the pieces a server needs from its settings: server.py
places `parts.quotas` in the interceptor chain after auth, then calls
`add_admin_service` once the tier is open (docs/POLICIES.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gateway import validate
from gateway.audit import AuditLog, AuditTrail
from gateway.auth import require
from gateway.policies import FIELDS, Policies, Policy, PolicyTable
from gateway.quotas import QuotaInterceptor
from gateway.status import unary
from gateway.validate import Layout
from kvstore.api_tokens import check_tenant
from kvstore.clock import Clock, SystemClock
from kvstore.config import Settings
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, has_default_hint
from kvstore.prefix import BlockScope, chain_hashes
from kvstore.v1 import admin_pb2 as pb
from kvstore.v1 import admin_pb2_grpc as pb_grpc
from tiers.pins import PinLimits, PinTotals
from tiers.store import ManagedStore, PinningStore

#: The admin folder inside store.data_dir: policies.json and audit.jsonl.
ADMIN_DIR = "admin"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name
ADMIN = "admin"


@dataclass(frozen=True)
class AdminParts:
    """What a server needs for policies: the policies, their audit log, the quota interceptor.

    The policies and the log are the data dir's files (`open_admin`) or, in a fleet, etcd's
    shared tables (`gateway.shared_tables.open_fleet_admin`): the servicer sees only their seams.
    """

    policies: PolicyTable
    audit: AuditTrail
    quotas: QuotaInterceptor

    async def close(self) -> None:
        """Close the audit log and the policies."""
        self.audit.close()
        await self.policies.close()


def open_admin(settings: Settings, *, clock: Clock | None = None) -> AdminParts:
    """The policies of the store in `settings.store.data_dir`, their audit log and the quota interceptor.

    Raises:
        ConfigError: the policies file cannot be read.
    """
    clock = clock or SystemClock()
    folder = settings.store.data_dir / ADMIN_DIR
    audit = AuditLog(folder, clock=clock)
    defaults = Policy(retention_hours=settings.store.retention_hours, swa_ttl_s=settings.swa.ttl_s,
                      pin_max_hours=settings.store.pin_max_hours, pin_budget_bytes=settings.store.pin_budget_bytes)
    try:
        policies = Policies(folder, defaults=defaults, max_swa_ttl_s=settings.swa.ttl_s, audit=audit)
    except BaseException:
        audit.close()
        raise
    return admin_parts(settings, policies, audit, clock=clock)


def admin_parts(settings: Settings, policies: PolicyTable, audit: AuditTrail, *, clock: Clock) -> AdminParts:
    """The parts of a server's admin over `policies` and `audit`, with the quota interceptor on the policies."""
    quotas = QuotaInterceptor(policies, swa_ttl_s=settings.swa.ttl_s, clock=clock)
    return AdminParts(policies=policies, audit=audit, quotas=quotas)


def add_admin_service(server: grpc.aio.Server, parts: AdminParts, tier: ManagedStore,
                      layouts: dict[str, Layout]) -> str:
    """Wire the tier's hooks to the policies and serve the Admin service on `server`; its full name."""
    tier.set_retention_provider(parts.policies.retention_s)
    tier.set_quota_provider(lambda ns: parts.policies.policy(ns).nvme_quota_bytes)
    if isinstance(tier, PinningStore):  # R24: each tenant's pins within its policy's limits
        tier.set_pin_limits_provider(lambda ns: _pin_limits(parts.policies.policy(ns)))
    pb_grpc.add_AdminServicer_to_server(AdminServicer(parts, tier, layouts), server)
    return SERVICE_NAME


def _tenant(name: str) -> str:
    """The tenant an admin call names: required (an admin tool never defaults to a tenant)."""
    if not name:
        raise InvalidArgument("tenant is empty: name the tenant")
    return check_tenant(name)


def _path(raw: str) -> Path:
    if not raw:
        raise InvalidArgument("path is empty: name a file on the server's disk")
    path = Path(raw)
    if not path.is_absolute():
        raise InvalidArgument(f"path {raw!r} is relative: give an absolute path on the server's disk")
    return path


Call = TypeVar("Call", bound=Callable[..., Awaitable[Any]])


def _refused(hint: str) -> Callable[[Call], Call]:
    """An error of this call whose class gave only its default hint (written for the store's data
    calls: "nothing was stored") gets `hint` instead, true of this call ('' for a read)."""
    def wrap(fn: Call) -> Call:
        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except KVStoreError as exc:
                if has_default_hint(exc) and not exc.retryable:
                    exc.hint = hint
                raise
        return call  # type: ignore[return-value]
    return wrap


def _pin_limits(p: Policy) -> PinLimits:
    return PinLimits(max_s=p.pin_max_hours * 3600.0, budget_bytes=p.pin_budget_bytes)


def _policy(p: Policy) -> pb.Policy:
    return pb.Policy(**p.to_dict())


class AdminServicer(pb_grpc.AdminServicer):
    """Serves the Admin service over one store's policies, audit log and tier.

    Args:
        parts: policies, audit log and quota ledger (`open_admin`).
        tier: the NVMe tier (usage, purge, export and import).
        layouts: served geometries by name, the default first.
    """

    def __init__(self, parts: AdminParts, tier: ManagedStore, layouts: dict[str, Layout]) -> None:
        self.policies = parts.policies
        self.audit = parts.audit
        self.ledger = parts.quotas.ledger
        self.tier = tier
        self.layouts = layouts

    def _tenant_policy(self, tenant: str) -> pb.TenantPolicy:
        return pb.TenantPolicy(tenant=tenant, policy=_policy(self.policies.policy(tenant)),
                               is_default=not self.policies.has_own(tenant))

    @unary
    @_refused("")
    async def GetPolicy(self, request: pb.GetPolicyRequest, context: grpc.aio.ServicerContext) -> pb.GetPolicyResponse:
        require(ADMIN)
        tenant = _tenant(request.tenant)
        used = await self.tier.call(self.tier.namespace_usage, tenant)
        return pb.GetPolicyResponse(policy=self._tenant_policy(tenant), usage=pb.TenantUsage(
            nvme_bytes=used.stored_bytes, nvme_blocks=used.blocks, token_hours=used.token_hours,
            swa_bytes=self.ledger.live_bytes(tenant)))

    @unary
    @_refused("no policy was changed")
    async def SetPolicy(self, request: pb.SetPolicyRequest, context: grpc.aio.ServicerContext) -> pb.SetPolicyResponse:
        caller = require(ADMIN)
        tenant = _tenant(request.tenant)
        changes = {name: getattr(request, name) for name in FIELDS if request.HasField(name)}
        if not changes:
            raise InvalidArgument(f"no policy field is set: set at least one of {', '.join(FIELDS)}")
        before, after = await self.policies.change(tenant, changes, actor=caller.tenant)
        note = await self.policies.replication_note(tenant, after) if "replication" in changes else ""
        return pb.SetPolicyResponse(
            before=pb.TenantPolicy(tenant=tenant, policy=_policy(before), is_default=before is self.policies.defaults),
            after=self._tenant_policy(tenant), note=note)

    @unary
    @_refused("")
    async def ListPolicies(self, request: pb.ListPoliciesRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListPoliciesResponse:
        require(ADMIN)
        return pb.ListPoliciesResponse(
            policies=[self._tenant_policy(name) for name in self.policies.own()],
            defaults=_policy(self.policies.defaults))

    @unary
    @_refused("")
    async def PolicyLog(self, request: pb.PolicyLogRequest, context: grpc.aio.ServicerContext) -> pb.PolicyLogResponse:
        require(ADMIN)
        tenant = check_tenant(request.tenant) if request.tenant else ""
        entries = await self.audit.read(tenant=tenant, limit=request.limit)
        return pb.PolicyLogResponse(entries=[
            pb.AuditEntry(time_s=e.time_s, actor=e.actor, action=e.action, tenant=e.tenant,
                          old_json=_json(e.old), new_json=_json(e.new)) for e in entries])

    @unary
    @_refused("nothing was deleted")
    async def Purge(self, request: pb.PurgeRequest, context: grpc.aio.ServicerContext) -> pb.PurgeResponse:
        caller = require(ADMIN)
        tenant = _tenant(request.tenant)
        targets = self._purge_targets(request, tenant)
        await self.audit.check_writable()  # a purge cannot be undone: refused up front when it could not be audited
        before = await self.tier.call(self.tier.namespace_usage, tenant)
        pinning = self.tier if isinstance(self.tier, PinningStore) else None
        pins_before = (await self.tier.call(pinning.pins_of, tenant))[0] if pinning else PinTotals()
        purged = 0
        for scope, hashes in targets:
            purged += await self.tier.call(self.tier.purge, scope, hashes)
        after = await self.tier.call(self.tier.namespace_usage, tenant)
        pins_after = (await self.tier.call(pinning.pins_of, tenant))[0] if pinning else PinTotals()
        what: dict[str, Any] = {"all": True} if request.all else {"chain_blocks": len(targets[0][1] or ())}
        # R26: a purged block takes its pin; the entry says how many pins (and pinned bytes) went with them.
        await self.audit.record(
            actor=caller.tenant, action="purge", tenant=tenant,
            old={"blocks": before.blocks, "bytes": before.stored_bytes, "pins": pins_before.pins,
                 "pinned_bytes": pins_before.charged_bytes},
            new={"blocks": after.blocks, "bytes": after.stored_bytes, "purged_blocks": purged, "pins": pins_after.pins,
                 "pinned_bytes": pins_after.charged_bytes, **what})
        return pb.PurgeResponse(purged_blocks=purged)

    @unary
    @_refused("no pin was dropped")
    async def DropPins(self, request: pb.DropPinsRequest, context: grpc.aio.ServicerContext) -> pb.DropPinsResponse:
        caller = require(ADMIN)
        tenant = _tenant(request.tenant)
        if not isinstance(self.tier, PinningStore):
            raise FailedPrecondition("this store keeps no pins")
        await self.audit.check_writable()  # R27: every change to pins is audited
        before, _ = await self.tier.call(self.tier.pins_of, tenant)
        dropped = await self.tier.call(self.tier.drop_pins, tenant)
        await self.audit.record(actor=caller.tenant, action="drop-pins", tenant=tenant,
                                old={"pins": before.pins, "pinned_bytes": before.charged_bytes},
                                new={"pins": 0, "dropped": dropped})
        return pb.DropPinsResponse(dropped=dropped)

    def _purge_targets(self, request: pb.PurgeRequest, tenant: str) -> list[tuple[BlockScope, list[bytes] | None]]:
        """(scope, chain hashes or None for all) per purge the request asks for."""
        named = [f for f in ("token_ids", "block_hashes") if len(getattr(request, f))]
        if request.all:
            if named or request.extra_keys:
                raise InvalidArgument(f"all is set with {', '.join(named or ['extra_keys'])}: purge either a "
                                      "tenant's whole cache or one prompt")
            # With no hashes the tier takes the tenant's blocks of every geometry, served or not.
            return [(BlockScope(next(iter(self.layouts.values())).geometry.fingerprint, tenant), None)]
        layout, scope = validate.scope(self.layouts, request.geometry, tenant)
        if len(named) != 1:
            raise InvalidArgument("name exactly one of token_ids (a prompt) or block_hashes (its chain hashes), "
                                  "or set all (the tenant's whole cache)")
        if named == ["block_hashes"]:
            if request.extra_keys:
                raise InvalidArgument("extra_keys go with token_ids: block_hashes already include them")
            hashes = validate.hashes(list(request.block_hashes), limit=self.tier.settings.max_lookup_blocks)
        else:
            hashes = chain_hashes(list(request.token_ids), block_tokens=layout.block_tokens, parent=layout.root,
                                  extra_keys=list(request.extra_keys))
            if not hashes:
                raise InvalidArgument(f"{len(request.token_ids)} token ids make no full block of "
                                      f"{layout.block_tokens}: nothing is stored for them")
        return [(scope, hashes)]

    @unary
    @_refused("no export file was written")
    async def ExportTenant(self, request: pb.ExportTenantRequest,
                           context: grpc.aio.ServicerContext) -> pb.ExportTenantResponse:
        from gateway import tenant_export  # helper P6's module: imported when first used

        caller = require(ADMIN)
        tenant, path = _tenant(request.tenant), _path(request.path)
        await self.audit.check_writable()
        done = await tenant_export.export_tenant(self.tier, tenant, path, layouts=self.layouts)
        await self.audit.record(actor=caller.tenant, action="export", tenant=tenant,
                                old=None, new={"path": str(path), "records": done.records, "bytes": done.file_bytes})
        return pb.ExportTenantResponse(records=done.records, bytes=done.file_bytes, data_bytes=done.data_bytes,
                                       skipped=done.skipped)

    @unary
    @_refused("nothing is written before every frame checks out; blocks written after that stay, "
              "parents first, and importing the file again is safe")
    async def ImportTenant(self, request: pb.ImportTenantRequest,
                           context: grpc.aio.ServicerContext) -> pb.ImportTenantResponse:
        from gateway import tenant_export

        caller = require(ADMIN)
        path = _path(request.path)
        tenant = check_tenant(request.tenant) if request.tenant else None  # None: the file's tenant
        await self.audit.check_writable()
        done = await tenant_export.import_tenant(self.tier, tenant, path, layouts=self.layouts)
        await self.audit.record(actor=caller.tenant, action="import", tenant=done.tenant,
                                old=None, new={"path": str(path), "records": done.records, "written": done.written})
        return pb.ImportTenantResponse(records=done.records, written=done.written, skipped=done.skipped,
                                       tenant=done.tenant)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
