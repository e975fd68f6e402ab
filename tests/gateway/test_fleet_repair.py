"""The repairer's pass (gateway/fleet_repair.py, docs/FLEET.md F18) against a real etcd, two in-process nodes
on loopback (real LMDB, real gRPC), and a copy rate counted on a moved clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.fleet_repair import peer_credentials
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings, TlsSettings
from kvstore.errors import ConfigError
from kvstore.fleet.placement import replicas
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import SCOPE, chain, put
from tests.gateway.test_token_bucket import Recorded
from tiers import run_index


@pytest.mark.parametrize("bulk", [False, True], ids=["grpc", "bulk"])
def test_f18_a_pass_copies_every_run_to_the_replica_lacking_it_at_the_bucket_rate(fleet: Fleet, bulk: bool) -> None:
    if bulk:
        _need_mooncake()
    tiers, _, view = fleet.start(["a", "b"], bulk=bulk)
    a, b = tiers["a"], tiers["b"]
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3])]
    for hashes, blocks in chains:
        put(a, hashes, blocks)
    total = sum(len(x) for _, blocks in chains for x in blocks)
    bucket = Recorded(rate=total / 10, burst=total / 40)  # ten seconds of the clock for the whole copy
    r = fleet.repairer("a", view, bucket, bulk=bulk)
    progress = fleet.one_pass(r)
    assert (progress.copied_bytes, progress.sent_bytes, progress.under_replicated_bytes) == (total, total, 0)
    assert progress.bulk_bytes == (total if bulk else 0)  # the bound holds on either path
    assert progress.planned_nodes == ["a", "b"] and progress.under_replicated_runs == 0
    for hashes, blocks in chains:
        assert [data for _, data in b.read([SCOPE.key(h) for h in hashes])] == blocks
    # What went, counted per grant on the bucket's clock: never above the burst plus the rate's worth.
    sent = 0
    for t, n in bucket.grants:
        sent += n
        assert sent <= bucket.burst_bytes + bucket.rate_bytes_per_s * t + 1e-6
    assert sent == total and bucket.grants[-1][0] >= (total - bucket.burst_bytes) / bucket.rate_bytes_per_s - 1e-6
    # A second pass finds nothing to do: b's digests equal a's.
    again = fleet.one_pass(r)
    assert again.sent_bytes == total and again.passes == 2
    assert len(run_index.list_runs(b.env)) == len(chains)


def test_f18_of_two_holders_only_the_one_ranked_first_copies(fleet: Fleet, loop_thread: LoopThread) -> None:
    tiers, addresses, view = fleet.start(["a", "b", "c"])
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3, 4, 4, 2, 1])]
    for hashes, blocks in chains:  # a and b both hold every run: c, where it is a replica, lacks it
        put(tiers["a"], hashes, blocks)
        put(tiers["b"], hashes, blocks)
    live = ["a", "b", "c"]
    runs = run_index.list_runs(tiers["a"].env)

    async def plans(name: str) -> set[bytes]:
        r = fleet.repairer(name, view)
        try:  # both plan against the same state, before any copy: the race the rank order settles
            return {p.entry.run_key for p in await r.plan(runs, live, addresses)}
        finally:
            await r.peers.close()

    by_a, by_b = loop_thread.run(plans("a")), loop_thread.run(plans("b"))
    lacking = {e.run_key for e in runs if "c" in replicas(e.run_key, live, 2)}
    first = {k for k in lacking if next(n for n in replicas(k, live, 3) if n != "c") == "a"}
    assert lacking and first and first != lacking  # both cases are met
    assert (by_a, by_b) == (first, lacking - first)


def test_f20_nodes_copy_over_tls_checking_each_other_against_the_fleet_ca(fleet: Fleet, certs: Any,
                                                                       tmp_path: Path) -> None:
    tiers, _, view = fleet.start(["a", "b"], tls=certs)
    hashes, blocks = chain(6)
    put(tiers["a"], hashes, blocks)
    tls = TlsSettings(cert_file=str(certs.server.cert), key_file=str(certs.server.key))
    plain = peer_credentials(Settings(store=tiers["a"].settings, tls=TlsSettings()))
    wrong_ca = peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                         fleet=FleetSettings(ca_file=str(certs.other_ca.cert))))
    good = peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                     fleet=FleetSettings(ca_file=str(certs.ca.cert))))
    assert plain is None

    def run(credentials: Any) -> Any:
        return fleet.one_pass(fleet.repairer("a", view, credentials=credentials))

    refused = run(wrong_ca)  # b's certificate does not chain to that CA: nothing is sent, the runs count failed
    assert refused.copied_bytes == 0 and not any(run_index.held(tiers["b"].env, [SCOPE.key(h) for h in hashes]))
    assert run(good).copied_bytes == sum(map(len, blocks))
    assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks
    with pytest.raises(ConfigError, match=r"fleet\.ca_file"):
        peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                  fleet=FleetSettings(ca_file=str(tmp_path / "absent.pem"))))


def test_f17_a_copy_encoded_by_hand_is_the_message_protobuf_builds() -> None:
    """The repairer encodes CopyBlocks requests itself (one copy of each block's bytes, no message per
    block): they parse to the message protobuf would build, field for field, and serialize to the same bytes."""
    from gateway.fleet_repair import encode_copy
    from kvstore.native.records import BlockMeta
    from kvstore.v1 import fleet_pb2 as pb
    from tiers.run_index import RunBlock

    blocks = []
    for i, (size, depth) in enumerate([(1, 1), (127, 127), (300, 128), (70_000, 300_000)]):
        data = bytes([i]) * size
        meta = BlockMeta(parent_hash=bytes([i + 1]) * 32, depth=depth, size_bytes=size,
                         checksum=(1 << 64) - 1 - i, created_s=0.0,
                         last_access_s=1.75e9 + i / 3)
        blocks.append((RunBlock(key=bytes([i + 2]) * 48, meta=meta), "tenant-é" * (i + 1), data))
    wire = b"".join(piece for b, ns, data in blocks for piece in encode_copy(b, ns, data))
    want = pb.CopyBlocksRequest(blocks=[
        pb.CopiedBlock(key=b.key, namespace=ns, parent_hash=b.meta.parent_hash, depth=b.meta.depth, data=data,
                       checksum=b.meta.checksum, last_use_s=b.meta.last_access_s) for b, ns, data in blocks])
    assert pb.CopyBlocksRequest.FromString(wire) == want
    assert wire == want.SerializeToString()
    # A bulk copy's entry: no data, the block's address in the source's map (what the target reads).
    bulk = b"".join(piece for i, (b, ns, _) in enumerate(blocks)
                    for piece in encode_copy(b, ns, b"", source_address=(1 << 40) * (i + 1) + 7))
    want = pb.CopyBlocksRequest(blocks=[
        pb.CopiedBlock(key=b.key, namespace=ns, parent_hash=b.meta.parent_hash, depth=b.meta.depth,
                       checksum=b.meta.checksum, last_use_s=b.meta.last_access_s,
                       source_address=(1 << 40) * (i + 1) + 7) for i, (b, ns, _) in enumerate(blocks)])
    assert bulk == want.SerializeToString()


def _need_mooncake() -> None:
    from gateway.transfer_bulk import engine_missing

    reason = engine_missing()
    if reason:
        pytest.skip(reason)


def test_f18_copies_go_over_the_bulk_transport_where_both_ends_have_it(fleet: Fleet) -> None:
    """Both nodes run the bulk transport: the target reads every block from the source's map (none of their
    bytes in the calls), checks and stores it; a second pass finds nothing to send."""
    _need_mooncake()
    a, b = fleet.node("a", bulk=True), fleet.node("b", bulk=True)
    view = fleet.view(2)
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3])]
    for hashes, blocks in chains:
        put(a.tier, hashes, blocks)
    total = sum(len(x) for _, blocks in chains for x in blocks)
    r = fleet.repairer("a", view, bulk=True)
    progress = fleet.one_pass(r)
    assert (progress.copied_bytes, progress.bulk_bytes, progress.under_replicated_bytes) == (total, total, 0)
    for hashes, blocks in chains:
        assert [data for _, data in b.tier.read([SCOPE.key(h) for h in hashes])] == blocks
    assert len(run_index.list_runs(b.tier.env)) == len(chains)
    assert fleet.one_pass(r).bulk_bytes == total  # nothing more to copy


def test_f18_a_target_without_the_bulk_transport_is_sent_the_bytes_over_grpc(fleet: Fleet) -> None:
    """The source offers bulk; the target does not run it: it refuses the first batch (storing nothing), and
    that batch and the rest of the pass go over gRPC."""
    _need_mooncake()
    fleet.node("a", bulk=True)
    b = fleet.node("b")
    view = fleet.view(2)
    chains = [chain(n, seed=10 + i) for i, n in enumerate([4, 3, 2, 4])]
    for hashes, blocks in chains:
        put(fleet.nodes["a"].tier, hashes, blocks)
    total = sum(len(x) for _, blocks in chains for x in blocks)
    progress = fleet.one_pass(fleet.repairer("a", view, bulk=True))
    assert (progress.copied_bytes, progress.bulk_bytes, progress.failed_runs) == (total, 0, 0)
    for hashes, blocks in chains:
        assert [data for _, data in b.tier.read([SCOPE.key(h) for h in hashes])] == blocks


def test_f17_copies_arriving_together_are_one_durable_transaction_and_a_refusal_is_only_its_own(
        fleet: Fleet, loop_thread: LoopThread) -> None:
    """The receiver's GroupCommit: batches of calls that arrive while a transaction is written share the next
    one (one fsync); when that transaction is refused, each call is written alone, so only the call whose
    blocks are refused fails (here: a batch that extends a parent this node does not hold)."""
    import asyncio

    from gateway.fleet_servicer import GroupCommit
    from kvstore.errors import KVStoreError
    from kvstore.geometry import TINY
    from kvstore.prefix import root_hash
    from tests.gateway.test_fleet_copy import TOKENS
    from tiers.block_txn import PutBatch

    tier = fleet.node("a").tier
    chains = [chain(3, seed=200 + i) for i in range(8)]
    good = [PutBatch(scope=SCOPE, parent_hash=root_hash(TINY.fingerprint, TOKENS), hashes=hashes, blocks=blocks,
                     is_root=True) for hashes, blocks in chains]
    orphan_hashes, orphan_blocks = chain(2, seed=300)
    orphan = PutBatch(scope=SCOPE, parent_hash=orphan_hashes[0], hashes=orphan_hashes[1:], blocks=orphan_blocks[1:],
                      is_root=False)

    async def together(batches: list[list[PutBatch]]) -> tuple[GroupCommit, list[Any]]:
        commits = GroupCommit(tier)
        found = await asyncio.gather(*(commits.put(b) for b in batches), return_exceptions=True)
        return commits, found

    commits, found = loop_thread.run(together([[b] for b in good[:4]]))
    assert (commits.commits, commits.calls) == (1, 4)  # four calls, one transaction
    assert [r[0].written_blocks for r in found] == [3, 3, 3, 3]
    commits, found = loop_thread.run(together([[b] for b in good[4:6]] + [[orphan]] + [[good[6]]]))
    assert isinstance(found[2], KVStoreError)
    assert [r[0].written_blocks for r in (found[0], found[1], found[3])] == [3, 3, 3]
    for hashes, blocks in chains[:7]:
        assert [data for _, data in tier.read([SCOPE.key(h) for h in hashes])] == blocks
    assert not any(run_index.held(tier.env, [SCOPE.key(h) for h in orphan_hashes[1:]]))


def test_f18_a_rounds_copies_start_beside_the_last_rounds_within_one_window(fleet: Fleet,
                                                                              loop_thread: LoopThread) -> None:
    """A pass's rounds overlap: the next round's copies start while a call of the round before is still in flight
    (no round waits on the slowest lane of the last), and the whole pass keeps at most WINDOW calls in flight."""
    import asyncio

    from gateway import fleet_repair

    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(2, seed=i) for i in range(3 * fleet_repair.FIRST_ROUND_RUNS)]  # rounds of 8 runs, 16
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    copier = r.peers.copier
    later = asyncio.Event()
    seen = {"calls": 0, "in_flight": 0, "most": 0, "overlapped": False}

    def counted(address: str) -> Any:
        call = copier(address)

        async def copy(request: bytes, **kwargs: Any) -> Any:
            seen["calls"] += 1
            seen["in_flight"] += 1
            seen["most"] = max(seen["most"], seen["in_flight"])
            try:
                if seen["calls"] == 1:  # the first round's one call is held until a later round's call comes
                    try:
                        await asyncio.wait_for(later.wait(), 10.0)
                        seen["overlapped"] = True
                    except TimeoutError:
                        pass
                else:
                    later.set()
                return await call(request, **kwargs)
            finally:
                seen["in_flight"] -= 1

        return copy

    r.peers.copier = counted  # type: ignore[method-assign]
    progress = fleet.one_pass(r)
    assert seen["overlapped"] and seen["calls"] >= 2
    assert 2 <= seen["most"] <= fleet_repair.WINDOW
    total = sum(len(x) for _, blocks in chains for x in blocks)
    assert (progress.copied_bytes, progress.under_replicated_bytes, progress.failed_runs) == (total, 0, 0)
    for hashes, blocks in chains:
        assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18_a_lanes_batches_end_where_a_run_ends_when_the_next_run_fits_a_batch_whole(fleet: Fleet) -> None:
    """A run that does not fit what is left of a batch starts the next one whole (that call needs none before
    it, R6); a run larger than a batch goes over several, each after the first marked as continuing it."""
    from gateway.fleet_repair import RunPlan, _Lane
    from kvstore.native.records import BlockMeta
    from tiers.run_index import RunBlock, RunEntry

    def run(name: str, n: int) -> tuple[RunPlan, list[RunBlock]]:
        blocks = [RunBlock(key=f"{name}{i}".encode(), meta=BlockMeta(parent_hash=b"", depth=i + 1, size_bytes=10,
                                                                       checksum=0, created_s=0.0, last_access_s=0.0))
                  for i in range(n)]
        return RunPlan(entry=RunEntry(key=blocks[0].key, first_block=0), blocks=blocks), blocks

    fleet.start(["a"])
    r = fleet.repairer("a", fleet.views[0])
    r.batch_bytes = 30  # three blocks
    lane = _Lane(target="b", address="")
    lane.runs = [run("a", 2), run("b", 2), run("c", 5), run("d", 1)]
    got = [([b.key.decode() for b in batch], [plan.entry.key.decode() for plan, _ in done], starts)
           for batch, done, starts in r._batches(lane)]
    assert got == [(["a0", "a1"], ["a0"], True),  # b does not fit beside a: its own call
                   (["b0", "b1", "c0"], ["b0"], True),  # c is larger than a batch: it starts where room is
                   (["c1", "c2", "c3"], [], False),
                   (["c4", "d0"], ["c0", "d0"], False)]


def _copies_watched(r: Any, hold: Any) -> dict[str, Any]:
    """Wrap `r`'s CopyBlocks calls and reads: counts (calls, in flight, most in flight, reads, held = read and
    not answered, most held); `hold(seen)` is awaited inside each call before it goes (to hold the first)."""
    import asyncio

    loop = asyncio.get_running_loop()
    seen: dict[str, Any] = {"calls": 0, "in_flight": 0, "most": 0, "reads": 0, "held": 0, "most_held": 0,
                            "read": asyncio.Event()}
    copier, read = r.peers.copier, r._read

    def counted_read(*args: Any) -> Any:
        def note() -> None:
            seen["reads"] += 1
            seen["held"] += 1
            seen["most_held"] = max(seen["most_held"], seen["held"])
            seen["read"].set()

        loop.call_soon_threadsafe(note)
        return read(*args)

    def counted(address: str) -> Any:
        call = copier(address)

        async def copy(request: bytes, **kwargs: Any) -> Any:
            seen["calls"] += 1
            seen["in_flight"] += 1
            seen["most"] = max(seen["most"], seen["in_flight"])
            try:
                await hold(seen)
                return await call(request, **kwargs)
            finally:
                seen["in_flight"] -= 1
                seen["held"] -= 1

        return copy

    r.peers.copier = counted
    r._read = counted_read
    return seen


def test_f18_a_lane_sends_a_batch_that_starts_a_run_beside_the_one_before(fleet: Fleet,
                                                                            loop_thread: LoopThread) -> None:
    """Two runs in one lane, each its own batch: the second call goes while the first is in flight (runs are
    apart: a run's first block is stored without its parent, F17), and both are stored."""
    import asyncio
    import contextlib

    from tests.gateway.test_fleet_copy import BLOCK

    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(4, seed=40 + i) for i in range(2)]
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    r.batch_bytes = 5 * BLOCK  # one run's 4 blocks fill a lane's batch but not two: both runs in one lane

    async def go() -> tuple[Any, dict[str, Any]]:
        second = asyncio.Event()

        async def hold(seen: dict[str, Any]) -> None:
            if seen["calls"] == 1:  # the first call waits for the second to come (or gives up at the deadline)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(second.wait(), 10.0)
                seen["overlapped"] = second.is_set()
            else:
                second.set()

        seen = _copies_watched(r, hold)
        try:
            return await r.run_pass(), seen
        finally:
            await r.peers.close()

    progress, seen = loop_thread.run(go())
    assert seen["calls"] == 2 and seen["overlapped"] and seen["most"] == 2
    total = sum(len(x) for _, blocks in chains for x in blocks)
    assert (progress.copied_bytes, progress.under_replicated_bytes, progress.failed_runs) == (total, 0, 0)
    for hashes, blocks in chains:
        assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18_a_batch_that_continues_a_run_is_read_during_the_call_before_and_sent_after_its_answer(
        fleet: Fleet, loop_thread: LoopThread) -> None:
    """One run over two batches: the second is read while the first call is in flight (no call waits on its own
    read), and sent only once the first is answered (its parent stored first, R6)."""
    import asyncio

    from tests.gateway.test_fleet_copy import BLOCK

    tiers, _, view = fleet.start(["a", "b"])
    hashes, blocks = chain(4, seed=60)
    put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    r.batch_bytes = 2 * BLOCK

    async def go() -> tuple[Any, dict[str, Any]]:
        async def hold(seen: dict[str, Any]) -> None:
            if seen["calls"] == 1:  # the first call waits for the second batch's read
                while seen["reads"] < 2:
                    seen["read"].clear()
                    await asyncio.wait_for(seen["read"].wait(), 10.0)
                seen["read_ahead"] = seen["calls"] == 1

        seen = _copies_watched(r, hold)
        try:
            return await r.run_pass(), seen
        finally:
            await r.peers.close()

    progress, seen = loop_thread.run(go())
    assert seen["read_ahead"] and (seen["calls"], seen["most"]) == (2, 1)
    assert (progress.copied_bytes, progress.failed_runs) == (sum(map(len, blocks)), 0)
    assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18_a_pass_holds_at_most_held_batches_read_and_not_answered(fleet: Fleet, loop_thread: LoopThread,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ahead is bounded for the whole pass: never more than HELD_BATCHES batches read and not answered
    (their bytes in memory, or their read txns open), however many lanes."""
    from gateway import fleet_repair
    from tests.gateway.test_fleet_copy import BLOCK

    monkeypatch.setattr(fleet_repair, "HELD_BATCHES", 2)
    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(4, seed=80 + i) for i in range(6)]
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    r.batch_bytes = 4 * BLOCK  # a run a batch: a lane each, up to WINDOW

    async def go() -> tuple[Any, dict[str, Any]]:
        async def hold(seen: dict[str, Any]) -> None:
            return None

        seen = _copies_watched(r, hold)
        try:
            return await r.run_pass(), seen
        finally:
            await r.peers.close()

    progress, seen = loop_thread.run(go())
    assert seen["calls"] == len(chains) and seen["most_held"] == 2
    assert (progress.under_replicated_bytes, progress.failed_runs) == (0, 0)
    for hashes, blocks in chains:
        assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f16_a_run_that_branches_inside_is_walked_and_copied_whole(fleet: Fleet) -> None:
    """Two chains share a run's first two blocks and branch inside it, and a third block branches off the first:
    the run's walk (`run_index.members`, one cursor stepped over each block's children) finds every branch, parents
    before children, and a pass copies all of them."""
    import os

    from kvstore.geometry import TINY
    from kvstore.prefix import chain_hashes, root_hash
    from tests.gateway.test_fleet_copy import BLOCK, RUN_BLOCKS, TOKENS

    tiers, _, view = fleet.start(["a", "b"])
    a, b = tiers["a"], tiers["b"]
    tokens = list(range(RUN_BLOCKS * TOKENS))
    root = root_hash(TINY.fingerprint, TOKENS)
    branches = [tokens, tokens[:2 * TOKENS] + [t + 10**6 for t in tokens[2 * TOKENS:]],
                tokens[:TOKENS] + [t + 2 * 10**6 for t in tokens[TOKENS:3 * TOKENS]]]
    stored: dict[bytes, bytes] = {}
    for i, toks in enumerate(branches):
        hashes = chain_hashes(toks, block_tokens=TOKENS, parent=root)
        blocks = [stored.get(SCOPE.key(h)) or os.urandom(BLOCK) for h in hashes]
        put(a, hashes, blocks, 0 if i == 0 else (2 if i == 1 else 1))
        stored.update(zip((SCOPE.key(h) for h in hashes), blocks, strict=True))
    first = SCOPE.key(chain_hashes(tokens[:TOKENS], block_tokens=TOKENS, parent=root)[0])
    walked = run_index.members(a.env, first, RUN_BLOCKS)
    assert sorted(x.key for x in walked) == sorted(stored) and len(stored) == 4 + 2 + 2
    seen = set()
    for x in walked:  # parents before children (R6)
        assert x.key == first or x.key[:-32] + x.meta.parent_hash in seen
        seen.add(x.key)
    progress = fleet.one_pass(fleet.repairer("a", view))
    assert progress.copied_blocks == len(stored)
    assert [data for _, data in b.read(list(stored))] == list(stored.values())


def test_f18_the_next_round_is_planned_while_the_peers_answer_the_one_before(fleet: Fleet) -> None:
    """PLANNING_ROUNDS rounds plan at once: the second round's RunDigests is asked while the first round's is
    still unanswered (held here until it comes), and the pass still copies every run once."""
    import asyncio

    from gateway import fleet_repair

    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(2, seed=i) for i in range(3 * fleet_repair.FIRST_ROUND_RUNS)]  # rounds of 8 runs, 16
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    ask = r._ask
    second = asyncio.Event()
    seen = {"digests": 0, "overlapped": False}

    async def held(peer: str, address: str, method: str, request: Any) -> Any:
        if method == "RunDigests":
            seen["digests"] += 1
            if seen["digests"] == 1:  # the first round's question is held until the next round's comes
                try:
                    await asyncio.wait_for(second.wait(), 10.0)
                    seen["overlapped"] = True
                except TimeoutError:
                    pass
            else:
                second.set()
        return await ask(peer, address, method, request)

    r._ask = held  # type: ignore[method-assign]
    progress = fleet.one_pass(r)
    assert seen["overlapped"] and seen["digests"] == 2
    total = sum(len(x) for _, blocks in chains for x in blocks)
    assert (progress.copied_bytes, progress.under_replicated_bytes, progress.failed_runs) == (total, 0, 0)
    for hashes, blocks in chains:
        assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18_a_slow_progress_record_holds_no_copy_and_records_land_in_order(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass's first progress record is written beside its copies: etcd holding that put (here until a copy is
    answered) delays no copy, every record lands in the order made, and the pass returns once its last is written."""
    import asyncio

    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(n, seed=200 + i) for i, n in enumerate([3, 2, 4])]
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    r = fleet.repairer("a", view)
    copied = asyncio.Event()
    written: list[tuple[bool, int]] = []
    deliver = r._deliver

    async def delivered(*args: Any, **kwargs: Any) -> bool:
        went = await deliver(*args, **kwargs)
        copied.set()
        return went

    async def publish(progress: Any) -> None:
        if not written:
            await asyncio.wait_for(copied.wait(), 10)  # etcd slow: this put ends only once a copy was answered
        written.append((progress.running, progress.copied_blocks))

    monkeypatch.setattr(r, "_deliver", delivered)
    r.publish = publish
    progress = fleet.one_pass(r)
    total = sum(len(h) for h, _ in chains)
    assert progress.copied_blocks == total and not progress.running
    assert written[-1] == (False, total) and [c for _, c in written] == sorted(c for _, c in written)
