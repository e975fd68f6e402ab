"""A gateway's Get and Put stream across runs, against the router and against an older tree's gateway, in one run.

`kvstore bench fleet-gateway [--blocks N] [--run-blocks R] [--block-tokens T] [--put-batch-blocks B]
[--before-src DIR]` (or `python -m kvstore.bench.fleet_gateway ...`) starts one etcd, three `kvstore serve`
nodes at replication 2 and two `kvstore gateway`s on loopback, one with `[fleet] read_ahead` (the next run's read
started while this one is answered, F69) and one without (one run after another). It puts one prompt of N blocks
through the fleet client, then streams it, in turns, through each gateway and through the fleet client itself
(the router: the worker reading every node directly), and puts a new prompt of N blocks through the
read-ahead gateway and through the router in requests of B blocks (default: one run each, so every request but
the first starts at a run's first block: F69's check, F69b). The best of REPEAT turns each, as GB/s, with the
ratios: read-ahead against none (the same gateway code, same run) and the read-ahead gateway against the router
(a gateway's client against one that routes itself), for the Get and for the Put stream; with `--before-src`,
also the first block's latency of a Get (F69a).

`--before-src DIR` adds a third gateway run from another source tree (the code before a change: `git archive
COMMIT | tar -x -C DIR`, then `cp kvstore/native/*.so DIR/kvstore/native/`), read-ahead on, started with DIR as
its working folder (so `python -m` imports DIR's code); its Gets and Put streams take their turns beside this
tree's, and the figures say this tree's gateway against it.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import kvstore
from kvstore.bench.fleet import stream_s
from kvstore.bench.fleet_processes import START_DEADLINE_S, EtcdProcess, NodeProcess, stop_all
from kvstore.bench.report import Figure, Progress, Report
from kvstore.client.fleet import FleetClient
from kvstore.client.store import Client

#: Turns per path; the best is reported (the box's other load only slows a turn).
REPEAT = 5


@contextmanager
def _gateway(folder: Path, etcd: str, cluster: str, *, run_blocks: int, block_tokens: int,
             read_ahead: bool, src: Path | None = None) -> Iterator[str]:
    """A `kvstore gateway` on a free loopback port (run from the tree `src` when given); yields its host:port."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "gateway.toml"
    cfg.write_text(f'[store]\ndata_dir = "{folder / "none"}"\nblock_tokens = {block_tokens}\n'
                   f'[fleet]\netcd = "{etcd}"\ncluster = "{cluster}"\nrun_blocks = {run_blocks}\n'
                   f"replication = 2\nread_ahead = {'true' if read_ahead else 'false'}\n")
    log = folder / "gateway.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "gateway", "--config", str(cfg), "--port",
                                    "0"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=src)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while "listening on 127.0.0.1:" not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstore gateway did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)  # polling its log under the deadline above
        port = log.read_text().split("listening on 127.0.0.1:", 1)[1].split()[0]
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench fleet-gateway`."""
    parser.add_argument("--blocks", type=int, default=512, help="blocks of the prompt got and put (default 512)")
    parser.add_argument("--run-blocks", type=int, default=16, help="blocks a run places together (default 16)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens a block (default 16)")
    parser.add_argument("--put-batch-blocks", type=int, default=None,
                        help="blocks a request of the Put stream (default: --run-blocks, one run each)")
    parser.add_argument("--before-src", type=Path, default=None,
                        help="a source tree whose gateway is measured beside this one's (see above)")


def _put_s(client: Client, blocks: int, block_tokens: int, batch: int) -> float:
    """Seconds to put a new prompt of `blocks` random blocks through `client`, `batch` blocks a request."""
    tokens = [random.randrange(50_000) for _ in range(blocks * block_tokens)]
    payload = [random.randbytes(client.block_bytes) for _ in range(blocks)]
    start = time.perf_counter()
    result = client.put(tokens, payload, batch_blocks=batch)
    seconds = time.perf_counter() - start
    if result.written_blocks != blocks:
        raise RuntimeError(f"put wrote {result.written_blocks} of {blocks} blocks")
    return seconds


def _first_block_s(client: Client, hashes: Sequence[bytes]) -> float:
    """Seconds until a Get of `hashes` answers its first block (the rest read and dropped)."""
    start = time.perf_counter()
    blocks = client.stream(list(hashes))
    next(iter(blocks))
    seconds = time.perf_counter() - start
    for _ in blocks:
        pass
    return seconds


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the bench (see the module's docstring)."""
    report = Report(bench="fleet-gateway")
    batch = args.put_batch_blocks or args.run_blocks
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-gateway-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        etcd = EtcdProcess(folder / "etcd").start()
        stack.callback(etcd.stop)
        cluster = f"bench-{uuid.uuid4().hex[:8]}"
        env = {"KVSTORE_STORE_CAPACITY_BYTES": str(8 << 30), "KVSTORE_STORE_BLOCK_TOKENS": str(args.block_tokens),
               "KVSTORE_FLEET_ETCD": etcd.endpoint, "KVSTORE_FLEET_CLUSTER": cluster,
               "KVSTORE_FLEET_RUN_BLOCKS": str(args.run_blocks)}
        with ThreadPoolExecutor(3) as pool:  # started together, stopped together (each drains a second)
            nodes = list(pool.map(lambda i: NodeProcess(folder / f"node{i}", env), range(3)))
        stack.callback(stop_all, nodes)
        gateways: list[tuple[str, bool, Path | None]] = [("read-ahead", True, None), ("one run at a time", False, None)]
        if args.before_src is not None:
            gateways.append(("before", True, args.before_src.resolve()))
        targets = {}
        for name, ahead, src in gateways:
            targets[name] = stack.enter_context(_gateway(folder / name.replace(" ", "-"), etcd.endpoint, cluster,
                                                         run_blocks=args.run_blocks, block_tokens=args.block_tokens,
                                                         read_ahead=ahead, src=src))
        router = kvstore.Client(f"etcd://{etcd.endpoint}/{cluster}")
        assert isinstance(router, FleetClient)
        stack.callback(router.close)
        router.view.wait_until(lambda live: {n.node_id for n in nodes} <= set(live), 30.0)
        tokens = [random.randrange(50_000) for _ in range(args.blocks * args.block_tokens)]
        payload = [random.randbytes(router.block_bytes) for _ in range(args.blocks)]
        hashes = router.put(tokens, payload).block_hashes
        expect = sum(map(len, payload))
        clients: dict[str, Client] = {"router": router,
                                      **{name: stack.enter_context(kvstore.Client(t)) for name, t in targets.items()}}
        putters = [name for name in clients if name in ("router", "read-ahead", "before")]
        best = dict.fromkeys(clients, float("inf"))
        puts = dict.fromkeys(putters, float("inf"))
        firsts = dict.fromkeys((name for name in putters if name != "router"), float("inf"))  # a gateway's Get
        with progress.bar("turns", REPEAT, unit="turn", scale=False) as bar:
            for _ in range(REPEAT):  # in turns, so the box's load falls on every path alike
                for name, client in clients.items():
                    best[name] = min(best[name], stream_s(client, hashes, expect))
                for name in putters:
                    puts[name] = min(puts[name], _put_s(clients[name], args.blocks, args.block_tokens, batch))
                    if name in firsts:
                        firsts[name] = min(firsts[name], _first_block_s(clients[name], hashes))
                bar.update(1)
    gb = expect / 1e9
    report.notes.update(blocks=args.blocks, block_bytes=router.block_bytes, run_blocks=args.run_blocks,
                        runs=-(-args.blocks // args.run_blocks), put_batch_blocks=batch, repeat=REPEAT,
                        nodes=3, replication=2, before_src=str(args.before_src) if args.before_src else None)
    rate = {name: gb / seconds for name, seconds in best.items()}
    report.add(Figure.against("get via the read-ahead gateway", rate["read-ahead"], "GB/s",
                              "one run at a time", rate["one run at a time"]))
    report.add(Figure.against("get via the read-ahead gateway vs the router", rate["read-ahead"], "GB/s",
                              "router (fleet client)", rate["router"]))
    if "before" in rate:
        report.add(Figure.against("get via the gateway, this tree", rate["read-ahead"], "GB/s",
                                  "before (--before-src)", rate["before"]))
        report.add(Figure.against("first block of a get via the gateway, this tree", firsts["read-ahead"] * 1e3,
                                  "ms", "before (--before-src)", firsts["before"] * 1e3))
        report.add(Figure.against("put stream via the gateway, this tree", gb / puts["read-ahead"], "GB/s",
                                  "before (--before-src)", gb / puts["before"]))
    report.add(Figure.against("put stream via the read-ahead gateway vs the router", gb / puts["read-ahead"], "GB/s",
                              "router (fleet client), same batches", gb / puts["router"]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench and print its figures (`python -m kvstore.bench.fleet_gateway`)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    print(run(parser.parse_args(argv), Progress(enabled=False)).to_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
