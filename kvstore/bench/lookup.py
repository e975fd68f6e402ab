"""Lookup of a long conversation over gRPC: its next turn through the chain memo, and a cold Lookup.

In one run, a `kvstore serve` process holds a chain of --tokens (1M by default)
and is asked, over loopback gRPC, by the worker's client:

- the conversation's next turn: the same prompt plus --new-tokens (4,096), the
  client's chain memo holding the turn before (kvstore.client.chain_memo) and the
  server the chain it found then (an anchor: gateway/lookup_anchors.py), so only the
  new hashes travel; against today's client on the same server (every token hashed
  again, one repeated field per hash), against the memo alone (the whole chain
  sent, packed) and against a raw gRPC echo of the same request bytes (no kvstore
  logic at either end);
- a cold Lookup with the hashes in hand (`lookup_hashes`): packed against the
  repeated field, and against the raw echo;
- a cold Lookup from tokens (every token hashed, as a first turn is);
- then, the server stopped, the server's own answer (the tier's lookup of the
  same hashes in-process), the floor any wire path adds to.

Tokens are a uint32 numpy array (an engine's token ids); --list-tokens also times
the next turn with a Python list, whose conversion alone costs ~10 ms per 1M
tokens. Best of --repeat calls each (medians in the notes). The blocks are the tiny
geometry's (the lookup does not read a block's bytes; its work is per block, not per byte).

A figure and its raw echo are timed in turns, each call after the same preparation
(for a next turn: the memo cleared and the turn before looked up, ~12 ms of hashing,
during which both servers sit idle), so both pay the same wake-up: on a shared or
virtual machine a call after an idle gap costs up to twice a call back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import GiB, best_of, scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import TINY

ECHO_METHOD = "/bench.Echo/Unary"
# A generic handler with no protobuf and no logic: takes the request's bytes, answers 8 bytes.
ECHO_SERVER = """
import asyncio, grpc
async def main():
    server = grpc.aio.server(options=[('grpc.max_receive_message_length', -1)])
    handler = grpc.method_handlers_generic_handler('bench.Echo', {
        'Unary': grpc.unary_unary_rpc_method_handler(lambda req, ctx: len(req).to_bytes(8, 'big'))})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port('127.0.0.1:0')
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench lookup`."""
    parser.add_argument("--tokens", type=int, default=1_000_000, help="the conversation's length (default 1M)")
    parser.add_argument("--new-tokens", type=int, default=4096, help="tokens the next turn adds (default 4,096)")
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--repeat", type=int, default=15, help="calls per figure; the best is reported")
    parser.add_argument("--list-tokens", action="store_true", help="also time the next turn with a Python list")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    from kvstore.client import Client

    bt = args.block_tokens
    n_blocks = max(args.tokens // bt, 1)
    rng = np.random.default_rng(0)
    turn = rng.integers(0, 100_000, size=n_blocks * bt, dtype=np.uint32)
    report = Report(bench="lookup")
    report.notes.update(tokens=len(turn), new_tokens=args.new_tokens, blocks=n_blocks, block_tokens=bt,
                        geometry=TINY.name, repeat=args.repeat, cpus=os.cpu_count())
    block_bytes = TINY.block_bytes(bt)
    with scratch(args.dir) as folder:
        with serve_process(folder / "store", n_blocks * block_bytes, bt) as target, echo_server() as echo, \
                Client(target, geometry=TINY.name) as client, \
                Client(target, geometry=TINY.name, chain_memo_bytes=0) as cold, \
                Client(target, geometry=TINY.name, chain_memo_bytes=0) as today:
            cold.connection.lookup_anchors = False  # every Lookup sends the whole chain, packed
            today.connection.lookup_anchors = today.connection.lookup_packed_hashes = False  # one field per hash
            with progress.bar("put the conversation", n_blocks, "block") as bar:
                client.put(turn, _blocks(n_blocks, block_bytes), on_batch=bar.update)
            hashes = client.hashes(turn)
            samples = _next_turn(client, today, echo, turn, hashes, args, rng)
            samples.update(_cold(cold, today, echo, turn, hashes, args))
        samples["server"] = [_server_answer(folder / "store", bt, n_blocks * block_bytes, hashes, args.repeat)]
    figures = {name: min(times) for name, times in samples.items()}
    report.notes["medians_ms"] = ", ".join(f"{name} {statistics.median(times) * 1e3:.3f}"
                                           for name, times in samples.items() if len(times) > 1)
    _report(report, figures, len(turn), args)
    return report


def _blocks(n: int, size: int) -> list[bytes]:
    pool = [os.urandom(size) for _ in range(16)]
    return [pool[i % 16] for i in range(n)]


def _in_turns(calls: dict[str, Callable[[], object]], repeat: int,
              prepare: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds of each call, `repeat` rounds, the calls taking turns within a round, each after `prepare`
    (untimed): a figure and its baseline see the same machine and the same idle gap before them."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(repeat, 1)):
        for name, call in calls.items():
            if prepare is not None:
                prepare()
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return samples


def _next_turn(client: Any, today: Any, echo: Callable[[bytes], bytes], turn: np.ndarray, hashes: list[bytes],
               args: argparse.Namespace, rng: np.random.Generator) -> dict[str, list[float]]:
    """Seconds of the next turn's lookup through the memo (holding the turn before) and the anchor, through the
    memo alone, and of a raw echo of the anchored request's bytes, each after the turn before was looked up;
    then today's client."""
    from kvstore.v1 import kvstore_pb2 as pb

    blocks = len(turn) // args.block_tokens
    prompts = [np.concatenate([turn, rng.integers(0, 100_000, size=args.new_tokens, dtype=np.uint32)])
               for _ in range(4)]
    at = iter(range(1 << 62))

    def prepare() -> None:  # the turn before: hashed and kept, its chain found (not timed)
        client.connection.chain_memo.clear()
        client.connection.lookup_anchors = True
        client.lookup(turn)

    def memo_turn(form: Callable[[np.ndarray], Any], *, anchors: bool = True) -> Callable[[], None]:
        def call() -> None:
            client.connection.lookup_anchors = anchors
            found = client.lookup(prompt)
            if found.found_blocks != blocks:
                raise RuntimeError(f"the next turn found {found.found_blocks} blocks, expected {blocks}")
        prompt = form(prompts[next(at) % len(prompts)])
        return call

    extra = (len(turn) + args.new_tokens) // args.block_tokens - len(hashes)
    turn_raw = pb.LookupRequest(geometry=client.geometry, anchor_hash=hashes[-1], anchor_blocks=len(hashes),
                                block_hashes_packed=bytes(32 * extra)).SerializeToString()
    calls: dict[str, Callable[[], object]] = {"turn_memo": memo_turn(lambda p: p),
                                              "echo_turn": lambda: echo(turn_raw),
                                              "turn_memo_only": memo_turn(lambda p: p, anchors=False)}
    if args.list_tokens:
        calls["turn_memo_list"] = memo_turn(lambda p: p.tolist())
    out = _in_turns(calls, args.repeat, prepare)
    client.connection.lookup_anchors = True
    out["turn_today"] = [best_of(lambda: today.lookup(prompts[0]), args.repeat)]
    return out


def _cold(cold: Any, today: Any, echo: Callable[[bytes], bytes], turn: np.ndarray, hashes: list[bytes],
          args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of a cold Lookup (no memo, no anchor) with the hashes in hand, packed, in turns with a raw echo
    of the same request bytes and today's repeated field; then from tokens."""
    from kvstore.v1 import kvstore_pb2 as pb

    cold_raw = pb.LookupRequest(geometry=cold.geometry, block_hashes_packed=b"".join(hashes)).SerializeToString()
    out = _in_turns({"cold_packed": lambda: cold.lookup_hashes(hashes), "echo_cold": lambda: echo(cold_raw),
                     "cold_repeated": lambda: today.lookup_hashes(hashes)}, args.repeat)
    out["cold_tokens"] = [best_of(lambda: cold.lookup(turn), args.repeat)]
    return out


def _server_answer(data_dir: Path, block_tokens: int, data_bytes: int, hashes: list[bytes], repeat: int) -> float:
    """Seconds of the tier's own lookup of `hashes` (a chain it has seen), in-process, the server stopped."""
    from kvstore.config import StoreSettings
    from kvstore.prefix import BlockScope
    from tiers.lmdb_tier import LmdbBlockTier

    tier = LmdbBlockTier(StoreSettings(data_dir=data_dir, capacity_bytes=int(data_bytes * 1.2) + GiB,
                                       block_tokens=block_tokens))
    try:
        scope = BlockScope(TINY.fingerprint, "default")
        if tier.lookup(scope, hashes)[0] != len(hashes):
            raise RuntimeError("the stopped server's store does not hold the conversation")
        return best_of(lambda: tier.lookup(scope, hashes), repeat)
    finally:
        tier.close()


@contextmanager
def echo_server() -> Iterator[Callable[[bytes], bytes]]:
    """A bare gRPC server in its own process; yields a call sending bytes and returning its 8-byte answer."""
    import grpc

    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)])
        try:
            yield channel.unary_unary(ECHO_METHOD)
        finally:
            channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _report(report: Report, s: dict[str, float], tokens: int, args: argparse.Namespace) -> None:
    ms = {k: v * 1e3 for k, v in s.items()}
    label = f"{tokens:,} tokens"
    turn = f"next turn of {label} (+{args.new_tokens:,})"
    report.add(Figure.against(f"lookup {turn} over gRPC, chain memo + anchor", ms["turn_memo"], "ms",
                              "same turn, today's client (every token hashed, repeated hashes)", ms["turn_today"]))
    report.add(Figure.against(f"lookup {turn} over gRPC, chain memo + anchor (vs raw echo)", ms["turn_memo"], "ms",
                              "raw gRPC echo of the same request bytes", ms["echo_turn"]))
    report.add(Figure.against(f"lookup {turn} over gRPC, chain memo only (whole chain sent)", ms["turn_memo_only"],
                              "ms", "same turn, today's client", ms["turn_today"]))
    if "turn_memo_list" in ms:
        report.add(Figure.against(f"lookup {turn} over gRPC, chain memo + anchor, tokens as a list",
                                  ms["turn_memo_list"], "ms", "same turn, today's client", ms["turn_today"]))
    report.add(Figure.against(f"lookup {label} cold over gRPC, hashes packed", ms["cold_packed"], "ms",
                              "same, repeated hashes (before)", ms["cold_repeated"]))
    report.add(Figure.against(f"lookup {label} cold over gRPC, hashes packed (vs raw echo)", ms["cold_packed"], "ms",
                              "raw gRPC echo of the same request bytes", ms["echo_cold"]))
    report.add(Figure.against(f"lookup {label} cold over gRPC, hashes packed (vs server)", ms["cold_packed"], "ms",
                              "the server's own answer (tier lookup in-process)", ms["server"]))
    report.add(Figure.against(f"lookup {label} cold from tokens (every token hashed)", ms["cold_tokens"], "ms",
                              "same with the hashes in hand", ms["cold_packed"]))
    report.notes["targets"] = (f"next turn <= 1 ms: {'met' if ms['turn_memo'] <= 1 else 'not met'}; "
                               f"cold (hashes in hand) <= 3 ms: {'met' if ms['cold_packed'] <= 3 else 'not met'}")
