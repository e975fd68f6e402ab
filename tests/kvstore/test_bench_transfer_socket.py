"""`python -m kvstore.bench.transfer_socket`: the one-copy socket ceiling lands every byte (no timing asserted)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

from kvstore.bench.transfer_socket import _send_all


def test_both_variants_land_the_source_bytes_between_two_processes() -> None:
    # 4 MiB of 10,007-byte blocks (not a page multiple) in requests of 7: the last request short.
    out = subprocess.run([sys.executable, "-m", "kvstore.bench.transfer_socket", "--total-mib", "4", "--value-bytes",
                          "10007", "--batch", "7", "--repeat", "2", "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    report = json.loads(out)
    assert set(report) == {"unverified", "verified"}
    for name, r in report.items():  # run() raises when the landed bytes differ from the source
        assert r["blocks"] == (4 << 20) // 10007 and r["verify"] == (name == "verified")
        assert len(r["gbps_runs"]) == 2 and r["gbps_best"] == max(r["gbps_runs"]) > 0


def test_a_partial_scatter_send_resumes_where_it_stopped() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # every sendmsg goes in part
    a.settimeout(30)
    b.settimeout(30)
    views = [memoryview(os.urandom(n)) for n in (70_001, 3, 129_000, 1, 65_536)]
    want = b"".join(bytes(v) for v in views)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    _send_all(a, list(views))
    reader.join(30)
    a.close()
    b.close()
    assert bytes(got) == want
