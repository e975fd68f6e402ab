"""A slice of each shipped trace replayed against a real `kvstore serve` through the real client, and
simulated: the usable hit rates agree within 1 point (the simulation runs the same rules)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.trace.load import load_trace
from kvstore.trace.replayer import replay
from kvstore.trace.requests import Trace
from kvstore.trace.simulate import SimSettings, Simulation
from tests.children import Child, write_config

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
SWA_TTL_S = 300.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    tmp = tmp_path_factory.mktemp("trace-replay")
    cfg = write_config(tmp / "kvstore.toml", {"store": {"data_dir": str(tmp / "store"), "capacity_bytes": 4 << 30},
                                              "swa": {"ttl_s": SWA_TTL_S}})
    child = Child("serve", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    try:
        yield child
    finally:
        child.kill_if_alive()


# Slices whose gaps are all under the TTL: the replay runs them in seconds, the simulation on
# their recorded times, and both see the same snapshots live. Sent one at a time, in arrival
# order, as the simulation takes them (Mooncake's requests share blocks across sessions).
@pytest.mark.parametrize(("name", "requests"), [("weka_session.json", 4), ("mooncake.jsonl", 12)])
def test_replay_and_simulation_agree_on_usable_hits(server: Child, name: str, requests: int) -> None:
    trace = load_trace(FIXTURES / name, requests=requests)
    tally = replay(trace, target=server.target, swa_ttl_s=SWA_TTL_S, concurrency=1, max_requests=requests)
    assert not tally.errors, server.log()
    assert tally.requests == requests and tally.usable_tokens > 0
    sim = Simulation(SimSettings(swa_ttl_s=SWA_TTL_S)).run(Trace(name=name, kind=trace.kind, requests=tally.done))
    assert sim.total.prompt_tokens == tally.prompt_tokens
    assert abs(sim.total.usable_hit_rate - tally.usable_hit_rate) <= 0.01
    assert abs(sim.total.lookup_hit_rate - tally.lookup_hit_rate) <= 0.01
    assert {"lookup", "put"} <= set(tally.latencies_s)
