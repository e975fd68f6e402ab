"""Redis lost under a `kvstore serve` whose SWA pool lives in it, mid-traffic, then brought back.

Rule 4 of docs/SWA_POOL.md on real processes: while the redis-server is gone
(killed) or hung (SIGSTOP: connections open, nothing answers), SWA calls are
misses and failed puts (answers, never error statuses), global KV Put and Get
keep working and the server stays up; once Redis is back (a new redis-server on
the same port, or the hung one resumed), SWA works again without restarting
kvstore, with its limits applied.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

POOL_CAP_BYTES = 256 << 20
#: Traffic rounds that must run with Redis up, then down, then back, before each step.
ROUNDS_PER_PHASE = 3


@dataclass
class Round:
    """One round of traffic: a KV block put and read back, a snapshot put and read back."""

    kv_ok: bool
    swa_stored: int
    swa_failed: int
    swa_hit: bool


@dataclass
class Traffic:
    """Rounds run by the traffic thread, and anything that escaped as an exception."""

    rounds: list[Round] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def wait_rounds(self, n: int, server: Any) -> None:
        """Wait until `n` rounds ran (bounded: the thread failing or the server dying ends the wait)."""
        while len(self.rounds) < n and not self.errors and server.alive:
            threading.Event().wait(0.002)
        assert not self.errors, self.errors
        assert server.alive, server.log()


def _traffic(client: Any, chain: Any, snapshot: bytes, traffic: Traffic) -> None:
    """Extend `chain` by one block per round and read it back; put and get one snapshot per round."""
    try:
        i = 0
        while not traffic.stop.is_set() and i < chain.blocks:
            tokens = chain.tokens[: (i + 1) * client.block_tokens]
            client.put(tokens, [chain.block(i)], first_block=i)
            chain.acked = i + 1
            kv_ok = client.get(tokens, first_block=i).blocks == [chain.block(i)]
            key = client.swa.key(tokens)
            data = snapshot[: client.swa.snapshot_bytes(len(tokens))]  # a snapshot's size depends on its T
            put = client.swa.put_many([(key, len(tokens), data)])
            got = client.swa.get_many([key])[0]
            traffic.rounds.append(Round(kv_ok=kv_ok, swa_stored=put.stored, swa_failed=put.failed,
                                        swa_hit=got == data))
            i += 1
    except BaseException as exc:  # reported by the test
        traffic.errors.append(exc)


def _lose(redis_server: Any, how: str) -> None:
    if how == "killed":
        redis_server.stop()  # SIGKILL
    else:
        redis_server.process.send_signal(signal.SIGSTOP)  # hung: its socket accepts, nothing answers


def _bring_back(redis_server: Any, how: str) -> None:
    if how == "killed":
        redis_server.start()  # the same port, empty: no persistence, limits forgotten
    else:
        redis_server.process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_redis_lost_mid_traffic_then_back(how: str, serve: Callable[..., Any], config: Callable[..., Path],
                                          tmp_path: Path, kit: Any, redis_server: Any) -> None:
    # Each SWA call to a hung Redis waits the socket timeout before it is a miss: 0.5 s, short, but with room
    # for a live Redis taking a 2.7 MB snapshot on a loaded box (0.2 s had little: the rounds after it is back
    # must all succeed).
    cfg = config(swa={"backend": "redis", "redis_url": redis_server.url, "socket_timeout_s": 0.5,
                      "cap_bytes": POOL_CAP_BYTES})
    server = serve(tmp_path / "data", config=cfg)
    # The client's deadline is also its direct path's Redis socket timeout: the first SWA call to a hung Redis
    # waits it out before falling back to the gateway (a miss, as asserted). 5 s, not 30: the same fallback,
    # 25 s sooner, and still ten times the server's own Redis timeout for any call on a loaded box.
    client = server.client(timeout_s=5)
    chain = kit.make_chains(client, 1, 400)[0]
    snapshot = os.urandom(client.swa.snapshot_bytes(2**20 + 1))  # the largest: a full window and the tail
    traffic = Traffic()
    thread = threading.Thread(target=_traffic, args=(client, chain, snapshot, traffic))
    thread.start()
    try:
        traffic.wait_rounds(ROUNDS_PER_PHASE, server)
        _lose(redis_server, how)  # mid-traffic
        down_from = len(traffic.rounds) + 1  # the round running at the kill may have reached Redis in time
        traffic.wait_rounds(down_from + ROUNDS_PER_PHASE, server)

        with server.client() as probe:
            down = traffic.rounds[down_from:]
            assert all(r.kv_ok for r in down)
            assert all((r.swa_stored, r.swa_failed, r.swa_hit) == (0, 1, False) for r in down), down
            n = chain.acked  # read once: the traffic thread goes on
            found = probe.lookup(chain.tokens[: n * client.block_tokens], swa_positions=[n * client.block_tokens])
            assert found.found_blocks == n and found.swa_position is None
            stats = probe.swa.stats()
            assert not stats.backend_up and stats.backend_errors > 0 and stats.failed_puts >= ROUNDS_PER_PHASE

            _bring_back(redis_server, how)
            back_from = len(traffic.rounds) + 1  # a round begun while Redis was down may still miss
            traffic.wait_rounds(back_from + ROUNDS_PER_PHASE, server)
            back = traffic.rounds[back_from:]
            assert all(r.kv_ok and (r.swa_stored, r.swa_failed, r.swa_hit) == (1, 0, True) for r in back), back
            stats = probe.swa.stats()
            assert stats.backend_up
            with redis.Redis(port=redis_server.port) as raw:
                assert int(raw.config_get("maxmemory")["maxmemory"]) == POOL_CAP_BYTES
            n = len(traffic.rounds)  # a round is recorded once its snapshot is stored and read back
            found = probe.lookup(chain.tokens[: n * client.block_tokens], swa_positions=[n * client.block_tokens])
            assert found.found_blocks == n and found.swa_position == n * client.block_tokens
    finally:
        traffic.stop.set()
        thread.join(timeout=60)
        client.close()
    assert not traffic.errors, traffic.errors
    assert server.alive, server.log()
    with server.client() as probe:
        kit.assert_usage_matches(probe, kit.census(probe, [chain]))
    assert server.stop() == 0, server.log()
