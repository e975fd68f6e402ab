"""A fleet transfer session's bulk transport (docs/FLEET.md F73, F74): each node that runs it writes its runs into this
process's region through Mooncake's engines (one per process, the region registered once however many node
sessions hold it); the nodes that do not stream.

One real etcd and three real `kvstore serve` nodes on loopback, module-scoped: two with `transfer.bulk =
"mooncake"` (two blocks a BulkFetch, so a run takes several calls), one without. Real Mooncake engines on both
sides. The test that restarts a node runs last.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.client import fleet_remote, transfer_bulk
from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_transfer import FleetTransferSession
from kvstore.client.store import Client
from kvstore.region import Region
from tests.children import Child, write_config
from tests.kvstore.client.test_fleet import (
    BLOCK_TOKENS,
    LEASE_TTL_S,
    RUN_BLOCKS,
    RUN_TOKENS,
    Fleet,
    Node,
    fleet_client,
    prompt,
)
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir

MISSING_ENGINE = ""
try:
    from mooncake.engine import TransferEngine  # noqa: F401
except Exception as exc:  # the package absent, or libibverbs missing
    MISSING_ENGINE = f"mooncake-transfer-engine cannot run here ({exc}); fix: {transfer_bulk.FIX}"

pytestmark = pytest.mark.skipif(bool(MISSING_ENGINE), reason=MISSING_ENGINE)

#: Which of the three nodes run the bulk transport.
BULK = (True, True, False)


def _start(tmp: Path, etcd: str, cluster: str, i: int) -> Node:
    sections: dict[str, dict[str, object]] = {
        "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": LEASE_TTL_S, "run_blocks": RUN_BLOCKS},
    }
    if BULK[i]:
        sections["transfer"] = {"bulk": "mooncake", "bulk_max_blocks": 2, "bulk_staging_bytes": 1 << 20}
    cfg = write_config(tmp / f"node{i}.toml", sections)
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return Node(node_id=datadir.node_id(tmp / f"store{i}"), child=child)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One etcd and three nodes (the first two with the bulk transport), started at once."""
    tmp = tmp_path_factory.mktemp("fleet-bulk")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: _start(tmp, etcd.endpoint, cluster, i), range(3)))
    fleet = Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes)
    fleet.tmp = tmp  # type: ignore[attr-defined]
    try:
        yield fleet
    finally:
        for n in fleet.nodes:
            n.child.kill_if_alive()
        etcd.stop()


def registered(region: Region) -> bool:
    """Whether the region is registered with this process's first engine now."""
    return registered_at(transfer_bulk.region_address(region), region.size_bytes)


def registered_at(address: int, size_bytes: int) -> bool:
    """Whether memory at `address` is registered with this process's first engine (Mooncake refuses a second
    registration of the same memory: asked raw, then undone; bookkeeping only on TCP, so also once unmapped)."""
    engine, _ = transfer_bulk.local_engines("127.0.0.1", 1)[0]
    if engine.register_memory(address, size_bytes):
        return True
    engine.unregister_memory(address)
    return False


def test_f73_a_region_is_registered_once_and_let_go_by_its_last_holder() -> None:
    """F73: two holders of one region register it once with the engine (a second raw registration is refused),
    the first to let go leaves it registered, the last unregisters it."""
    engine, _ = transfer_bulk.local_engines("127.0.0.1", 1)[0]
    with Region(1 << 16) as region:
        address = transfer_bulk.region_address(region)
        assert transfer_bulk.register_counted(engine, address, region.size_bytes)
        assert transfer_bulk.register_counted(engine, address, region.size_bytes)
        transfer_bulk.unregister_counted(engine, address)
        assert registered(region)
        transfer_bulk.unregister_counted(engine, address)
        assert not registered(region)


def bulk_sessions(fleet: Fleet, node_id: str) -> int:
    """Sessions on the bulk transport at a node now."""
    with Client(fleet.node(node_id).child.target) as c:
        return c.transfer_stats().bulk_sessions


def stored(client: FleetClient, until: Callable[[list[bytes]], bool]) -> tuple[list[bytes], list[bytes]]:
    """A prompt of 8 runs, drawn until `until` holds of its chain, put on the fleet: its chain and blocks."""
    while not until(chain := client.hashes(tokens := prompt(RUN_TOKENS * 8))):
        pass
    payload = [random.randbytes(client.block_bytes) for _ in range(len(chain))]
    client.put(tokens, payload)
    return chain, payload


def first_readers(client: FleetClient, chain: list[bytes]) -> list[str]:
    return [client.pool.read_order(chain[r.first_block], r.replicas)[0] for r in client.placement(chain)]


def test_f74_bulk_from_every_node_that_runs_it_and_the_stream_from_the_rest(fleet: Fleet) -> None:
    """F74: path "bulk": each run read first from a bulk node comes by the bulk transport, from both such nodes in
    one region (each thread's node sessions hold it), the others' runs streamed, every byte at an offset; a read of
    descriptors takes the same paths; path "auto" with no node of this host mapping does the same."""
    bulk = {n.node_id for n, b in zip(fleet.nodes, BULK, strict=True) if b}
    with fleet_client(fleet) as client:
        chain, payload = stored(
            client, lambda chain: set(first_readers(client, chain)) == {n.node_id for n in fleet.nodes}
        )
        expected = ["bulk" if n in bulk else "stream" for n in first_readers(client, chain)]
        size = client.block_bytes
        for path, local in (("bulk", None), ("auto", [])):
            with FleetTransferSession(client, path=path, local=local) as session:
                region = session.register((len(payload) + 1) * size)
                state = session.fetch(chain, region, offset_bytes=size)
                assert state.done_prefix == len(payload)
                assert bytes(region.view[size:]) == b"".join(payload)
                assert session.last_paths == expected
                assert {n for n, p in session.blocks_read if p == "bulk"} == bulk
                plain = fleet.nodes[2].node_id
                assert set(session.bulk_reasons) == {plain}
                assert "offers no bulk transport" in session.bulk_reasons[plain]
                # Learned once for that process of the node, not per session (a restore opens one per call).
                assert fleet_remote.no_bulk_reason(plain, client.view.nodes[plain]) == session.bulk_reasons[plain]
                region.view[:] = bytes(len(region.view))
                before = session.blocks_read.copy()
                got = session.read(session.descriptors(chain, region, offset_bytes=size)).wait()
                assert got.done_prefix == len(payload) and bytes(region.view[size:]) == b"".join(payload)
                bulk_blocks = sum(v - before[k] for k, v in session.blocks_read.items() if k[1] == "bulk")
                assert bulk_blocks == RUN_BLOCKS * expected.count("bulk")
                opened = session.bulk_sessions()
                assert set(opened) == bulk
                assert session.fetch(chain, region, offset_bytes=size).done_prefix == len(payload)
                # One bulk session per node, kept across fetches whichever threads read it (each costs an
                # OpenSession and an OpenBulk).
                assert session.bulk_sessions() == opened
                assert {n: bulk_sessions(fleet, n) for n in bulk} == dict.fromkeys(bulk, 1)
                assert registered(region)
                address = transfer_bulk.region_address(region)
            assert not registered_at(address, region.size_bytes)  # let go with the session: no write lands after


def test_f73_a_node_session_closing_leaves_the_region_registered_for_the_others(fleet: Fleet) -> None:
    """F73 (restarts a node): a bulk node restarted; the session's next fetch replaces that node's session (the old
    one closed, letting the region go) while the other bulk node's sessions still hold it: the region stays
    registered, and both nodes' runs come by the bulk transport again, every byte."""
    first, other = fleet.nodes[0], fleet.nodes[1]
    with fleet_client(fleet) as client:
        chain, payload = stored(
            client, lambda chain: {first.node_id, other.node_id} <= set(first_readers(client, chain))
        )
        size = client.block_bytes
        with FleetTransferSession(client, path="bulk") as session:
            region = session.register(len(payload) * size)
            assert session.fetch(chain, region).done_prefix == len(payload)
            old = client.view.nodes[first.node_id].started_at
            tmp: Path = fleet.tmp  # type: ignore[attr-defined]
            first.child.kill9()
            first.child = Child("node0", ["serve", "--config", str(tmp / "node0.toml"), "--port", "0"], tmp / "logs")
            client.view.wait_until(
                lambda nodes: first.node_id in nodes and nodes[first.node_id].started_at != old, 30.0
            )
            region.view[:] = bytes(len(region.view))
            state = session.fetch(chain, region)
            assert state.done_prefix == len(payload) and bytes(region.view) == b"".join(payload)
            readers = first_readers(client, chain)
            assert [
                p for p, n in zip(session.last_paths, readers, strict=True) if n in (first.node_id, other.node_id)
            ] == ["bulk"] * sum(n in (first.node_id, other.node_id) for n in readers)
            assert registered(region)
