"""A gateway's Get answered as the nodes' runs arrive, and a Put stream's boundary checks (docs/FLEET.md F69a, F69b).

Real processes on loopback: one etcd, three `kvstore serve` nodes (runs of 4 blocks of 16 tokens), a gateway at
one copy and one at two. Nodes are stopped (SIGSTOP) to hold a run's answer back, and killed (SIGKILL) to fail
one mid-Get; the test that kills two nodes runs last.
"""

from __future__ import annotations

import random
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvstore
from kvstore.client.blocks import stream_blocks
from kvstore.client.store import Client
from kvstore.errors import FailedPrecondition, Unavailable
from kvstore.fleet.placement import replicas
from kvstore.v1 import kvstore_pb2 as pb
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.kvstore.fleet.test_gateway import BLOCK_TOKENS, RUN_BLOCKS, RUN_TOKENS, _node, blocks, prompt
from tests.waiting import wait_until


@dataclass
class Fleet:
    """The module's fleet: nodes (id -> process) and gateways by copies (1, 2)."""

    nodes: dict[str, Child]
    gateways: dict[int, Child]


def _gateway(tmp: Path, etcd: str, cluster: str, copies: int) -> Child:
    cfg = write_config(
        tmp / f"gateway{copies}.toml",
        {
            "store": {"data_dir": str(tmp / f"gateway{copies}-none"), "block_tokens": BLOCK_TOKENS},
            "fleet": {"etcd": etcd, "cluster": cluster, "run_blocks": RUN_BLOCKS, "replication": copies},
        },
    )
    return Child(f"gateway{copies}", ["gateway", "--config", str(cfg), "--port", "0"], tmp / "logs")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One etcd, three nodes, then a gateway at one copy and one at two."""
    tmp = tmp_path_factory.mktemp("gateway-stream")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(3) as pool:
        nodes = dict(pool.map(lambda i: _node(tmp, etcd.endpoint, cluster, i), range(3)))
    gateways: dict[int, Child] = {}
    try:
        with ThreadPoolExecutor(2) as pool:
            gateways = dict(
                zip((1, 2), pool.map(lambda c: _gateway(tmp, etcd.endpoint, cluster, c), (1, 2)), strict=True)
            )
        yield Fleet(nodes=nodes, gateways=gateways)
    finally:
        for child in [*gateways.values(), *nodes.values()]:
            child.kill_if_alive()
        etcd.stop()


def _gets(fleet: Fleet) -> dict[str, int]:
    """Each live node's Get count, asked of it directly."""
    counts = {}
    for node, child in fleet.nodes.items():
        if child.alive:
            with kvstore.Client(child.target) as direct:
                counts[node] = direct.stats().gets
    return counts


def _first_reader(fleet: Fleet, plain: Client, chain: list[bytes], run: int) -> str:
    """The node the gateway reads `run` of `chain` from first (its draw: the one whose Get count moves)."""
    before = _gets(fleet)
    lo = run * RUN_BLOCKS
    assert all(
        s == pb.BLOCK_STATUS_FOUND
        for _, s, _ in stream_blocks(plain.connection, chain[lo : lo + RUN_BLOCKS], chain=chain, first_block=lo)
    )
    after = _gets(fleet)
    [node] = [n for n in after if after[n] != before[n]]
    return node


def _streamed(plain: Client, chain: list[bytes], got: list[tuple[int, int, bytes]]) -> Future[None]:
    """A Get of `chain` through `plain` on a thread, each block appended to `got` as the client receives it."""

    def run() -> None:
        for block in plain.stream(chain):
            got.append(block)

    pool = ThreadPoolExecutor(1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def test_f69a_a_gateways_get_answers_each_run_as_it_arrives(fleet: Fleet) -> None:
    """F69a: a Get of two runs through a gateway (one copy: each run on one node) with run 1's node stopped: the
    client receives run 0's blocks while run 1 is unanswered; once the node goes on, run 1's, each block once."""
    with kvstore.Client(fleet.gateways[1].target) as plain:
        while True:  # a prompt whose two runs lie on two nodes
            tokens = prompt(2 * RUN_TOKENS)
            chain = plain.hashes(tokens)
            data = blocks(2 * RUN_BLOCKS, plain.block_bytes)
            plain.put(tokens, data)
            run0, run1 = (_first_reader(fleet, plain, chain, r) for r in (0, 1))
            if run0 != run1:
                break
        stopped = fleet.nodes[run1].proc
        got: list[tuple[int, int, bytes]] = []
        stopped.send_signal(signal.SIGSTOP)
        try:
            done = _streamed(plain, chain, got)
            wait_until(lambda: len(got) >= RUN_BLOCKS, "run 0 answered while run 1's node is stopped")
            assert not done.done() and got == [(i, pb.BLOCK_STATUS_FOUND, data[i]) for i in range(RUN_BLOCKS)]
            stopped.send_signal(signal.SIGCONT)
            done.result(timeout=60)
        finally:
            stopped.send_signal(signal.SIGCONT)
    assert got == [(i, pb.BLOCK_STATUS_FOUND, d) for i, d in enumerate(data)]


def _raw_stream(plain: Client, requests: list[pb.PutRequest]) -> list[pb.PutResponse]:
    c = plain.connection
    return list(c.stream(c.kvstore.PutStream, iter(requests)))


def _put_request(
    plain: Client, tokens: list[int], data: list[bytes], chain: list[bytes], start: int, stop: int, **fields: bytes
) -> pb.PutRequest:
    """A Put through a gateway of blocks [start, stop), as kvstore.Client sends it (`run_fields`), `fields` over."""
    request = pb.PutRequest(
        parent_hash=chain[start - 1] if start else b"",
        token_ids=tokens[start * BLOCK_TOKENS : stop * BLOCK_TOKENS],
        blocks=data[start:stop],
    )
    for name, value in {**plain.connection.run_fields(chain, start), **fields}.items():
        setattr(request, name, value)
    return request


def test_f69b_a_put_streams_boundary_after_its_own_run_is_not_checked_again(fleet: Fleet) -> None:
    """F69b: in one Put stream through a gateway, a request from a run's first block whose request before stored
    that run to its end asks no node for the parent (F69's check skipped); a stream's first boundary request, and
    one naming another run key than the run before was stored under, are still checked (a Get of the parent)."""
    with kvstore.Client(fleet.gateways[2].target) as plain:
        tokens = prompt(4 * RUN_TOKENS)
        chain = plain.hashes(tokens)
        data = blocks(4 * RUN_BLOCKS, plain.block_bytes)
        before = sum(_gets(fleet).values())
        runs = [_put_request(plain, tokens, data, chain, r * RUN_BLOCKS, (r + 1) * RUN_BLOCKS) for r in range(3)]
        assert [len(r.block_hashes) for r in _raw_stream(plain, runs)] == [RUN_BLOCKS] * 3
        assert sum(_gets(fleet).values()) == before  # runs 1 and 2 followed their run in the same stream
        assert plain.lookup(tokens[: 3 * RUN_TOKENS]).found_blocks == 3 * RUN_BLOCKS

        # A stream from run 3 (run 2 stored by the stream before): its first request is checked, as F69 says.
        tail = _put_request(plain, tokens, data, chain, 3 * RUN_BLOCKS, 4 * RUN_BLOCKS)
        before = sum(_gets(fleet).values())
        assert len(_raw_stream(plain, [tail])[0].block_hashes) == RUN_BLOCKS
        assert sum(_gets(fleet).values()) == before + 1

        # A stream whose second request names another key for the run before (one placed on the same nodes, so
        # the check finds the parent there): that request is checked, as F69 says.
        other = prompt(2 * RUN_TOKENS)
        ochain = plain.hashes(other)
        odata = blocks(2 * RUN_BLOCKS, plain.block_bytes)
        placed = set(replicas(ochain[0], fleet.nodes, 2))
        key = next(k for k in iter(lambda: random.randbytes(32), b"") if set(replicas(k, fleet.nodes, 2)) == placed)
        wrong = _put_request(plain, other, odata, ochain, RUN_BLOCKS, 2 * RUN_BLOCKS, parent_run_key=key)
        before = sum(_gets(fleet).values())
        stored = _raw_stream(plain, [_put_request(plain, other, odata, ochain, 0, RUN_BLOCKS), wrong])
        assert [len(r.block_hashes) for r in stored] == [RUN_BLOCKS] * 2
        assert sum(_gets(fleet).values()) == before + 1


def test_f69b_a_put_stream_after_half_a_run_is_still_refused(fleet: Fleet) -> None:
    """F69b keeps F69 otherwise: a stream whose request before ended inside the run before (half of run 0) does not
    skip the check of the request from run 1's first block: FAILED_PRECONDITION, nothing of run 1 stored."""
    with kvstore.Client(fleet.gateways[2].target) as plain:
        tokens = prompt(2 * RUN_TOKENS)
        chain = plain.hashes(tokens)
        data = blocks(2 * RUN_BLOCKS, plain.block_bytes)
        half = _put_request(plain, tokens, data, chain, 0, RUN_BLOCKS // 2)
        run1 = _put_request(plain, tokens, data, chain, RUN_BLOCKS, 2 * RUN_BLOCKS)
        with pytest.raises(FailedPrecondition, match=r"the last of run 0\) is not stored on any live replica"):
            _raw_stream(plain, [half, run1])
        assert plain.lookup(tokens).found_blocks == RUN_BLOCKS // 2


def test_f69a_a_node_killed_mid_get_the_rest_comes_from_the_other_replica(fleet: Fleet) -> None:
    """F69a with F33: a Get of two runs through the gateway at two copies; the node it reads run 1 from is stopped,
    run 0 answered, then that node SIGKILLed: run 1 comes from its other replica, every block once, in order, and
    the client is told nothing of it."""
    with kvstore.Client(fleet.gateways[2].target) as plain:
        while True:  # a prompt whose runs are read first from two nodes
            tokens = prompt(2 * RUN_TOKENS)
            chain = plain.hashes(tokens)
            data = blocks(2 * RUN_BLOCKS, plain.block_bytes)
            plain.put(tokens, data)
            run0, run1 = (_first_reader(fleet, plain, chain, r) for r in (0, 1))
            if run0 != run1:
                break
        victim = fleet.nodes[run1]
        got: list[tuple[int, int, bytes]] = []
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            done = _streamed(plain, chain, got)
            wait_until(lambda: len(got) >= RUN_BLOCKS, "run 0 answered while run 1's first replica is stopped")
            assert not done.done()
            victim.kill9()
            done.result(timeout=60)
        finally:
            if victim.alive:
                victim.proc.send_signal(signal.SIGCONT)
    assert got == [(i, pb.BLOCK_STATUS_FOUND, d) for i, d in enumerate(data)]


def test_f69a_a_run_no_node_serves_is_told_after_the_blocks_before(fleet: Fleet) -> None:
    """F69a: a run that no node it may be read from answers (its replica and F42's next-ranked node, at one copy)
    is the client's error, UNAVAILABLE after the retry policy, once the run before it was answered whole. Kills
    nodes: the module's last test (the node killed above is still in the view: its lease runs)."""
    dead = next(n for n, child in fleet.nodes.items() if not child.alive)
    with kvstore.Client(fleet.gateways[1].target) as plain:
        while True:  # run 1 on a live node other than run 0's, the dead node ranked next for it
            tokens = prompt(2 * RUN_TOKENS)
            chain = plain.hashes(tokens)
            run1, after = replicas(chain[RUN_BLOCKS], fleet.nodes, 2)
            if after != dead or run1 == dead or replicas(chain[0], fleet.nodes, 1)[0] in (run1, dead):
                continue
            data = blocks(2 * RUN_BLOCKS, plain.block_bytes)
            plain.put(tokens, data)
            break
        got: list[tuple[int, int, bytes]] = []
        fleet.nodes[run1].kill9()
        with pytest.raises(Unavailable):
            _streamed(plain, chain, got).result(timeout=120)
    assert got == [(i, pb.BLOCK_STATUS_FOUND, data[i]) for i in range(RUN_BLOCKS)]
