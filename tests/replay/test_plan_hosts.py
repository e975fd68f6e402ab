"""Where a prefix lives, over one server (docs/PLANNER.md "Where a prefix lives"): a real `kvstore serve`
child on a real LMDB store, a Lookup asked for hosts, a same-host reader opening the store it names, and
the planner's (and `kvstore plan --hosts`') path and time for a worker on each host."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.prefix_hosts import PrefixHost, host_id
from replay.cost import CostModel
from replay.hosts import DIRECT_GPU, NETWORK, OTHER_HOSTS, SHM, PathRates, choose
from replay.planner import Planner
from tests.kvstore.client.test_colocated_support import Store, make_store, payload
from tiers import datadir

BLOCKS = 12
TOKENS = 16 * BLOCKS + 5


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, list[int], np.ndarray]]:
    """One server holding one prompt's 12 blocks (no test writes to it)."""
    store = make_store(tmp_path_factory.mktemp("hosts"))
    store.start()
    rng = random.Random(26)
    tokens = [rng.randrange(1 << 20) for _ in range(TOKENS)]
    client = store.client()
    data = payload(rng, BLOCKS, client.block_bytes)
    client.put(tokens, data)  # type: ignore[arg-type]  # a uint8 array [n, block_bytes] (Client.put's doc)
    yield store, tokens, data
    store.close()


def test_a_lookup_names_the_node_holding_the_found_prefix_and_its_store_opens(
        served: tuple[Store, list[int], np.ndarray]) -> None:
    store, tokens, data = served
    client = store.client()
    found = client.lookup(tokens, hosts=True)
    assert found.found_blocks == BLOCKS
    assert found.hosts == (PrefixHost(node_id=datadir.node_id(store.data_dir), host=socket.gethostname(),
                                      host_id=host_id(), block_ranges=((0, BLOCKS),), colocated=True,
                                      data_dir=str(store.data_dir.resolve())),)
    assert host_id() and found.hosts[0].blocks_below(5) == 5
    # The store it names is one a same-host reader opens: the blocks read there are the ones put.
    reader = store.reader(threads=1)
    assert Path(found.hosts[0].data_dir) == reader.data_dir.resolve()
    with reader.read(client, found.block_hashes) as read:
        assert read.found_blocks == BLOCKS
        out = np.zeros_like(data)
        read.copy_into(out)
    assert np.array_equal(out, data)
    assert client.lookup(tokens).hosts == ()  # not asked: not answered
    assert client.lookup([7] * 40, hosts=True).hosts == ()  # nothing found: no host holds it


def test_the_plan_says_the_path_and_time_of_a_worker_on_each_host(served: tuple[Store, list[int], np.ndarray]) -> None:
    store, tokens, _ = served
    client = store.client()
    slow = CostModel(recompute_tokens_per_s=1.0)  # recompute is dear: a fetch wins wherever it is not slower
    with Planner(client, cost=slow, report=False, lease_ms=0,
                 hosts=PathRates(network_gbps=1e-9, direct_gpu_gbps=40.0)) as planner:
        plan = planner.plan(tokens)
    beside, other = plan.hosts
    assert (beside.host, beside.host_id, beside.path) == (socket.gethostname(), host_id(), DIRECT_GPU)
    assert (beside.local_blocks, beside.remote_blocks, beside.fetch_gbps) == (BLOCKS, 0, 40.0)
    assert beside.data_dir == str(store.data_dir.resolve()) and beside.nodes == (datadir.node_id(store.data_dir),)
    assert (other.host, other.path, other.local_blocks, other.remote_blocks) == (OTHER_HOSTS, NETWORK, 0, BLOCKS)
    # A router prefers the worker beside the data: there a fetch wins; elsewhere the network loses to a prefill.
    assert beside.action != "full-prefill" and other.action == "full-prefill"
    assert beside.estimated_s < other.estimated_s
    assert choose(plan.hosts, ["elsewhere", host_id()]) is beside  # a free worker beside the data is chosen
    assert choose(plan.hosts, ["elsewhere"]) is other and choose([], [host_id()]) is None
    with Planner(client, report=False, lease_ms=0, hosts=PathRates(direct=False)) as planner:
        no_reader = planner.plan(tokens)
    assert no_reader.hosts[0].path == SHM and no_reader.hosts[0].fetch_gbps == CostModel().fetch_gbps
    with Planner(client, report=False, lease_ms=0) as planner:
        assert planner.plan(tokens).hosts == []  # not asked


def _plan(target: str, tokens_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "plan", "--tokens", str(tokens_file), "--target",
                           target, *extra], capture_output=True, text=True, timeout=120)


def test_kvstore_plan_hosts_shows_each_hosts_path_and_time(served: tuple[Store, list[int], np.ndarray],
                                                           tmp_path: Path) -> None:
    store, tokens, _ = served
    assert store.server is not None
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(tokens))
    out = _plan(store.server.target, prompt, "--hosts", "--json", "--network-gbps", "0.25")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert [(h["host"], h["path"], h["local_blocks"], h["remote_blocks"]) for h in shown["hosts"]] == [
        (socket.gethostname(), DIRECT_GPU, BLOCKS, 0), (OTHER_HOSTS, NETWORK, 0, BLOCKS)]
    assert shown["hosts"][1]["fetch_gbps"] == 0.25 and shown["hosts"][0]["host_id"] == host_id()
    text = _plan(store.server.target, prompt, "--hosts", "--no-direct")
    assert text.returncode == 0, text.stderr
    assert "hosts (where the found prefix lives" in text.stdout
    assert f"{socket.gethostname()} (nodes {datadir.node_id(store.data_dir)}): shm, {BLOCKS} found blocks local" \
        in text.stdout and "any other host: network" in text.stdout
    plain = json.loads(_plan(store.server.target, prompt, "--json").stdout)
    assert "hosts" not in plain  # without --hosts: the plan as before
    bad = _plan(store.server.target, prompt, "--hosts", "--network-gbps", "0", "--json")
    assert bad.returncode == 2 and "network_gbps" in json.loads(bad.stdout)["error"]["message"]
