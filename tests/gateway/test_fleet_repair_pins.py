"""Pins on the copies re-replication makes (docs/RETENTION.md R31; gateway/fleet_repair.py, gateway/fleet_servicer.py):
a real etcd, in-process nodes on loopback (real LMDB, real gRPC, and the bulk transport where Mooncake runs), one
moved clock. A copied block carries the pin its source holds on it; the target grants it in the transaction that
stores the block, within its own limits; a pin past its time is not sent."""

from __future__ import annotations

import pytest

from gateway.audit import AuditLog
from gateway.fleet_repair import encode_copy
from gateway.fleet_servicer import PIN_COPY_ACTOR, parse_copies
from kvstore.fleet.membership import Membership
from kvstore.native.records import BlockMeta
from kvstore.v1 import fleet_pb2 as pb
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import BLOCK, RUN_BLOCKS, SCOPE, chain, put
from tests.gateway.test_fleet_repair import _need_mooncake
from tiers import run_index
from tiers.run_index import RunBlock

HOUR = 3600.0
#: Every node's pin limits here (R24): pins of up to 200 hours, a budget far above what the tests pin.
PINS = {"pin_max_hours": 200.0, "pin_budget_bytes": 1 << 24}


def _kill(fleet: Fleet, loop_thread: LoopThread, name: str) -> None:
    """Stop node `name`'s server and end its registration: it is gone from the fleet, its copies with it."""
    node = fleet.nodes[name]
    loop_thread.run(node.halt())
    if node.registration is not None:
        loop_thread.run(node.registration.stop())
        node.registration = None


def _view_of(fleet: Fleet, loop_thread: LoopThread, names: set[str]) -> Membership:
    """A membership view once it sees exactly the nodes `names`."""
    view = fleet.view(len(names))
    loop_thread.run(view.wait_until(lambda m: set(m.nodes) == names, 10))
    return view


def _stored(fleet: Fleet, name: str, hashes: list[bytes]) -> list[bool]:
    """Which of the blocks node `name` holds (asked of the run index: no use of them is recorded)."""
    return run_index.held(fleet.nodes[name].tier.env, [SCOPE.key(h) for h in hashes])


@pytest.mark.parametrize("bulk", [False, True], ids=["grpc", "bulk"])
def test_r31_a_copy_made_by_re_replication_holds_the_pin_until_its_time(fleet: Fleet, loop_thread: LoopThread,
                                                                         bulk: bool) -> None:
    """A pinned run on a and b, unused past the tenant's 72-hour retention; b is killed and c joins: a's pass copies
    the run to c with its pin (until the same time), and a second pass sends nothing. Then a is killed too: c's
    copy, the only one left, stays while unpinned blocks past retention go to make room, and goes once the pin's
    time has passed."""
    if bulk:
        _need_mooncake()
    a, b = fleet.node("a", bulk=bulk, **PINS), fleet.node("b", bulk=bulk, **PINS)
    hashes, blocks = chain(RUN_BLOCKS, seed=1)  # one run
    until = fleet.clock.now() + 190 * HOUR
    for node in (a, b):
        put(node.tier, hashes, blocks)
        assert node.tier.pin(SCOPE, hashes[-1], until).until_s == until  # R28: one pin on each copy
    fleet.clock.advance(100 * HOUR)  # past retention: only the pin keeps the run now (and gets it copied)
    _kill(fleet, loop_thread, "b")
    c = fleet.node("c", bulk=bulk, capacity_bytes=2 * RUN_BLOCKS * BLOCK, **PINS)  # room for two runs
    view = _view_of(fleet, loop_thread, {"a", "c"})
    repairer = fleet.repairer("a", view, bulk=bulk)
    progress = fleet.one_pass(repairer)
    assert (progress.copied_blocks, progress.bulk_bytes) == (RUN_BLOCKS, RUN_BLOCKS * BLOCK if bulk else 0)
    assert (progress.pins_copied, progress.pins_short) == (1, 0)
    totals, held = c.tier.pins_of("default")
    assert [(p.key, p.until_s) for p in held] == [(SCOPE.key(hashes[-1]), until)]
    assert totals.charged_bytes == RUN_BLOCKS * BLOCK  # charged to the tenant's budget on c (R24)
    sent = progress.sent_bytes
    assert fleet.one_pass(repairer).sent_bytes == sent  # both count the pinned run alike: nothing more to send
    _kill(fleet, loop_thread, "a")  # c's copy is the only one left
    other = chain(RUN_BLOCKS, seed=2)
    put(c.tier, *other)  # c is full: the pinned run (the older) and this one
    fleet.clock.advance(75 * HOUR)  # `other` past retention too, the pin's time 15 hours off
    newer = chain(RUN_BLOCKS, seed=3)
    put(c.tier, *newer)  # its room comes from the unpinned run, not the older pinned one (R23)
    assert _stored(fleet, "c", hashes) == [True] * RUN_BLOCKS
    assert _stored(fleet, "c", other[0]) == [False] * RUN_BLOCKS
    fleet.clock.advance(20 * HOUR)  # past the pin's time; `newer` is within its retention
    put(c.tier, *chain(RUN_BLOCKS, seed=4))
    assert _stored(fleet, "c", hashes) == [False] * RUN_BLOCKS  # the pin expired (R25): the run went
    assert _stored(fleet, "c", newer[0]) == [True] * RUN_BLOCKS


def test_r31_an_expired_pin_is_not_copied_and_a_shorter_grant_is_counted(fleet: Fleet,
                                                                         loop_thread: LoopThread) -> None:
    """Of a's three pinned runs, one's pin is past its time (not swept yet): not sent. One's runs longer than the
    target allows: granted shorter there, counted and logged, and a's pin stays as it was. One pins a block inside
    its run: the copy is pinned on that block."""
    a = fleet.node("a", **PINS)
    runs = [chain(RUN_BLOCKS, seed=10 + i) for i in range(3)]
    start = fleet.clock.now()
    for hashes, blocks in runs:
        put(a.tier, hashes, blocks)
    expiring, long, inner = SCOPE.key(runs[0][0][-1]), SCOPE.key(runs[1][0][-1]), SCOPE.key(runs[2][0][1])
    assert a.tier.pin(SCOPE, runs[0][0][-1], start + HOUR).until_s
    assert a.tier.pin(SCOPE, runs[1][0][-1], start + 150 * HOUR).until_s
    assert a.tier.pin(SCOPE, runs[2][0][1], start + 5 * HOUR).until_s
    fleet.clock.advance(2 * HOUR)  # the first pin is past its time
    audit = AuditLog(fleet.root / "c-audit", clock=fleet.clock)
    c = fleet.node("c", audit=audit, pin_max_hours=100.0, pin_budget_bytes=1 << 24)
    now = c.tier.retention_clock.now()
    progress = fleet.one_pass(fleet.repairer("a", _view_of(fleet, loop_thread, {"a", "c"})))
    assert progress.copied_blocks == 3 * RUN_BLOCKS
    assert (progress.pins_copied, progress.pins_short) == (1, 1)
    assert {p.key: p.until_s for p in c.tier.pins_of("default")[1]} == {long: now + 100 * HOUR,
                                                                          inner: start + 5 * HOUR}
    assert expiring not in {p.key for p in c.tier.pins_of("default")[1]}
    assert {p.key: p.until_s for p in a.tier.pins_of("default")[1]} == {long: start + 150 * HOUR,
                                                                          inner: start + 5 * HOUR}
    for hashes, _ in runs:
        assert _stored(fleet, "c", hashes) == [True] * RUN_BLOCKS
    # Each grant on c is audited there (R27), as the fleet's, with the time asked and the time granted.
    entries = loop_thread.run(audit.read(tenant="default"))
    assert {(e.actor, e.action, e.new["block"], e.new["asked_until_s"], e.new["until_s"]) for e in entries} == {
        (PIN_COPY_ACTOR, "pin", runs[1][0][-1].hex(), start + 150 * HOUR, now + 100 * HOUR),
        (PIN_COPY_ACTOR, "pin", runs[2][0][1].hex(), start + 5 * HOUR, start + 5 * HOUR)}


def test_r31_a_copied_blocks_pin_is_on_the_wire_as_protobuf_encodes_it() -> None:
    """The repairer's hand-encoded CopiedBlock carries `pin_until_s` as protobuf serializes it, and the receiver's
    own parse reads it back (0 where the block has no pin)."""
    meta = BlockMeta(parent_hash=b"\x01" * 32, depth=3, size_bytes=4, checksum=7, created_s=0.0, last_access_s=1.8e9)
    block = RunBlock(key=b"\x02" * 48, meta=meta)
    wire = b"".join([*encode_copy(block, "t", b"data", pin_until_s=1.8e9 + 0.5), *encode_copy(block, "t", b"data")])
    want = [pb.CopiedBlock(key=block.key, namespace="t", parent_hash=meta.parent_hash, depth=3, data=b"data",
                           checksum=7, last_use_s=1.8e9, pin_until_s=pin) for pin in (1.8e9 + 0.5, 0.0)]
    assert wire == pb.CopyBlocksRequest(blocks=want).SerializeToString()
    assert [c.pin_until_s for c in parse_copies(wire)] == [1.8e9 + 0.5, 0.0]


@pytest.mark.parametrize("bulk", [False, True], ids=["grpc", "bulk"])
def test_r32_a_replica_that_holds_the_run_but_missed_its_pin_is_given_it(fleet: Fleet, loop_thread: LoopThread,
                                                                          bulk: bool) -> None:
    """Two runs on a and b, b away (its server stopped, still in the view) while a's copy of one is pinned and
    the other's pin, held on both, is extended there. b comes back holding every block: a's pass finds the
    missing pins in the digests and sends the pinned blocks again with them, so b holds both pins until a's times,
    charged once each to the tenant's budget; nothing is copied, and a second pass (and b's own) sends nothing."""
    if bulk:
        _need_mooncake()
    a, b = fleet.node("a", bulk=bulk, **PINS), fleet.node("b", bulk=bulk, **PINS)
    missed, extended = chain(RUN_BLOCKS, seed=20), chain(RUN_BLOCKS, seed=21)
    start = fleet.clock.now()
    for node in (a, b):
        put(node.tier, *missed)
        put(node.tier, *extended)
        assert node.tier.pin(SCOPE, extended[0][-1], start + 10 * HOUR).until_s
    loop_thread.run(b.halt())  # away: a's pins below cannot reach it
    assert a.tier.pin(SCOPE, missed[0][1], start + 150 * HOUR).until_s == start + 150 * HOUR
    assert a.tier.pin(SCOPE, extended[0][-1], start + 120 * HOUR).until_s == start + 120 * HOUR
    loop_thread.run(b.serve())
    view = _view_of(fleet, loop_thread, {"a", "b"})
    progress = fleet.one_pass(fleet.repairer("a", view, bulk=bulk))
    assert (progress.copied_blocks, progress.pins_copied, progress.pins_short) == (0, 2, 0)
    totals, held = b.tier.pins_of("default")
    assert {p.key: p.until_s for p in held} == {SCOPE.key(missed[0][1]): start + 150 * HOUR,
                                                SCOPE.key(extended[0][-1]): start + 120 * HOUR}
    # R24: each pin charges its prefix in the run once (the extended one is not charged again).
    assert (totals.pins, totals.charged_bytes) == (2, 2 * BLOCK + RUN_BLOCKS * BLOCK)
    assert b.tier.pins_of("default")[0] == a.tier.pins_of("default")[0]
    again = fleet.repairer("a", view, bulk=bulk)
    assert fleet.one_pass(again).sent_bytes == 0  # the digests agree now, pins included
    assert fleet.one_pass(fleet.repairer("b", view, bulk=bulk)).sent_bytes == 0


def test_r32_a_pin_the_replica_grants_shorter_is_not_asked_again(fleet: Fleet, loop_thread: LoopThread) -> None:
    """c holds a's pinned run without the pin and allows shorter pins: a's pass sends the pin once, c grants it
    within its own limits (counted short), and the next passes of the same repairer do not ask again; a pin
    moved later on a is sent again."""
    a = fleet.node("a", **PINS)
    c = fleet.node("c", pin_max_hours=100.0, pin_budget_bytes=1 << 24)
    hashes, blocks = chain(RUN_BLOCKS, seed=30)
    start = fleet.clock.now()
    put(a.tier, hashes, blocks)
    put(c.tier, hashes, blocks)
    assert a.tier.pin(SCOPE, hashes[-1], start + 150 * HOUR).until_s
    now = c.tier.retention_clock.now()
    repairer = fleet.repairer("a", _view_of(fleet, loop_thread, {"a", "c"}))
    progress = fleet.one_pass(repairer)
    assert (progress.copied_blocks, progress.pins_copied, progress.pins_short) == (0, 0, 1)
    assert {p.key: p.until_s for p in c.tier.pins_of("default")[1]} == {SCOPE.key(hashes[-1]): now + 100 * HOUR}
    sent = progress.sent_bytes
    assert sent == BLOCK  # only the pinned block went again
    fleet.clock.advance(HOUR)
    assert fleet.one_pass(repairer).sent_bytes == sent  # not asked again for the same time
    assert a.tier.pin(SCOPE, hashes[-1], start + 160 * HOUR).until_s == start + 160 * HOUR
    progress = fleet.one_pass(repairer)
    assert (progress.sent_bytes, progress.pins_short) == (2 * sent, 2)
    assert {p.until_s for p in c.tier.pins_of("default")[1]} == {now + 101 * HOUR}
