"""The access trace's counters through a stateless gateway (docs/CAPACITY.md "Recording", docs/FLEET.md F53):
the gateway's Stats carry every node's recorder summed, as `kvstore stats --target etcd://...` sums them.

Real parts: the session's etcd, two `kvstore serve` nodes recording their trace ([trace] enabled) at
replication 2, one `kvstore gateway`, all on loopback; and `gateway.fleet_stats.merge_stats` on the
nodes' own answers for the rule that the fleet records when any node does."""

from __future__ import annotations

import contextlib
import io
import json
import random
import uuid
from pathlib import Path

import kvstore
from gateway.fleet_stats import merge_stats
from kvstore.cli import main
from kvstore.client.fleet import FleetClient
from kvstore.v1 import kvstore_pb2 as pb
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

BLOCK_TOKENS = 16
RUN_BLOCKS = 4
COUNTS = ("written_records", "dropped_records", "written_bytes", "files_written", "files_removed",
          "queued_records", "bytes_on_disk")


def test_a_gateways_stats_sum_the_nodes_trace_counters(tmp_path: Path, etcd_server: EtcdProcess) -> None:
    """Puts, Lookups and Gets through the gateway are recorded on both nodes (each holds a copy); once the
    writers have written them, the gateway's Stats (and `kvstore stats --target GATEWAY --json`) carry the
    two nodes' counters summed, each node's above 0 (seen failing with the merge's trace line deleted: all 0;
    the command's, exit 2, with a gateway's FAILED_PRECONDITION for the SWA pool and Transfer not taken as none)."""
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    fleet = {"etcd": etcd_server.endpoint, "cluster": cluster, "run_blocks": RUN_BLOCKS, "replication": 2}
    children: list[Child] = []
    try:
        for i in range(2):
            cfg = write_config(tmp_path / f"node{i}.toml", {
                "store": {"data_dir": str(tmp_path / f"store{i}"), "capacity_bytes": 1 << 27,
                          "block_tokens": BLOCK_TOKENS},
                "fleet": {**fleet, "lease_ttl_s": 60}, "trace": {"enabled": True, "flush_s": 0.05}})
            children.append(Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        gw_cfg = write_config(tmp_path / "gw.toml", {
            "store": {"data_dir": str(tmp_path / "none"), "block_tokens": BLOCK_TOKENS}, "fleet": fleet})
        gateway = Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs")
        children.append(gateway)
        routed = kvstore.Client(f"etcd://{etcd_server.endpoint}/{cluster}")
        assert isinstance(routed, FleetClient)
        with routed, kvstore.Client(gateway.target) as plain:
            routed.view.wait_until(lambda nodes: len(nodes) == 2, 30.0)
            tokens = [random.randrange(50_000) for _ in range(3 * RUN_BLOCKS * BLOCK_TOKENS)]
            plain.put(tokens, [random.randbytes(plain.block_bytes) for _ in range(3 * RUN_BLOCKS)])
            assert plain.lookup(tokens).found_blocks == 3 * RUN_BLOCKS
            assert plain.get(tokens).found_prefix_blocks == 3 * RUN_BLOCKS

            def written() -> bool:  # every record written: the counters stay as they are now
                nodes = routed.node_stats().values()
                return len(nodes) == 2 and all(n.trace.written_records > 0 and not n.trace.queued_records
                                               for n in nodes)

            wait_until(written, "both nodes wrote their trace records")
            nodes = list(routed.node_stats().values())
            total = plain.stats().trace
            assert total.enabled
            for field in COUNTS:
                assert getattr(total, field) == sum(getattr(n.trace, field) for n in nodes), field
            assert total.written_records > max(n.trace.written_records for n in nodes)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["stats", "--target", gateway.target, "--json", "--timeout", "5"]) == 0
            shown = json.loads(out.getvalue())["trace"]
            assert shown["enabled"] is True
            assert shown["written_records"] == total.written_records
    finally:
        for child in reversed(children):
            child.kill_if_alive()


def test_the_fleet_records_when_any_node_does() -> None:
    """One node recording and one not: the merge says the trace is on, with the recording node's counts; no node
    answering with a trace (a tenant's own Stats) leaves it out (seen failing with `enabled` as `all` nodes')."""
    on = pb.StatsResponse(trace=pb.TraceCounters(enabled=True, written_records=5, bytes_on_disk=100))
    off = pb.StatsResponse(trace=pb.TraceCounters(enabled=False))
    merged = merge_stats([off, on, on])
    assert merged.trace.enabled and merged.trace.written_records == 10 and merged.trace.bytes_on_disk == 200
    assert not merge_stats([off, off]).trace.enabled
    assert not merge_stats([pb.StatsResponse(), pb.StatsResponse()]).HasField("trace")
