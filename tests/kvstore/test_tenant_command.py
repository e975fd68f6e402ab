"""`kvstore tenant create|revoke|list` end to end: the commands on the data dir of a running
`kvstore serve`, which takes each change without a restart (docs/SECURITY.md)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import PermissionDenied, Unauthenticated


def kvstore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A `kvstore serve` child re-reading its tenants file every 50 ms; (target, data dir)."""
    data = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "KVSTORE_AUTH_RELOAD_S": "0.05", "KVSTORE_STORE_BLOCK_TOKENS": "16"})
    try:
        assert proc.stdout is not None
        match = re.search(r"listening on [\d.]+:(\d+)", proc.stdout.readline())
        assert match, "kvstore serve did not start"
        yield f"127.0.0.1:{match.group(1)}", data
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def eventually(check: object, timeout_s: float = 30.0) -> None:
    """Poll `check()` until it returns without raising (the server re-reads the file within reload_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()  # type: ignore[operator]
            return
        except (AssertionError, Unauthenticated, pytest.fail.Exception):  # pytest.raises that saw nothing: not yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def create(data: Path, *args: str) -> str:
    run = kvstore("tenant", "create", *args, "--data-dir", str(data))
    assert run.returncode == 0, run.stderr
    token = run.stdout.strip()
    assert re.fullmatch(r"kvst_[0-9a-f]{8}_[A-Za-z0-9_-]{43}", token) and "shown once" in run.stderr
    return token


def test_create_list_revoke_against_a_running_server(serve: tuple[str, Path], tmp_path: Path) -> None:
    target, data = serve
    with Client(target) as open_client:  # no tenants yet: the default tenant, no token
        open_client.lookup(list(range(16)))
    acme = create(data, "acme")
    ops = create(data, "ops", "--admin")
    assert acme not in (data / "tenants.json").read_text()  # only its hash is kept
    assert stat.S_IMODE((data / "tenants.json").stat().st_mode) == 0o600

    def refused_without_token() -> None:
        with pytest.raises(Unauthenticated):
            Client(target, timeout_s=5)

    eventually(refused_without_token)
    eventually(lambda: Client(target, token=acme, timeout_s=5).close())
    with Client(target, token=acme) as client:
        client.put(list(range(32)), [bytes(client.block_bytes)] * 2)
        assert not client.stats().store_wide  # its own counters only
        with pytest.raises(PermissionDenied):
            client.transfer_stats()
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(list(range(40))))
    plan = kvstore("plan", "--tokens", str(prompt), "--target", target, "--namespace", "", "--json",
                   env={"KVSTORE_TOKEN": acme})  # another command taking the token from the environment
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert json.loads(plan.stdout)["found_tokens"] == 32

    eventually(lambda: Client(target, token=ops, timeout_s=5).close())
    stats = kvstore("stats", "--target", target, "--json", env={"KVSTORE_TOKEN": ops})  # the token from the env
    assert stats.returncode == 0, stats.stdout + stats.stderr
    assert json.loads(stats.stdout)["store_wide"] is True
    refused = kvstore("stats", "--target", target, "--json", env={"KVSTORE_TOKEN": ""})
    assert refused.returncode == 2 and json.loads(refused.stdout)["error"]["code"] == "UNAUTHENTICATED"

    listed = json.loads(kvstore("tenant", "list", "--data-dir", str(data), "--json").stdout)
    assert [(t["tenant"], t["rights"], t["revoked_at"]) for t in listed["tokens"]] == [
        ("acme", ["read", "write"], None), ("ops", ["read", "write", "admin"], None)]
    revoked = kvstore("tenant", "revoke", "acme", "--data-dir", str(data))
    assert revoked.returncode == 0 and "revoked 1 token" in revoked.stdout

    def acme_refused() -> None:
        with pytest.raises(Unauthenticated, match="revoked"):
            Client(target, token=acme, timeout_s=5)

    eventually(acme_refused)
    table = kvstore("tenant", "list", "--data-dir", str(data)).stdout
    assert re.search(r"^acme +[0-9a-f]{8} +read,write +\S+ +\d{4}-", table, re.M)  # revoked, still listed


def test_revoking_what_is_not_there_and_bad_names_fail_in_one_line(tmp_path: Path) -> None:
    for args, says in ((("revoke", "ghost"), "no active tenant 'ghost'"),
                       (("create", "no spaces"), "is not 1-128 of"),
                       (("create", "acme", "--rights", "read,fly"), "rights")):
        run = kvstore("tenant", *args, "--data-dir", str(tmp_path))
        assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "auth is off" in kvstore("tenant", "list", "--data-dir", str(tmp_path)).stdout


def test_commands_take_the_token_from_the_flag_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from kvstore.commands import add_connection_arguments, client_options

    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    monkeypatch.setenv("KVSTORE_TOKEN", "from-env")
    assert client_options(parser.parse_args([])) == {"token": "from-env", "tls": None}
    assert client_options(parser.parse_args(["--token", "from-flag"]))["token"] == "from-flag"
    tls = client_options(parser.parse_args(["--tls-ca", "ca.pem", "--tls-server-name", "kv"]))["tls"]
    assert (tls.ca_file, tls.server_name, tls.cert_file) == ("ca.pem", "kv", "")
    monkeypatch.delenv("KVSTORE_TOKEN")
    assert client_options(parser.parse_args([]))["token"] is None


def test_serve_beyond_loopback_needs_auth_and_tls_or_insecure(tmp_path: Path) -> None:
    refused = kvstore("serve", "--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path / "data"))
    assert refused.returncode == 2 and "refusing to serve on 0.0.0.0 without auth" in refused.stderr
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]
        assert lines[0].startswith("kvstore listening on 0.0.0.0:")
        assert any("auth: OFF (--insecure)" in line for line in lines)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
