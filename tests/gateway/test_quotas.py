"""Quotas end to end: a real server on loopback with tenants' tokens, a real LMDB store and the
in-process SWA pool, time moved by a ManualClock. Each quota exceeded answers RESOURCE_EXHAUSTED
naming the limit and the tenant, and holds only for that tenant."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, SwaSettings
from kvstore.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvstore.geometry import V4_1_FLASH

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)


@pytest.fixture
def start_wired(start_server: Callable[..., Any], tmp_path: Path) -> Callable[..., Any]:
    """Start a server (with the Admin service and the quota interceptor, as gateway.server builds it), 8 blocks."""
    def start(**kwargs: Any) -> Any:
        store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=8 * BLOCK_BYTES, block_tokens=TOKENS)
        return start_server(store, **kwargs)

    return start


@pytest.fixture
def running(start_wired: Callable[..., Any]) -> Any:
    return start_wired()


def make_tokens(running: Any) -> dict[str, str]:
    """Tokens of "ops" (admin), "acme" and "other" (read and write), in the running server's tenants file."""
    path = running.tenants.path
    made = {name: api_tokens.create(path, name, frozenset(rights))[1]
            for name, rights in (("ops", {"read", "write", "admin"}), ("acme", {"read", "write"}),
                                 ("other", {"read", "write"}))}
    running.tenants.refresh()  # now, not at the next reload
    return made


@pytest.fixture
def tokens(running: Any) -> dict[str, str]:
    return make_tokens(running)


@pytest.fixture
def admin(running: Any, tokens: dict[str, str]) -> Iterator[AdminClient]:
    with AdminClient(running.target, token=tokens["ops"]) as a:
        yield a


@pytest.fixture
def acme(running: Any, tokens: dict[str, str]) -> Iterator[Client]:
    with Client(running.target, token=tokens["acme"]) as c:
        yield c


@pytest.fixture
def other(running: Any, tokens: dict[str, str]) -> Iterator[Client]:
    with Client(running.target, token=tokens["other"]) as c:
        yield c


def test_requests_per_s_quota(admin: AdminClient, running: Any, tokens: dict[str, str], other: Client,
                              clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    admin.set_policy("acme", requests_per_s=2)
    with Client(running.target, token=tokens["acme"]) as acme:  # GetInfo: the first of two this second
        acme.lookup(list(range(TOKENS)))
        with (caplog.at_level(logging.WARNING, logger="kvstore.requests"),
              pytest.raises(ResourceExhausted, match="tenant 'acme' is over its requests_per_s quota of 2 requests/s")):
            acme.lookup(list(range(TOKENS)))
        [failed] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvstore.requests"]
        assert (failed["tenant"], failed["status"], failed["reason"]) == ("acme", "RESOURCE_EXHAUSTED", "QuotaExceeded")
        for _ in range(5):
            other.lookup(list(range(TOKENS)))  # another tenant's bucket: untouched
        clock.advance(1.0)
        acme.lookup(list(range(TOKENS)))


def test_requests_per_s_quota_charges_a_streamed_answer(admin: AdminClient, running: Any,
                                                         tokens: dict[str, str], clock: ManualClock) -> None:
    admin.set_policy("acme", requests_per_s=2)
    with Client(running.target, token=tokens["acme"]) as acme:  # GetInfo: the first of two this second
        acme.get_hashes([bytes(32)])  # Get answers a stream: the second request of the second
        with pytest.raises(ResourceExhausted, match="tenant 'acme' is over its requests_per_s quota"):
            acme.get_hashes([bytes(32)])
        clock.advance(1.0)
        assert acme.get_hashes([bytes(32)]).found_prefix_blocks == 0


def test_nvme_quota(admin: AdminClient, acme: Client, other: Client) -> None:
    admin.set_policy("acme", nvme_quota_bytes=BLOCK_BYTES)
    acme.put(list(range(TOKENS)), [os.urandom(BLOCK_BYTES)])
    with pytest.raises(ResourceExhausted, match=r"'acme' is over its NVMe quota.*nvme_quota_bytes"):
        acme.put(list(range(100, 100 + TOKENS)), [os.urandom(BLOCK_BYTES)])
    other.put(list(range(100, 100 + 2 * TOKENS)), [os.urandom(BLOCK_BYTES)] * 2)
    assert admin.get_policy("acme").usage.nvme_bytes == BLOCK_BYTES


def test_swa_quota(admin: AdminClient, acme: Client, other: Client, clock: ManualClock) -> None:
    one = acme.swa.snapshot_bytes(60)
    admin.set_policy("acme", swa_quota_bytes=one)
    first, second = list(range(60)), list(range(1000, 1060))
    with pytest.raises(InvalidArgument):
        # Refused by the service after the ledger took it: given back.
        acme.swa.put(list(range(2000, 2060)), os.urandom(one - 1))
    assert acme.swa.put(first, os.urandom(one)).stored == 1
    assert acme.swa.put(first, os.urandom(one)).stored == 1  # the same key again: replaced, not counted twice
    with pytest.raises(ResourceExhausted, match=f"tenant 'acme' is over its swa_quota_bytes quota of {one} bytes"):
        acme.swa.put(second, os.urandom(one))
    assert acme.swa.get(second) is None  # nothing stored
    assert other.swa.put(second, os.urandom(one)).stored == 1
    assert acme.swa.delete_many([acme.swa.key(first)]) == 1
    assert acme.swa.put(second, os.urandom(one)).stored == 1  # the deleted snapshot's bytes came back
    assert admin.get_policy("acme").usage.swa_bytes == one
    clock.advance(301)  # past the pool's TTL: the ledger lets go of what expired
    assert acme.swa.put(first, os.urandom(one)).stored == 1


def test_swa_ttl(admin: AdminClient, acme: Client, other: Client, clock: ManualClock) -> None:
    admin.set_policy("acme", swa_ttl_s=10)
    tokens = list(range(60))
    data = os.urandom(acme.swa.snapshot_bytes(60))
    assert acme.swa.put(tokens, data).ttl_ms == 10_000
    assert acme.swa.put(tokens, data, ttl_s=5).ttl_ms == 5_000  # a shorter TTL asked for stays
    assert other.swa.put(tokens, data).ttl_ms == 300_000
    clock.advance(11)
    assert acme.swa.get(tokens) is None
    assert other.swa.get(tokens) == data


def test_another_tenants_swa_quota_tells_a_caller_nothing(admin: AdminClient, running: Any,
                                                          tokens: dict[str, str]) -> None:
    """A call naming another tenant's namespace is refused for that, not measured against its quota."""
    admin.set_policy("other", swa_quota_bytes=1)
    with Client(running.target, token=tokens["acme"], namespace="other") as intruder:
        data = os.urandom(intruder.swa.snapshot_bytes(60))
        with pytest.raises(PermissionDenied, match="namespace 'other' is not this token's tenant"):
            intruder.swa.put(list(range(60)), data)


def test_a_put_the_pool_could_not_take_is_not_charged(start_wired: Callable[..., Any], redis_server: Any) -> None:
    running = start_wired(swa=SwaSettings(backend="redis", redis_url=redis_server.url, socket_timeout_s=5.0))
    made = make_tokens(running)
    with AdminClient(running.target, token=made["ops"]) as ops, Client(running.target, token=made["acme"]) as acme:
        one = acme.swa.snapshot_bytes(60)
        ops.set_policy("acme", swa_quota_bytes=one)
        redis_server.stop()
        assert acme.swa.put(list(range(60)), os.urandom(one)).stored == 0  # the backend is down: lost, counted
        redis_server.start()
        assert acme.swa.put(list(range(1000, 1060)), os.urandom(one)).stored == 1
