"""Cross-host fetch against the peers' remote paths, same bytes, in turns: one table of ratios.

Issue 25 item 6 holds kvstore's best cross-host fetch (the striped gRPC `Transfer.Fetch`
or the bulk transport) against LMCache's `resp://` get (its C++ RESP client against
redis-server) and Mooncake's raw batch reads. Only same-run ratios mean anything on a
shared box, so each round runs, back to back on the same payload shape (the peers' own:
227,840-byte values, 256 tokens of V4.1-Flash a block, 1 GiB):

1. `../shared/peers/run_lmcache_bench.sh --connectors resp` (LMCache 0.5.6 in its own venv);
2. `../shared/peers/run_mooncake_bench.sh --skip-redis` (Mooncake Store `get_batch`,
   `batch_get_into`, master and a second client process, TCP);
3. `kvstore bench transfer --block-tokens 256 --batches 512 --small '' --gpu off` (gRPC
   fetch, bulk fetch, the one-copy TCP transport's fetch, and Mooncake's transfer engine read
   of the same bytes, the last three in turns inside the bench).

(A fourth step, a one-copy socket prototype's ceiling, went with the prototype once the one-copy
TCP transport, step 3's "tcp fetch", replaced it.)

Each step's load average is taken before it starts. Peers report a median of their runs
and every run; kvstore's bench keeps the best of `--repeat`: the table sets best against
best (each peer's fastest run) and gives the peers' medians beside them.

    python -m kvstore.bench.transfer_peers [--rounds 2] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The peers' payload: 227,840-byte values (256 tokens x 890 bytes), 1 GiB a pass.
VALUE_BYTES = 227_840
BLOCK_TOKENS = 256
TOTAL_BYTES = 1 << 30


def peers_dir(explicit: str | None) -> Path:
    """Where the peers' scripts are: `explicit`, else ../shared/peers or shared/peers from the repo root.

    Raises:
        FileNotFoundError: none holds run_lmcache_bench.sh.
    """
    root = Path(__file__).resolve().parents[2]
    for d in ([Path(explicit)] if explicit else [root.parent / "shared" / "peers", root / "shared" / "peers"]):
        if (d / "run_lmcache_bench.sh").exists():
            return d
    raise FileNotFoundError("no peers folder (run_lmcache_bench.sh); pass --peers DIR")


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def _json_tail(text: str) -> dict[str, Any]:
    """The JSON object a script printed last (the peers print it after any other lines).

    Raises:
        RuntimeError: there is none.
    """
    start = 0 if text.startswith("{") else text.rfind("\n{") + 1
    if start or text.startswith("{"):
        try:
            return json.loads(text[start:])  # type: ignore[no-any-return]
        except json.JSONDecodeError:
            pass
    raise RuntimeError(f"no JSON at the end of the output: {text[-500:]!r}")


def _free_ports(*names: str) -> dict[str, str]:
    """The environment naming a free loopback port for each of the peers' port variables: their
    defaults may be taken by another run on a shared box (round 2's redis-server once found
    16581 in use and the LMCache step failed)."""
    from kvstore.bench.redis_server import free_port

    return {name: str(free_port()) for name in names}


def _run(cmd: list[str], timeout_s: float, ports: tuple[str, ...] = ()) -> dict[str, Any]:
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **_free_ports(*ports)})
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {done.returncode}: {done.stderr[-800:]}")
    out = _json_tail(done.stdout)
    out["_wall_s"] = round(time.perf_counter() - began, 1)
    return out


def lmcache_resp(peers: Path, reps: int) -> dict[str, float]:
    """LMCache `resp://` get: best and median GB/s."""
    out = _run(["bash", str(peers / "run_lmcache_bench.sh"), "--connectors", "resp", "--skip-redis-raw",
                "--reps", str(reps)], 900, ("LMC_PORT", "REDIS_PORT"))
    get = out["lmcache"]["resp"]["get"]
    return {"resp get best": max(get["gbps_runs"]), "resp get median": get["gbps_median"],
            "tcp one stream": out["baseline"]["tcp_loopback_one_stream"]["gbps_median"]}


def mooncake_store(peers: Path, reps: int) -> dict[str, float]:
    """Mooncake Store's cross-process reads: best and median GB/s of each."""
    out = _run(["bash", str(peers / "run_mooncake_bench.sh"), "--skip-redis", "--reps", str(reps)], 900,
               ("MC_MASTER_PORT", "MC_METADATA_PORT", "MC_METRICS_PORT", "REDIS_PORT"))
    figures: dict[str, float] = {}
    _collect(out.get("mooncake", {}), "", figures)
    return figures


def _collect(node: Any, path: str, into: dict[str, float]) -> None:
    """Every `gbps_runs` / `gbps_median` under `node` of a cross-process read (get_batch, batch_get_into;
    not the colocated ones, which cross no process)."""
    if isinstance(node, dict):
        if "gbps_runs" in node and path.startswith("cross_process.") and path.endswith(("get_batch", "get_into")):
            into[f"{path} best"] = max(node["gbps_runs"])
            into[f"{path} median"] = node["gbps_median"]
        for key, value in node.items():
            _collect(value, f"{path}.{key}" if path else key, into)


def kvstore_transfer(reps: int) -> dict[str, float]:
    """`kvstore bench transfer`'s cross-host figures on the peers' payload: best GB/s of each."""
    tokens = (TOTAL_BYTES // VALUE_BYTES) * BLOCK_TOKENS
    out = _run([sys.executable, "-m", "kvstore.cli", "bench", "transfer", "--json", "--tokens", str(tokens),
                "--block-tokens", str(BLOCK_TOKENS), "--batches", "512", "--small", "", "--gpu", "off",
                "--repeat", str(reps)], 1800)
    figures: dict[str, float] = {}
    for f in out["figures"]:
        name = f["name"]
        if name == "grpc fetch batch=512":
            figures["grpc fetch"] = f["value"]
        elif name == "bulk fetch batch=512":
            figures["bulk fetch"] = f["value"]
        elif name == "tcp fetch":  # the one-copy TCP transport, in turns with the bulk fetch and the raw read
            figures["tcp fetch"] = f["value"]
        elif name == "grpc fetch vs mooncake":  # its baseline: the raw read taken in turns with the bulk fetch
            figures["mooncake engine raw read (in turns with bulk)"] = f["baseline_value"]
        elif name.startswith("grpc fetch batch=512 vs") and "streams" in name:
            figures["raw gRPC streams"] = f["baseline_value"]
    return figures


def round_once(peers: Path, reps: int, skip: set[str]) -> dict[str, Any]:
    """One round: LMCache resp://, Mooncake Store, kvstore, each with the load average before it."""
    out: dict[str, Any] = {}
    for name, fn in (("lmcache", lambda: lmcache_resp(peers, reps)), ("mooncake", lambda: mooncake_store(peers, reps)),
                     ("kvstore", lambda: kvstore_transfer(reps))):
        if name in skip:
            continue
        before = load()
        try:
            out[name] = fn()
        except Exception as exc:  # one peer failing still leaves the others' figures
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out[f"{name} load before"] = round(before, 2)
    return out


def ratios(r: dict[str, Any]) -> dict[str, float]:
    """The best kvstore cross-host path against each peer in the round (best against best)."""
    kv = r.get("kvstore", {})
    paths = {k: kv[k] for k in ("grpc fetch", "bulk fetch", "tcp fetch") if k in kv}
    if not paths:
        return {}
    best_name = max(paths, key=paths.__getitem__)
    best = paths[best_name]
    out: dict[str, Any] = {"best kvstore path": best_name, "best kvstore GB/s": best}
    if "resp get best" in r.get("lmcache", {}):
        out["best / LMCache resp:// get"] = best / r["lmcache"]["resp get best"]
    for key, value in r.get("mooncake", {}).items():
        if key.endswith(" best"):
            out[f"best / Mooncake {key[:-5]}"] = best / value
    raw = kv.get("mooncake engine raw read (in turns with bulk)")
    if raw:
        out["best / Mooncake engine raw batch read"] = best / raw
    lmc = r.get("lmcache", {}).get("resp get best")
    tcp = kv.get("tcp fetch")
    if tcp and lmc:  # the TCP transport on its own, whichever path was best
        out["tcp fetch / LMCache resp:// get"] = tcp / lmc
    if tcp and raw:
        out["tcp fetch / Mooncake engine raw batch read"] = tcp / raw
    return out


def main(argv: list[str] | None = None) -> int:
    """Run `--rounds` rounds and print every figure and ratio."""
    parser = argparse.ArgumentParser(prog="kvstore.bench.transfer_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="runs per figure in each bench (default 3)")
    parser.add_argument("--peers", default=None, help="the peers' folder (default ../shared/peers)")
    parser.add_argument("--skip", default="", help="comma list of lmcache, mooncake, kvstore to leave out")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    peers = peers_dir(args.peers)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rounds = []
    for i in range(args.rounds):
        r = round_once(peers, args.reps, skip)
        r["ratios"] = ratios(r)
        rounds.append(r)
        print(f"round {i + 1}: {json.dumps(r)}", file=sys.stderr, flush=True)
    print(json.dumps({"bench": "transfer-peers", "cpus": os.cpu_count(), "rounds": rounds}, indent=None if args.json
                     else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
