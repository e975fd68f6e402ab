"""`kvstore bench store`'s KV cache events figures (docs/EVENTS.md, "Figures").

Put with events on against off: two `kvstore serve` processes on the same disk, one with
`[events] enabled` and a subscriber draining and decoding its PUB socket, the other
without; the same chains are put to each in turn, the order swapping each round, so what
else the machine does weighs on both alike. Target: on >= 0.95x off.

The event rate one subscriber keeps up with: a publisher (kvstore's, from a replay log in
memory) sends batches as a Put of `--batch-blocks` blocks makes them, as fast as it can; one
subscriber in another process receives and decodes each with kvstore's decoder (vLLM's when
it is installed). Its rate, blocks announced per second, beside the same socket pair's raw
rate (the same frames received, not decoded): what the decoding leaves of the transport.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.harness import serve_process
from kvstore.bench.report import Figure, Progress, Report

#: The subscriber process: receives `n` batches, decodes each unless "raw", prints the seconds from first to last.
_SUBSCRIBER = r"""
import sys, time, zmq
endpoint, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
decode = None
if mode == "kvstore":
    from kvstore.events.wire import decode
elif mode != "raw":
    try:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch
        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    except ImportError:
        from kvstore.events.wire import decode
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.set_hwm(0)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(endpoint)
print("ready", flush=True)
first = None
got = blocks = 0
last_seq = -1
gaps = 0
while got < n:
    if not sub.poll(10000):
        break
    topic, seq, payload = sub.recv_multipart()
    first = first or time.perf_counter()
    s = int.from_bytes(seq, "big")
    gaps += s != last_seq + 1 and last_seq >= 0
    last_seq = s
    if decode is not None:
        blocks += sum(len(e.block_hashes) for e in decode(payload).events)
    got += 1
print(time.perf_counter() - (first or time.perf_counter()), got, blocks, gaps, flush=True)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the events figures (part of `kvstore bench store`)."""
    parser.add_argument("--events-rounds", type=int, default=4,
                        help="rounds of Put with events on and off, each a chain to both servers (0: skip)")
    parser.add_argument("--events-batches", type=int, default=20_000,
                        help="batches the subscriber-rate figure sends (default 20,000)")
    parser.add_argument("--events-decoder", choices=("auto", "kvstore"), default="auto",
                        help="the subscriber's decoder: vLLM's where it is installed (auto, the default), or "
                             "kvstore's (vLLM's import, no part of the figure, takes a minute on a busy machine)")


def run(report: Report, args: argparse.Namespace, folder: Path, blocks: list[bytes],
        progress: Progress) -> list[Figure]:
    """The events figures (notes go to `report`); `blocks` are the bench's blocks (a share goes to each round)."""
    figures: list[Figure] = []
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        report.notes["events"] = f"not measured: {exc} (pip install 'kvstore[events]')"
        return figures
    if args.events_rounds > 0:
        on_s, off_s, total = _put_on_off(folder, blocks, args, progress)
        figures.append(Figure.against("put with events on (a subscriber decoding)", total / on_s / 1e9, "GB/s",
                                      "put with events off", total / off_s / 1e9))
        report.notes["events_put_bytes_per_side"] = total
    if args.events_batches > 0:
        rate, raw = _subscriber_rate(args.events_batches, args.batch_blocks, args.events_decoder)
        figures.append(Figure.against(f"events one subscriber decodes ({args.batch_blocks}-block batches)", rate,
                                      "blocks/s", "same frames received, not decoded", raw))
        report.notes["events_subscriber_batches_per_s"] = round(rate / args.batch_blocks)
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Drain:
    """A subscriber thread decoding every batch of a server's PUB socket (a router's share of the work)."""

    endpoint: str
    received: int = 0

    def __post_init__(self) -> None:
        import zmq

        from kvstore.events.wire import decode

        self._decode = decode
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                self._decode(self._sub.recv_multipart()[2])
                self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._ctx.destroy(linger=0)


def _put_on_off(folder: Path, blocks: list[bytes], args: argparse.Namespace,
                progress: Progress) -> tuple[float, float, int]:
    """(seconds of Puts with events on, off, bytes put to each): the same chains to both, in turn."""
    from kvstore.client import Client

    rounds = args.events_rounds
    per_round = max(len(blocks) // rounds, 1)
    data_bytes = per_round * rounds * len(blocks[0])
    pub, replay = _free_port(), _free_port()
    env = {"KVSTORE_EVENTS_ENABLED": "true", "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
           "KVSTORE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}"}
    seconds = {True: 0.0, False: 0.0}
    with ExitStack() as stack:
        on = stack.enter_context(Client(stack.enter_context(
            serve_process(folder / "events-on", data_bytes, args.block_tokens, extra_env=env))))
        off = stack.enter_context(Client(stack.enter_context(
            serve_process(folder / "events-off", data_bytes, args.block_tokens))))
        drain = _Drain(f"tcp://127.0.0.1:{pub}")
        stack.callback(drain.close)
        with progress.bar("put: events on and off", rounds, "round") as bar:
            for r in range(rounds):
                part = blocks[r * per_round:(r + 1) * per_round]
                base = 10_000_000 * (r + 1)  # a fresh chain each round: every Put writes
                tokens = list(range(base, base + len(part) * args.block_tokens))
                sides = [(True, on), (False, off)][::1 if r % 2 == 0 else -1]
                for events, client in sides:
                    start = time.perf_counter()
                    client.put(tokens, part, batch_blocks=args.batch_blocks)
                    seconds[events] += time.perf_counter() - start
                bar.update(1)
    return seconds[True], seconds[False], data_bytes


@dataclass(frozen=True)
class _Batch:
    seq: int
    topic: bytes
    payload: bytes


def _batches(n: int, blocks_per_batch: int) -> list[_Batch]:
    """`n` batches of one BlockStored of `blocks_per_batch` 32-byte hashes each, as a Put makes them."""
    from kvstore.events import wire

    out = []
    for seq in range(n):
        hashes = [(seq * blocks_per_batch + i).to_bytes(32, "big") for i in range(blocks_per_batch)]
        event = wire.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=64,
                                 lora_id=None, medium=wire.MEDIUM, lora_name=None, kvstore_node="bench",
                                 kvstore_tenant="default", kvstore_geometry="f303fd5c6387cfaa")
        out.append(_Batch(seq, b"kv-events/default/", wire.encode(wire.KVEventBatch(ts=time.time(), events=[event]))))
    return out


def _subscriber_rate(n: int, blocks_per_batch: int, decoder: str = "auto") -> tuple[float, float]:
    """(blocks/s one subscriber process decodes, blocks/s it receives without decoding) of `n` batches;
    `decoder` "kvstore": kvstore's decoder even where vLLM's is installed."""
    from kvstore.events.publisher import EventPublisher

    batches = _batches(n, blocks_per_batch)

    def no_replay(start: int) -> Iterator[_Batch]:
        return iter(())

    rates = []
    for mode in ("decode" if decoder == "auto" else "kvstore", "raw"):
        pub = EventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint="", replay=no_replay,
                             queue_batches=n + 1, hwm=0, replay_max=1)
        try:
            proc = subprocess.Popen([sys.executable, "-c", _SUBSCRIBER, pub.endpoint, str(n), mode],
                                    stdout=subprocess.PIPE, text=True, env={**os.environ})
            assert proc.stdout is not None
            proc.stdout.readline()  # "ready": subscribed (a slow joiner still may miss the first few)
            time.sleep(0.5)  # ZMQ's slow-joiner: let the subscription reach the PUB before sending
            pub.submit(batches)
            seconds, got, _, _ = proc.stdout.readline().split()
            proc.wait(timeout=60)
        finally:
            pub.close()
        rates.append(int(got) * blocks_per_batch / max(float(seconds), 1e-9))
    return rates[0], rates[1]
