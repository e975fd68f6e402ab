"""ReportCorrupt and GetInfo.tenant under auth: the same-host reader's RPCs follow Get's tenant rules.

The server runs in-process here (the reader itself is not needed: these are the wire rules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client
from kvstore.config import StoreSettings
from kvstore.errors import PermissionDenied
from kvstore.v1 import kvstore_pb2 as pb


def _issue(store: StoreSettings, tenant: str, rights: set[str]) -> str:
    return api_tokens.create(store.data_dir / "tenants.json", tenant, frozenset(rights))[1]


@pytest.fixture
def authed(start_server: Callable[..., Any], store_settings: StoreSettings) -> tuple[Any, dict[str, str]]:
    """A server with tenants acme (read, write), other (read), writer (write only)."""
    tokens = {"acme": _issue(store_settings, "acme", {"read", "write"}),
              "other": _issue(store_settings, "other", {"read"}),
              "writer": _issue(store_settings, "writer", {"write"})}
    return start_server(store_settings), tokens


def _report(client: Client, hashes: list[bytes], namespace: str = "") -> pb.ReportCorruptResponse:
    conn = client.connection
    return conn.call(conn.kvstore.ReportCorrupt, pb.ReportCorruptRequest(
        geometry=client.geometry, namespace=namespace, block_hashes=hashes))


def test_get_info_names_the_callers_tenant(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as acme:
        assert acme.connection.call(acme.connection.kvstore.GetInfo, pb.GetInfoRequest()).tenant == "acme"


def test_get_info_without_auth_names_the_default_tenant(client: Client) -> None:
    assert client.connection.call(client.connection.kvstore.GetInfo, pb.GetInfoRequest()).tenant == "default"


def test_report_corrupt_follows_gets_tenant_rules(authed: tuple[Any, dict[str, str]]) -> None:
    server, tokens = authed
    with Client(server.target, token=tokens["acme"]) as acme, \
            Client(server.target, token=tokens["other"]) as other, \
            Client(server.target, token=tokens["writer"]) as writer:
        tokens_ = list(range(acme.block_tokens * 2))
        acme.put(tokens_, [bytes(acme.block_bytes)] * 2)
        hashes = acme.hashes(tokens_)
        with pytest.raises(PermissionDenied):
            _report(other, hashes, namespace="acme")  # another tenant's namespace
        with pytest.raises(PermissionDenied):
            _report(writer, hashes)  # no read right
        # Its own namespace: another tenant's blocks are simply not there.
        assert list(_report(other, hashes).statuses) == [pb.BLOCK_STATUS_MISSING] * 2
        # The owner's intact blocks: checked, found, kept.
        reply = _report(acme, hashes)
        assert list(reply.statuses) == [pb.BLOCK_STATUS_FOUND] * 2 and reply.dropped_blocks == 0
        assert acme.lookup(tokens_).found_blocks == 2
