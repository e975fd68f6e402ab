"""Tokens on a real server on loopback: who may call what (gateway.auth, gateway.tenants)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import METHOD_RIGHTS
from kvstore import api_tokens
from kvstore.client import Client
from kvstore.config import AuthSettings, ServerSettings, StoreSettings
from kvstore.errors import ConfigError, PermissionDenied, Unauthenticated
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc, swa_pb2, transfer_pb2, transfer_pb2_grpc

READ_WRITE = frozenset({"read", "write"})


def tenants_file(store: StoreSettings) -> Path:
    return store.data_dir / "tenants.json"


def issue(store: StoreSettings, tenant: str, rights: frozenset[str] = READ_WRITE) -> str:
    return api_tokens.create(tenants_file(store), tenant, rights)[1]


def code_of(call: Callable[..., Any], request: Any, token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", token),) if token is not None else None
    try:
        result = call(request, timeout=10, metadata=metadata)
        for _ in result if not hasattr(result, "ByteSize") else ():
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def authed(start_server: Callable[..., Any], store_settings: StoreSettings) -> tuple[Any, dict[str, str]]:
    """A server with tenants acme (read, write), reader (read), writer (write), ops (admin)."""
    tokens = {"acme": issue(store_settings, "acme"), "reader": issue(store_settings, "reader", frozenset({"read"})),
              "writer": issue(store_settings, "writer", frozenset({"write"})),
              "ops": issue(store_settings, "ops", frozenset({"read", "write", "admin"}))}
    return start_server(store_settings), tokens


def test_no_tenants_on_loopback_needs_no_token(client: Client) -> None:
    tokens = list(range(32))
    client.put(tokens, [bytes(client.block_bytes)] * 2)
    assert client.lookup(tokens).found_blocks == 2 and client.stats().blocks_written == 2  # default tenant, admin


def test_no_token_is_unauthenticated(authed: tuple[Any, dict[str, str]]) -> None:
    server, _ = authed
    with pytest.raises(Unauthenticated, match="no token"):
        Client(server.target)


@pytest.mark.parametrize("value", ["Basic abc", "kvst_00000000_x", "Bearer ", "Bearer kvst_00000000_guess"])
def test_a_bad_or_unknown_token_is_unauthenticated(authed: tuple[Any, dict[str, str]], value: str) -> None:
    server, tokens = authed
    with grpc.insecure_channel(server.target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        assert code_of(stub.GetInfo, kvstore_pb2.GetInfoRequest(), value) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stub.GetInfo, kvstore_pb2.GetInfoRequest(), "Bearer " + tokens["acme"]) == grpc.StatusCode.OK


def test_rights_are_checked_per_method(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    put = kvstore_pb2.PutRequest(token_ids=list(range(64)), blocks=[b"x"])
    get = kvstore_pb2.GetRequest(block_hashes=[bytes(32)])
    with grpc.insecure_channel(server.target) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        reader, writer = "Bearer " + tokens["reader"], "Bearer " + tokens["writer"]
        assert code_of(stub.Put, put, reader) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(stub.Get, get, reader) == grpc.StatusCode.OK
        assert code_of(stub.Get, get, writer) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(stub.Put, put, writer) == grpc.StatusCode.INVALID_ARGUMENT  # past auth: a bad block size
    with Client(server.target, token=tokens["reader"]) as client, pytest.raises(PermissionDenied, match="'write'"):
        client.put(list(range(16)), [bytes(client.block_bytes)])


def test_stats_span_every_tenant_for_admins_only(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as client:
        client.put(list(range(16)), [bytes(client.block_bytes)])
        with pytest.raises(PermissionDenied, match="admin"):
            client.transfer_stats()
        mine = client.stats()  # its own hit counters; nothing of the store as a whole
        assert not mine.store_wide and mine.blocks_written == mine.bytes_stored == mine.capacity_bytes == 0
        client.swa.put(list(range(16)), bytes(client.swa.snapshot_bytes(16)))
        swa = client.swa.stats()  # the pool's settings, which the client needs; no traffic of anyone
        assert swa.max_batch_snapshots > 0 and swa.ttl_s > 0 and swa.snapshots_put == swa.bytes_put == 0
    with Client(server.target, token=tokens["ops"]) as admin:
        admin.transfer_stats()
        assert admin.stats().blocks_written == 1 and admin.stats().store_wide
        assert admin.swa.stats().snapshots_put == 1


def test_health_needs_no_token(authed: tuple[Any, dict[str, str]]) -> None:
    server, _ = authed
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_tenant_comes_from_the_token(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    data = list(range(32))
    with Client(server.target, token=tokens["acme"]) as acme:
        acme.put(data, [b"a" * acme.block_bytes] * 2)
        with pytest.raises(PermissionDenied, match="not this token's tenant"), \
                Client(server.target, token=tokens["acme"], namespace="default") as other:
            other.lookup(data)
    with Client(server.target, token=tokens["ops"], namespace="acme") as admin:  # an admin may name any tenant
        assert admin.get(data).blocks == [b"a" * admin.block_bytes] * 2
    with Client(server.target, token=tokens["ops"]) as admin:  # ... and its own is "ops"
        assert admin.lookup(data).found_blocks == 0


def test_every_method_of_the_services_has_its_right_listed() -> None:
    # An unlisted method falls to "admin": listing every served one keeps tenants' calls open to them.
    for module in (kvstore_pb2, swa_pb2, transfer_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert f"/{service.full_name}/{method.name}" in METHOD_RIGHTS


def test_a_revoked_token_is_refused_without_a_restart(authed: tuple[Any, dict[str, str]],
                                                      store_settings: StoreSettings) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as client:
        client.lookup(list(range(16)))
        api_tokens.revoke(tenants_file(store_settings), "acme")
        server.tenants.refresh()
        with pytest.raises(Unauthenticated, match="unknown or revoked"):
            client.lookup(list(range(16)))


def test_the_watcher_picks_up_a_new_token(start_server: Callable[..., Any], store_settings: StoreSettings) -> None:
    issue(store_settings, "first")
    server = start_server(store_settings, auth=AuthSettings(reload_s=0.05))
    token = issue(store_settings, "second")
    for _ in range(400):  # the watcher re-reads within reload_s; no sleep asserted on
        try:
            Client(server.target, token=token, timeout_s=5).close()
            return
        except Unauthenticated:
            time.sleep(0.05)
    pytest.fail("the new token was never accepted")


def test_revoking_the_last_token_keeps_auth_on(authed: tuple[Any, dict[str, str]],
                                               store_settings: StoreSettings) -> None:
    server, _ = authed
    for tenant in ("acme", "reader", "writer", "ops"):
        api_tokens.revoke(tenants_file(store_settings), tenant)
    server.tenants.refresh()
    with pytest.raises(Unauthenticated):
        Client(server.target)


def test_a_tenants_file_appearing_turns_auth_on(server: Any, store_settings: StoreSettings) -> None:
    Client(server.target).close()
    token = issue(store_settings, "acme")
    server.tenants.refresh()
    with pytest.raises(Unauthenticated):
        Client(server.target)
    Client(server.target, token=token).close()


def test_auth_required_without_tenants_refuses_every_call(start_server: Callable[..., Any],
                                                          store_settings: StoreSettings) -> None:
    server = start_server(store_settings, auth=AuthSettings(required=True))
    with pytest.raises(Unauthenticated):
        Client(server.target)


def test_a_damaged_tenants_file_stops_the_start_and_is_ignored_later(
        start_server: Callable[..., Any], store_settings: StoreSettings) -> None:
    token = issue(store_settings, "acme")
    path = tenants_file(store_settings)
    good = path.read_text()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"tenants file .* is damaged"):
        start_server(store_settings)
    path.write_text(good)
    server = start_server(store_settings)
    path.write_text('{"version": 1, "tokens": [{"tenant": 5}]}')
    assert not server.tenants.refresh()  # the last good table stays
    Client(server.target, token=token).close()


def test_insecure_beyond_loopback_has_no_admin_right(start_server: Callable[..., Any],
                                                     store_settings: StoreSettings) -> None:
    server = start_server(store_settings, server=ServerSettings(host="0.0.0.0", port=0),
                          auth=AuthSettings(insecure=True))
    with Client(server.target) as client:
        client.lookup(list(range(16)))
        with pytest.raises(PermissionDenied, match="admin"):
            client.transfer_stats()
        assert not client.stats().store_wide
        with pytest.raises(PermissionDenied, match="not this token's tenant"), \
                Client(server.target, namespace="acme") as other:
            other.lookup(list(range(16)))


@pytest.mark.parametrize("with_tenant", [False, True])
def test_a_bind_beyond_loopback_without_auth_and_tls_is_refused(start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings,
                                                                 with_tenant: bool) -> None:
    if with_tenant:
        issue(store_settings, "acme")
    with pytest.raises(ConfigError, match=r"refusing to serve on 0\.0\.0\.0 without"):
        start_server(store_settings, server=ServerSettings(host="0.0.0.0", port=0))
    assert not (store_settings.data_dir / "data.mdb").exists()  # refused before the store was opened


def test_a_transfer_write_batch_needs_the_write_right(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    request = lambda sid: transfer_pb2.SubmitRequest(  # noqa: E731
        session_id=sid, op=transfer_pb2.TRANSFER_OP_WRITE, token_ids=list(range(16)),
        groups=[transfer_pb2.DescriptorGroup(region_id=1, length_bytes=1, offsets_bytes=[0])])
    for name, expected in (("reader", grpc.StatusCode.PERMISSION_DENIED), ("acme", grpc.StatusCode.OK)):
        with Client(server.target, token=tokens[name]) as client, client.transfer() as session:
            stub = transfer_pb2_grpc.TransferStub(client.connection.channel)
            assert code_of(stub.Submit, request(session.session_id), "Bearer " + tokens[name]) == expected


def test_a_method_nobody_listed_needs_admin(store_settings: StoreSettings) -> None:
    import asyncio
    from types import SimpleNamespace

    from gateway.auth import OPEN_CALLER, AuthInterceptor
    from gateway.tenants import TenantRegistry

    tokens = {"acme": issue(store_settings, "acme"), "ops": issue(store_settings, "ops", frozenset({"admin"}))}
    auth = AuthInterceptor(TenantRegistry(tenants_file(store_settings)), OPEN_CALLER, rights={})
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def served(token: str) -> bool:
        async def continuation(details: Any) -> Any:
            return handler
        details = SimpleNamespace(method="/kvstore.v1.Later/Anything",
                                  invocation_metadata=(("authorization", f"Bearer {token}"),))
        return await auth.intercept_service(continuation, details) is handler  # else: a refusal

    assert not asyncio.run(served(tokens["acme"])) and asyncio.run(served(tokens["ops"]))


def test_planner_reports_carry_the_token(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as client:
        client.report_resume(prompt_tokens=64, found_tokens=32, usable_tokens=0, action="full-prefill")
