"""The Grafana dashboard and docs/METRICS.md against what a real server's endpoint serves."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvstore-dashboard.json"
METRICS_DOC = ROOT / "docs" / "METRICS.md"
_NAME = re.compile(r"\bkvstore_[a-z0-9_]+\b")
_SELECTOR_LABEL = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
#: Labels Prometheus adds to every series it scrapes (the endpoint never serves them).
TARGET_LABELS = {"instance", "job"}


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expression, legend) of every panel target and template variable."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"], target.get("legendFormat", "")))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"${variable['name']}", variable["definition"], ""))
    return found


def _exercised(start_metered: Any) -> dict[str, set[str]]:
    """Sample name -> label names, scraped over HTTP from a server that served a bit of everything."""
    m = start_metered()
    with Client(m.target) as client:
        tokens = list(range(client.block_tokens * 2))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
        client.lookup(tokens)
        client.get(tokens)
        client.swa.put(tokens, os.urandom(client.swa.snapshot_bytes(len(tokens))))
        client.swa.get(tokens)
        client.report_resume(prompt_tokens=len(tokens), found_tokens=len(tokens), usable_tokens=len(tokens),
                             action="fetch+snapshot")
        with pytest.raises(grpc.RpcError):  # refused: a rejection series
            pb_grpc.KVStoreStub(client.connection.channel).Lookup(pb.LookupRequest(geometry="no-such-geometry"))
        with client.transfer():
            text = m.scrape_text()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels


def test_every_metric_and_label_the_dashboard_queries_is_served(start_metered: Any) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    served = _exercised(start_metered)
    queries = _queries(dashboard)
    assert len(queries) > 20
    for where, expr, legend in queries:
        names = set(_NAME.findall(expr))
        assert names, f"{where}: {expr} names no kvstore metric"
        if all(n.startswith("kvstore_fleet_") for n in names):
            continue  # a fleet node's or a worker's: tests/kvstore/fleet/test_fleet_operators.py checks them
        if all(n.startswith("kvstore_gateway_") for n in names):
            continue  # a gateway's: tests/kvstore/fleet/test_gateway.py checks them
        missing = names - served.keys()
        assert not missing, f"{where}: {sorted(missing)} not served (query {expr})"
        used = set(_SELECTOR_LABEL.findall(expr)) | set(_LEGEND.findall(legend))
        for group in _BY.findall(expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        have = set().union(*(served[n] for n in names)) | TARGET_LABELS
        assert used <= have, f"{where}: labels {sorted(used - have)} not on {sorted(names)}"


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance", "tenant"}
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]


def test_docs_metrics_lists_every_served_metric_and_no_other(start_metered: Any) -> None:
    served = _exercised(start_metered)
    # The fleet's table is served by fleet nodes and workers only: tests/kvstore/fleet/test_fleet_operators.py.
    head, _, rest = METRICS_DOC.read_text().partition("\n## Fleet")
    single = head + (rest.split("\n## ", 1)[1] if "\n## " in rest else "")
    documented = set(re.findall(r"^\| `(kvstore_\w+)` \|", single, re.MULTILINE))
    families = set()
    for name in served:
        if name.endswith("_created"):
            continue  # prometheus-client's creation timestamps, not ours
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name.startswith("kvstore_rpc_duration") else name
        families.add(family)
    assert families - documented == set(), "served but not in docs/METRICS.md"
    assert documented - families == set(), "in docs/METRICS.md but not served"
