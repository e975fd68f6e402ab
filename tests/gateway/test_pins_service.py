"""Pins through the service (docs/RETENTION.md R22-R27): a real gRPC server on loopback over a real LMDB store.

A Put or a Lookup asks `keep_until_s`; the answer says what was granted (or why less); the
pinned prefix outlives its retention; Stats shows each tenant's pins; every grant is audited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.admin_servicer import ADMIN_DIR
from gateway.audit import AuditLog
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

HOUR = 3600.0
TOKENS = 16
CHAIN = 4
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)


@pytest.fixture
def stub(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[tuple[Any, Path, str]]:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=2 * CHAIN * BLOCK_BYTES, block_tokens=TOKENS,
                          pin_max_hours=100.0, pin_budget_bytes=2 * CHAIN * BLOCK_BYTES)
    server = start_server(store)
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield pb_grpc.KVStoreStub(channel), store.data_dir, server.target


def _put(stub: Any, seed: int, keep_until_s: float = 0.0) -> pb.PutResponse:
    tokens = list(range(seed, seed + TOKENS * CHAIN))
    return stub.Put(pb.PutRequest(token_ids=tokens, blocks=[os.urandom(BLOCK_BYTES) for _ in range(CHAIN)],
                                  keep_until_s=keep_until_s))


def _found(stub: Any, hashes: list[bytes], keep_until_s: float = 0.0) -> pb.LookupResponse:
    return stub.Lookup(pb.LookupRequest(block_hashes=hashes, keep_until_s=keep_until_s))


def test_r22_r23_a_puts_pin_is_answered_and_keeps_the_prefix_past_retention(stub: tuple[Any, Path, str],
                                                                            clock: ManualClock) -> None:
    s, data_dir, _ = stub
    asked = clock.now() + 90 * HOUR
    a = _put(s, 0, keep_until_s=asked)
    assert (a.kept_until_s, a.keep_note) == (asked, "")
    clock.advance(1)
    b = _put(s, 10_000)
    clock.advance(80 * HOUR)  # both past the 72-hour retention; a is the older, but pinned
    _put(s, 20_000)
    assert _found(s, list(a.block_hashes)).found_blocks == CHAIN
    assert _found(s, list(b.block_hashes)).found_blocks == 0
    entries = AuditLog(data_dir / ADMIN_DIR).entries(tenant="default")
    assert [(e.action, e.new["until_s"], e.new["block"]) for e in entries if e.action == "pin"] == [
        ("pin", asked, a.block_hashes[-1].hex())]


def test_r24_a_lookups_pin_says_what_was_granted(stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    s, _, _ = stub
    a = _put(s, 0)
    reply = _found(s, list(a.block_hashes), keep_until_s=clock.now() + 500 * HOUR)
    assert reply.found_blocks == CHAIN and reply.kept_until_s == clock.now() + 100 * HOUR
    assert "100 h" in reply.keep_note
    missing = _found(s, [os.urandom(32)], keep_until_s=clock.now() + HOUR)
    assert missing.kept_until_s == 0 and "nothing was found" in missing.keep_note
    with pytest.raises(grpc.RpcError) as err:
        _found(s, list(a.block_hashes), keep_until_s=float("nan"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "keep_until_s" in (err.value.details() or "")


def test_r27_stats_shows_each_tenants_pins(stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    s, _, target = stub
    _put(s, 0, keep_until_s=clock.now() + HOUR)
    tenant = next(t for t in s.Stats(pb.StatsRequest(tenant="default")).tenants if t.tenant == "default")
    assert (tenant.pins, tenant.pinned_bytes) == (1, CHAIN * BLOCK_BYTES)
    shown = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--target", target, "--tenant", "default"],
                           capture_output=True, text=True, check=True, timeout=120).stdout
    assert f"1 pin holding {CHAIN * BLOCK_BYTES:,} B" in shown  # `kvstore stats`, per tenant
    clock.advance(2 * HOUR)  # expired: not shown (R25)
    tenant = next(t for t in s.Stats(pb.StatsRequest(tenant="default")).tenants if t.tenant == "default")
    assert tenant.pins == 0


def test_r27_an_operator_drops_a_tenants_pins_and_it_is_audited(stub: tuple[Any, Path, str],
                                                                 clock: ManualClock) -> None:
    from kvstore.v1 import admin_pb2, admin_pb2_grpc

    s, data_dir, target = stub
    _put(s, 0, keep_until_s=clock.now() + HOUR)
    _put(s, 10_000, keep_until_s=clock.now() + HOUR)
    with grpc.insecure_channel(target) as channel:
        assert admin_pb2_grpc.AdminStub(channel).DropPins(admin_pb2.DropPinsRequest(tenant="default")).dropped == 2
    _put(s, 0, keep_until_s=clock.now() + HOUR)  # its blocks again: a use, and a pin anew
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "pins", "--tenant", "default", "--drop", "--yes",
                          "--target", target, "--json"], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == {"tenant": "default", "dropped_pins": 1}  # `kvstore pins --drop`
    assert next(t for t in s.Stats(pb.StatsRequest(tenant="default")).tenants).pins == 0
    drops = [e for e in AuditLog(data_dir / ADMIN_DIR).entries(tenant="default") if e.action == "drop-pins"]
    assert [(e.old["pins"], e.new["dropped"]) for e in drops] == [(2, 2), (1, 1)]


def test_r24_a_tenants_policy_sets_its_pin_limits(stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    from kvstore.v1 import admin_pb2, admin_pb2_grpc

    s, _, target = stub
    a = _put(s, 0)
    with grpc.insecure_channel(target) as channel:
        admin_pb2_grpc.AdminStub(channel).SetPolicy(admin_pb2.SetPolicyRequest(tenant="default", pin_max_hours=10.0))
    reply = _found(s, list(a.block_hashes), keep_until_s=clock.now() + 50 * HOUR)
    assert reply.kept_until_s == clock.now() + 10 * HOUR and "10 h" in reply.keep_note  # the policy's, not [store]'s


def test_r22_the_client_pins_a_stored_prefix(stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    from kvstore.client import Client

    _, _, target = stub
    tokens = list(range(TOKENS * CHAIN))
    with Client(target) as client:
        client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(CHAIN)])
        got = client.pin(tokens, clock.now() + 5 * HOUR)
        assert (got.found_blocks, got.kept_until_s, got.keep_note) == (CHAIN, clock.now() + 5 * HOUR, "")
        assert client.pin(list(range(900, 900 + TOKENS)), clock.now() + HOUR).kept_until_s == 0  # nothing found


def test_r29_an_expired_pin_is_audited_by_itself(stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    from tests.waiting import wait_until

    s, data_dir, _ = stub
    asked = clock.now() + HOUR
    a = _put(s, 0, keep_until_s=asked)
    log = AuditLog(data_dir / ADMIN_DIR)

    def expired() -> list[Any]:
        return [e for e in log.entries(tenant="default") if e.action == "pin-expired"]

    assert expired() == []
    clock.advance(HOUR + 1)  # no Put, no call: the server's own round finds it past its time
    wait_until(lambda: expired(), "the expired pin's audit entry")
    (entry,) = expired()
    assert (entry.actor, entry.old, entry.new) == (
        "kvstore", {"block": a.block_hashes[-1].hex(), "until_s": asked, "charged_bytes": CHAIN * BLOCK_BYTES}, None)
    _put(s, 10_000)  # later rounds audit it no more
    clock.advance(1)
    assert len(expired()) == 1


def test_r22_the_clients_put_and_lookup_ask_for_retention_and_say_what_was_granted(
        stub: tuple[Any, Path, str], clock: ManualClock) -> None:
    from kvstore.client import Client
    from kvstore.errors import InvalidArgument

    s, _, target = stub
    tokens = list(range(500, 500 + TOKENS * CHAIN))
    with Client(target) as client:
        asked = clock.now() + 5 * HOUR
        put = client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(CHAIN)], batch_blocks=1,
                         keep_until_s=asked)  # a stream of four batches: the last one pins the prompt's last block
        assert (put.written_blocks, put.kept_until_s, put.keep_note) == (CHAIN, asked, "")
        tenant = next(t for t in s.Stats(pb.StatsRequest(tenant="default")).tenants if t.tenant == "default")
        assert (tenant.pins, tenant.pinned_bytes) == (1, CHAIN * BLOCK_BYTES)  # one pin, on the deepest block
        far = client.lookup(tokens, keep_until_s=clock.now() + 500 * HOUR)
        assert far.found_blocks == CHAIN and far.kept_until_s == clock.now() + 100 * HOUR and "100 h" in far.keep_note
        assert client.lookup(tokens).kept_until_s == 0  # not asked: nothing granted
        for bad in (float("inf"), -1.0, True, "soon"):
            with pytest.raises(InvalidArgument, match="keep_until_s"):
                client.put(tokens, [os.urandom(BLOCK_BYTES)] * CHAIN, keep_until_s=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="keep_until_s"):
                client.lookup(tokens, keep_until_s=bad)  # type: ignore[arg-type]


def test_r26_a_purge_that_takes_pins_says_so_in_its_audit_entry(stub: tuple[Any, Path, str],
                                                                clock: ManualClock) -> None:
    """A purge of the tenant's cache takes its pins with its blocks (R26): the audit entry names the pins and pinned
    bytes before and after, so the pins' removal is audited with it."""
    from kvstore.v1 import admin_pb2, admin_pb2_grpc

    s, data_dir, target = stub
    _put(s, 0, keep_until_s=clock.now() + HOUR)
    _put(s, 10_000)
    with grpc.insecure_channel(target) as channel:
        purged = admin_pb2_grpc.AdminStub(channel).Purge(admin_pb2.PurgeRequest(tenant="default", all=True))
    assert purged.purged_blocks == 2 * CHAIN
    entry = next(e for e in AuditLog(data_dir / ADMIN_DIR).entries(tenant="default") if e.action == "purge")
    assert (entry.old["pins"], entry.old["pinned_bytes"]) == (1, CHAIN * BLOCK_BYTES)
    assert (entry.new["pins"], entry.new["pinned_bytes"], entry.new["purged_blocks"]) == (0, 0, 2 * CHAIN)
