"""A worker process killed with -9 while the server copies into and out of its shared-memory regions.

tests/gateway/test_transfer_safety.py kills an idle client; here the client
dies with fetch and write batches running on a real `kvstore serve`: the
server must stay up, end the dead client's sessions and unmap its regions,
keep its store consistent (blocks the client stored are whole or absent, no
hole), and serve the next client.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHAINS = 4
BLOCKS_PER_CHAIN = 128
#: Batches each of the worker's two threads completes before it is killed.
DONE_BEFORE_KILL = 3

#: The worker: one thread fetches the stored chains into a region over and over, one
#: stores new chains from a region; each prints a line per completed batch.
_WORKER = textwrap.dedent("""
    import importlib.util, sys, threading
    spec = importlib.util.spec_from_file_location("faults_conftest", sys.argv[2])
    kit = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    from kvstore.client import Client
    from kvstore.transfer import Descriptor

    target, chains, blocks = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
    lock = threading.Lock()

    def say(line):
        with lock:
            print(line, flush=True)

    def reader():
        with Client(target) as client, client.transfer(path="shm") as session:
            region = session.register(blocks * client.block_bytes)
            stored = kit.make_chains(client, chains, blocks)
            n = 0
            while True:
                chain = stored[n % chains]
                state = session.fetch(client.hashes(chain.tokens), region)
                assert state.done_prefix == blocks and bytes(region.view) == b"".join(chain.payload())
                n += 1
                say(f"fetched {chain.seed}")

    def writer():
        with Client(target) as client, client.transfer(path="shm") as session:
            bb = client.block_bytes
            region = session.register(blocks * bb)
            seed = 100
            while True:
                chain = kit.make_chains(client, 1, blocks, first_seed=seed)[0]
                region.view[:] = b"".join(chain.payload())
                descs = [Descriptor(region_id=region.region_id, offset_bytes=i * bb, length_bytes=bb)
                         for i in range(blocks)]
                state = session.write(chain.tokens, descs).wait()
                assert state.done_prefix == blocks
                say(f"stored {seed}")
                seed += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (reader, writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
""")


def test_a_worker_killed_mid_transfer_leaves_the_server_serving(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any) -> None:
    server = serve(tmp_path / "data", config=config())
    with server.client() as client, client.transfer(path="shm") as probe:
        try:
            probe.deregister(probe.register(client.block_bytes))
        except kit.FailedPrecondition as exc:
            pytest.skip(f"the server cannot map this process's regions here: {exc.message}")
        stored = kit.make_chains(client, CHAINS, BLOCKS_PER_CHAIN)
        for chain in stored:
            client.put(chain.tokens, chain.payload())
            chain.acked = chain.blocks

    conftest = Path(__file__).with_name("conftest.py")
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, server.target, str(conftest), str(CHAINS),
                               str(BLOCKS_PER_CHAIN)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written: list[int] = []
    fetched = 0
    try:
        assert worker.stdout is not None
        while fetched < DONE_BEFORE_KILL or len(written) < DONE_BEFORE_KILL:
            line = worker.stdout.readline()
            assert line, f"the worker ended: {worker.stderr.read() if worker.stderr else ''}"
            kind, seed = line.split()
            if kind == "stored":
                written.append(int(seed))
            else:
                fetched += 1
        worker.kill()  # SIGKILL, batches running: no clean-up of any kind in the worker
        worker.wait(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert server.alive, server.log()

    with server.client() as client:
        # The dead worker's connection drops at once; its sessions end as their streams do.
        deadline = time.monotonic() + 30
        while (stats := client.transfer_stats()).sessions or stats.regions or stats.mapped_bytes:
            assert time.monotonic() < deadline, f"the dead worker's sessions or regions stayed: {stats}"
            time.sleep(0.02)
        # Its chains: those it saw stored are whole; the one in flight is whole or absent, no hole.
        mine = kit.make_chains(client, len(written) + 1, BLOCKS_PER_CHAIN, first_seed=100)
        for chain in mine[:-1]:
            chain.acked = chain.blocks
        kit.assert_usage_matches(client, kit.census(client, [*stored, *mine]))
        with client.transfer(path="shm") as session:
            region = session.register(BLOCKS_PER_CHAIN * client.block_bytes)
            assert session.fetch(client.hashes(stored[0].tokens), region).done_prefix == BLOCKS_PER_CHAIN
            assert bytes(region.view) == b"".join(stored[0].payload())
    assert server.stop() == 0, server.log()
