"""The wire contract: generated code is fresh, and layers import in one direction."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (ROOT / "kvstore" / "v1").iterdir() if p.is_file()}
    assert fresh.keys() == committed.keys(), "run: python scripts/gen_proto.py"
    for name, data in fresh.items():
        assert committed[name] == data, f"kvstore/v1/{name} is stale: run python scripts/gen_proto.py"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


#: Core modules allowed one outer module each, and why.
ALLOWED_OUTER_IMPORTS = {
    # The trace simulation runs the NVMe tier's own Put, eviction and retention rules on an in-memory
    # index, and the planner's decision, so that a rule changed there changes it too (docs/CAPACITY.md).
    "kvstore/trace/sim_index.py": {"tiers.usage"},
    "kvstore/trace/simulate.py": {"tiers.block_txn", "tiers.damage", "tiers.eviction", "tiers.puts",
                                  "tiers.retention", "replay.cost", "replay.plan", "replay.planner",
                                  "gateway.policies"},
    # ... and each tenant's policy through the gateway's own policy table and SWA quota ledger.
    "kvstore/trace/sim_policies.py": {"gateway.policies", "gateway.quotas"},
    "kvstore/trace/replayer.py": {"replay.planner"},  # a replay plans each request as a worker's planner does
}


def _full_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" if node.module == "tiers" else node.module for a in node.names)
    return names


def test_core_does_not_import_outer_layers() -> None:
    # cli.py and bench/ are the composition root: they may import anything, lazily.
    core = [p for p in (ROOT / "kvstore").rglob("*.py")
            if "bench" not in p.parts and p.name != "cli.py" and "v1" not in p.parts]
    offenders = {}
    for p in core:
        rel = str(p.relative_to(ROOT))
        outer = {n for n in _full_imports(p) if n.split(".")[0] in {"tiers", "gateway", "replay", "integrations"}}
        offenders[rel] = sorted(outer - ALLOWED_OUTER_IMPORTS.get(rel, set()))
    assert {k: v for k, v in offenders.items() if v} == {}


def test_storage_server_path_does_not_import_torch() -> None:
    for folder in ("tiers", "gateway"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "torch" not in _imports(path), f"{path} imports torch"


def test_server_process_never_loads_torch() -> None:
    import subprocess
    import sys

    code = "import sys, gateway.server; print(sorted(m for m in ('torch', 'triton', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"  # torch and triton stay on the worker side; redis loads only for its backends


def test_nothing_but_the_engines_imports_the_adapters() -> None:
    # integrations/ sits on top (it imports kvstore and replay); the engines load it by module path.
    for folder in ("kvstore", "tiers", "gateway", "replay"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "integrations" not in _imports(path), f"{path} imports integrations"


_PACKAGES = ("kvstore", "tiers", "gateway", "replay", "integrations")


def _module_graph() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports, anywhere in it (a lazy import
    or one under TYPE_CHECKING is still a dependency of the design)."""
    modules: dict[str, Path] = {}
    for pkg in _PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "v1" not in path.relative_to(ROOT).parts:
                name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in modules else node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    # The transfer paths see their session through transfer_path.SessionView, and both ring
    # servers take RingContext from its own module, so that the layout reads one way.
    assert _circles(_module_graph()) == []


#: Gateway modules that may name the LMDB tier (and its `env`), and why. Every other one sees
#: its store through `tiers.store` (BlockStore and its capabilities; docs/ARCHITECTURE.md).
LMDB_TIER_IMPORTERS = {
    # The composition: it opens the node's tier and hands it to the services as their store.
    "gateway/server.py",
    # A node's own re-replication and Fleet service read the run index in its LMDB
    # (tiers.run_index); next: behind methods of the tier (docs/FLEET.md).
    "gateway/fleet_repair.py",
    "gateway/fleet_servicer.py",
}


def test_the_gateway_sees_its_store_through_the_protocol() -> None:
    offenders = {}
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in LMDB_TIER_IMPORTERS:
            continue
        # (The mapped paths may hold `lmdb.Transaction`s: the MappedReads capability lends them.)
        raw = [n for n in ("tiers.lmdb_tier",) if n in _full_imports(path)]
        if "tier.env" in path.read_text():  # a raw LMDB transaction begun by the gateway itself
            raw.append("tier.env")
        if raw:
            offenders[rel] = raw
    assert offenders == {}
