"""`python -m kvstore.bench.transfer_peers` reads the peers' own output and sets kvstore's best path against it.

The peers' scripts install venvs and take minutes, so here a peers folder holds scripts that print
what the real ones print (their JSON's shape, as run on the dev box on 2026-12-02, after log lines
on stderr); the driver runs them as it runs the real ones. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench import transfer_peers

LMCACHE_OUT = {"baseline": {"tcp_loopback_one_stream": {"gbps_median": 2.1}},
               "lmcache": {"resp": {"get": {"gbps_median": 2.011, "gbps_runs": [2.725, 1.371, 2.011]}}}}
MOONCAKE_OUT = {"mooncake": {"colocated": {"get_batch": {"gbps_median": 3.3, "gbps_runs": [3.3]}},
                             "cross_process": {"get_batch": {"gbps_median": 0.95, "gbps_runs": [0.9, 0.95, 1.0]},
                                               "batch_get_into": {"gbps_median": 1.9, "gbps_runs": [1.9, 2.0]},
                                               "batch_is_exist": {"ms_median": 5.4}}}}


def _peers(folder: Path, *, lmcache_rc: int = 0) -> Path:
    scripts = (("run_lmcache_bench.sh", LMCACHE_OUT, lmcache_rc), ("run_mooncake_bench.sh", MOONCAKE_OUT, 0))
    for name, out, rc in scripts:
        # As the real scripts: progress on stderr, the JSON last on stdout, the arguments passed on.
        (folder / name).write_text(f"echo \"[run] $*\" >&2\ncat <<'EOF'\n{json.dumps(out, indent=1)}\nEOF\n"
                                   f"exit {rc}\n")
    return folder


def test_a_round_reads_each_peers_figures(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.bench.transfer_peers", "--rounds", "1",
                          "--skip", "kvstore", "--peers", str(_peers(tmp_path)), "--json"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    (r,) = json.loads(out)["rounds"]
    assert r["lmcache"] == {"resp get best": 2.725, "resp get median": 2.011, "tcp one stream": 2.1}
    assert r["mooncake"] == {"cross_process.get_batch best": 1.0, "cross_process.get_batch median": 0.95,
                             "cross_process.batch_get_into best": 2.0, "cross_process.batch_get_into median": 1.9}
    assert isinstance(r["lmcache load before"], float) and "kvstore" not in r
    assert r["ratios"] == {}  # no kvstore figure, no ratio


def test_a_failing_peer_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    r = transfer_peers.round_once(_peers(tmp_path, lmcache_rc=3), 1, {"kvstore"})
    assert "exited 3" in r["lmcache"]["error"]
    assert r["mooncake"]["cross_process.get_batch best"] == 1.0


def test_the_best_kvstore_path_is_set_against_every_peer_best_against_best() -> None:
    r = {"lmcache": {"resp get best": 2.0}, "mooncake": {"cross_process.get_batch best": 1.0,
                                                         "cross_process.get_batch median": 0.5},
         "kvstore": {"grpc fetch": 0.8, "bulk fetch": 1.5, "mooncake engine raw read (in turns with bulk)": 1.2}}
    got = transfer_peers.ratios(r)
    assert got["best kvstore path"] == "bulk fetch" and got["best kvstore GB/s"] == 1.5
    assert got["best / LMCache resp:// get"] == pytest.approx(0.75)
    assert got["best / Mooncake cross_process.get_batch"] == pytest.approx(1.5)
    assert got["best / Mooncake engine raw batch read"] == pytest.approx(1.25)
    assert not any("median" in k for k in got), "best against best: no peer's median in a ratio"


def test_no_json_in_a_peers_output_is_an_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match="no JSON"):
        transfer_peers._json_tail("[bench] something went wrong\n")
    assert transfer_peers._json_tail("log line\n{\n \"a\": {\"b\": 1}\n}\n") == {"a": {"b": 1}}
