"""The Prometheus endpoint of a real server on loopback, scraped over HTTP (gateway.metrics)."""

from __future__ import annotations

import math
import os
import socket
import threading
import urllib.request
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import MetricsInterceptor, ServerMetrics, serve_metrics, start_endpoint
from gateway.status import unary
from kvstore.client import Client
from kvstore.errors import ResourceExhausted
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KV = "kvstore.v1.KVStore"


def stub(target: str) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(target))


def test_a_call_counts_under_its_method_tenant_and_code(start_metered: Any) -> None:
    m = start_metered()
    kv = stub(m.target)
    kv.GetInfo(pb.GetInfoRequest())
    with pytest.raises(grpc.RpcError):
        kv.Lookup(pb.LookupRequest(geometry="no-such-geometry", block_hashes=[bytes(32)]))
    kv.Stats(pb.StatsRequest())
    s = m.scrape()
    assert s.value("kvstore_rpc_requests_total", method=f"{KV}/GetInfo", tenant="default", code="OK") == 1
    assert s.value("kvstore_rpc_duration_seconds_count", method=f"{KV}/GetInfo", tenant="default") == 1
    assert s.value("kvstore_rpc_requests_total", method=f"{KV}/Lookup", tenant="default",
                  code="INVALID_ARGUMENT") == 1
    assert s.value("kvstore_rpc_rejections_total", method=f"{KV}/Lookup", tenant="default",
                  code="INVALID_ARGUMENT", reason="InvalidArgument") == 1
    assert [labels["method"] for labels, _ in s.where("kvstore_rpc_rejections_total")] == [f"{KV}/Lookup"]


def test_a_server_stream_counts_once_when_it_ends(start_metered: Any) -> None:
    m = start_metered()
    with Client(m.target) as client:
        assert [status for _, status, _ in client.stream([bytes(32), bytes(32)])] == [2, 2]  # two missing blocks
    s = m.scrape()
    assert s.value("kvstore_rpc_requests_total", method=f"{KV}/Get", tenant="default", code="OK") == 1
    assert s.value("kvstore_rpc_duration_seconds_count", method=f"{KV}/Get", tenant="default") == 1


def test_the_tenant_is_the_tokens_and_tenants_past_the_cap_fold_into_other(start_metered: Any, issue: Any) -> None:
    tokens = {"t0": issue("t0", frozenset({"read"})), **{f"t{i}": issue(f"t{i}") for i in range(1, 5)}}
    m = start_metered(tenant_labels=3)
    kv = stub(m.target)
    for token in tokens.values():
        kv.Lookup(pb.LookupRequest(block_hashes=[bytes(32)]), metadata=[("authorization", f"Bearer {token}")])
    with pytest.raises(grpc.RpcError) as refused:
        kv.Lookup(pb.LookupRequest(block_hashes=[bytes(32)]))  # no token
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as denied:
        kv.Put(pb.PutRequest(), metadata=[("authorization", f"Bearer {tokens['t0']}")])  # t0 may only read
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    s = m.scrape()
    assert s.by_tenant("kvstore_rpc_requests_total") == {"t0": 2, "t1": 1, "t2": 1, "other": 2, "unauthenticated": 1}
    assert s.value("kvstore_rpc_rejections_total", method=f"{KV}/Put", tenant="t0", code="PERMISSION_DENIED",
                   reason="status") == 1
    assert s.value("kvstore_rpc_rejections_total", method=f"{KV}/Lookup", tenant="unauthenticated",
                   code="UNAUTHENTICATED", reason="status") == 1
    assert s.value("kvstore_metrics_tenants_folded_total") == 2
    assert s.value("kvstore_metrics_tenant_labels") == 3


def test_the_collector_reads_what_the_stats_calls_report(start_metered: Any) -> None:
    m = start_metered()
    with Client(m.target) as client:
        tokens = list(range(client.block_tokens * 4))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(4)])
        client.lookup(tokens)
        client.lookup(list(range(10_000, 10_000 + client.block_tokens * 2)))  # a miss
        client.get(tokens[: client.block_tokens * 2])
        position = client.block_tokens * 4
        client.swa.put(tokens, os.urandom(client.swa.snapshot_bytes(position)))
        client.swa.get(tokens)
        client.swa.get(list(range(7, 7 + position)))  # a miss
        with client.transfer():  # an open session
            kv, swa, transfer = client.stats(), client.swa.stats(), client.transfer_stats()
            s = m.scrape()
    assert kv.blocks_stored == 4 and swa.snapshots_put == 1 and kv.lookup_tokens_found < kv.lookup_tokens_asked
    store = {"kvstore_store_blocks": kv.blocks_stored, "kvstore_store_bytes": kv.bytes_stored,
             "kvstore_store_capacity_bytes": kv.capacity_bytes, "kvstore_store_free_bytes": kv.bytes_free,
             "kvstore_store_write_rate_bytes_per_second": kv.write_rate_bytes_per_s,
             "kvstore_store_headroom_hours": kv.headroom_hours, "kvstore_store_retention_hours": kv.retention_hours,
             "kvstore_store_active_leases": kv.active_leases, "kvstore_store_lookups_total": kv.lookups,
             "kvstore_store_lookup_tokens_asked_total": kv.lookup_tokens_asked,
             "kvstore_store_lookup_tokens_found_total": kv.lookup_tokens_found, "kvstore_store_gets_total": kv.gets,
             "kvstore_store_get_tokens_returned_total": kv.get_tokens_returned, "kvstore_store_puts_total": kv.puts,
             "kvstore_store_bytes_written_total": kv.bytes_written, "kvstore_store_evictions_total": kv.evictions,
             "kvstore_store_rejected_puts_total": kv.rejected_puts,
             "kvstore_store_lookup_hit_ratio": kv.lookup_tokens_found / kv.lookup_tokens_asked}
    pool = {"kvstore_swa_snapshots_put_total": swa.snapshots_put, "kvstore_swa_bytes_put_total": swa.bytes_put,
            "kvstore_swa_snapshots_asked_total": swa.snapshots_asked, "kvstore_swa_hits_total": swa.hits,
            "kvstore_swa_items": swa.items, "kvstore_swa_bytes": swa.bytes_used,
            "kvstore_swa_evictions_total": swa.evictions, "kvstore_swa_hit_ratio": swa.hits / swa.snapshots_asked}
    moved = {"kvstore_transfer_sessions": transfer.sessions, "kvstore_transfer_regions": transfer.regions,
             "kvstore_transfer_mapped_bytes": transfer.mapped_bytes,
             "kvstore_transfer_bytes_moved_total": transfer.bytes_moved, "kvstore_transfer_rings": transfer.rings,
             "kvstore_transfer_ring_requests_total": transfer.ring_requests,
             "kvstore_transfer_bulk_sessions": transfer.bulk_sessions,
             "kvstore_transfer_bulk_fetches_total": transfer.bulk_fetches,
             "kvstore_transfer_bulk_staged_total": transfer.bulk_staged,
             "kvstore_transfer_bulk_lanes": transfer.bulk_lanes}
    for name, expected in {**store, **pool, **moved}.items():
        assert s.value(name) == pytest.approx(expected), name
    assert s.value("kvstore_store_geometry_blocks", geometry=client.geometry) == kv.blocks_stored
    assert s.value("kvstore_swa_backend_up", backend=swa.backend) == 1
    assert s.value("kvstore_stats_up", source="store") == s.value("kvstore_stats_up", source="loop") == 1


def test_a_scrape_answers_the_store_series_while_the_event_loop_is_busy(start_metered: Any,
                                                                        loop_thread: Any) -> None:
    m = start_metered()
    assert m.metrics.collector is not None
    m.metrics.collector.loop_timeout_s = 0.2
    release = threading.Event()
    loop_thread.loop.call_soon_threadsafe(release.wait, 30)  # the gRPC loop stuck in a long call
    try:
        s = m.scrape()
    finally:
        release.set()
    assert s.value("kvstore_stats_up", source="store") == 1
    assert s.value("kvstore_stats_up", source="loop") == 0
    assert s.value("kvstore_store_blocks") == 0
    assert s.value("kvstore_swa_items") is None


def test_the_endpoint_is_off_at_port_0_and_refuses_a_taken_port() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    assert start_endpoint(SimpleNamespace(host="127.0.0.1", port=0), registry) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=r"\[metrics\] port"):
            start_endpoint(SimpleNamespace(host="127.0.0.1", port=port), registry)


def test_hit_ratios_are_nan_before_anything_was_asked(start_metered: Any) -> None:
    s = start_metered().scrape()
    assert math.isnan(s.value("kvstore_store_lookup_hit_ratio") or 0.0)


def test_per_tenant_series_read_the_hit_counters_and_what_each_tenant_stores(start_metered: Any, issue: Any) -> None:
    tokens = {name: issue(name) for name in ("acme", "beta", "gamma")}
    m = start_metered(tenant_labels=2)
    with Client(m.target, token=tokens["acme"]) as acme:
        prompt = list(range(acme.block_tokens * 3))
        acme.put(prompt, [os.urandom(acme.block_bytes) for _ in range(3)])
        acme.lookup(prompt + list(range(500, 500 + acme.block_tokens)))  # 3 of 4 blocks found
    with Client(m.target, token=tokens["beta"]) as beta:
        prompt = list(range(beta.block_tokens))
        beta.put(prompt, [os.urandom(beta.block_bytes)])
        beta.get(prompt)
    s = m.scrape()  # acme and beta called first: gamma (known, never called) is "other"
    tier = m.running.tier
    for name in ("acme", "beta"):
        usage = tier.namespace_usage(name)
        assert s.value("kvstore_tenant_stored_blocks", tenant=name) == usage.blocks
        assert s.value("kvstore_tenant_stored_bytes", tenant=name) == usage.stored_bytes
        assert s.value("kvstore_tenant_token_hours", tenant=name) == pytest.approx(usage.token_hours)
    assert s.value("kvstore_tenant_stored_blocks", tenant="acme") == 3
    assert s.value("kvstore_tenant_stored_blocks", tenant="other") == 0
    block_tokens = acme.block_tokens
    assert s.value("kvstore_tenant_lookup_tokens_asked_total", tenant="acme") == 4 * block_tokens
    assert s.value("kvstore_tenant_lookup_tokens_found_total", tenant="acme") == 3 * block_tokens
    assert s.value("kvstore_tenant_get_tokens_returned_total", tenant="beta") == block_tokens
    assert s.value("kvstore_tenant_get_tokens_returned_total", tenant="acme") == 0



class _Over(ResourceExhausted):
    """A refusal that names the limit it hit (as a quota's error may)."""

    limit = "requests_per_s"


class _Refuser:
    @unary
    async def Refuse(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise _Over("tenant acme is over its 5 requests/s")


def test_the_rejection_reason_names_the_error_class_and_the_limit(loop_thread: Any) -> None:
    metrics = ServerMetrics()
    handler = grpc.method_handlers_generic_handler("test.Refuser", {"Refuse": grpc.unary_unary_rpc_method_handler(
        _Refuser().Refuse, request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[MetricsInterceptor(metrics)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop_thread.run(start())
    endpoint = serve_metrics(metrics.registry, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/test.Refuser/Refuse")(b"", timeout=20)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with urllib.request.urlopen(endpoint.url, timeout=30) as reply:
            text = reply.read().decode()
    finally:
        endpoint.close_now()
        loop_thread.run(server.stop(0))
    reasons = [s.labels["reason"] for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "kvstore_rpc_rejections_total"]
    assert reasons == ["_Over:requests_per_s"]
