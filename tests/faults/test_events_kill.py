"""KV cache events across a kill -9 (docs/EVENTS.md E1, E3): the consumer's view against the store after restart.

A `kvstore serve` with `[events]` on takes Puts from a writer thread while a consumer
(tests/events_consumer.py: vLLM's decoder, a real SUB socket) follows the stream; the
server is killed mid-stream, started again on the same data dir, and the consumer asks
the new replay socket for everything after the last batch it applied. Then its view must
be exactly what the store holds: no event for a block that was not stored (a batch in
flight at the kill was either committed with its blocks or not at all), none missed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'kvstore[events]')")

from kvstore.geometry import V4_1_FLASH
from tests.events_consumer import Consumer
from tests.faults.conftest import Chain, ServeProcess, make_chains
from tests.waiting import wait_until

EVENTS = {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}


def _endpoints(server: ServeProcess) -> tuple[str, str]:
    """The PUB and replay endpoints the server printed (`kvstore events: on A, replay on B, ...`)."""
    pattern = r"kvstore events: on (tcp://[\d.:]+), replay on (tcp://[\d.:]+)"
    wait_until(lambda: re.search(pattern, server.out_path.read_text()), "the server's events line")
    match = re.search(pattern, server.out_path.read_text())
    assert match is not None
    return match.group(1), match.group(2)


def _stored(server: ServeProcess, chains: list[Chain]) -> set[bytes]:
    """Every block hash of `chains` a Get finds in the store."""
    with server.client() as client:
        out: set[bytes] = set()
        for chain in chains:
            hashes = client.hashes(chain.tokens)
            got = client.get_hashes(hashes)
            out.update(h for h, b in zip(hashes, got.blocks, strict=True) if b is not None)
        return out


def test_e1_e3_the_consumers_view_matches_the_store_after_a_kill(
        serve: Callable[..., ServeProcess], config: Callable[..., Path], tmp_path: Path) -> None:
    conf = config(events=EVENTS)
    server = serve(tmp_path / "store", config=conf)
    consumer = Consumer(*_endpoints(server))
    with server.client() as client:
        chains = make_chains(client, 40, 6)
    stop = threading.Event()

    def write() -> None:
        try:
            with server.client() as c:
                for chain in chains:
                    if stop.is_set():
                        return
                    for lo in range(0, chain.blocks, 2):  # two blocks a Put: several batches a chain
                        c.put(chain.tokens[:(lo + 2) * chain.block_tokens], chain.payload(lo, lo + 2),
                              first_block=lo)
        except Exception:  # the kill cuts a Put off: expected, the store says what was stored
            return

    writer = threading.Thread(target=write)
    writer.start()
    try:
        wait_until(lambda: consumer.poll(10) >= 0 and consumer.last_seq >= 12, "a dozen batches received")
        server.kill9()  # mid-stream: Puts in flight, batches queued and unsent
    finally:
        stop.set()
        writer.join(timeout=60)
    seen_before = consumer.last_seq
    consumer.poll(100)  # whatever reached the socket before the kill
    server = serve(tmp_path / "store", config=conf)
    consumer.reconnect(*_endpoints(server))
    consumer.replay(consumer.last_seq + 1)
    try:
        fingerprint = V4_1_FLASH.fingerprint.hex()
        assert set(consumer.view) <= {("default", fingerprint)}
        assert consumer.stored("default", fingerprint) == _stored(server, chains)
        assert consumer.clears == 1  # one log across the restart: its numbers went on (E3)
        assert consumer.last_seq >= seen_before
    finally:
        consumer.close()
