"""Damaged or shared data dirs under a real `kvstore serve` (issue 9 items 7 and 15, issue 29 item 3,
docs/OPERATIONS.md).

Each test fills a store through a real server, stops it, damages `data.mdb` as a
disk or an operator might, and starts `kvstore serve` again: it must refuse with
a message naming the file and what to do, never start on it (a truncated file
killed the server with SIGBUS on its first Lookup, an emptied one was served
silently empty, a damaged leaf aborted it). Then `kvstore check --repair` (or the
operator's other way out) makes it serve again, with what it serves intact.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tracemalloc
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.audit import MAX_LINE_BYTES as AUDIT_MAX_LINE_BYTES
from gateway.audit import AuditLog
from gateway.hit_stats import MAX_FILE_BYTES as HITS_MAX_BYTES
from gateway.hit_stats import HitStats
from gateway.policies import MAX_FILE_BYTES as POLICIES_MAX_BYTES
from gateway.policies import Policies, Policy
from kvstore import api_tokens
from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.clock import ManualClock
from kvstore.errors import ConfigError, Unauthenticated
from tests.waiting import wait_until
from tiers.datadir import MAX_IDENTITY_BYTES, DataDirBusy, DataDirLock, read_identity, write_identity
from tiers.lmdb_pages import PageReader

CHAINS, BLOCKS = 6, 8


def fill(serve: Callable[..., Any], config: Path, data_dir: Path, kit: SimpleNamespace) -> list[Any]:
    """Chains stored through a real server, stopped cleanly."""
    server = serve(data_dir, config=config)
    with server.client() as client:
        chains = kit.make_chains(client, CHAINS, BLOCKS)
        for chain in chains:
            client.put(chain.tokens, chain.payload())
            chain.acked = chain.blocks
    assert server.stop() == 0
    return list(chains)


def refused(data_dir: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """Start `kvstore serve` on `data_dir` and expect it to exit with an error, not listen."""
    try:
        run = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--host", "127.0.0.1",
                              "--data-dir", str(data_dir), "--config", str(config)],
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"kvstore serve started on a damaged store: {exc.stdout!r}") from None
    assert run.returncode != 0, run.stdout
    assert "listening on" not in run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    return run


def repair(data_dir: Path) -> str:
    """`kvstore check --data-dir D --repair`; check_store directly while the CLI has no `check`."""
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "check", "--data-dir", str(data_dir), "--repair"],
                         capture_output=True, text=True, timeout=300)
    if "invalid choice: 'check'" in run.stderr:
        from tiers.integrity import check_store

        report = check_store(data_dir, repair=True)
        assert report.repaired, report.lines()
        return "\n".join(report.lines())
    assert "Traceback" not in run.stderr, run.stderr
    return run.stdout + run.stderr


def serves_what_it_keeps(serve: Callable[..., Any], config: Path, data_dir: Path, chains: list[Any],
                         kit: SimpleNamespace) -> int:
    """Start on the repaired store: every chain's readable blocks are a prefix, bit-identical."""
    for chain in chains:
        chain.acked = 0  # blocks on lost pages are gone: what is left must still be whole
    server = serve(data_dir, config=config)
    with server.client() as client:
        readable = kit.census(client, chains)
        kit.assert_usage_matches(client, readable)
        more = kit.make_chains(client, 1, 2, first_seed=500)[0]
        client.put(more.tokens, more.payload())  # and it takes writes again
        assert client.lookup(more.tokens).found_blocks == 2
    assert server.stop() == 0
    return readable


@pytest.fixture
def store(tmp_path: Path, serve: Callable[..., Any], config: Callable[..., Path],
          kit: SimpleNamespace) -> tuple[Path, Path, list[Any]]:
    cfg = config(store={"capacity_bytes": 64 << 20})
    data_dir = tmp_path / "data"
    return data_dir, cfg, fill(serve, cfg, data_dir, kit)


@pytest.mark.parametrize("keep", ["half", "8KiB"])
def test_a_truncated_data_file_is_refused_then_repaired(store: tuple[Path, Path, list[Any]],
                                                       serve: Callable[..., Any], kit: SimpleNamespace,
                                                       keep: str) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    os.truncate(data, data.stat().st_size // 2 if keep == "half" else 8192)
    run = refused(data_dir, cfg)
    assert f"{data} is truncated" in run.stderr and "kvstore check" in run.stderr and "--repair" in run.stderr
    assert "truncated: 1" in repair(data_dir)
    readable = serves_what_it_keeps(serve, cfg, data_dir, chains, kit)
    assert readable < CHAINS * BLOCKS


def test_an_emptied_data_file_is_refused_not_served_empty(store: tuple[Path, Path, list[Any]],
                                                          serve: Callable[..., Any], kit: SimpleNamespace) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    os.truncate(data, 0)
    run = refused(data_dir, cfg)
    assert f"{data} is empty" in run.stderr and "move" in run.stderr
    shutil.move(data_dir, data_dir.with_name("data.lost"))  # what the message says to do
    assert serves_what_it_keeps(serve, cfg, data_dir, chains, kit) == 0


def test_a_damaged_leaf_page_is_refused_then_repaired(store: tuple[Path, Path, list[Any]],
                                                      serve: Callable[..., Any], kit: SimpleNamespace) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    with PageReader(path=data) as reader:
        records = reader.named_trees()[b"records"]
        for _ in reader.entries(records, "records", values=False):
            pass
        leaves = list(reader.leaves)
    assert len(leaves) > 2, "the store should span several leaves"
    with data.open("r+b") as f:  # a page of zeros where a leaf of block records was
        f.seek(leaves[len(leaves) // 2] * 4096)
        f.write(bytes(4096))
    run = refused(data_dir, cfg)
    assert f"{data} has 1 damaged page(s)" in run.stderr and "--repair" in run.stderr
    report = repair(data_dir)
    assert "damaged-page" in report
    readable = serves_what_it_keeps(serve, cfg, data_dir, chains, kit)
    assert 0 < readable < CHAINS * BLOCKS


def test_a_second_server_on_one_data_dir_is_refused_naming_the_first(tmp_path: Path, serve: Callable[..., Any],
                                                                    config: Callable[..., Path]) -> None:
    """Two servers on one store would each keep their own usage totals and write them back (issue 9 item 7)."""
    cfg = config(store={"capacity_bytes": 64 << 20})
    data_dir = tmp_path / "data"
    first = serve(data_dir, config=cfg)
    run = refused(data_dir, cfg)
    assert f"{data_dir} is in use by another kvstore process (pid {first.proc.pid}" in run.stderr
    assert first.alive
    assert first.stop() == 0
    serve(data_dir, config=cfg).stop()  # the lock went with the first server


# -- The data dir's side files (issue 29 item 3; docs/OPERATIONS.md, "Damaged side files") --
#
# Every file the server keeps in its data dir beside LMDB's, with every kind of damage, read by
# the code the start runs on it; then one representative per file under a real `kvstore serve`.
# Before: binary or `1e400` hits counters, a binary tenants file and a policies file holding
# `[1,2,3]` or `null` each killed the start with a traceback.

REFUSED, SET_ASIDE, SKIPPED, REWRITTEN = "refused", "set aside", "skipped", "rewritten"


@dataclass(frozen=True, kw_only=True)
class SideFile:
    """One side file: where it is, how the real code writes a good one, what a damaged one gives."""

    name: str
    #: Write a good file into the data dir, as the server or the CLI does.
    make: Callable[[Path], None]
    #: What a start does with a damaged one (the documented behaviour).
    outcome: str
    #: The bound on what is read (0: none, the file is streamed or never read).
    max_bytes: int
    #: The file's own wrong-type and out-of-range contents, by name.
    extra: dict[str, bytes]


def _make_tenants(data_dir: Path) -> None:
    api_tokens.create(data_dir / "tenants.json", "acme", frozenset({"read"}))


def _policies(data_dir: Path) -> Policies:
    folder = data_dir / "admin"
    return Policies(folder, defaults=Policy(retention_hours=72.0, swa_ttl_s=300.0), max_swa_ttl_s=300.0,
                    audit=AuditLog(folder))


def _make_policies(data_dir: Path) -> None:
    _policies(data_dir).set("acme", {"retention_hours": 100.0}, actor="ops")


def _hits(data_dir: Path) -> HitStats:
    return HitStats(data_dir / "stats", ManualClock(), block_tokens=16)


def _make_hits(data_dir: Path) -> None:
    stats = _hits(data_dir)
    stats.record("acme", "lookup", 4, 2)
    stats.close()


def _make_audit(data_dir: Path) -> None:
    log = AuditLog(data_dir / "admin")
    log.append(actor="ops", action="set_policy", tenant="acme", old={}, new={"retention_hours": 100.0})
    log.close()


def _make_lock(data_dir: Path) -> None:
    DataDirLock.acquire(data_dir).release()


GOOD_TOKEN = ('{"version": 1, "tokens": [{"token_id": "0badc0de", "tenant": "acme", "rights": ["root"], '
              '"sha256": "' + "0" * 64 + '", "created_at": "2026-12-01T00:00:00+00:00", "revoked_at": null}]}')
SIDE_FILES = [
    SideFile(name="tenants.json", make=_make_tenants, outcome=REFUSED, max_bytes=api_tokens.MAX_FILE_BYTES,
             extra={"an unknown right": GOOD_TOKEN.encode(),
                    "a hash that is not hex": GOOD_TOKEN.replace("0" * 64, "z" * 64).replace("root", "read").encode(),
                    "tokens not a list": b'{"version": 1, "tokens": {"a": 1}}'}),
    SideFile(name="admin/policies.json", make=_make_policies, outcome=REFUSED, max_bytes=POLICIES_MAX_BYTES,
             extra={"retention below the floor": b'{"version": 1, "tenants": {"acme": {"retention_hours": 1}}}',
                    "a field of the wrong type": b'{"version": 1, "tenants": {"acme": {"swa_ttl_s": "x"}}}',
                    "tenants not an object": b'{"version": 1, "tenants": [1]}',
                    "a floor past the range": b'{"version": 1, "retention_floor_hours": 1e300}'}),
    SideFile(name="stats/hits.json", make=_make_hits, outcome=SET_ASIDE, max_bytes=HITS_MAX_BYTES,
             extra={"a counter of 1e400": b'{"fields": ["lookups"], "all": {"a": [1e400]}, "buckets": {}, '
                                          b'"counted_since_s": 0}',
                    "a negative counter": b'{"fields": ["lookups"], "all": {"a": [-1]}, "buckets": {}, '
                                          b'"counted_since_s": 0}',
                    "a counter past 2^63": b'{"fields": ["lookups"], "all": {"a": [99999999999999999999]}, '
                                           b'"buckets": {}, "counted_since_s": 0}',
                    "buckets of the wrong type": b'{"fields": [], "all": {}, "buckets": {"60": [1]}, '
                                                 b'"counted_since_s": 0}'}),
    SideFile(name="kvstore-identity.json", make=write_identity, outcome=REFUSED, max_bytes=MAX_IDENTITY_BYTES,
             extra={"a store_id that is a number": b'{"store_id": 5}',
                    "a time past the range": b'{"store_id": "a", "created": 1e400}'}),
    SideFile(name="admin/audit.jsonl", make=_make_audit, outcome=SKIPPED, max_bytes=0,
             extra={"a time past the range": b'{"time_s": 1e300, "actor": "a", "action": "b", "tenant": "c", '
                                             b'"old": 1, "new": 2}\n',
                    "a line past the bound": b"{" + b" " * AUDIT_MAX_LINE_BYTES + b"}\n"}),
    SideFile(name="kvstore.lock", make=_make_lock, outcome=REWRITTEN, max_bytes=4096, extra={}),
]
#: Contents every side file is tried with, from its good bytes.
CONTENTS: dict[str, Callable[[bytes], bytes]] = {
    "binary": lambda good: bytes(range(256)) * 16,
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "a JSON array": lambda good: b"[1, 2, 3]",
    "JSON null": lambda good: b"null",
    "a number past a double": lambda good: b'{"version": 1, "x": 1e400}',
    "nested too deeply": lambda good: b"[" * 100_000,
}
#: Most memory a load may take (tracemalloc's peak), whatever the file holds: far below the files' sizes.
MAX_LOAD_MEMORY_BYTES = 16 << 20


def _cases() -> list[Any]:
    cases = []
    for side in SIDE_FILES:
        names = [*CONTENTS, *side.extra, "larger than the bound" if side.max_bytes else "200 MB", "a folder"]
        cases += [pytest.param(side, name, id=f"{side.name}-{name}") for name in names]
    return cases


def _damage(path: Path, side: SideFile, case: str, good: bytes) -> None:
    path.unlink()
    if case == "a folder":
        path.mkdir()
    elif case in ("larger than the bound", "200 MB"):  # sparse: no disk, and it must not be read whole
        path.touch()
        os.truncate(path, side.max_bytes + 1 if side.max_bytes else 200 << 20)
    else:
        path.write_bytes(side.extra[case] if case in side.extra else CONTENTS[case](good))


def _start_on(data_dir: Path, side: SideFile) -> None:
    """What a start runs on `side` (the rest of the store left out)."""
    if side.name == "tenants.json":
        api_tokens.read_records(data_dir / side.name)
    elif side.name == "admin/policies.json":
        _policies(data_dir)
    elif side.name == "stats/hits.json":
        _hits(data_dir).close()
    elif side.name == "kvstore-identity.json":
        read_identity(data_dir)
    elif side.name == "admin/audit.jsonl":
        log = AuditLog(data_dir / "admin")
        log.append(actor="ops", action="purge", tenant="acme", old=None, new=None)
        assert [e.action for e in log.entries()] == ["purge"]  # what was there is skipped, not served
        log.close()
    else:
        DataDirLock.acquire(data_dir).release()


@pytest.mark.parametrize(("side", "case"), _cases())
def test_a_damaged_side_file_gives_its_documented_outcome(tmp_path: Path, side: SideFile, case: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    side.make(data_dir)
    path = data_dir / side.name
    good = path.read_bytes()
    _damage(path, side, case, good)
    outcome = REFUSED if case == "a folder" and side.outcome in (SKIPPED, REWRITTEN) else side.outcome
    tracemalloc.start()
    try:
        if outcome == REFUSED:
            with pytest.raises(ConfigError) as refusal:
                _start_on(data_dir, side)
        else:
            _start_on(data_dir, side)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_LOAD_MEMORY_BYTES, f"reading it took {peak} bytes"
    if outcome == REFUSED:
        message = refusal.value.message
        assert str(path) in message and "\n" not in message and refusal.value.hint, message
        assert len(message) < 400, message  # one line that says why, not the file's content
    elif outcome == SET_ASIDE:
        damaged = path.with_name(path.name + ".damaged")
        assert damaged.exists() and "moved to" in caplog.text
        assert _hits(data_dir).tenants() == []  # counting started from zero and was written back whole
    elif outcome == REWRITTEN:
        assert json.loads(path.read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"[" * 4096, b"null"])
def test_a_busy_data_dir_names_its_holder_whatever_the_lock_file_holds(tmp_path: Path, content: bytes) -> None:
    held = DataDirLock.acquire(tmp_path)
    try:
        (tmp_path / "kvstore.lock").write_bytes(content)
        with pytest.raises(DataDirBusy, match="holder unknown"):
            DataDirLock.acquire(tmp_path)
    finally:
        held.release()


#: One representative per side file under a real server: (file, content, exit status; 0: it serves).
STARTS = [
    ("tenants.json", bytes(range(256)), 2, "is damaged: it is not UTF-8 text"),
    ("admin/policies.json", b"[1, 2, 3]", 2, "are damaged: it holds a JSON array, not an object"),
    ("admin/policies.json", b"null", 2, "are damaged: it holds a JSON null, not an object"),
    ("kvstore-identity.json", bytes(range(256)), 2, "is damaged (it is not UTF-8 text"),
    ("stats/hits.json", bytes(range(256)), 0, "moved to"),
    ("stats/hits.json", b'{"fields": ["lookups"], "all": {"a": [1e400]}, "buckets": {}, "counted_since_s": 0}', 0,
     "moved to"),
    ("admin/audit.jsonl", bytes(range(256)) + b"\n", 0, ""),
    ("kvstore.lock", bytes(range(256)), 0, ""),
]


@pytest.mark.parametrize(("name", "content", "status", "says"), STARTS,
                         ids=[f"{s[0]}-{i}" for i, s in enumerate(STARTS)])
def test_kvstore_serve_on_a_damaged_side_file(tmp_path: Path, serve: Callable[..., Any],
                                              config: Callable[..., Path], name: str, content: bytes, status: int,
                                              says: str) -> None:
    cfg = config(store={"capacity_bytes": 64 << 20})
    data_dir = tmp_path / "data"
    path = data_dir / name
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    if status:
        run = refused(data_dir, cfg)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == status and len(lines) == 1, run.stderr
        assert lines[0].startswith("kvstore: ConfigError: ") and str(path) in lines[0] and says in lines[0]
        return
    server = serve(data_dir, config=cfg)
    with server.client() as client:
        client.lookup(list(range(64)))
        if name == "admin/audit.jsonl":
            with AdminClient(server.target) as admin:
                admin.set_policy("acme", retention_hours=100)
                assert [e.tenant for e in admin.policy_log()] == ["acme"]
    assert server.stop() == 0
    assert says in server.log()
    if name == "stats/hits.json":
        assert path.with_name("hits.json.damaged").read_bytes() == content
        assert _hits(data_dir).windows(None, ["all"])[0].counts["lookups"] == 1  # counting restarted
    if name == "kvstore.lock":
        assert json.loads(path.read_text())["pid"] == server.proc.pid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("kvstore_tenants_")}


def _until(what: str, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    wait_until(condition, what, timeout_s)


def test_a_token_revoked_with_the_cli_after_a_binary_tenants_file_is_refused(
        tmp_path: Path, serve: Callable[..., Any], config: Callable[..., Path]) -> None:
    """Issue 29 item 2 as found: a binary tenants file under a running `kvstore serve`, the file restored,
    then `kvstore tenant revoke`: the revoked token must be refused within a reload."""
    data_dir = tmp_path / "data"
    path = data_dir / "tenants.json"
    acme = api_tokens.create(path, "acme", frozenset({"read", "write"}))[1]
    keeper = api_tokens.create(path, "keeper", frozenset({"read", "write"}))[1]
    backup = path.read_bytes()
    port = _free_port()
    server = serve(data_dir, config=config(store={"capacity_bytes": 64 << 20}, auth={"reload_s": 0.05},
                                           metrics={"port": port}))

    def accepted(token: str) -> bool:
        try:
            Client(server.target, token=token, timeout_s=10).close()
        except Unauthenticated:
            return False
        return True

    tmp = path.with_name("tenants.binary")
    tmp.write_bytes(bytes(range(256)) * 4)
    os.replace(tmp, path)
    _until("the damage seen", lambda: _scrape(port)["kvstore_tenants_file_ok"] == 0)
    assert accepted(acme)  # the last good table
    tmp.write_bytes(backup)
    os.replace(tmp, path)  # restored from the backup, then revoked as docs/SECURITY.md says
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "tenant", "revoke", "acme", "--data-dir", str(data_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    _until("the revoked token refused", lambda: not accepted(acme))
    assert accepted(keeper)
    metrics = _scrape(port)
    assert metrics["kvstore_tenants_file_ok"] == 1 and metrics["kvstore_tenants_load_failures_total"] == 1
    assert server.stop() == 0
    assert server.log().count("kept the previous tenants table") == 1


@pytest.mark.parametrize("leftover", ["hits.json.tmp", "policies.json.tmp", "kvstore-identity.tmp", "tenants"])
def test_a_leftover_temporary_file_is_overwritten_not_read(tmp_path: Path, leftover: str) -> None:
    """A crash between a temporary file's write and its rename leaves it behind: the next write truncates it."""
    data_dir = tmp_path / "data"
    (data_dir / "stats").mkdir(parents=True)
    (data_dir / "admin").mkdir()
    where = {"hits.json.tmp": "stats", "policies.json.tmp": "admin", "kvstore-identity.tmp": "",
             "tenants": ""}[leftover]
    name = f".tenants.json.{os.getpid()}.tmp" if leftover == "tenants" else leftover
    (data_dir / where / name).write_bytes(bytes(range(256)) * 64)
    if leftover == "hits.json.tmp":
        _make_hits(data_dir)
        assert _hits(data_dir).windows(None, ["all"])[0].counts["lookups"] == 1
    elif leftover == "policies.json.tmp":
        _make_policies(data_dir)
        assert _policies(data_dir).policy("acme").retention_hours == 100.0
    elif leftover == "kvstore-identity.tmp":
        write_identity(data_dir)
        assert read_identity(data_dir) is not None
    else:
        _make_tenants(data_dir)
        assert [r.tenant for r in api_tokens.read_records(data_dir / "tenants.json") or []] == ["acme"]
    assert not (data_dir / where / name).exists()  # renamed into place
