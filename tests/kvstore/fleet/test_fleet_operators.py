"""Operators' view of a fleet (issue 23 item 8): `kvstore stats --target etcd://...` over real nodes, a node's
kvstore_fleet_* series on its /metrics, and the router's counters in the worker's process registry.

Real parts only: the session's etcd and three `kvstore serve` processes (kvstore/bench/fleet_processes.py)
on loopback, scraped over HTTP."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvstore.bench.fleet_processes import NodeProcess
from kvstore.cli import main
from kvstore.client import Client
from kvstore.config_sections import FleetSettings
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
BLOCK_TOKENS = 16
#: Re-replication's rate: slow enough that a pass's under-replicated bytes are seen above 0 for a while.
REPAIR_BYTES_PER_S = 2 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


@contextlib.contextmanager
def _three_nodes(fleet: FleetSettings, folder: Path) -> Iterator[list[tuple[NodeProcess, int]]]:
    """Three nodes of `fleet` at replication 2, each with its /metrics on a free loopback port."""
    started = []
    try:
        for i in range(3):
            port = _free_port()
            env = {"KVSTORE_STORE_BLOCK_TOKENS": str(BLOCK_TOKENS), "KVSTORE_STORE_CAPACITY_BYTES": str(1 << 30),
                   "KVSTORE_FLEET_ETCD": fleet.etcd, "KVSTORE_FLEET_CLUSTER": fleet.cluster,
                   "KVSTORE_FLEET_LEASE_TTL_S": "2", "KVSTORE_FLEET_RUN_BLOCKS": "8",
                   "KVSTORE_FLEET_REPAIR_BYTES_PER_S": str(REPAIR_BYTES_PER_S), "KVSTORE_METRICS_PORT": str(port)}
            try:
                started.append((NodeProcess(folder / f"node{i}", env), port))
            except RuntimeError:  # the free port was taken meanwhile (another pytest worker): once more
                if "already in use" not in (folder / f"node{i}" / "serve.log").read_text(errors="replace"):
                    raise
                env["KVSTORE_METRICS_PORT"] = str(port := _free_port())
                started.append((NodeProcess(folder / f"node{i}b", env), port))
        yield started
    finally:
        for node, _ in started:
            node.stop()


@pytest.fixture
def nodes(fleet: FleetSettings, tmp_path: Path) -> Iterator[list[tuple[NodeProcess, int]]]:
    """A fresh fleet of three (`_three_nodes`), for a test that changes it (a node killed)."""
    with _three_nodes(fleet, tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def quiet_fleet(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[tuple[FleetSettings, list[tuple[NodeProcess, int]]]]:
    """One fleet of three for the module's tests that only read it (a node's /metrics, `kvstore stats`; a
    ghost member registered and gone again), started once: 3-4 s to start and 4 s to stop each time."""
    fleet = FleetSettings(etcd=etcd_server.endpoint, cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)
    with _three_nodes(fleet, tmp_path_factory.mktemp("quiet-fleet")) as started:
        yield fleet, started


def _stats_json(target: str) -> dict:  # type: ignore[type-arg]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["stats", "--target", target, "--json", "--timeout", "5"]) == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def _client_counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_fleet_stats_metrics_and_router_counters(fleet: FleetSettings, nodes: list[tuple[NodeProcess, int]]) -> None:
    target = f"etcd://{fleet.etcd}/{fleet.cluster}"
    with Client(target, timeout_s=10) as client:
        wait_until(lambda: len(client.view.nodes) == 3, "the client sees the three nodes")
        # More than the repair bucket's burst (8 MiB) lands on the node killed below and one other.
        blocks_per_prompt = 4 * 8
        prompts = [[p * 1000 + t for t in range(blocks_per_prompt * BLOCK_TOKENS)]
                   for p in range(max(1, (24 << 20) // (client.block_bytes * blocks_per_prompt)))]
        for tokens in prompts:
            client.put(tokens, [os.urandom(client.block_bytes) for _ in range(blocks_per_prompt)])
            client.lookup(tokens)
        report = _stats_json(target)
        assert report["total"]["reachable"] == 3
        per_node = [n for n in report["nodes"] if n["reachable"]]
        for key in ("blocks_stored", "bytes_stored", "lookup_tokens_found", "lookup_tokens_asked"):
            assert report["total"][key] == sum(n[key] for n in per_node) > 0
        start = report["total"]["windows"]["start"]
        found = sum(n["windows"]["start"]["lookup_tokens_found"] for n in per_node)
        asked = sum(n["windows"]["start"]["lookup_tokens_asked"] for n in per_node)
        assert start["lookup_tokens_found"] == found and start["lookup_token_hit_rate"] == found / asked
        # Two copies of every block: the fleet stores twice what was put.
        assert report["total"]["blocks_stored"] == 2 * blocks_per_prompt * len(prompts)

        for _, port in nodes:
            scrape = _scrape(port)
            assert scrape["kvstore_fleet_members"] == 3 and scrape["kvstore_fleet_membership_stale"] == 0
        wait_until(lambda: all(_scrape(p)["kvstore_fleet_lease_renewals_total"] > 0 for _, p in nodes),
                   "every node renewed its lease")

        victim, _ = nodes[0]
        survivors = [p for n, p in nodes if n is not victim]
        failovers = _client_counter("kvstore_fleet_client_failovers_total", op="get")
        errors = _client_counter("kvstore_fleet_client_node_errors_total", node=victim.node_id)
        victim.kill()
        # Read everything at once, before the lease ends: runs whose chosen replica is the dead node fail over.
        for tokens in prompts:
            got = client.get(tokens)
            assert all(s == "found" for s in got.statuses)
        assert _client_counter("kvstore_fleet_client_failovers_total", op="get") > failovers
        assert _client_counter("kvstore_fleet_client_node_errors_total", node=victim.node_id) > errors

        report = _stats_json(target)
        dead = [n for n in report["nodes"] if n["node_id"] == victim.node_id]
        if dead:  # still in etcd (its lease runs): listed, unreachable, not counted
            assert not dead[0]["reachable"] and report["total"]["reachable"] == 2
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["stats", "--target", target, "--timeout", "5"]) == 0
            # The lease may end between the two calls: the table then lists 2 of 2; while the node is a
            # member it is counted among the nodes asked and has its unreachable row.
            if "2 of 2 nodes answered" not in out.getvalue():
                assert "2 of 3 nodes answered" in out.getvalue()
                assert re.search(rf"^{victim.node_id}\s+\S+\s+unreachable", out.getvalue(), re.MULTILINE)
            assert report["total"]["blocks_stored"] == sum(n["blocks_stored"] for n in report["nodes"]
                                                           if n["reachable"])

        # The bytes a pass found to copy are a moment's state (a fast pass copies them between two scrapes):
        # the copied-bytes counter is what shows that a pass found and copied the dead node's runs.
        def settled_over_two() -> bool:
            scraped = [_scrape(p) for p in survivors]
            return (all(m["kvstore_fleet_members"] == 2 and m["kvstore_fleet_repair_settled"] == 1
                        and m["kvstore_fleet_repair_under_replicated_bytes"] == 0 for m in scraped)
                    and sum(m["kvstore_fleet_repair_copied_bytes_total"] for m in scraped) > 0)

        wait_until(settled_over_two, "re-replication copies the dead node's runs and settles", timeout_s=60)


def test_docs_fleet_table_lists_every_fleet_series_a_node_serves(
        quiet_fleet: tuple[FleetSettings, list[tuple[NodeProcess, int]]]) -> None:
    """docs/METRICS.md's fleet table against a fleet node's endpoint (kvstore_fleet_*), and the client's."""
    nodes = quiet_fleet[1]
    text = (ROOT / "docs" / "METRICS.md").read_text()
    section = text.split("## Fleet", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(kvstore_fleet_\w+)` \|", section, re.MULTILINE))
    with urllib.request.urlopen(f"http://127.0.0.1:{nodes[0][1]}/metrics", timeout=10) as reply:
        served = {f.name for f in text_string_to_metric_families(reply.read().decode())
                  if f.name.startswith("kvstore_fleet_")}
    import kvstore.client.fleet_metrics  # noqa: F401  (registers the router's counters)

    client_side = {m.name for m in REGISTRY.collect() if m.name.startswith("kvstore_fleet_client_")}
    assert served and client_side
    assert documented == served | client_side


def test_dashboard_fleet_panels_query_what_fleet_nodes_and_workers_serve(
        quiet_fleet: tuple[FleetSettings, list[tuple[NodeProcess, int]]]) -> None:
    """Every kvstore_fleet_* metric and label the Grafana dashboard queries is served by a fleet node's endpoint
    or the router's registry (the single-node panels: tests/gateway/metrics/test_dashboard.py)."""
    nodes = quiet_fleet[1]
    import kvstore.client.fleet_metrics as fm
    from tests.gateway.metrics.test_dashboard import _BY, _LEGEND, _NAME, _SELECTOR_LABEL, TARGET_LABELS, _queries

    fm.failover("get")  # children exist once counted: their labels are served from then on
    fm.node_error("some-node")
    with urllib.request.urlopen(f"http://127.0.0.1:{nodes[0][1]}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    served: dict[str, set[str]] = {}
    for family in [*text_string_to_metric_families(text), *REGISTRY.collect()]:
        for s in family.samples:
            served.setdefault(s.name, set()).update(s.labels)
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kvstore-dashboard.json").read_text())
    fleet_queries = [(w, e, leg) for w, e, leg in _queries(dashboard) if "kvstore_fleet_" in e]
    titles = {w for w, _, _ in fleet_queries}
    assert {"Nodes live (etcd's membership)", "Under-replicated bytes", "Re-replication rate per node",
            "Router failovers and errors"} <= titles
    for where, expr, legend in fleet_queries:
        names = set(_NAME.findall(expr))
        missing = names - served.keys()
        assert not missing, f"{where}: {sorted(missing)} not served (query {expr})"
        used = set(_SELECTOR_LABEL.findall(expr)) | set(_LEGEND.findall(legend))
        for group in _BY.findall(expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        have = set().union(*(served[n] for n in names)) | TARGET_LABELS
        assert used <= have, f"{where}: labels {sorted(used - have)} not on {sorted(names)}"


def test_a_member_that_does_not_answer_is_listed_unreachable(
        quiet_fleet: tuple[FleetSettings, list[tuple[NodeProcess, int]]]) -> None:
    """A node in etcd's membership whose port answers nothing (as a killed node until its lease ends) is one
    `unreachable` line, left out of the totals; the command still exits 0."""
    fleet = quiet_fleet[0]
    import asyncio
    import dataclasses

    from kvstore.fleet.membership import register_node

    target = f"etcd://{fleet.etcd}/{fleet.cluster}"
    ghost_settings = dataclasses.replace(fleet, run_blocks=8, lease_ttl_s=60)

    async def with_ghost() -> tuple[dict, str]:  # type: ignore[type-arg]
        ghost = await register_node(ghost_settings, node_id="ghost", address=f"127.0.0.1:{_free_port()}",
                                    capacity_bytes=1 << 30, block_tokens=BLOCK_TOKENS)
        try:
            report = await asyncio.to_thread(_stats_json, target)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert await asyncio.to_thread(main, ["stats", "--target", target, "--timeout", "5"]) == 0
            return report, out.getvalue()
        finally:
            await ghost.stop()

    report, text = asyncio.run(with_ghost())
    ghost = [n for n in report["nodes"] if n["node_id"] == "ghost"]
    assert len(ghost) == 1 and not ghost[0]["reachable"] and ghost[0]["error"]
    assert report["total"]["nodes"] == 4 and report["total"]["reachable"] == 3
    assert report["total"]["blocks_stored"] == sum(n["blocks_stored"] for n in report["nodes"] if n["reachable"])
    assert re.search(r"^ghost\s+127\.0\.0\.1:\d+\s+unreachable", text, re.MULTILINE), text
    assert "3 of 4 nodes answered" in text
