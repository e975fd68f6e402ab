"""`python -m kvstore.bench.transfer_peers` reads the one-copy TCP transport's figure from `kvstore bench
transfer` and sets it against `resp://` and Mooncake's raw read of the same round (no timing asserted)."""

from __future__ import annotations

import pytest

from kvstore.bench import transfer_peers


def test_the_tcp_fetch_is_a_kvstore_path_and_is_set_against_resp_and_the_raw_read() -> None:
    r = {
        "lmcache": {"resp get best": 2.0},
        "kvstore": {
            "grpc fetch": 0.8,
            "bulk fetch": 1.5,
            "tcp fetch": 2.4,
            "mooncake engine raw read (in turns with bulk)": 1.2,
        },
    }
    got = transfer_peers.ratios(r)
    assert got["best kvstore path"] == "tcp fetch" and got["best kvstore GB/s"] == 2.4
    assert got["tcp fetch / LMCache resp:// get"] == pytest.approx(1.2)
    assert got["tcp fetch / Mooncake engine raw batch read"] == pytest.approx(2.0)


def test_the_bench_figure_named_tcp_fetch_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    out = {
        "figures": [
            {"name": "tcp fetch", "value": 1.7},
            {"name": "bulk fetch batch=512", "value": 1.1},
            {"name": "grpc fetch vs mooncake", "value": 0.5, "baseline_value": 1.4},
        ]
    }
    monkeypatch.setattr(transfer_peers, "_run", lambda *a, **k: out)
    assert transfer_peers.kvstore_transfer(1) == {
        "tcp fetch": 1.7,
        "bulk fetch": 1.1,
        "mooncake engine raw read (in turns with bulk)": 1.4,
    }
