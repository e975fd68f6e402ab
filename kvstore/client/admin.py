"""The Admin service's client: tenants' policies, the audit log, purge, export and import.

Every call sends the token as `authorization: Bearer <token>` metadata and
needs the "admin" right; a failure is raised as its `kvstore.errors` class
(PermissionDenied without the right, Unauthenticated without a valid token,
InvalidArgument or FailedPrecondition naming the rule a change breaks).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore.client import arguments
from kvstore.client.connection import TlsOptions, open_channel, status_error, token_metadata
from kvstore.errors import InvalidArgument
from kvstore.v1 import admin_pb2 as pb
from kvstore.v1 import admin_pb2_grpc as pb_grpc

#: The fields of a policy, as SetPolicy takes them (every field of its request but the tenant: a new field needs
#: no change here).
POLICY_FIELDS = tuple(f.name for f in pb.SetPolicyRequest.DESCRIPTOR.fields if f.name != "tenant")


class AdminClient:
    """A channel to a kvstore server's Admin service.

    Args:
        target: "host:port" of the server or of a fleet's gateway (an etcd:// address is refused: F54).
        token: an API token with the "admin" right (None: send none, for a server without auth).
        tls: speak TLS (None: plaintext).
        timeout_s: deadline of each call.

    Raises:
        InvalidArgument: an etcd:// target (docs/FLEET.md F54): a fleet's Admin calls go through a gateway, which
            sends each to the node or nodes it needs (F52); without the check gRPC takes the address for a host
            name and answers a retryable UNAVAILABLE.
    """

    def __init__(self, target: str, *, token: str | None = None, tls: TlsOptions | None = None,
                 timeout_s: float = 30.0) -> None:
        self.target = arguments.text(target, "target")
        if self.target.startswith("etcd://"):
            raise InvalidArgument(
                f"the Admin service takes a server's host:port, not the fleet address {self.target!r}",
                hint="give a gateway's (or a node's) host:port: policies, the audit log and tokens live in etcd, so "
                     "the gateway answers for the whole fleet (docs/FLEET.md F52, F54); tokens: kvstore tenant "
                     "--target etcd://...")
        self.timeout_s = arguments.seconds(timeout_s, "timeout_s")
        self._metadata = token_metadata(token) or ()
        self.channel = open_channel(self.target, tls)
        self.stub = pb_grpc.AdminStub(self.channel)

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def get_policy(self, tenant: str) -> pb.GetPolicyResponse:
        """The policy `tenant` is served under (`is_default` when it has none of its own) and its usage."""
        return self._call(self.stub.GetPolicy, pb.GetPolicyRequest(tenant=arguments.text(tenant, "tenant")))

    def set_policy(self, tenant: str, **fields: Any) -> pb.SetPolicyResponse:
        """Change the named policy fields of `tenant` (the others keep their values); the policy before and after.

        Raises:
            InvalidArgument: an unknown field, or a value the server refuses (named).
            FailedPrecondition: a retention lower than the tenant's.
        """
        unknown = set(fields) - set(POLICY_FIELDS)
        if unknown:
            raise InvalidArgument(f"unknown policy field(s) {sorted(unknown)}; the fields are {list(POLICY_FIELDS)}")
        if not fields:
            raise InvalidArgument(f"no policy field given: name at least one of {', '.join(POLICY_FIELDS)}")
        return self._call(self.stub.SetPolicy, pb.SetPolicyRequest(tenant=arguments.text(tenant, "tenant"), **fields))

    def list_policies(self) -> pb.ListPoliciesResponse:
        """Every tenant with a policy of its own, and the defaults the others get."""
        return self._call(self.stub.ListPolicies, pb.ListPoliciesRequest())

    def policy_log(self, *, tenant: str = "", limit: int = 0) -> list[pb.AuditEntry]:
        """The audit log, oldest first: only `tenant`'s entries when named, the last `limit` when not 0."""
        request = pb.PolicyLogRequest(tenant=arguments.text(tenant, "tenant"),
                                      limit=arguments.integer(limit, "limit", most=2**32 - 1))
        return list(self._call(self.stub.PolicyLog, request).entries)

    def purge(self, tenant: str, *, all_blocks: bool = False, token_ids: Sequence[int] | None = None,
              extra_keys: Sequence[bytes | str] = (), block_hashes: Sequence[bytes] | None = None,
              geometry: str = "") -> int:
        """Delete one prompt's blocks (by token ids or chain hashes) with every block stored below them,
        or with `all_blocks` the tenant's whole cache; the number of blocks deleted."""
        request = pb.PurgeRequest(tenant=arguments.text(tenant, "tenant"), all=all_blocks,
                                  geometry=arguments.text(geometry, "geometry"))
        if token_ids is not None:
            request.token_ids.extend(arguments.token_ids(token_ids, "token_ids"))
        request.extra_keys.extend(k.encode() if isinstance(k, str) else k for k in arguments.extra_keys(extra_keys))
        if block_hashes is not None:
            request.block_hashes.extend(arguments.hashes(block_hashes, "block_hashes"))
        return int(self._call(self.stub.Purge, request).purged_blocks)

    def drop_pins(self, tenant: str) -> int:
        """Drop every pin of `tenant` (docs/RETENTION.md R27, audited); how many were live."""
        return int(self._call(self.stub.DropPins, pb.DropPinsRequest(tenant=arguments.text(tenant, "tenant"))).dropped)

    def export_tenant(self, tenant: str, path: str | Path) -> pb.ExportTenantResponse:
        """Have the server write `tenant`'s cache to `path` (absolute, on the server's disk)."""
        return self._call(self.stub.ExportTenant, pb.ExportTenantRequest(tenant=arguments.text(tenant, "tenant"),
                                                                         path=str(path)))

    def import_tenant(self, tenant: str, path: str | Path) -> pb.ImportTenantResponse:
        """Have the server read an export at `path` (absolute, on the server's disk) into `tenant`'s cache
        ("": the tenant it was exported from)."""
        return self._call(self.stub.ImportTenant, pb.ImportTenantRequest(tenant=arguments.text(tenant, "tenant"),
                                                                         path=str(path)))

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
