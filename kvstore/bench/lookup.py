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
  repeated field, and against the raw echo; the same with the hashes' check while the
  call flies against the check first (`Client.overlap_check`, docs/FLEET.md F83);
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

The next turn's budget is measured in the same run (the `budget_ms` note, medians): what
crosses the wire (the anchored request's and its reply's bytes), the client's memo alone
(C1's byte compare and the new blocks' hashing; the compare alone beside it), the anchored
request's bytes sent by a bare stub (wire + server, no client work), a one-block Lookup (the handler's fixed cost), the
stub and the echo back to back (no idle gap: the server's own cost over the echo), and, the
server stopped, the server's work in-process: parse, cut the new hashes, the tier's anchored
walk (A5).

The overlap probe asks whether the round trip's wake-up can hide behind the memo's work (the two
are serial in a next turn): the memo then the echo of the request, against the echo's call
started before the memo, either a client-streaming call opened (its headers wake the server's
handler; the request goes on it once the memo is done) or an empty unary call sent ahead (a ping).
A third way moves C1's compare off the critical path instead: the new blocks hashed from the
kept chain's last hash, the request sent, and the compare of the prompt with a kept copy of
the turn before's tokens made by a worker thread meanwhile (libc's memcmp through ctypes, the
GIL released), against the same pieces in series. The echo stands for the server so that no
proto method or client path is added before the probe says it pays. It did: `Client.lookup` now takes
that path (docs/PREFIX_HASHING.md C7), timed as the next turn against the same client with the overlap
off (`overlap_compare`: the compare first, then the request).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import GiB, best_of, scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import TINY

ECHO_METHOD = "/bench.Echo/Unary"
#: The echo's client-streaming method: answers the total bytes of the messages, once the stream ends.
ECHO_STREAM_METHOD = "/bench.Echo/Stream"
# A generic handler with no protobuf and no logic: takes the request's bytes, answers 8 bytes.
ECHO_SERVER = """
import asyncio, grpc
async def stream(requests, ctx):
    total = 0
    async for request in requests:
        total += len(request)
    return total.to_bytes(8, 'big')
async def main():
    server = grpc.aio.server(options=[('grpc.max_receive_message_length', -1)])
    handler = grpc.method_handlers_generic_handler('bench.Echo', {
        'Unary': grpc.unary_unary_rpc_method_handler(lambda req, ctx: len(req).to_bytes(8, 'big')),
        'Stream': grpc.stream_unary_rpc_method_handler(stream)})
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
    from kvstore import prefix
    from kvstore.client import Client

    bt = args.block_tokens
    n_blocks = max(args.tokens // bt, 1)
    rng = np.random.default_rng(0)
    turn = rng.integers(0, 100_000, size=n_blocks * bt, dtype=np.uint32)
    report = Report(bench="lookup")
    report.notes.update(
        tokens=len(turn),
        new_tokens=args.new_tokens,
        blocks=n_blocks,
        block_tokens=bt,
        geometry=TINY.name,
        repeat=args.repeat,
        cpus=os.cpu_count(),
    )
    block_bytes = TINY.block_bytes(bt)
    with scratch(args.dir) as folder:
        with (
            serve_process(folder / "store", n_blocks * block_bytes, bt) as target,
            echo_server() as echo,
            Client(target, geometry=TINY.name) as client,
            Client(target, geometry=TINY.name, chain_memo_bytes=0) as cold,
            Client(target, geometry=TINY.name, chain_memo_bytes=0) as today,
        ):
            cold.connection.lookup_anchors = False  # every Lookup sends the whole chain, packed
            today.connection.lookup_anchors = today.connection.lookup_packed_hashes = False  # one field per hash
            with progress.bar("put the conversation", n_blocks, "block") as bar:
                client.put(turn, _blocks(n_blocks, block_bytes), on_batch=bar.update)
            hashes = client.hashes(turn)
            samples, wire, turn_raw = _next_turn(client, today, echo, turn, hashes, args, rng)
            samples.update(_cold(cold, today, echo, turn, hashes, args))
        server = _server_answer(folder / "store", bt, n_blocks * block_bytes, hashes, turn_raw, args.repeat)
        samples["server"] = server.pop("cold")
    figures = {name: min(times) for name, times in samples.items()}
    report.notes["medians_ms"] = ", ".join(
        f"{name} {statistics.median(times) * 1e3:.3f}" for name, times in samples.items() if len(times) > 1
    )
    report.notes["budget_ms"] = _budget(samples, server)
    report.notes["cold_budget_ms"] = _cold_budget(samples)
    report.notes["wire_bytes"] = wire
    report.notes["overlap_compare"] = Client.overlap_compare  # C7 on by default here (the usable CPUs)
    report.notes["overlap_check"] = Client.overlap_check  # F83's check while the call flies, by default here
    # the chain hashes in C (kvstore.native._chainhash) where it was built, else hashlib per block (~3x slower)
    report.notes["native_chain_hashes"] = prefix._native_chain is not None
    _report(report, figures, len(turn), args)
    return report


def _blocks(n: int, size: int) -> list[bytes]:
    pool = [os.urandom(size) for _ in range(16)]
    return [pool[i % 16] for i in range(n)]


def _in_turns(
    calls: dict[str, Callable[[], object]],
    repeat: int,
    prepare: Callable[[], object] | None = None,
    *,
    warm: bool = False,
) -> dict[str, list[float]]:
    """Seconds of each call, `repeat` rounds, the calls taking turns within a round, each after `prepare`
    (untimed): a figure and its baseline see the same machine and the same idle gap before them. `warm`:
    each call right after an untimed one of its own (back to back, no idle gap)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(max(repeat, 1)):
        for name, call in calls.items():
            if prepare is not None:
                prepare()
            if warm:
                call()
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return samples


def _next_turn(
    client: Any,
    today: Any,
    echo: Echo,
    turn: np.ndarray,
    hashes: list[bytes],
    args: argparse.Namespace,
    rng: np.random.Generator,
) -> tuple[dict[str, list[float]], dict[str, int], bytes]:
    """Seconds of the next turn's lookup through the memo (holding the turn before) and the anchor, through the
    memo alone, and of a raw echo of the anchored request's bytes, each after the turn before was looked up;
    the budget's parts; then today's client. Also what crosses the wire (bytes) and the anchored request."""
    from kvstore.prefix import chain_hashes_of_bytes
    from kvstore.v1 import kvstore_pb2 as pb

    blocks = len(turn) // args.block_tokens
    prompts = [
        np.concatenate([turn, rng.integers(0, 100_000, size=args.new_tokens, dtype=np.uint32)]) for _ in range(4)
    ]
    at = iter(range(1 << 62))

    def prepare() -> None:  # the turn before: hashed and kept, its chain found (not timed)
        client.connection.chain_memo.clear()
        client.connection.lookup_anchors = True
        client.lookup(turn)

    default_overlap = client.overlap_compare  # C7's default on this machine (Client.OVERLAP_MIN_CPUS)

    def memo_turn(
        form: Callable[[np.ndarray], Any], *, anchors: bool = True, overlap: bool | None = None
    ) -> Callable[[], None]:
        def call() -> None:
            client.connection.lookup_anchors = anchors
            client.overlap_compare = default_overlap if overlap is None else overlap
            found = client.lookup(prompt)
            client.overlap_compare = default_overlap
            if found.found_blocks != blocks:
                raise RuntimeError(f"the next turn found {found.found_blocks} blocks, expected {blocks}")

        prompt = form(prompts[next(at) % len(prompts)])
        return call

    conn = client.connection
    # The request a next turn sends (Client._lookup's fields): the anchor, then the new blocks' hashes.
    new_hashes = client.hashes(prompts[0])[len(hashes) :]
    turn_request = pb.LookupRequest(
        geometry=client.geometry,
        namespace=client.namespace,
        anchor_hash=hashes[-1],
        anchor_blocks=len(hashes),
        block_hashes_packed=b"".join(new_hashes),
    )
    turn_raw = turn_request.SerializeToString()
    one_block = pb.LookupRequest(geometry=client.geometry, namespace=client.namespace, block_hashes_packed=hashes[0])

    def memo() -> object:  # the client's work of a next turn: its chain through the memo
        return conn.chain(prompts[next(at) % len(prompts)])

    # The compare moved off the critical path: the new blocks hashed from the anchor (they need only the
    # candidate chain's last hash), the request sent, C1's compare of the prompt with a kept copy run by a
    # worker meanwhile, its GIL released (memcmp through ctypes); against the same pieces in series.
    kept, equal, worker = turn.copy(), _memcmp(), ThreadPoolExecutor(1)
    new_raw = prompts[0][len(turn) :].tobytes()

    def compare() -> bool:
        return equal(prompts[next(at) % len(prompts)][: len(turn)], kept)

    def new_blocks() -> object:
        return chain_hashes_of_bytes(new_raw, block_tokens=args.block_tokens, parent=hashes[-1], tail=b"")

    def compared_meanwhile() -> None:
        new_blocks()
        check = worker.submit(compare)
        echo(turn_raw)
        if not check.result():
            raise RuntimeError("the prompt does not begin with the kept tokens")

    def compared_first() -> None:
        if not compare():
            raise RuntimeError("the prompt does not begin with the kept tokens")
        new_blocks()
        echo(turn_raw)

    prepare()
    reply = conn.call(conn.kvstore.Lookup, turn_request)
    if reply.anchor_unknown or reply.found_blocks != blocks:
        raise RuntimeError(f"the bare anchored request found {reply.found_blocks} blocks, expected {blocks}")
    wire = {
        "turn_request": len(turn_raw),
        "turn_reply": reply.ByteSize(),
        "cold_request": pb.LookupRequest(
            geometry=client.geometry, namespace=client.namespace, block_hashes_packed=b"".join(hashes)
        ).ByteSize(),
    }
    calls: dict[str, Callable[[], object]] = {
        "turn_memo": memo_turn(lambda p: p),
        "echo_turn": lambda: echo(turn_raw),
        # the same client with C7's overlap on and off (C1's compare on a worker while the request flies, or
        # first, then the request): whichever the machine's default, both are timed
        "turn_overlap": memo_turn(lambda p: p, overlap=True),
        "turn_serial": memo_turn(lambda p: p, overlap=False),
        "turn_memo_only": memo_turn(lambda p: p, anchors=False),
        # the budget: the memo alone, the request without the client's
        # work, a one-block Lookup (the handler's fixed cost)
        "turn_chain": lambda: conn.chain(prompts[next(at) % len(prompts)]),
        # of it, C1's byte compare alone (nothing hashed or kept)
        "turn_compare": lambda: conn.chain_memo.kept_tokens(prompts[next(at) % len(prompts)], root=conn.root),
        "turn_stub": lambda: conn.call(conn.kvstore.Lookup, turn_request),
        "one_block": lambda: conn.call(conn.kvstore.Lookup, one_block),
        # the overlap probe: the memo, then the echo of the request (the
        # serial order), against the echo's call started before the memo
        "overlap_serial": lambda: (memo(), echo(turn_raw)),
        "overlap_opened": lambda: echo.opened_before(memo, turn_raw),
        "overlap_pinged": lambda: echo.pinged_before(memo, turn_raw),
        "compare_first": compared_first,
        "compare_meanwhile": compared_meanwhile,
    }
    if args.list_tokens:
        calls["turn_memo_list"] = memo_turn(lambda p: p.tolist())
    out = _in_turns(calls, args.repeat, prepare)
    # Back to back: each call right after one of its own, so neither server wakes from an idle gap.
    out.update(
        _in_turns(
            {"stub_b2b": lambda: conn.call(conn.kvstore.Lookup, turn_request), "echo_b2b": lambda: echo(turn_raw)},
            args.repeat * 2,
            warm=True,
        )
    )
    worker.shutdown()
    client.connection.lookup_anchors = True
    out["turn_today"] = [best_of(lambda: today.lookup(prompts[0]), args.repeat)]
    return out, wire, turn_raw


def _cold(
    cold: Any,
    today: Any,
    echo: Callable[[bytes], bytes],
    turn: np.ndarray,
    hashes: list[bytes],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Seconds of a cold Lookup (no memo, no anchor) with the hashes in hand, packed, in turns with a raw echo
    of the same request bytes and today's repeated field, and the pieces of its budget (the hashes' check, their
    join, the request built, and the same request by the bare stub: wire and server, no client work); then from
    tokens."""
    from kvstore.client import arguments
    from kvstore.v1 import kvstore_pb2 as pb

    conn = cold.connection
    cold_request = pb.LookupRequest(geometry=cold.geometry, namespace=cold.namespace,
                                    block_hashes_packed=b"".join(hashes))
    cold_raw = pb.LookupRequest(geometry=cold.geometry, block_hashes_packed=b"".join(hashes)).SerializeToString()
    default_check = cold.overlap_check  # F83's default on this machine (Client.OVERLAP_MIN_CPUS)

    def checked(overlap: bool) -> Callable[[], object]:
        def call() -> object:
            cold.overlap_check = overlap
            try:
                return cold.lookup_hashes(hashes)
            finally:
                cold.overlap_check = default_check

        return call

    out = _in_turns(
        {
            "cold_packed": lambda: cold.lookup_hashes(hashes),
            "echo_cold": lambda: echo(cold_raw),
            "cold_repeated": lambda: today.lookup_hashes(hashes),
            # the same client with the hashes' check while the call flies and before it: both timed, whichever
            # the machine's default (docs/FLEET.md F83)
            "cold_check_meanwhile": checked(True),
            "cold_check_first": checked(False),
            # the budget's pieces: the client's work before the send, and the request without it
            "cold_check": lambda: arguments.exact_hashes(hashes, "hashes"),
            "cold_join": lambda: b"".join(hashes),
            "cold_build": lambda: pb.LookupRequest(geometry=cold.geometry, namespace=cold.namespace,
                                                   block_hashes_packed=cold_request.block_hashes_packed),
            "cold_stub": lambda: conn.call(conn.kvstore.Lookup, cold_request),
        },
        args.repeat,
    )
    out["cold_tokens"] = [best_of(lambda: cold.lookup(turn), args.repeat)]
    return out


def _server_answer(
    data_dir: Path, block_tokens: int, data_bytes: int, hashes: list[bytes], turn_raw: bytes, repeat: int
) -> dict[str, list[float]]:
    """Seconds of the server's own work, in-process, the server stopped: the tier's lookup of `hashes` (a
    chain it has seen; "cold", best of `repeat`), and a next turn's stages (each `repeat` * 10 calls): parse
    its request `turn_raw`, cut the hashes after the anchor, the tier's anchored walk (A5)."""
    from gateway import validate
    from kvstore.config import StoreSettings
    from kvstore.prefix import BlockScope
    from kvstore.v1 import kvstore_pb2 as pb
    from tiers.lmdb_tier import LmdbBlockTier

    tier = LmdbBlockTier(
        StoreSettings(data_dir=data_dir, capacity_bytes=int(data_bytes * 1.2) + GiB, block_tokens=block_tokens)
    )
    try:
        scope = BlockScope(TINY.fingerprint, "default")
        if tier.lookup(scope, hashes)[0] != len(hashes):
            raise RuntimeError("the stopped server's store does not hold the conversation")
        request = pb.LookupRequest.FromString(turn_raw)
        after = validate.anchored_after(request.block_hashes_packed, request.anchor_blocks, limit=1 << 24)
        answer = tier.lookup_after(scope, request.anchor_hash, request.anchor_blocks, after)
        if answer is None or answer[0] != len(hashes):
            raise RuntimeError(f"the anchored walk found {answer}, expected {len(hashes)} blocks")
        stages = {
            "server_parse": lambda: pb.LookupRequest.FromString(turn_raw),
            "server_cut": lambda: validate.anchored_after(
                request.block_hashes_packed, request.anchor_blocks, limit=1 << 24
            ),
            "server_walk": lambda: tier.lookup_after(scope, request.anchor_hash, request.anchor_blocks, after),
        }
        out = _in_turns(stages, repeat * 10)
        out["cold"] = [best_of(lambda: tier.lookup(scope, hashes), repeat)]
        return out
    finally:
        tier.close()


def _cold_budget(samples: dict[str, list[float]]) -> str:
    """Where a cold Lookup's time goes beyond the echo and the server (task L4), medians in ms."""

    def ms(name: str) -> float:
        return statistics.median(samples[name]) * 1e3

    return (
        f"cold {ms('cold_packed'):.3f} (the client's default) = the client before the send: the hashes' check "
        f"{ms('cold_check'):.3f} (while the call flies: {ms('cold_check_meanwhile'):.3f} in all, first: "
        f"{ms('cold_check_first'):.3f}), their join {ms('cold_join'):.3f}, the request built {ms('cold_build'):.3f}; "
        f"+ the request by a bare stub {ms('cold_stub'):.3f} (wire and server; the raw echo of its bytes "
        f"{ms('echo_cold'):.3f}, timed after another server's call, the stub's after the client's own work)"
    )


def _budget(samples: dict[str, list[float]], server: dict[str, list[float]]) -> str:
    """Where a next turn's time goes, medians in ms (see the module docstring)."""

    def ms(times: list[float]) -> float:
        return statistics.median(times) * 1e3

    turn, chain, stub, echo = (ms(samples[k]) for k in ("turn_memo", "turn_chain", "turn_stub", "echo_turn"))
    serial, overlap = ms(samples["turn_serial"]), ms(samples["turn_overlap"])
    return (
        f"next turn {turn:.3f} (the client's default), {overlap:.3f} with C1's compare on a worker, {serial:.3f} "
        f"serial = client memo {chain:.3f} "
        f"(of it C1's compare {ms(samples['turn_compare']):.3f}) + the anchored request by a bare stub {stub:.3f} "
        f"(+ {serial - chain - stub:.3f} the client's other work / noise); the stub against the echo of its "
        f"bytes {echo:.3f} after the same idle gap, {ms(samples['stub_b2b']):.3f} against "
        f"{ms(samples['echo_b2b']):.3f} back to back; a one-block Lookup {ms(samples['one_block']):.3f}; "
        f"server in-process: parse {ms(server['server_parse']) * 1e3:.1f} us, cut the new hashes "
        f"{ms(server['server_cut']) * 1e3:.1f} us, the anchored walk {ms(server['server_walk']) * 1e3:.1f} us"
    )


class Echo:
    """The client of the echo server: a unary call of bytes (`echo(request)`, its 8-byte answer), and the
    two ways of starting a call before the client's own work that the next turn's overlap probe times."""

    def __init__(self, channel: Any) -> None:
        self._unary = channel.unary_unary(ECHO_METHOD)
        self._stream = channel.stream_unary(ECHO_STREAM_METHOD)

    def __call__(self, request: bytes) -> bytes:
        return self._unary(request)  # type: ignore[no-any-return]

    def opened_before(self, work: Callable[[], object], request: bytes) -> bytes:
        """A client-streaming call opened (its headers sent, the server's handler started) before `work`,
        `request` sent on it once `work` is done: the server wakes while the client works."""
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        reply = self._stream.future(iter(requests.get, None))
        work()
        requests.put(request)
        requests.put(None)
        return reply.result()  # type: ignore[no-any-return]

    def pinged_before(self, work: Callable[[], object], request: bytes) -> bytes:
        """An empty unary call sent (not awaited) before `work`, then `request`'s: the ping wakes the server."""
        ping = self._unary.future(b"")
        work()
        answer = self(request)
        ping.result()
        return answer


def _memcmp() -> Callable[[np.ndarray, np.ndarray], bool]:
    """Whether two arrays hold the same bytes, compared by libc's memcmp through ctypes, which releases the
    GIL for the call (bytes.startswith holds it): another thread's gRPC call runs meanwhile."""
    memcmp = ctypes.CDLL(None).memcmp
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int

    def equal(a: np.ndarray, b: np.ndarray) -> bool:
        return a.nbytes == b.nbytes and memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0

    return equal


@contextmanager
def echo_server() -> Iterator[Echo]:
    """A bare gRPC server in its own process; yields its client (`Echo`)."""
    import grpc

    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)])
        try:
            yield Echo(channel)
        finally:
            channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _report(report: Report, s: dict[str, float], tokens: int, args: argparse.Namespace) -> None:
    ms = {k: v * 1e3 for k, v in s.items()}
    label = f"{tokens:,} tokens"
    turn = f"next turn of {label} (+{args.new_tokens:,})"
    report.add(
        Figure.against(
            f"lookup {turn} over gRPC, chain memo + anchor",
            ms["turn_memo"],
            "ms",
            "same turn, today's client (every token hashed, repeated hashes)",
            ms["turn_today"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn} through Client.lookup, C1's compare on a worker (vs serial)",
            ms["turn_overlap"],
            "ms",
            "the same client, the compare first, then the request (overlap_compare off)",
            ms["turn_serial"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn} over gRPC, chain memo + anchor (vs raw echo)",
            ms["turn_memo"],
            "ms",
            "raw gRPC echo of the same request bytes",
            ms["echo_turn"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn}, its request by a bare stub (vs raw echo)",
            ms["turn_stub"],
            "ms",
            "raw gRPC echo of the same request bytes",
            ms["echo_turn"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn}, its request by a bare stub, back to back (vs raw echo)",
            ms["stub_b2b"],
            "ms",
            "raw gRPC echo of the same request bytes, back to back",
            ms["echo_b2b"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn}, the client's chain memo alone",
            ms["turn_chain"],
            "ms",
            "the whole next turn over gRPC",
            ms["turn_memo"],
        )
    )
    serial = "the memo, then the raw echo of the request (serial)"
    report.add(
        Figure.against(
            f"lookup {turn}, the memo overlapped: the echo's stream opened before it (vs serial)",
            ms["overlap_opened"],
            "ms",
            serial,
            ms["overlap_serial"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn}, the memo overlapped: the echo pinged before it (vs serial)",
            ms["overlap_pinged"],
            "ms",
            serial,
            ms["overlap_serial"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn}, C1's compare on a worker while the request flies (vs compared first)",
            ms["compare_meanwhile"],
            "ms",
            "the same compare (memcmp), the new blocks' hashes, the raw echo of the request, in series",
            ms["compare_first"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {turn} over gRPC, chain memo only (whole chain sent)",
            ms["turn_memo_only"],
            "ms",
            "same turn, today's client",
            ms["turn_today"],
        )
    )
    if "turn_memo_list" in ms:
        report.add(
            Figure.against(
                f"lookup {turn} over gRPC, chain memo + anchor, tokens as a list",
                ms["turn_memo_list"],
                "ms",
                "same turn, today's client",
                ms["turn_today"],
            )
        )
    report.add(
        Figure.against(
            f"lookup {label} cold over gRPC, hashes packed",
            ms["cold_packed"],
            "ms",
            "same, repeated hashes (before)",
            ms["cold_repeated"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {label} cold over gRPC, hashes packed (vs raw echo)",
            ms["cold_packed"],
            "ms",
            "raw gRPC echo of the same request bytes",
            ms["echo_cold"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {label} cold over gRPC, hashes packed (vs server)",
            ms["cold_packed"],
            "ms",
            "the server's own answer (tier lookup in-process)",
            ms["server"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {label} cold over gRPC, the hashes' check while the call flies (vs checked first)",
            ms["cold_check_meanwhile"],
            "ms",
            "the same client, the hashes checked, then the request (overlap_check off)",
            ms["cold_check_first"],
        )
    )
    report.add(
        Figure.against(
            f"lookup {label} cold from tokens (every token hashed)",
            ms["cold_tokens"],
            "ms",
            "same with the hashes in hand",
            ms["cold_packed"],
        )
    )
    report.notes["targets"] = (
        f"next turn <= 1 ms: {'met' if ms['turn_memo'] <= 1 else 'not met'}; "
        f"cold (hashes in hand) <= 3 ms: {'met' if ms['cold_packed'] <= 3 else 'not met'}"
    )
