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
    # The same-host reader reads the store's file itself: it needs the on-disk record
    # layout and the checksum loop, nothing that serves (docs/DIRECT_RESTORE.md).
    "kvstore/client/colocated.py": {"tiers.records", "tiers.blockcopy"},
    "kvstore/client/colocated_read.py": {"tiers.records", "tiers.blockcopy"},  # its MappedRead, split off
    # The ring's native half (tiers._ring) asks without the GIL: write, wake, spin (docs/TRANSFER.md).
    "kvstore/client/transfer_ring.py": {"tiers.ring"},
    # The SWA paths' checksums and arena copy, native and without the GIL
    # (tiers._blockcopy; docs/SWA_POOL.md).
    "kvstore/client/swa_put.py": {"tiers.swa_digest"},
    "kvstore/client/swa_shm.py": {"tiers.swa_digest"},
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
