"""TLS to etcd (docs/FLEET.md F57) against a real etcd serving only TLS and asking each client for a certificate
(--cert-file, --key-file, --trusted-ca-file, --client-cert-auth): a node and a gateway from [fleet] settings, a
client from an etcds:// address, the CLI from flags and from the etcds:// target; plaintext and certificate-less
clients refused."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from urllib.parse import urlencode

import pytest

import kvstore
from kvstore.cli import main
from kvstore.client.fleet import FleetClient
from kvstore.errors import Unavailable
from kvstore.fleet.endpoints import EtcdTls
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

BLOCK_TOKENS = 16


def _joined(address: str) -> bool:
    """Whether a fleet client of `address` starts (a node has recorded the layout and registered)."""
    try:
        with kvstore.Client(address, timeout_s=5) as client:
            return bool(client.view.nodes)  # type: ignore[attr-defined]
    except Unavailable:
        return False


def test_f57_nodes_gateways_clients_and_commands_speak_tls_to_etcd(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.gateway.conftest import make

    ca = make(tmp_path / "certs", "ca")
    # etcd's certificate serves TLS; it carries client auth too, since the readiness probe shows it.
    served = make(tmp_path / "certs", "etcd", ca, server=True, client=True)
    mine = make(tmp_path / "certs", "client", ca)
    etcd = EtcdProcess(tmp_path / "etcd", tls=EtcdTls(ca_file=str(ca.cert), cert_file=str(served.cert),
                                                      key_file=str(served.key))).start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    files = {"etcd_ca_file": str(ca.cert), "etcd_cert_file": str(mine.cert), "etcd_key_file": str(mine.key)}
    fleet = {"etcd": f"https://{etcd.endpoint}", "cluster": cluster, "run_blocks": 4, "lease_ttl_s": 10, **files}
    children: list[Child] = []
    try:
        cfg = write_config(tmp_path / "node.toml", {"store": {"data_dir": str(tmp_path / "store"),
                                                              "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
                                                    "fleet": fleet})
        children.append(Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        query = urlencode({name.removeprefix("etcd_"): path for name, path in files.items()})
        address = f"etcds://{etcd.endpoint}/{cluster}?{query}"
        wait_until(lambda: _joined(address), "the node registered in etcd over TLS")
        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(address) as client:
            assert isinstance(client, FleetClient)
            client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(12)])
            assert client.lookup(tokens).found_blocks == 12
        gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                               "block_tokens": BLOCK_TOKENS}, "fleet": fleet})
        children.append(Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs"))
        with kvstore.Client(children[-1].target) as through_gateway:  # its view and tables follow etcd over TLS
            assert through_gateway.lookup(tokens).found_blocks == 12

        assert main(["fleet", "status", "--etcd", f"https://{etcd.endpoint}", "--cluster", cluster, "--json",
                     "--etcd-ca-file", str(ca.cert), "--etcd-cert-file", str(mine.cert),
                     "--etcd-key-file", str(mine.key)]) == 0
        assert len(json.loads(capsys.readouterr().out)["nodes"]) == 1
        assert main(["tenant", "create", "acme", "--target", address]) == 0
        assert main(["tenant", "list", "--target", address]) == 0
        assert "acme" in capsys.readouterr().out

        # Refused: plaintext to a TLS-only etcd, and TLS without the certificate etcd asks for.
        for refused in (f"etcd://{etcd.endpoint}/{cluster}", f"etcds://{etcd.endpoint}/{cluster}?ca_file={ca.cert}"):
            with pytest.raises(Unavailable, match="etcd does not answer"):
                kvstore.Client(refused, timeout_s=3)
        assert main(["fleet", "status", "--etcd", f"https://{etcd.endpoint}", "--cluster", cluster,
                     "--etcd-ca-file", str(ca.cert)]) == 2
    finally:
        for child in children:
            child.kill_if_alive()
        etcd.stop()
