"""kill -9 of `kvstore serve` while writes run: several PutStreams (group commit) beside failing
Puts, and several shared-memory transfer write batches.

tests/gateway/test_serve_process.py kills one client's unary Puts; here the
writes overlap: three streams whose batches the server commits in groups,
beside a client whose Puts abort (their parent is not stored), so commits and
aborts interleave in LMDB's single writer when the process dies; and three
transfer sessions storing blocks straight from their regions.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.transfer import Descriptor

STREAMS = 3
BLOCKS_PER_CHAIN = 480
#: Blocks per PutStream batch: small, so many batches queue and share commits.
BATCH_BLOCKS = 4


class KillSwitch:
    """Sends `sig` to a server once, from the first thread to see `ready()` (in an ack callback: the
    signal goes out while that thread's stream is mid-way, whatever the scheduler does to the others)."""

    def __init__(self, server: Any, sig: int, ready: Callable[[], bool]) -> None:
        self.server = server
        self.sig = sig
        self.ready = ready
        self.fired = False
        self._lock = threading.Lock()

    def check(self) -> None:
        with self._lock:
            if not self.fired and self.ready():
                self.fired = True
                self.server.proc.send_signal(self.sig)


def _stream(client: Any, chain: Any, switch: KillSwitch, errors: list[BaseException]) -> None:
    def acked(n: int) -> None:
        chain.acked += n
        switch.check()

    try:
        client.put(chain.tokens, chain.payload(), batch_blocks=BATCH_BLOCKS, on_batch=acked)
    except KVStoreError:
        pass  # the server died under it
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def _orphans(client: Any, kit: Any, stop: threading.Event, refused: list[int], errors: list[BaseException]) -> None:
    """Puts of blocks 1.. of a chain whose block 0 was never stored: each is refused and its txn aborts."""
    chain = kit.Chain(seed=999, blocks=2, block_tokens=client.block_tokens, block_bytes=client.block_bytes)
    while not stop.is_set():
        try:
            client.put(chain.tokens, chain.payload(1), first_block=1)
            errors.append(AssertionError("a Put on a parent that is not stored was accepted"))
            return
        except FailedPrecondition:
            refused[0] += 1
        except KVStoreError:
            return  # the server died under it
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            return


def _kill_mid_streams(serve: Callable[..., Any], cfg: Path, data_dir: Path, kit: Any,
                      sig: int = signal.SIGKILL) -> list[Any]:
    """Run the streams and the refused Puts, signal the server mid-way (SIGKILL, or SIGTERM: it must
    then exit 0, saying it stopped); the chains as acknowledged."""
    first = serve(data_dir, config=cfg)
    clients = [first.client(timeout_s=60) for _ in range(STREAMS + 1)]
    chains = kit.make_chains(clients[0], STREAMS, BLOCKS_PER_CHAIN)
    errors: list[BaseException] = []
    refused = [0]
    stop = threading.Event()
    # Once a quarter of all blocks is acknowledged (and a refused Put has run beside
    # them), every stream still has most of its chain to send: the signal lands mid-stream.
    target = STREAMS * BLOCKS_PER_CHAIN // 4
    switch = KillSwitch(first, sig, lambda: sum(ch.acked for ch in chains) >= target and refused[0] > 0)
    threads = [threading.Thread(target=_stream, args=(c, ch, switch, errors))
               for c, ch in zip(clients, chains, strict=False)]
    threads.append(threading.Thread(target=_orphans, args=(clients[-1], kit, stop, refused, errors)))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(timeout=120)
    stop.set()
    threads[-1].join(timeout=60)
    for c in clients:
        c.close()
    assert switch.fired, f"the streams ended before the signal: {errors}"
    status = first.proc.wait(timeout=60)
    if sig == signal.SIGKILL:
        assert status == -signal.SIGKILL
    else:
        assert status == 0, f"signal {sig} under load: exit {status}\n{first.log()}"
        assert "kvstore stopped" in first.err_path.read_text(), first.log()
    assert not errors, errors
    assert refused[0] > 0, "no refused Put ran beside the streams"
    return chains


def test_kill_9_during_group_committed_streams_keeps_every_acknowledged_block(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any) -> None:
    data_dir, cfg = tmp_path / "data", config()
    chains = _kill_mid_streams(serve, cfg, data_dir, kit)
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.census(client, chains)
        # The store takes the rest of every chain after the crash.
        for chain in chains:
            found = client.lookup(chain.tokens).found_blocks
            client.put(chain.tokens, chain.payload(found), first_block=found)
            chain.acked = chain.blocks
        kit.census(client, chains)


def test_kill_9_during_group_committed_streams_leaves_usage_equal_to_readable_blocks(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any) -> None:
    data_dir, cfg = tmp_path / "data", config()
    chains = _kill_mid_streams(serve, cfg, data_dir, kit)
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))
    # The rest of every chain, streamed beside refused Puts again, this time without a kill:
    # the totals must stay right while the process lives, not only once recounted at a start.
    clients = [again.client(timeout_s=60) for _ in range(STREAMS + 1)]
    errors: list[BaseException] = []
    refused = [0]
    stop = threading.Event()
    orphans = threading.Thread(target=_orphans, args=(clients[-1], kit, stop, refused, errors))
    orphans.start()
    streams = [threading.Thread(target=_finish, args=(c, ch, errors)) for c, ch in zip(clients, chains, strict=False)]
    for t in streams:
        t.start()
    for t in streams:
        t.join(timeout=60)
    stop.set()
    orphans.join(timeout=60)
    for c in clients:
        c.close()
    assert not errors, errors
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))
    assert again.stop() == 0, again.log()
    third = serve(data_dir, config=cfg)
    with third.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))


def test_sigterm_during_streams_stops_cleanly_and_keeps_every_acknowledged_block(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any) -> None:
    data_dir, cfg = tmp_path / "data", config()
    chains = _kill_mid_streams(serve, cfg, data_dir, kit, sig=signal.SIGTERM)
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))


def _finish(client: Any, chain: Any, errors: list[BaseException]) -> None:
    """Stream the rest of a chain, from its first block not stored."""
    try:
        found = client.lookup(chain.tokens).found_blocks
        client.put(chain.tokens, chain.payload(found), first_block=found, batch_blocks=BATCH_BLOCKS)
        chain.acked = chain.blocks
    except BaseException as exc:  # reported by the test
        errors.append(exc)


#: Blocks per transfer write batch.
WRITE_BATCH_BLOCKS = 16


def _write_by_transfer(session: Any, region: Any, chain: Any, switch: KillSwitch, errors: list[BaseException]) -> None:
    """Store the chain from a registered region, one write batch after another; `acked` counts DONE blocks."""
    client = session.connection
    bb = client.block_bytes
    try:
        region.view[:] = b"".join(chain.payload())
        for start in range(0, chain.blocks, WRITE_BATCH_BLOCKS):
            stop = min(start + WRITE_BATCH_BLOCKS, chain.blocks)
            descs = [Descriptor(region_id=region.region_id, offset_bytes=i * bb, length_bytes=bb)
                     for i in range(start, stop)]
            state = session.write(chain.tokens[: stop * client.block_tokens], descs, first_block=start).wait()
            chain.acked += state.done_prefix
            switch.check()
            if state.done_prefix < stop - start:
                return  # the server died under it (or refused): nothing after a gap is acknowledged
    except KVStoreError:
        pass  # the server died under it
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_kill_9_during_shm_transfer_writes(serve: Callable[..., Any], config: Callable[..., Path],
                                           tmp_path: Path, kit: Any) -> None:
    data_dir, cfg = tmp_path / "data", config()
    before = kit.segment_lines()
    server = serve(data_dir, config=cfg)
    clients = [server.client(timeout_s=60) for _ in range(STREAMS)]
    sessions = [c.transfer(path="shm") for c in clients]
    try:
        try:
            regions = [s.register(BLOCKS_PER_CHAIN * c.block_bytes) for s, c in zip(sessions, clients, strict=True)]
        except FailedPrecondition as exc:
            pytest.skip(f"the server cannot map this process's regions here: {exc.message}")
        chains = kit.make_chains(clients[0], STREAMS, BLOCKS_PER_CHAIN)
        errors: list[BaseException] = []
        target = STREAMS * BLOCKS_PER_CHAIN // 4
        switch = KillSwitch(server, signal.SIGKILL, lambda: sum(ch.acked for ch in chains) >= target)
        threads = [threading.Thread(target=_write_by_transfer, args=(s, r, ch, switch, errors))
                   for s, r, ch in zip(sessions, regions, chains, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert switch.fired, f"the writes ended before the kill: {errors}"
        server.kill9()  # reaps it: it died of the SIGKILL
        assert not errors, errors
    finally:
        for s in sessions:
            s.close()
        for c in clients:
            c.close()
    assert kit.segment_lines() - before == set()  # the sessions are closed: no segment left mapped or open
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))
