"""The authorization metadata itself (gateway.auth.AuthInterceptor.authenticate), on a real server:
a call carrying more than one `authorization` entry is refused, whichever of them is valid."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvstore import api_tokens
from kvstore.config import StoreSettings
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc


@pytest.fixture
def authed(start_server: Callable[..., Any], store_settings: StoreSettings) -> tuple[Any, str, str]:
    """A server with tokens on, and the authorization values of a reader of acme and an admin of ops."""
    tenants = store_settings.data_dir / "tenants.json"
    reader = "Bearer " + api_tokens.create(tenants, "acme", frozenset({"read"}))[1]
    admin = "Bearer " + api_tokens.create(tenants, "ops", frozenset({"read", "write", "admin"}))[1]
    return start_server(store_settings), reader, admin


def get_info(target: str, metadata: tuple[tuple[str, str], ...]) -> kvstore_pb2.GetInfoResponse:
    with grpc.insecure_channel(target) as channel:
        return kvstore_pb2_grpc.KVStoreStub(channel).GetInfo(kvstore_pb2.GetInfoRequest(), timeout=30,
                                                              metadata=metadata)


def test_one_authorization_entry_is_served(authed: tuple[Any, str, str]) -> None:
    server, reader, admin = authed
    assert get_info(server.target, (("authorization", reader),)).tenant == "acme"
    assert get_info(server.target, (("authorization", admin),)).tenant == "ops"


@pytest.mark.parametrize("which", ["same twice", "reader then admin", "admin then reader", "bad then good",
                                   "good then bad"])
def test_two_authorization_entries_are_unauthenticated(authed: tuple[Any, str, str], which: str) -> None:
    server, reader, admin = authed
    values = {"same twice": (reader, reader), "reader then admin": (reader, admin),
              "admin then reader": (admin, reader), "bad then good": ("Bearer nope", reader),
              "good then bad": (reader, "Bearer nope")}[which]
    with pytest.raises(grpc.RpcError) as refused:
        get_info(server.target, tuple(("authorization", v) for v in values))
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "2 authorization metadata entries" in refused.value.details()


def test_three_entries_are_counted_in_the_refusal(authed: tuple[Any, str, str]) -> None:
    server, reader, _ = authed
    with pytest.raises(grpc.RpcError) as refused:
        get_info(server.target, (("authorization", reader),) * 3)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "3 authorization metadata entries: send exactly one" in refused.value.details()
