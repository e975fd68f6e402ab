"""Stats and tenants (real server with tokens on loopback): a tenant reads its own hit counters only;
an admin reads any tenant's, all of them, and the store-wide totals."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.cli import main
from kvstore.client import Client
from kvstore.config import StoreSettings
from kvstore.errors import PermissionDenied

RW = frozenset({"read", "write"})


def test_a_tenant_sees_its_own_hit_counters_only(start_server: Callable[..., Any], store_settings: StoreSettings,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = store_settings.data_dir / "tenants.json"
    tokens = {name: api_tokens.create(path, name, RW)[1] for name in ("tenant-a", "tenant-b")}
    admin_token = api_tokens.create(path, "ops", frozenset({"read", "write", "admin"}))[1]
    server = start_server(store_settings)
    with Client(server.target, token=tokens["tenant-a"]) as a, Client(server.target, token=tokens["tenant-b"]) as b:
        prompt = list(range(a.block_tokens * 2))
        a.put(prompt, [os.urandom(a.block_bytes) for _ in range(2)])
        a.lookup(prompt)
        b.lookup(prompt)  # a's blocks are no hit of b's
        b.lookup(prompt)
        mine = a.stats()
        assert [t.tenant for t in mine.tenants] == ["tenant-a"] and not mine.store_wide
        day = next(w.counts for w in mine.windows if w.window == "24h")
        assert (day.lookups, day.lookup_blocks_found) == (1, 2)
        assert (mine.lookups, mine.bytes_stored, mine.write_rate_bytes_per_s) == (0, 0, 0)  # store-wide: not shown
        with pytest.raises(PermissionDenied, match="the stats of tenant 'tenant-b' need the 'admin' right"):
            a.stats(tenant="tenant-b")
        assert main(["stats", "--target", server.target, "--token", tokens["tenant-b"], "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert list(data["tenants"]) == ["tenant-b"] and data["windows"]["24h"]["lookups"] == 2
        assert data["store_wide"] is False and data["swa"] is None and data["transfer"] is None
    with Client(server.target, token=admin_token) as ops:
        every = ops.stats()
        assert [t.tenant for t in every.tenants] == ["tenant-a", "tenant-b"] and every.store_wide
        assert next(w.counts for w in every.windows if w.window == "24h").lookups == 3 and every.lookups == 3
        assert [t.tenant for t in ops.stats(tenant="tenant-b").tenants] == ["tenant-b"]
