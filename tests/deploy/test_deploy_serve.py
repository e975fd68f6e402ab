"""deploy/kvstore.toml starts a real server that demands TLS and tokens (issue 12 item 6).

`kvstore serve --config deploy/kvstore.toml` runs as a child process, with only what
differs on a test machine overridden the way an operator would (KVSTORE_<SECTION>_<FIELD>):
the folders and certificate paths into tmp_path, the ports free, the capacity small.
The certificates come from deploy/docker/make-test-certs.sh; the first token from
`kvstore tenant create --config` (finding the tenants file as the server does).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client, TlsOptions
from kvstore.errors import KVStoreError, Unauthenticated

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The test machine's differences from the deploy file, as an operator would override them."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = tmp_path / "tls"
    subprocess.run(["bash", str(DEPLOY / "docker" / "make-test-certs.sh"), str(certs)], check=True,
                   capture_output=True, timeout=60)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return base | {
        "KVSTORE_CONFIG": str(DEPLOY / "kvstore.toml"),
        "KVSTORE_STORE_DATA_DIR": str(tmp_path / "data"),
        "KVSTORE_STORE_CAPACITY_BYTES": str(1 << 30),
        "KVSTORE_SERVER_PORT": "0",
        "KVSTORE_METRICS_PORT": "0",
        "KVSTORE_TLS_CERT_FILE": str(certs / "tls.crt"),
        "KVSTORE_TLS_KEY_FILE": str(certs / "tls.key"),
    }


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """`kvstore serve --config deploy/kvstore.toml`: the loopback address of its port."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", env["KVSTORE_CONFIG"]],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"listening on [\d.]+:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"127.0.0.1:{match.group(1)}"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()


def kvstore(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, text=True,
                          timeout=60, env=env)


def test_the_deploy_config_serves_tls_and_tokens_only(served: str, env: dict[str, str], tmp_path: Path) -> None:
    ca = str(tmp_path / "tls" / "ca.crt")
    probe = kvstore(env, "health", "--target", served, "--tls-ca", ca, "--tls-server-name", "kvstore")
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    tls = TlsOptions(ca_file=ca, server_name="kvstore")
    with pytest.raises(Unauthenticated):  # auth.required: no token, no call, before any tenant exists
        Client(served, tls=tls, timeout_s=10).close()
    with pytest.raises(KVStoreError):  # plaintext to the TLS port
        Client(served, timeout_s=3).close()
    created = kvstore(env, "tenant", "create", "acme", "--config", env["KVSTORE_CONFIG"])
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    deadline = time.monotonic() + 30  # the server reads the tenants file again within auth.reload_s
    while True:
        try:
            client = Client(served, tls=tls, token=token, timeout_s=10)
            break
        except Unauthenticated:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    with client:
        tokens = list(range(2 * client.block_tokens))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
        assert client.lookup(tokens).found_blocks == 2
