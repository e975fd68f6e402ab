"""`kvstore serve --metrics-port` as an operator runs it: a real process, scraped over HTTP, its failed
requests on stderr as JSON lines, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_serves_metrics_logs_failures_as_json_lines_and_stops_cleanly(tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                             str(tmp_path / "data"), "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for _ in range(10):  # the start-up lines: where it listens, the store, the pool, auth, metrics, ...
            lines.append(proc.stdout.readline())
            if "kvstore metrics:" in lines[-1]:
                break
        listening = re.search(r"listening on [\d.]+:(\d+)", lines[0])
        assert listening, lines
        url = f"http://127.0.0.1:{port}/metrics"
        assert url in lines[-1], lines
        with Client(f"127.0.0.1:{listening.group(1)}") as client:
            tokens = list(range(client.block_tokens * 2))
            client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
        with grpc.insecure_channel(f"127.0.0.1:{listening.group(1)}") as channel, pytest.raises(grpc.RpcError):
            pb_grpc.KVStoreStub(channel).Lookup(pb.LookupRequest(geometry="no-such-geometry"))
        with urllib.request.urlopen(url, timeout=30) as reply:
            text = reply.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("kvstore_store_blocks", ())] == 2
        assert samples[("kvstore_rpc_requests_total",
                        (("code", "OK"), ("method", "kvstore.v1.KVStore/Put"), ("tenant", "default")))] == 1
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0
        # The failed call: one bare JSON object on its own stderr line.
        [failed] = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
        assert (failed["event"], failed["status"], failed["method"]) == (
            "rpc_failed", "INVALID_ARGUMENT", "kvstore.v1.KVStore/Lookup")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
