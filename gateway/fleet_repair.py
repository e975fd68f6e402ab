"""Re-replication: each node brings the runs it holds back to their replication factor (docs/FLEET.md F18).

A pass starts when the membership changes (a lease expired, a node joined) and
every `repair_interval_s` otherwise. For each run the node holds (tiers/run_index.py)
it ranks every live node by the run's rendezvous score (kvstore/fleet/placement.py);
the first `replication` are the run's replicas now. Exactly one holder acts for a
block: the node copies only blocks that no holder ranked above it holds (a digest
comparison, then a per-block check where digests differ), so after a node's loss
the surviving replica ranked first copies, and a survivor whose copy was damaged
(dropped when its checksum failed, F17) leaves the other survivor the blocks to send.
Each replica lacking blocks is asked which it holds (a copy is never sent twice),
and is sent the rest in batches of about `BATCH_BYTES`, each taken from a token
bucket (`gateway.token_bucket`) at `repair_bytes_per_s`, so foreground traffic keeps
the rest of the disk and the network.

A node that stops being a replica of a run (a node joined and ranks above it) keeps its copy while the new
replica fills, so copies never drop below the factor (docs/FLEET.md F21); it drops it at a later pass once every
replica confirms theirs (F79): each of the run's `replication` replicas answers RunDigests with this copy's digest,
then, asked to carry this copy's last uses (`RaiseUses`, F19), says it holds every block with a last use at least
this copy's; no block of it is leased or pinned here (checked in the transaction that removes it), this node does
not drain, and the membership view is not stale (etcd answered this pass). Anything in doubt keeps the copy.

A draining node (`kvstore fleet drain`, F21) stays a member and serves; its record says `draining`, and every
node's pass ranks the draining members after the others, so the run's replicas are the first `replication`
others: they get its copies (from the holder ranked first, the draining node sending only what none above it
holds). The draining node counts, from the replicas' answers (RunDigests, HeldBlocks), the in-window bytes of
its runs they do not hold yet (`drain_left_bytes`); a pass that finds none left and nothing failed revokes its
lease (it leaves the membership) and says `drained`.

Where this node and the target both run the bulk transport (`[transfer] bulk = "mooncake"`), a batch's
bytes are not in the call: the target's engine reads them from this node's map, verified in place
(`gateway.fleet_bulk`); gRPC carries them otherwise, and for the rest of a pass to a target that refused.

A copied block this node holds a live pin on carries the pin's time (docs/RETENTION.md R31): the target pins
its copy until then in the transaction that stores it, within its own limits for the tenant (`pins_granted`,
`pins_short` in its answer; a short one is logged here and counted, and this node's pin stays as it is). A pin
past its time is not sent. So a copy re-replication makes holds the pins the run's other copies hold.

A replica that holds every block of a run but not a pin this node holds on one (it was down or away when the pin
was asked) is found by the digests, which carry each copy's live pins (R32): no holder ranked above this node
holding that pin as long, this node sends the pinned block again with its pin, and the replica grants it in the
transaction that stores (touches) the block. A pin sent to a replica is not sent to it again until its time
changes here (`_pins_sent`), so one the replica granted shorter or refused (its own limits) is not asked each pass.

Progress (`kvstore.fleet.repair_progress.RepairProgress`) is published in etcd under
the node's lease, so `kvstore fleet status` shows under-replicated bytes fleet-wide.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gateway.fleet_bulk import BATCH_BYTES, BulkSource
from gateway.fleet_servicer import MAX_KEYS, SERVICE, STREAM_OPENED, TOKEN_METADATA
from gateway.token_bucket import TokenBucket
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings
from kvstore.errors import ConfigError, DeadlineExceeded, KVStoreError
from kvstore.fleet.etcd import EtcdSession, follow_prefix, stop_task
from kvstore.fleet.membership import Membership, Registration, session_for
from kvstore.fleet.placement import replicas, scores, superseded
from kvstore.fleet.repair_progress import RepairProgress, drain_key, repair_key
from kvstore.native import blockcopy
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tiers import namespaces, pins, run_index
from tiers.lmdb_tier import LmdbBlockTier
from tiers.reads import ReadStatus
from tiers.retention import TOUCH_GRANULARITY_S
from tiers.run_index import RunBlock, RunDigest, RunEntry

log = logging.getLogger("kvstore.fleet.repair")
#: CopyBlocks calls one pass keeps in flight (over every target): reads, the network and the receivers'
#: fsyncs overlap, while the token bucket still bounds the bytes (F18).
WINDOW = 4
#: Runs planned at a time (their blocks' metas are held while planned); the first rounds are smaller
#: (FIRST_ROUND_RUNS, doubling), so the first copies start while the rest is planned.
RUNS_PER_ROUND = 512
FIRST_ROUND_RUNS = 8
#: Rounds planned at once (the next round's own metas read while the peers answer the questions of the one before).
PLANNING_ROUNDS = 2
#: Rounds' worth of metas (full rounds: RUNS_PER_ROUND runs of `run_blocks`) whose copies may be under way at once:
#: a round's copies start as soon as it is planned, beside those of the rounds before, while the blocks the copying
#: rounds hold stay within it (F18b: a round of small runs copies beside a big one, not after it).
COPYING_ROUNDS = 2
#: Calls one lane keeps in flight: a batch that starts a run goes beside the one before it (runs are apart); one
#: that continues a run waits for the answer to the one before (its parent stored first, R6).
LANE_DEPTH = 2
#: Batches read (their bytes, or their read txn over the bulk transport) and not answered yet, per pass: each
#: lane reads its next batch while its call is in flight, so no call waits on its own read (F18).
HELD_BATCHES = 2 * WINDOW
#: F18d: a gRPC batch larger than this goes as a CopyBlocksStream of pieces of at most this many block bytes, each
#: read while the one before is sent and committed by the receiver while the next arrives (its read, the network
#: and the receiver's commit overlap inside one batch; a piece continuing a run needs no answer before it).
STREAM_PIECE_BYTES = 4 << 20
#: F86: passes given up (the view moved) that the next pass may resume over, at most: past them it plans every run.
RESUMED_VIEWS = 4
#: F87: runs a periodic pass (the settled view unchanged) plans at most; a node holding more sweeps them over several
#: passes, each taking the next runs in key order after the last one's, wrapping (50,000 runs of 256 blocks: ~13M
#: block records read, ~2 min of a core on the dev box; an 8 TB node's ~440,000 runs take 9 passes).
SWEEP_RUNS = 50_000
#: Seconds a CopyBlocks call may take.
CALL_TIMEOUT_S = 30.0
#: Seconds a question (RunDigests, HeldBlocks) may take: a node that does not answer one within it is
#: taken as down for the rest of the pass (a SIGSTOPped node would otherwise hold the pass a deadline per run).
ASK_TIMEOUT_S = 10.0
#: gRPC statuses that say the peer is not there now (its channel is dialed afresh at the next call).
_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Peers:
    """gRPC channels to the other nodes, one per address, each call carrying the fleet's token.

    Args:
        token: the fleet's token (None: none is sent).
        max_message_bytes: the message size the nodes take.
        credentials: TLS to the nodes (`peer_credentials`); None: plaintext.
    """

    def __init__(self, token: bytes | None, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.metadata = ((TOKEN_METADATA, token.decode()),) if token else ()
        self.credentials = credentials
        self.max_message_bytes = max_message_bytes
        self.options = [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes),
                        # A node restarted on its address is dialed again within a second, not after
                        # gRPC's default backoff (up to two minutes after repeated refusals).
                        ("grpc.initial_reconnect_backoff_ms", 500),
                        ("grpc.min_reconnect_backoff_ms", 500),
                        ("grpc.max_reconnect_backoff_ms", 1000)]
        self._stubs: dict[str, fleet_pb2_grpc.FleetStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._copiers: dict[str, Callable[..., Awaitable[pb.CopyBlocksResponse]]] = {}
        self._streamers: dict[str, grpc.aio.StreamUnaryMultiCallable] = {}

    def stub(self, address: str) -> fleet_pb2_grpc.FleetStub:
        """The Fleet stub of the node at `address`."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = (grpc.aio.secure_channel(address, self.credentials, options=self.options) if self.credentials
                       else grpc.aio.insecure_channel(address, options=self.options))
            self._channels[address] = channel
            stub = self._stubs[address] = fleet_pb2_grpc.FleetStub(channel)
        return stub

    def copier(self, address: str) -> Callable[..., Awaitable[pb.CopyBlocksResponse]]:
        """CopyBlocks of the node at `address`, taking the request already encoded (`encode_copy`)."""
        return self._raw_call(self._copiers, address, lambda channel: channel.unary_unary(
            SERVICE + "CopyBlocks", request_serializer=None, response_deserializer=pb.CopyBlocksResponse.FromString))

    def streamer(self, address: str) -> grpc.aio.StreamUnaryMultiCallable:
        """CopyBlocksStream of the node at `address` (F18d): a call its encoded pieces are written to."""
        return self._raw_call(self._streamers, address, lambda channel: channel.stream_unary(
            SERVICE + "CopyBlocksStream", request_serializer=None,
            response_deserializer=pb.CopyBlocksResponse.FromString))

    def _raw_call(self, calls: dict[str, Any], address: str, make: Callable[[grpc.aio.Channel], Any]) -> Any:
        """`calls`' multicallable for `address`, made on its channel (dialled if need be) the first time."""
        call = calls.get(address)
        if call is None:
            self.stub(address)
            call = calls[address] = make(self._channels[address])
        return call

    def forget(self, address: str) -> None:
        """Drop the channel to `address` (it did not answer): the next call dials it afresh, so a node
        restarted there is reached at once rather than after the old channel's reconnect backoff. The old
        channel is closed by `close_retired` (closing it now would cancel the calls still on it)."""
        self._stubs.pop(address, None)
        self._copiers.pop(address, None)
        self._streamers.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._retired.append(channel)

    async def close_retired(self) -> None:
        """Close the channels `forget` dropped (call it when none of their calls can be in flight)."""
        retired, self._retired = self._retired, []
        for channel in retired:
            await channel.close()

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
        self._copiers.clear()
        self._streamers.clear()
        await self.close_retired()


@dataclass
class RunPlan:
    """One run this node is to copy: its blocks and, per target node id, the blocks the target lacks."""

    entry: RunEntry
    blocks: list[RunBlock]
    sends: dict[str, list[RunBlock]] = field(default_factory=dict)
    #: Targets whose copy of the run is not made yet (a send failed, or has not ended).
    pending: set[str] = field(default_factory=set)


@dataclass
class Round:
    """What planning a round of runs found: the runs to copy, and those it could not decide (a node that
    ranks above this one or a replica did not answer: which blocks it holds is unknown), retried next pass."""

    plans: list[RunPlan] = field(default_factory=list)
    undecided_runs: int = 0
    undecided_bytes: int = 0
    #: A draining node's runs whose replicas among the others lack some of its blocks (or did not say), and the
    #: bytes they lack, as they answered before this round's copies (F21: the drain ends when a pass finds none).
    short_runs: int = 0
    short_bytes: int = 0
    #: F79: runs this node holds but is no longer a replica of, whose every replica answered this copy's digest:
    #: (the run, its blocks counted, its replicas), dropped once the replicas confirm its last uses.
    stale: list[tuple[RunEntry, list[RunBlock], tuple[str, ...]]] = field(default_factory=list)

    def held_blocks(self) -> int:
        """Blocks whose metas the round holds until its copies and stale step end."""
        return sum(len(plan.blocks) for plan in self.plans) + sum(len(blocks) for _, blocks, _ in self.stale)


class _Window:
    """A pass's bounds on its copies (F18): calls in flight over every target (`calls`, WINDOW), and batches
    read and not answered (`held`, HELD_BATCHES: what a pass holds in memory, or under open read txns)."""

    def __init__(self) -> None:
        self.calls = asyncio.Semaphore(WINDOW)
        self.held = asyncio.Semaphore(HELD_BATCHES)


@dataclass
class _Ready:
    """One batch read and ready to send: the encoded request, and over the bulk transport the read txn that keeps
    its blocks' pages in place until the call is answered."""

    chunk: list[RunBlock]
    request: bytes
    count: int
    size: int
    #: The pins the request carries (R31): storage key -> time.
    pins: dict[bytes, float]
    #: The bulk transport's open read txn (None: the bytes are in the request).
    txn: Any = None
    #: F18d: the batch's blocks after the first piece (`request`), in pieces read as the stream sends them; empty:
    #: the batch is one CopyBlocks.
    rest: list[list[RunBlock]] = field(default_factory=list)

    def end(self) -> None:
        """Answered or given up: the target reads no more of the map's pages."""
        if self.txn is not None:
            self.txn.abort()
            self.txn = None


@dataclass
class _Lane:
    """Runs sent to one target one batch after another (a run is never split over two lanes, so its
    parents always reach the target before its children, R6)."""

    target: str
    address: str
    runs: list[tuple[RunPlan, list[RunBlock]]] = field(default_factory=list)
    size: int = 0


class FleetRepairer:
    """The node's re-replication task.

    Args:
        tier: the node's store.
        node_id: this node's id.
        membership: the live view of the fleet.
        replication: copies per run.
        run_blocks: blocks per run.
        window_s: the retention floor: only blocks used within it are copied (older ones may go anyway), unless
            `retention_of` names each tenant's own.
        bucket: the copy rate.
        peers: channels to the other nodes.
        interval_s: seconds between passes while membership does not change.
        publish: writes the progress record (None: not published).
        bulk: this node's engine for copies over the bulk transport; None: every copy goes over gRPC.
    """

    def __init__(self, tier: LmdbBlockTier, *, node_id: str, membership: Membership, replication: int,
                 run_blocks: int, window_s: float, bucket: TokenBucket, peers: Peers, interval_s: float,
                 publish: Callable[[RepairProgress], Awaitable[None]] | None, bulk: BulkSource | None = None) -> None:
        self.tier = tier
        self.node_id = node_id
        self.membership = membership
        self.replication = replication
        self.run_blocks = run_blocks
        self.window_s = window_s
        self.bucket = bucket
        self.peers = peers
        self.interval_s = interval_s
        self.publish = publish
        self.bulk = bulk
        #: Bytes per CopyBlocks: BATCH_BYTES, within half the message size the nodes take.
        self.batch_bytes = max(1, min(BATCH_BYTES, peers.max_message_bytes // 2))
        self._names: dict[bytes, str] = {}
        self.progress = RepairProgress(node_id=node_id)
        #: Called once when a drain has left nothing to copy (leave the membership: revoke the lease); None: a
        #: drained node stays a member.
        self.leave: Callable[[], Awaitable[None]] | None = None
        #: Whether a drain of this node is requested (it answers None when etcd does not: unknown, nothing
        #: changes); None: drains are not looked for.
        self.drain_requested: Callable[[], Awaitable[bool | None]] | None = None
        #: Set when this node's drain request changes in etcd (F85: its key's watch, `watch_drain`): `_run` passes at
        #: once, not at the next periodic pass; None: a drain is noticed at the next pass.
        self.drain_changed: asyncio.Event | None = None
        #: Writes whether this node drains into its membership record (F21: no one places on it); None: not written.
        self.mark_draining: Callable[[bool], Awaitable[None]] | None = None
        #: The nodes the pass under way ranks after the others (draining: F21), this one among them while it drains.
        self._draining: frozenset[str] = frozenset()
        #: The session the repairer's own etcd calls go through (progress, drain check); None: it makes none.
        self.etcd: EtcdSession | None = None
        #: Closed by `stop` after the membership view (the repairer's own etcd session).
        self.closing: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._published_at = 0.0
        #: The progress record's put under way (`_publish`), None before the first.
        self._publishing: asyncio.Future[None] | None = None
        #: The nodes (id -> address) the pass under way planned over, and those of them draining; None between passes.
        self._planned: tuple[frozenset[tuple[str, str]], frozenset[str]] | None = None
        #: Peers that did not answer in the pass under way: not asked again in it.
        self._down: set[str] = set()
        #: Peers that refused a copy over the bulk transport in the pass under way: sent over gRPC in it.
        self._grpc_only: set[str] = set()
        #: Targets that answered a CopyBlocksStream UNIMPLEMENTED (an older node): one CopyBlocks a batch this pass.
        self._unary_only: set[str] = set()
        #: Targets whose CopyBlocksStream answered its opening (initial metadata) this pass: they serve it.
        self._streams_served: set[str] = set()
        #: R32: (target, block's storage key) -> the pin's time last sent there, in a CopyBlocks it answered: not sent
        #: again for that time (a shorter grant or refusal: the target's limits, asked once); pruned past their time.
        self._pins_sent: dict[tuple[str, bytes], float] = {}
        #: F18f: the nodes (sorted ids) of the last pass that planned every run, failed none and saw no drain, over a
        #: view etcd answered; None: no such pass since the last one that did not (the next pass plans every run).
        self._settled: tuple[str, ...] | None = None
        #: F86: the nodes (sorted ids) each pass given up since the settled one planned over, oldest first: the next
        #: pass resumes over them (a run is skipped only where none of these views, nor the settled one, moved it).
        self._given_up: list[tuple[str, ...]] = []
        #: F87: the key of the last run the last periodic pass's sweep planned (the next starts after it); b"": none.
        self._swept_to = b""
        #: F79: whether etcd answered this pass's drain check (a stale copy is dropped only then); True where the
        #: repairer asks etcd nothing (`drain_requested` None: the view's staleness alone decides).
        self._etcd_answered = True

    def start(self) -> None:
        """Run passes in the background until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-repair")

    async def stop(self) -> None:
        """Cancel the task, close the channels and the membership view."""
        if self._task is not None:  # a pass's clean-up after the cancel may take a while: cancelled again after 5 s
            await stop_task(self._task, again_s=5.0)  # again while a cancel is lost (aetcd)
            self._task = None
        if self._publishing is not None:  # the last record's put: let it end (bounded by the session's deadline)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._publishing
        await self.peers.close()
        await self.membership.close()
        if self.bulk is not None:
            self.bulk.close()
        for close in self.closing:
            await close()

    async def _run(self) -> None:
        seen = -1
        while True:
            # A draining node passes again soon, until a pass finds nothing left to copy (F21).
            wait_s = 1.0 if self.progress.draining and not self.progress.drained else self.interval_s
            with contextlib.suppress(DeadlineExceeded):  # no change within the interval: a periodic pass
                await self._wait_for_change(seen, wait_s)
            seen = self.membership.revision
            if self.drain_changed is not None:
                self.drain_changed.clear()  # the pass below reads the request as it is now
            try:
                await self.pass_until_view_moves()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end re-replication: logged, and the next pass tries again
                log.exception("fleet: a re-replication pass failed")
                # The record must not say a pass is under way that ended (the fleet would never settle),
                # nor that nothing is left: the pass counts as failed until one completes.
                self.progress.running = False
                self.progress.failed_runs += 1
                await self._publish(force=True, wait=True)

    async def _wait_for_change(self, seen: int, timeout_s: float) -> None:
        """Return once the view moved past `seen` or a drain was asked or cancelled for this node (F85: the drain
        key's watch sets `drain_changed`, so a drain starts at once, not at the next periodic pass).

        Raises:
            DeadlineExceeded: neither happened within `timeout_s`.
        """
        moved = asyncio.ensure_future(self.membership.wait_until(_changed_since(seen), timeout_s))
        if self.drain_changed is None:
            await moved
            return
        asked = asyncio.ensure_future(self.drain_changed.wait())
        try:
            done, _ = await asyncio.wait({moved, asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (moved, asked):
                f.cancel()
            await asyncio.gather(moved, asked, return_exceptions=True)
        if asked not in done:
            moved.result()  # the view moved, or DeadlineExceeded

    async def pass_until_view_moves(self) -> RepairProgress:
        """`run_pass`, given up as soon as the membership differs from the one it planned over: the
        next pass, over the view as it is now, starts at once (a pass planned over a node that left
        would copy to and wait on it, and finish having done nothing the new view needs)."""
        self._planned = None
        kept = self._settled, list(self._given_up)
        work = asyncio.ensure_future(self.run_pass())
        moved = asyncio.ensure_future(self.membership.wait_until(self._view_moved, 1e9))
        try:
            await asyncio.wait({work, moved}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            moved.cancel()
            given_up, planned = not work.done(), self._planned
            if given_up:
                work.cancel()
            await asyncio.gather(work, moved, return_exceptions=True)
        if given_up:
            self._resume_after(kept, planned)
            log.info("fleet: the membership changed during a re-replication pass; planning again over it")
            return self.progress
        return work.result()

    def _resume_after(self, kept: tuple[tuple[str, ...] | None, list[tuple[str, ...]]],
                      planned: tuple[frozenset[tuple[str, str]], frozenset[str]] | None) -> None:
        """F86: a pass given up leaves the next one what it started from (`kept`: the settled nodes and the views given
        up since), with its own view added, so that pass resumes rather than plans every run. Not when it planned
        while a node drained (its ranking was not the placement's), nor past RESUMED_VIEWS given up in a row; a pass
        given up before it planned over any view adds nothing."""
        settled, given_up = kept
        if planned is None:
            self._settled, self._given_up = settled, given_up
            return
        nodes, draining = planned
        if settled is None or draining or len(given_up) >= RESUMED_VIEWS:
            self._settled, self._given_up = None, []
            return
        self._settled, self._given_up = settled, [*given_up, tuple(sorted(n for n, _ in nodes))]

    def _pass_nodes(self, m: Membership) -> dict[str, str]:
        """node id -> address of the nodes a pass plans over: every member, draining ones too (they hold copies and
        serve; they rank after the others, `_draining_in`), but an id whose address a later-started record names
        (F42: a wiped node's old id while its lease runs; counted, the one process there would confirm a run for
        both ids, and a third copy would be dropped as stale, leaving one)."""
        gone = superseded(m.nodes)
        return {n: r.address for n, r in m.nodes.items() if n not in gone}

    def _draining_in(self, m: Membership) -> frozenset[str]:
        """The members whose records say they drain, and this node while it drains (a member or, drained, not):
        no pass counts them as replicas (F21)."""
        mine = {self.node_id} if self.progress.draining else set()
        return frozenset({n for n, r in m.nodes.items() if r.draining} | mine)

    def _view_moved(self, m: Membership) -> bool:
        return self._planned is not None and (frozenset(self._pass_nodes(m).items()),
                                              self._draining_in(m)) != self._planned

    async def _follow_drain(self) -> None:
        """F21: a drain requested is marked in this node's record (no one places on it from then); one cancelled
        before it ended is unmarked (placed on again). After it ended (the lease revoked), a cancel stops the
        progress record coming back (`--cancel` deleted it): the node joins again at its restart."""
        p = self.progress
        self._etcd_answered = True
        if self.drain_requested is None:
            return
        requested = await self.drain_requested()
        self._etcd_answered = requested is not None
        if requested is None or requested == p.draining:
            return  # etcd did not answer (the next pass asks again), or nothing changed
        if p.drained:
            self.publish = None
            return
        if self.mark_draining is not None:
            try:
                await self.mark_draining(requested)
            except KVStoreError as exc:  # the record is unchanged: the next pass tries again
                log.warning("fleet: cannot mark node %s %s: %s", self.node_id,
                            "draining" if requested else "no longer draining", exc)
                return
        p.draining, p.drain_left_bytes, p.drain_left_runs = requested, 0, 0
        log.info("fleet: node %s %s", self.node_id, "drains: it leaves once the other nodes hold its runs"
                 if requested else "no longer drains (cancelled)")

    async def _leave_drained(self) -> None:
        """F21: every run this node holds is at its replication on the other nodes, as they answered: leave the
        membership (the lease revoked: its record goes with it) and say `drained`. The pass is not given up when
        its own record leaves the view (`_planned` cleared): it ends, and publishes that."""
        self._planned, self.progress.drained = None, True
        if self.leave is not None:
            await self.leave()
        log.info("fleet: node %s is drained: the other nodes hold every run it held; it left the membership and "
                 "may be stopped", self.node_id)

    async def run_pass(self) -> RepairProgress:
        """One pass over every run held, against the membership as it is now; returns the progress."""
        p = self.progress
        await self._follow_drain()
        addresses = self._pass_nodes(self.membership)
        if self.membership.stale or not addresses or (self.node_id not in addresses and not p.drained):
            return p  # etcd away, or our own record not seen yet: the view cannot be planned over
        self._draining = self._draining_in(self.membership)
        self._planned, self._down, self._grpc_only = (frozenset(addresses.items()), self._draining), set(), set()
        self._unary_only, self._streams_served = set(), set()
        now = self.tier.retention_clock.now()
        self._pins_sent = {k: u for k, u in self._pins_sent.items() if u > now}
        await self.peers.close_retired()  # the last pass's calls have all ended
        p.planned_nodes, p.running = sorted(addresses), True
        p.under_replicated_bytes = p.under_replicated_runs = p.failed_runs = 0
        left_bytes = left_runs = 0
        await self._publish(force=True)
        started, planning_s, copied_before = time.monotonic(), 0.0, p.copied_bytes
        runs = await self.tier.call(run_index.list_runs, self.tier.env)
        (settled, self._settled), (given_up, self._given_up) = (self._settled, None), (self._given_up, [])
        held_runs = len(runs)
        if settled is not None and not self._draining:
            if given_up or settled != tuple(sorted(addresses)):
                # On a thread: a node's every run ranked over every view (80 nodes, 550,000 runs: ~45 s of Python)
                # must not hold the event loop that serves its calls.
                runs = await asyncio.to_thread(self._moved_since, runs, [list(settled), *map(list, given_up)],
                                               sorted(addresses))
            else:  # F87: a periodic pass over the settled view sweeps a part
                runs, self._swept_to = sweep(runs, self._swept_to, SWEEP_RUNS)
        p.pass_runs, p.held_runs = len(runs), held_runs
        self._names = await self.tier.call(run_index.namespace_names, self.tier.env)
        planned = 0
        # Each round is planned while the one before is copied (their runs are apart: what one round asks of
        # a peer does not depend on the other's copies); the first is small, so copies start soon. F18: one
        # window of calls in flight for the whole pass; a round's copies start as soon as it is planned, beside
        # the last round's (each run whole in one lane, a run's first block stored without its parent, F17), so
        # no round waits on the slowest lane of the one before; rounds copy while their metas held stay within
        # COPYING_ROUNDS full rounds' (F18b), and PLANNING_ROUNDS are planned.
        window = _Window()
        copying: list[tuple[asyncio.Future[None], int]] = []  # each round copying, and the blocks it holds
        copying_cap = COPYING_ROUNDS * RUNS_PER_ROUND * self.run_blocks
        # F18b: the first round is planned at once while the metas of the runs after it are read ahead (as many
        # blocks as a first round of full runs holds); those are planned biggest first, so a big run's copies start
        # before the rounds of small runs, not after them.
        first, rest = runs[:FIRST_ROUND_RUNS], runs[FIRST_ROUND_RUNS:]
        ahead: dict[bytes, tuple[list[RunBlock], dict[bytes, float]]] = {}
        reading = asyncio.ensure_future(self._read_ahead(rest, now, ahead))
        chunks: Iterator[Sequence[RunEntry]] | None = None
        # F18: PLANNING_ROUNDS rounds are planned at once, so this node reads one round's metas while the peers
        # answer (read theirs for) the round before, each in its own process; their copies still start in order.
        planning: list[asyncio.Future[Round]] = []

        def plan(chunk: Sequence[RunEntry]) -> None:
            planning.append(asyncio.ensure_future(self.plan_round(chunk, sorted(addresses), addresses, ahead)))

        async def plan_ahead() -> None:
            nonlocal chunks
            if chunks is None:
                await reading
                size_of = {key: sum(b.meta.size_bytes for b in blocks) for key, (blocks, _) in ahead.items()}
                chunks = _rounds(sorted(rest[:len(ahead)], key=lambda r: -size_of[r.key]) + list(rest[len(ahead):]),
                                 2 * FIRST_ROUND_RUNS)
            while len(planning) < PLANNING_ROUNDS and (chunk := next(chunks, None)) is not None:
                plan(chunk)

        try:
            if first:
                plan(first)
            await plan_ahead()
            while planning:
                at = time.monotonic()
                found = await planning[0]
                planning.pop(0)
                planning_s += time.monotonic() - at
                # F18b: rounds copy at once while the blocks they hold stay within COPYING_ROUNDS full rounds'
                # (each waits only for enough of them to end, whichever they are).
                holds = found.held_blocks()
                while copying and sum(n for _, n in copying) + holds > copying_cap:
                    await asyncio.wait([f for f, _ in copying], return_when=asyncio.FIRST_COMPLETED)
                    for f, _ in copying:
                        if f.done():
                            f.result()  # a round that failed ends the pass (its error raised here)
                    copying = [(f, n) for f, n in copying if not f.done()]
                await plan_ahead()
                planned += len(found.plans) + found.undecided_runs
                # F18: an undecided run is counted under-replicated (and failed) until a pass can decide it.
                p.under_replicated_runs += len(found.plans) + found.undecided_runs
                p.under_replicated_bytes += found.undecided_bytes + sum(
                    b.meta.size_bytes for plan in found.plans for s in plan.sends.values() for b in s)
                p.failed_runs += found.undecided_runs
                left_bytes, left_runs = left_bytes + found.short_bytes, left_runs + found.short_runs
                await self._publish()
                copying.append((asyncio.ensure_future(self._copy_round(found.plans, addresses, window, found.stale)),
                                holds))
            for f, _ in copying:
                await f
        finally:
            under_way: list[asyncio.Future[Any]] = [reading, *planning, *(f for f, _ in copying)]
            for left in under_way:  # the pass was given up (or a round failed): so are the rounds under way
                left.cancel()
            for left in under_way:
                with contextlib.suppress(asyncio.CancelledError):
                    await left
        if not p.failed_runs and not self._draining and self._may_drop():  # F18f: the next pass may skip runs
            self._settled = tuple(sorted(addresses))
        p.running, p.passes = False, p.passes + 1
        if p.draining:
            p.drain_left_bytes, p.drain_left_runs = left_bytes, left_runs
            if not p.drained and not left_runs and not p.failed_runs:
                await self._leave_drained()
        if planned:
            log.info("fleet: a re-replication pass over %d nodes: %d of %d runs to copy (%d failed), planned in "
                     "%.2f s; %d bytes copied, in %.2f s", len(addresses), planned, len(runs), p.failed_runs,
                     planning_s, p.copied_bytes - copied_before, time.monotonic() - started)
        if held_runs > len(runs):
            log.info("fleet: %d of %d runs held skipped: the nodes a pass asks about them are those of the last "
                     "settled pass (F18f), or a periodic pass sweeps the next %d (F87)", held_runs - len(runs),
                     held_runs, SWEEP_RUNS)
        self._planned = None
        await self._publish(force=True, wait=True)
        return p

    async def plan(self, runs: Sequence[RunEntry], live: list[str], addresses: dict[str, str]) -> list[RunPlan]:
        """The runs among `runs` this node is to copy over the `live` node ids (at `addresses`), with what
        each target lacks. Asks the peers; copies nothing."""
        return (await self.plan_round(runs, live, addresses)).plans

    #: Copies of the run of a storage key: its tenant's replication (docs/FLEET.md F51; the server sets it to
    #: the policies' `replication_of_key`); None: `replication` for every run.
    copies: Callable[[bytes], int] | None = None

    #: Seconds the blocks of a storage key's tenant are kept (F19: a pass copies a tenant's blocks used within its
    #: own retention; the server sets it to the policies' `retention_of_key`, as the receivers' digests count);
    #: None: `window_s` for every run.
    retention_of: Callable[[bytes], float] | None = None

    def copies_of(self, entry: RunEntry) -> int:
        """The replication `entry`'s run is kept at (its tenant's, F51)."""
        return self.copies(entry.key) if self.copies is not None else self.replication

    async def plan_round(self, runs: Sequence[RunEntry], live: list[str], addresses: dict[str, str],
                         ahead: dict[bytes, tuple[list[RunBlock], dict[bytes, float]]] | None = None) -> Round:
        """`plan`, with the runs it could not decide: one RunDigests per peer, then one HeldBlocks per peer
        (per MAX_KEYS keys) for every run whose digests differ, all peers asked at once. `ahead`: runs' metas read
        ahead (`_read_ahead`, run root -> read), taken out of it; the others are read here."""
        ahead = {} if ahead is None else ahead
        missing = [r for r in runs if r.key not in ahead]
        fresh = iter(await self.tier.call(self._read_metas, missing, self.tier.retention_clock.now()) if missing
                     else ())
        read = [ahead.pop(r.key) if r.key in ahead else next(fresh) for r in runs]
        held = [blocks for blocks, _ in read]
        orders = [self._order(r.run_key, live) for r in runs]
        asked: dict[str, list[int]] = {}  # peer -> indexes of the runs it is asked about
        for i, order in enumerate(orders):
            if held[i]:
                me = order.index(self.node_id)
                for peer in {*order[:me], *order[:self._targets(runs[i], order)]} - {self.node_id}:
                    asked.setdefault(peer, []).append(i)
        theirs = await self._digests(asked, runs, addresses)
        # Which runs each peer is asked block by block (its digest differs from ours and is not empty).
        mine = [RunDigest.of(blocks, live) for blocks, live in read]
        checks: dict[str, list[int]] = {}
        for i, order in enumerate(orders):
            if not held[i]:
                continue
            me = order.index(self.node_id)
            if any(theirs.get((n, runs[i].key)) == mine[i] for n in order[:me]):
                continue  # a holder ranked above holds the same blocks: it acts, not us
            for n in {*order[:me], *order[:self._targets(runs[i], order)]} - {self.node_id}:
                d = theirs.get((n, runs[i].key))
                if d is not None and d.blocks and not d.same_blocks(mine[i]):  # R32: pins aside
                    checks.setdefault(n, []).append(i)
        has = await self._held(checks, held, addresses)
        found = Round()
        for i, order in enumerate(orders):
            if held[i]:
                plan = self._plan_run(runs[i], held[i], mine[i], order, theirs, has)
                if plan is None:
                    found.undecided_runs += 1
                    found.undecided_bytes += mine[i].size_bytes
                elif plan.sends:
                    found.plans.append(plan)
                if self.node_id in self._draining:
                    short = self._short_bytes(runs[i], held[i], mine[i], order, theirs, has)
                    found.short_runs += short > 0
                    found.short_bytes += short
                if self._confirmed_elsewhere(runs[i], mine[i], order, theirs):
                    found.stale.append((runs[i], held[i], order[:self._targets(runs[i], order)]))
        return found

    def _moved_since(self, runs: list[RunEntry], before: list[list[str]], live: list[str]) -> list[RunEntry]:
        """F18f: the runs whose plan may differ from the last settled pass's over `before[0]`: those whose nodes a
        pass asks about them (the replicas, and those ranked above this node) are not the same now. For the others
        this pass would ask the same nodes as that pass, which found nothing left to do: what happened to them since
        (a damaged copy dropped, a half-stored Put) is a periodic pass's to find, as it is between membership changes.

        F86: `before[1:]` are the views of the passes given up since (oldest first); a run is also moved where any of
        them ranks it otherwise, since under that view a node may have dropped its copy as stale (F79) or been sent
        one, which the settled pass never saw."""
        # Nothing drains (`run_pass` skips nothing otherwise): a run's order is the rendezvous ranking of the nodes
        # (kvstore/fleet/placement.py's `replicas`), each node's score hashed once for every view.
        nodes = sorted({*live, *(n for view in before for n in view)})
        me = self.node_id
        moved = []
        for entry in runs:
            key = entry.run_key
            ranks = scores(key, nodes)
            copies = self.copies_of(entry)
            now = _asked(live, ranks, copies, me)
            if any(_asked(view, ranks, copies, me) != now for view in before):
                moved.append(entry)
        return moved

    def _read_metas(self, runs: Sequence[RunEntry], now: float) -> list[tuple[list[RunBlock], dict[bytes, float]]]:
        """Each run's blocks a pass copies and counts, with their live pins (on the tier's executor). F19: blocks
        used within their tenant's window; R31: and a pinned prefix, whatever its last use; R32: with the pins."""
        return run_index.in_window_pins(self.tier.env, [r.key for r in runs], self.run_blocks,
                                        since_s=now - self.window_s, now_s=now, retention_of=self.retention_of)

    async def _read_ahead(self, runs: Sequence[RunEntry], now: float,
                          out: dict[bytes, tuple[list[RunBlock], dict[bytes, float]]]) -> None:
        """F18b: the metas of the first of `runs` into `out` (run root -> its read), in their order, read in rounds'
        chunks until they hold as many blocks as a first round of full runs (FIRST_ROUND_RUNS x run_blocks). A pass
        of full runs reads one round's worth ahead, as it would have anyway; one of small runs reads many of them,
        and finds its big ones among them. The chunks are read one after another in one call on the store's executor,
        not a hop of the event loop each (a loaded node's loop, busy with the pass's calls, held each hop for ms)."""
        found = await self.tier.call(self._read_ahead_metas, runs, now)
        for entry, read in zip(runs[:len(found)], found, strict=True):
            out[entry.key] = read

    def _read_ahead_metas(self, runs: Sequence[RunEntry], now: float
                          ) -> list[tuple[list[RunBlock], dict[bytes, float]]]:
        """`_read_ahead`'s reads, on the store's executor: the first of `runs`' metas, in order, a round's chunk at
        a time until they hold FIRST_ROUND_RUNS x run_blocks blocks."""
        found: list[tuple[list[RunBlock], dict[bytes, float]]] = []
        blocks = 0
        for chunk in _rounds(runs):
            if blocks >= FIRST_ROUND_RUNS * self.run_blocks:
                break
            for read in self._read_metas(chunk, now):
                found.append(read)
                blocks += len(read[0])
        return found

    def _confirmed_elsewhere(self, entry: RunEntry, mine: RunDigest, order: tuple[str, ...],
                             theirs: dict[tuple[str, bytes], RunDigest | None]) -> bool:
        """F79: whether this node (not draining) is not among the run's replicas while each of its `replication`
        replicas answered this copy's digest (its blocks whole there) and this copy holds no live pin: a copy to
        drop once the replicas carry its last uses (`_drop_stale`)."""
        if self.node_id in self._draining:
            return False  # a drain keeps its copies until it leaves (F21's own path)
        n = self._targets(entry, order)
        if n < self.copies_of(entry) or self.node_id in order[:n] or not mine.blocks or mine.pins:
            return False
        return all((d := theirs.get((t, entry.key))) is not None and d.same_blocks(mine) for t in order[:n])

    def _order(self, run_key: bytes, live: list[str]) -> tuple[str, ...]:
        """Every node of `live` (and this one) in the run's rank order, the draining ones after the rest (F21):
        the others rank among themselves as placement does, and so do the draining ones."""
        last = [n for n in {*live, self.node_id} if n in self._draining]
        first = [n for n in live if n not in self._draining]
        return (replicas(run_key, first, len(first)) if first else ()) + \
            (replicas(run_key, last, len(last)) if last else ())

    def _targets(self, entry: RunEntry, order: tuple[str, ...]) -> int:
        """How many of `order` are the run's replicas: its replication, of the nodes not draining (F21)."""
        return min(self.copies_of(entry), sum(n not in self._draining for n in order))

    def _short_bytes(self, entry: RunEntry, blocks: list[RunBlock], mine: RunDigest, order: tuple[str, ...],
                     theirs: dict[tuple[str, bytes], RunDigest | None],
                     has: dict[tuple[str, bytes], set[bytes] | None]) -> int:
        """F21: the bytes of this (draining) node's blocks of a run that its replicas among the others do not hold,
        as they answered (all of them where a replica did not say which it holds; every copy short when the
        fleet has fewer other nodes than the replication)."""
        total = sum(b.meta.size_bytes for b in blocks)
        n = self._targets(entry, order)
        short = total * (self.copies_of(entry) - n)
        for target in order[:n]:
            d = theirs.get((target, entry.key))
            if d is not None and d.same_blocks(mine):
                continue
            found = has.get((target, entry.key)) if d is not None and d.blocks else set()
            short += total if found is None else sum(b.meta.size_bytes for b in blocks if b.key not in found)
        return short

    def _plan_run(self, entry: RunEntry, blocks: list[RunBlock], mine: RunDigest, order: tuple[str, ...],
                  theirs: dict[tuple[str, bytes], RunDigest | None],
                  has: dict[tuple[str, bytes], set[bytes] | None]) -> RunPlan | None:
        """What to send of one run (no sends: nothing to do here); None when it cannot be decided."""
        plan = RunPlan(entry=entry, blocks=blocks)
        me = order.index(self.node_id)
        above = [theirs.get((n, entry.key)) for n in order[:me]]
        if any(d == mine for d in above):
            return plan  # a holder ranked above holds the same blocks: it acts, not us
        unique = blocks
        for n, d in zip(order[:me], above, strict=True):
            if d is None:
                return None  # it did not answer: it may hold the blocks and act; whether is not known
            if d.same_blocks(mine):
                unique = []  # it holds the same blocks (their pins aside, R32)
            elif d.blocks:  # holds some: keep only what it lacks
                theirs_held = has.get((n, entry.key))
                if theirs_held is None:
                    return None
                unique = [b for b in unique if b.key not in theirs_held]
        # R32: the pins this node acts for: those no holder ranked above holds as long.
        acting = {h: until for h, until in mine.pins
                  if not any(d is not None and d.pin_of(h) >= until for d in above)}
        for target in order[:self._targets(entry, order)]:
            if target == self.node_id or not (unique or acting):
                continue
            d = theirs.get((target, entry.key))
            if d == mine:
                continue
            if d is None:
                return None  # the replica did not answer: what it lacks is not known, and it cannot take a copy
            if d.same_blocks(mine):
                target_held: set[bytes] = {b.key for b in blocks}
            elif d.blocks:
                found = has.get((target, entry.key))
                if found is None:
                    return None
                target_held = found
            else:
                target_held = set()
            send = [b for b in unique if b.key not in target_held]
            # R32: a block the target holds without the pin this node acts for is sent again with the pin (its
            # grant commits with the block's touch there); not twice for the same time (`_pins_sent`).
            repin = {b.key for b in blocks if b.key in target_held
                     and (h := b.key[KEY_BYTES - HASH_BYTES:]) in acting and d.pin_of(h) < acting[h]
                     and self._pins_sent.get((target, b.key)) != acting[h]}
            if repin:
                sending = {b.key for b in send} | repin
                send = [b for b in blocks if b.key in sending]  # the run's order: parents first (R6)
            if send:
                plan.sends[target] = send
        return plan

    def _peer_failed(self, peer: str, address: str, exc: grpc.aio.AioRpcError) -> None:
        """A peer's call failed: a node that is not there is asked nothing more this pass, and its channel is
        dialed afresh next time."""
        if exc.code() in _DOWN:
            self._down.add(peer)
            self.peers.forget(address)

    async def _ask(self, peer: str, address: str, method: str, request: Any) -> Any:
        """One question (`RunDigests`, `HeldBlocks`) to a peer: its reply, or None when it is down this pass or
        does not answer (then it is asked nothing more this pass, `_peer_failed`)."""
        if peer in self._down:
            return None
        try:
            return await getattr(self.peers.stub(address), method)(request, metadata=self.peers.metadata,
                                                                  timeout=ASK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("fleet: node %s does not answer %s (%s)", peer, method, exc.code().name)
            self._peer_failed(peer, address, exc)
            return None

    async def _digests(self, asked: dict[str, list[int]], runs: Sequence[RunEntry],
                       addresses: dict[str, str]) -> dict[tuple[str, bytes], RunDigest | None]:
        """(peer, run root) -> what the peer holds of the run (None: the peer did not answer)."""
        async def ask(peer: str, idx: list[int]) -> list[tuple[tuple[str, bytes], RunDigest | None]]:
            roots = [runs[i].key for i in idx]
            reply = await self._ask(peer, addresses[peer], "RunDigests", pb.RunDigestsRequest(run_roots=roots))
            if reply is None:
                return [((peer, k), None) for k in roots]
            return [((peer, k), RunDigest(blocks=d.blocks, size_bytes=d.size_bytes, digest=d.digest,
                                          pins=tuple(sorted((p.hash, p.until_s) for p in d.pins))))
                    for k, d in zip(roots, reply.runs, strict=True)]

        found = await asyncio.gather(*(ask(peer, idx) for peer, idx in asked.items()))
        return dict(pair for answers in found for pair in answers)

    async def _held(self, checks: dict[str, list[int]], held: list[list[RunBlock]], addresses: dict[str, str]
                    ) -> dict[tuple[str, bytes], set[bytes] | None]:
        """(peer, run root) -> the keys of the run's blocks the peer holds (None: it did not answer), asked in
        one HeldBlocks per peer and MAX_KEYS keys, every peer at once."""
        async def ask(peer: str, idx: list[int]) -> list[tuple[tuple[str, bytes], set[bytes] | None]]:
            out: list[tuple[tuple[str, bytes], set[bytes] | None]] = []
            chunk: list[int] = []
            n_keys = 0
            for i in [*idx, -1]:
                if i < 0 or (chunk and n_keys + len(held[i]) > MAX_KEYS):
                    out += await one(peer, chunk)
                    chunk, n_keys = [], 0
                if i >= 0:
                    chunk.append(i)
                    n_keys += len(held[i])
            return out

        async def one(peer: str, idx: list[int]) -> list[tuple[tuple[str, bytes], set[bytes] | None]]:
            roots = [held[i][0].key for i in idx]
            keys = [b.key for i in idx for b in held[i]]
            reply = await self._ask(peer, addresses[peer], "HeldBlocks", pb.HeldBlocksRequest(keys=keys)) if idx \
                else None
            if reply is None:
                return [((peer, k), None) for k in roots]
            answers = iter(zip(keys, reply.held, strict=True))
            return [((peer, held[i][0].key), {k for k, h in itertools.islice(answers, len(held[i])) if h})
                    for i in idx]

        found = await asyncio.gather(*(ask(peer, idx) for peer, idx in checks.items()))
        return dict(pair for answers in found for pair in answers)

    def _lanes(self, plans: list[RunPlan], addresses: dict[str, str]) -> list[_Lane]:
        """Every send of the round, as up to WINDOW lanes per target, each run whole in one lane, the
        lanes of a target about even in bytes. A target gets another lane only once each of its lanes holds
        a batch: a round of a few small runs goes in one full call, not in several small ones (each its
        own fsync there)."""
        by_target: dict[str, list[_Lane]] = {}
        for plan in plans:
            for target, blocks in plan.sends.items():
                plan.pending.add(target)
                lanes = by_target.setdefault(target, [])
                if len(lanes) < WINDOW and all(x.size >= self.batch_bytes for x in lanes):
                    lanes.append(_Lane(target=target, address=addresses[target]))
                lane = min(lanes, key=lambda x: x.size)
                lane.runs.append((plan, blocks))
                lane.size += sum(b.meta.size_bytes for b in blocks)
        return [lane for lanes in by_target.values() for lane in lanes]

    async def _copy_round(self, plans: list[RunPlan], addresses: dict[str, str],
                          window: _Window | None = None,
                          stale: Sequence[tuple[RunEntry, list[RunBlock], tuple[str, ...]]] = ()) -> None:
        """Send each target what it lacks of the round's runs: lanes at once, at most WINDOW calls in flight, each
        batch taken from the bucket first (F18's bounded rate); then drop the round's stale copies their replicas
        confirm (F79). The stale step comes after the copies (F80): its RaiseUses round trips and write
        transactions must not delay a copy, and a stale run is never one this node sends (every replica holds it)."""
        if plans:
            window = _Window() if window is None else window
            await asyncio.gather(*(self._send_lane(lane, window) for lane in self._lanes(plans, addresses)))
            p = self.progress
            for plan in plans:
                p.under_replicated_runs -= not plan.pending
                p.failed_runs += bool(plan.pending)
            await self._publish()
        if stale:
            await self._drop_stale(stale, addresses)

    def _may_drop(self) -> bool:
        """F79: the membership view may be trusted to drop a copy: not stale, and etcd answered this pass."""
        return not self.membership.stale and self._etcd_answered

    async def _drop_stale(self, stale: Sequence[tuple[RunEntry, list[RunBlock], tuple[str, ...]]],
                          addresses: dict[str, str]) -> None:
        """F79: ask each replica of the stale runs to carry this copy's last uses (`RaiseUses`, F19), and drop each
        run every one of its replicas confirmed for every block, in a write transaction that keeps it if a block of
        it is leased or pinned here, or used here since; the round's runs in one transaction (F84:
        `LmdbBlockTier.drop_confirmed_runs`), each alone where that one fails (a damaged page: only its run stays)."""
        if not self._may_drop():
            return
        leased = self.tier.leases.pinned()
        runs = [(e, b, r) for e, b, r in stale if not any(x.key in leased for x in b)]
        asked: dict[str, list[int]] = {}
        for i, (_, _, reps) in enumerate(runs):
            for peer in reps:
                asked.setdefault(peer, []).append(i)
        answers = await asyncio.gather(*(self._raise_uses(peer, addresses[peer], [runs[i][1] for i in idx])
                                         for peer, idx in asked.items()))
        short = {idx[j] for (peer, idx), said in zip(asked.items(), answers, strict=True)
                 for j, whole in enumerate(said) if not whole}
        now = self.tier.retention_clock.now()
        # R4: a block not confirmed may go with the copy only once eviction could take it.
        confirmed = [(entry.key, {b.key: b.meta.last_access_s for b in blocks}, now - TOUCH_GRANULARITY_S - (
            self.retention_of(entry.key) if self.retention_of is not None else self.window_s))
            for i, (entry, blocks, _) in enumerate(runs) if i not in short]
        if not confirmed or not self._may_drop():
            return
        try:
            dropped = await self.tier.call(self.tier.drop_confirmed_runs, confirmed)
        except KVStoreError as exc:  # a damaged page on the way (DataLoss): each run alone, so only its own stays
            log.warning("fleet: cannot drop %d stale copies in one transaction (%s): each alone", len(confirmed), exc)
            dropped = [await self._drop_alone(*run) for run in confirmed]
        p = self.progress
        for removed in dropped:
            if removed:
                p.stale_dropped_runs, p.stale_dropped_bytes = p.stale_dropped_runs + 1, p.stale_dropped_bytes + removed
        await self._publish()

    async def _drop_alone(self, root: bytes, confirmed: dict[bytes, float], start: float) -> int:
        """One stale run dropped in its own transaction (`_drop_stale`'s fallback); 0 where it cannot be (it stays, as
        in any doubt), or where the view cannot be trusted any more (F79)."""
        if not self._may_drop():
            return 0
        try:
            return await self.tier.call(self.tier.drop_confirmed_run, root, confirmed, start)
        except KVStoreError as exc:
            log.warning("fleet: cannot drop the stale copy of run %s...: %s", root.hex()[:24], exc)
            return 0

    async def _raise_uses(self, peer: str, address: str, runs: list[list[RunBlock]]) -> list[bool]:
        """F79: one RaiseUses per MAX_KEYS blocks to a replica, carrying this copy's last uses; for each run,
        whether the replica said it holds every block with a last use at least this copy's (False where it did not
        answer)."""
        out: list[bool] = []
        at = 0
        while at < len(runs):
            chunk: list[list[RunBlock]] = []
            n_keys = 0
            while at < len(runs) and (not chunk or n_keys + len(runs[at]) <= MAX_KEYS):
                chunk.append(runs[at])
                n_keys += len(runs[at])
                at += 1
            request = pb.RaiseUsesRequest(uses=[pb.BlockUse(key=b.key, last_use_s=b.meta.last_access_s)
                                                for blocks in chunk for b in blocks])
            reply = await self._ask(peer, address, "RaiseUses", request)
            answered = reply is not None and len(reply.at_least) == len(request.uses)
            said = iter(reply.at_least) if answered else None
            out += [said is not None and all([next(said) for _ in blocks]) for blocks in chunk]
        return out

    def _batches(self, lane: _Lane) -> Iterator[tuple[list[RunBlock], list[tuple[RunPlan, int]], bool]]:
        """The lane's runs as batches of about `batch_bytes`: (blocks, the runs whose last block is in it and their
        bytes, whether it starts a run). Several small runs go in one; a run that does not fit what is left of a
        batch starts the next one whole (so that call needs none before it, R6); a larger run goes over several,
        each after the one before."""
        batch: list[RunBlock] = []
        done: list[tuple[RunPlan, int]] = []
        size, starts = 0, True
        for plan, blocks in lane.runs:
            run_bytes = sum(b.meta.size_bytes for b in blocks)
            if batch and size + run_bytes > self.batch_bytes >= run_bytes:
                yield batch, done, starts
                batch, done, size, starts = [], [], 0, True
            for i, b in enumerate(blocks):
                if batch and size + b.meta.size_bytes > self.batch_bytes:
                    yield batch, done, starts
                    batch, done, size, starts = [], [], 0, i == 0
                batch.append(b)
                size += b.meta.size_bytes
            done.append((plan, run_bytes))
        if batch:
            yield batch, done, starts

    async def _send_lane(self, lane: _Lane, window: _Window) -> None:
        """One lane's runs to its target (`_batches`), each batch read while the calls before it are in flight; a
        batch that starts a run is sent beside them (up to LANE_DEPTH), one that continues a run once the call
        before is answered (R6). Stops at the first failed call (what is left stays pending: counted
        under-replicated and failed, and re-planned by the next pass); the calls already made end first."""
        skipped: set[bytes] = set()  # blocks not sent (damaged, gone): their descendants cannot go either
        flying: list[tuple[asyncio.Task[bool], list[tuple[RunPlan, int]]]] = []

        async def settle_first() -> bool:
            task, done = flying.pop(0)
            went = await task
            if went:
                self._finish(done, lane.target)
            return went

        try:
            for chunk, done, starts in self._batches(lane):
                if lane.target in self._down:
                    return
                await window.held.acquire()
                try:
                    ready = await self._prepare(lane, chunk, skipped)
                except BaseException:
                    window.held.release()
                    raise
                while flying and (not starts or len(flying) >= LANE_DEPTH):
                    if not await settle_first():
                        ready.end()
                        window.held.release()
                        return
                flying.append((asyncio.ensure_future(self._deliver_held(lane, ready, skipped, window)), done))
            while flying:
                if not await settle_first():
                    return
        except asyncio.CancelledError:  # the pass was given up: so are the calls under way
            for task, _ in flying:
                task.cancel()
            raise
        finally:
            for task, _ in flying:  # a call failed: the calls already made end before the lane does
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task

    def _finish(self, done: list[tuple[RunPlan, int]], target: str) -> None:
        """The runs in `done` are copied to `target`."""
        for plan, size in done:
            plan.pending.discard(target)
            self.progress.under_replicated_bytes -= size

    async def _prepare(self, lane: _Lane, chunk: list[RunBlock], skipped: set[bytes]) -> _Ready:
        """The batch read and encoded: over the bulk transport where this node and the target run it (found and
        verified in the map, held under a read txn until answered), else its bytes read by the verified read."""
        if self.bulk is not None and lane.target not in self._grpc_only:
            ready = await self._prepare_bulk(self.bulk, chunk, skipped)
            if ready is not None:
                return ready
        # F18d: a batch above STREAM_PIECE_BYTES goes as a stream of pieces, the first read now, the rest as it is sent.
        pieces = [chunk] if lane.target in self._unary_only else _pieces(chunk, STREAM_PIECE_BYTES)
        request, count, size, damaged, sent_pins = await self.tier.call(self._read, pieces[0], skipped)
        self.progress.damaged_blocks += damaged
        return _Ready(chunk=chunk, request=request, count=count, size=size, pins=sent_pins, rest=pieces[1:])

    async def _stream(self, lane: _Lane, ready: _Ready, skipped: set[bytes]) -> pb.CopyBlocksResponse:
        """F18d: one CopyBlocksStream of the batch's pieces (`_stream_pieces`), written one after another; its answer.
        The first stream to a target in a pass waits for the target's opening (initial metadata naming
        STREAM_OPENED) before any piece: an older node answers UNIMPLEMENTED at once, and a piece written while that
        answer arrives turns the call's status into gRPC's INTERNAL, hiding it.

        Raises:
            grpc.aio.AioRpcError: the call failed (UNIMPLEMENTED: the target does not serve the stream).
        """
        call: grpc.aio.StreamUnaryCall = self.peers.streamer(lane.address)(metadata=self.peers.metadata,
                                                                           timeout=CALL_TIMEOUT_S)
        pieces = self._stream_pieces(ready, skipped)
        try:
            if lane.target not in self._streams_served:
                opened = await call.initial_metadata()
                if not any(key == STREAM_OPENED for key, _ in opened or ()):
                    return await call  # not served there: raises its status (UNIMPLEMENTED)
                self._streams_served.add(lane.target)
            try:
                async for piece in pieces:
                    await call.write(piece)
                await call.done_writing()
            except asyncio.InvalidStateError:
                pass  # the call ended while writing: its status, awaited next, says why
            return await call
        except BaseException:
            call.cancel()
            raise
        finally:
            await pieces.aclose()

    async def _stream_pieces(self, ready: _Ready, skipped: set[bytes]) -> AsyncGenerator[bytes, None]:
        """F18d: a streamed batch's pieces, encoded: the first one read already, each next one read (on the
        store's executor, the verified read of `_read`) while the one before is sent, and taken from the bucket
        before it goes (F18's bounded rate). A piece whose blocks all cannot go (damaged, or their parent was
        not sent) is left out; what follows it skips their descendants (`skipped`)."""
        reads = iter(ready.rest)

        def read_next() -> asyncio.Future[tuple[bytes, int, int, int, dict[bytes, float]]] | None:
            piece = next(reads, None)
            return None if piece is None else asyncio.ensure_future(self.tier.call(self._read, piece, skipped))

        reading = read_next()
        try:
            if ready.count:
                yield ready.request
            while reading is not None:
                request, count, size, damaged, sent_pins = await reading
                reading = read_next()
                self.progress.damaged_blocks += damaged
                if not count:
                    continue
                await self.bucket.take(size)
                self.progress.sent_bytes += size
                ready.pins.update(sent_pins)
                yield request
        finally:
            if reading is not None:  # the call ended early (failed, or given up): the read under way is dropped
                reading.cancel()

    async def _prepare_bulk(self, bulk: BulkSource, chunk: list[RunBlock], skipped: set[bytes]) -> _Ready | None:
        """`_prepare` over the bulk transport: the request carries each block's address in this node's map, its
        pages held under a read txn left open (`_Ready.end`). None: send it over gRPC instead (the map cannot
        answer the batch exactly, or one of its blocks cannot go)."""
        size = chunk[0].meta.size_bytes
        names = [self._names.get(namespaces.id_of_key(b.key)) for b in chunk]
        if any(b.meta.size_bytes != size or b.key[:-32] + b.meta.parent_hash in skipped for b in chunk) \
                or None in names:
            return None  # gRPC's path reads each block and skips what cannot go, with its descendants
        resolved = await self.tier.call(bulk.resolve, [b.key for b in chunk], size)
        if resolved is None:
            return None
        try:
            held = await self.tier.call(pins_on, self.tier, [b.key for b in chunk])
            segment = bulk.segment.encode()
            request = b"".join([piece for b, ns, at in zip(chunk, names, resolved.addresses, strict=True)
                                for piece in encode_copy(b, ns or "", b"", source_address=at,
                                                         pin_until_s=held.get(b.key, 0.0))]
                               + [b"\x12", _varint(len(segment)), segment])
        except BaseException:
            resolved.txn.abort()
            raise
        return _Ready(chunk=chunk, request=request, count=len(chunk), size=size * len(chunk), pins=held,
                      txn=resolved.txn)

    async def _deliver_held(self, lane: _Lane, ready: _Ready, skipped: set[bytes], window: _Window) -> bool:
        """`_deliver`, then the batch's place among those held (`_Window.held`) is free."""
        try:
            return await self._deliver(lane, ready, skipped, window)
        finally:
            window.held.release()

    async def _deliver(self, lane: _Lane, ready: _Ready, skipped: set[bytes], window: _Window) -> bool:
        """One CopyBlocks of the batch read (`ready`) to the lane's target, taken from the bucket first (F18's
        bounded rate); whether it went. A target that refuses the bulk transport is sent this batch and the rest
        of its pass over gRPC."""
        bulk = ready.txn is not None
        try:
            if not ready.count and not ready.rest:
                return True
            if lane.target in self._down:
                return False
            await self.bucket.take(ready.size)  # F18: the bounded rate, on either path
            async with window.calls:
                if lane.target in self._down:
                    return False
                if not bulk:
                    self.progress.sent_bytes += ready.size
                try:
                    if ready.rest:  # F18d: streamed, each piece read while the one before is sent and stored
                        reply = await self._stream(lane, ready, skipped)
                    else:
                        reply = await self.peers.copier(lane.address)(ready.request, metadata=self.peers.metadata,
                                                                      timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    if not (ready.rest and exc.code() is grpc.StatusCode.UNIMPLEMENTED):
                        log.warning("fleet: copying %d blocks to node %s%s failed: %s: %s", ready.count, lane.target,
                                    " over the bulk transport" if bulk else "", exc.code().name, exc.details())
                        self._peer_failed(lane.target, lane.address, exc)
                        return False
                    reply = None
        finally:
            # Answered (or given up): the target reads no more of these pages. Were its engine still reading
            # after a deadline, a page LMDB reused would fail the block's checksum there: never stored.
            ready.end()
        if reply is None:  # F18d: a node without CopyBlocksStream (older): one CopyBlocks a batch for this pass
            log.info("fleet: node %s takes no CopyBlocksStream: one CopyBlocks a batch for the rest of this pass",
                     lane.target)
            self._unary_only.add(lane.target)
            return await self._deliver(lane, await self._prepare(lane, ready.chunk, skipped), skipped, window)
        if bulk and reply.bulk_refused:
            log.warning("fleet: node %s takes no copies over the bulk transport (%s): gRPC for the rest of this "
                        "pass", lane.target, reply.bulk_refused)
            self._grpc_only.add(lane.target)
            return await self._deliver(lane, await self._prepare(lane, ready.chunk, skipped), skipped, window)
        p = self.progress
        if bulk:
            p.sent_bytes += ready.size
            p.bulk_bytes += reply.written_bytes
        p.copied_bytes += reply.written_bytes
        p.copied_blocks += reply.written_blocks
        self._count_pins(lane.target, reply, ready.pins)
        await self._publish()
        return True

    def _count_pins(self, target: str, reply: pb.CopyBlocksResponse, sent: dict[bytes, float]) -> None:
        """R31: what the target granted of the pins sent with a batch (`sent`: storage key -> time); one granted
        short (its limits for the tenant) is logged and counted (this node's own pin is left as it is). R32: each
        is remembered as sent to the target for its time, so it is not sent again for it."""
        for key, until in sent.items():
            self._pins_sent[(target, key)] = until
        p = self.progress
        p.pins_copied += reply.pins_granted
        p.pins_short += reply.pins_short
        if reply.pins_short:
            log.warning("fleet: node %s granted %d copied pins shorter than held here, or not at all: %s",
                        target, reply.pins_short, reply.pin_note)

    def _read(self, chunk: list[RunBlock], skipped: set[bytes]) -> tuple[bytes, int, int, int, dict[bytes, float]]:
        """The chunk's blocks as one encoded CopyBlocksRequest, each block verified against its checksum by
        the read (F17): (request, blocks in it, their bytes, blocks found damaged, the pins it carries: key ->
        time). Runs on the tier's executor, off the event loop. Where every block is stored and intact, its bytes
        are verified and copied once, from LMDB's map straight into the request, without the GIL
        (`_read_in_place`); otherwise each block is read and copied into the request (`encode_copy`)."""
        held = pins_on(self.tier, [b.key for b in chunk])
        fast, damaged = self._read_in_place(chunk, skipped, held)
        if fast is not None:
            return fast
        statuses = self.tier.read([b.key for b in chunk])
        pieces: list[bytes] = []
        sent: dict[bytes, float] = {}
        count = size = 0
        for b, (status, data) in zip(chunk, statuses, strict=True):
            parent = b.key[:-32] + b.meta.parent_hash
            if status is not ReadStatus.FOUND or parent in skipped:
                if status is ReadStatus.CORRUPT:
                    damaged += 1
                    log.warning("fleet: block %s... is damaged here (its checksum fails): dropped, not copied; "
                                "a holder ranked below sends its copy", b.key.hex()[:24])
                skipped.add(b.key)
                continue
            namespace = self._names.get(namespaces.id_of_key(b.key))
            if namespace is None:
                skipped.add(b.key)
                continue
            pieces += encode_copy(b, namespace, data, pin_until_s=held.get(b.key, 0.0))
            if b.key in held:
                sent[b.key] = held[b.key]
            count += 1
            size += len(data)
        return b"".join(pieces), count, size, damaged, sent

    def _read_in_place(self, chunk: list[RunBlock], skipped: set[bytes], held: dict[bytes, float]
                       ) -> tuple[tuple[bytes, int, int, int, dict[bytes, float]] | None, int]:
        """`_read` when every block of the chunk can go: the request laid out from the blocks' metas, each block
        verified and copied from LMDB's map into its place in it (`LmdbBlockTier.stage_reads`: the lookups
        under the GIL, the checks and copies without it, so the planning and calls of the rest of the pass go
        on beside; one copy of the bytes, not two). (the `_read` answer, or None where a block is missing,
        damaged or not the size planned, and the blocks it found damaged: `_read` then reads the chunk block
        by block, which skips those and their descendants.)"""
        names = [self._names.get(namespaces.id_of_key(b.key)) for b in chunk]
        if None in names or any(b.key[:-32] + b.meta.parent_hash in skipped for b in chunk):
            return None, 0
        frames = [copy_frame(b, ns or "", b.meta.size_bytes, pin_until_s=held.get(b.key, 0.0))
                  for b, ns in zip(chunk, names, strict=True)]
        total = sum(len(before) + b.meta.size_bytes + len(after) for b, (before, after) in zip(chunk, frames,
                                                                                              strict=True))
        staged = self.tier.stage_reads([b.key for b in chunk])

        def fill(view: memoryview) -> bytes:
            dests, at = [], 0
            for b, (before, after) in zip(chunk, frames, strict=True):
                view[at:at + len(before)] = before
                at += len(before)
                dests.append(view[at:at + b.meta.size_bytes])
                at += b.meta.size_bytes
                view[at:at + len(after)] = after
                at += len(after)
            try:
                return staged.copy(dests)
            finally:
                for d in dests:
                    d.release()

        try:
            request, codes = blockcopy.fill_bytes(total, fill)
        except ValueError:  # a block is not the size its meta said when planned: read block by block
            return None, 0
        finally:
            staged.close()
        if codes.count(blockcopy.FOUND) < len(chunk):
            damaged = codes.count(blockcopy.CORRUPT)
            if damaged:  # dropped already by the copy: the block-by-block read finds them gone
                log.warning("fleet: %d blocks are damaged here (their checksums fail): dropped, not copied; a "
                            "holder ranked below sends its copy", damaged)
            return None, damaged
        size = sum(b.meta.size_bytes for b in chunk)
        return (request, len(chunk), size, 0, {b.key: held[b.key] for b in chunk if b.key in held}), 0

    async def _publish(self, *, force: bool = False, wait: bool = False) -> None:
        """Write the progress record (at most once a second unless `force`), beside the pass: an etcd put's round
        trip holds no copy nor plan (a pass's first record took up to 70 ms here, under load). Records are written
        in order (each put after the one before), so an older one never lands over a newer; with `wait`, returns
        once this one is written (a pass's last: the fleet reads it as the pass's end). One not forced is left out
        while another is under way (etcd slow: the next one carries it)."""
        now = time.monotonic()
        under_way = self._publishing is not None and not self._publishing.done()
        if self.publish is None or (not force and (now - self._published_at < 1.0 or under_way)):
            return
        self._published_at = now
        self.progress.updated_at = time.time()
        self._publishing = asyncio.ensure_future(self._put_record(self.publish, self._publishing))
        if wait:
            await asyncio.shield(self._publishing)

    async def _put_record(self, publish: Callable[[RepairProgress], Awaitable[None]],
                          before: asyncio.Future[None] | None) -> None:
        """One progress record written, after the one `before` it."""
        if before is not None:
            await asyncio.wait([before])
            if not before.cancelled() and (failed := before.exception()) is not None:
                log.error("fleet: publishing re-replication progress failed", exc_info=failed)
        try:
            await publish(self.progress)
        except KVStoreError as exc:  # etcd away: the next update tries again
            log.warning("fleet: cannot publish re-replication progress: %s", exc)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_F64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")


def pins_on(tier: LmdbBlockTier, keys: Sequence[bytes]) -> dict[bytes, float]:
    """The live pins this node holds on `keys` (R31): key -> the pin's time. A pin past its time (not yet
    swept, R25) is left out: it is not copied. Blocking: on the store's executor."""
    now = tier.retention_clock.now()
    out: dict[bytes, float] = {}
    with tier.env.begin() as txn:
        db = tier.env.open_db(pins.PINS_DB, txn=txn)
        for key in keys:
            pin = pins.read_pin(txn, db, key)
            if pin is not None and pin.until_s > now:
                out[key] = pin.until_s
    return out


def encode_copy(block: RunBlock, namespace: str, data: bytes, *, source_address: int = 0,
                pin_until_s: float = 0.0) -> list[bytes]:
    """One `CopiedBlock` as the pieces of its entry in a `CopyBlocksRequest`'s wire bytes (field 1, length
    delimited), `data` among them uncopied: joined, they are what `CopyBlocksRequest(blocks=[...])`
    serializes to, without building a message per block or copying each block's bytes twice more. With
    `source_address` (a bulk copy's: `data` empty), the block's address in the source's map instead; with
    `pin_until_s`, the source's live pin on the block (R31)."""
    before, after = copy_frame(block, namespace, len(data), source_address=source_address, pin_until_s=pin_until_s)
    return [before, data, after]


def copy_frame(block: RunBlock, namespace: str, size: int, *, source_address: int = 0,
               pin_until_s: float = 0.0) -> tuple[bytes, bytes]:
    """`encode_copy`'s entry around a block's `size` bytes of data: (what goes before them, what goes after), so
    the bytes can be written between them in place (`FleetRepairer._read_in_place`)."""
    ns = namespace.encode()
    m = block.meta
    head = b"".join((b"\x0a", _varint(len(block.key)), block.key, b"\x12", _varint(len(ns)), ns,
                     b"\x1a", _varint(len(m.parent_hash)), m.parent_hash, b"\x20", _varint(m.depth),
                     b"\x2a" + _varint(size) if size else b""))
    tail = b"\x31" + _F64.pack(m.checksum) + b"\x39" + _DOUBLE.pack(m.last_access_s)
    if source_address:
        tail += b"\x41" + _F64.pack(source_address)
    if pin_until_s:
        tail += b"\x49" + _DOUBLE.pack(pin_until_s)
    return b"\x0a" + _varint(len(head) + size + len(tail)) + head, tail


def peer_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """TLS to the other nodes when this node's port speaks it (they are configured alike): their
    certificates checked against `[fleet] ca_file` (default: this node's own certificate), and under
    mutual TLS this node's certificate shown to them. None: plaintext, as the port.

    Raises:
        ConfigError: a file cannot be read.
    """
    tls = settings.tls
    if not tls.enabled:
        return None

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {name} {path}: {exc.strerror or exc}") from None

    roots = read("fleet.ca_file" if settings.fleet.ca_file else "tls.cert_file",
                 settings.fleet.ca_file or tls.cert_file)
    if not tls.client_ca_file:
        return grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=read("tls.key_file", tls.key_file),
                                        certificate_chain=read("tls.cert_file", tls.cert_file))


def _pieces(chunk: list[RunBlock], piece_bytes: int) -> list[list[RunBlock]]:
    """F18d: the batch's blocks in order, in pieces of at most `piece_bytes` of block bytes (a block larger goes
    alone); one piece where the batch fits one."""
    pieces: list[list[RunBlock]] = [[]]
    size = 0
    for b in chunk:
        if pieces[-1] and size + b.meta.size_bytes > piece_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(b)
        size += b.meta.size_bytes
    return pieces


def _rounds(runs: Sequence[RunEntry], first: int = FIRST_ROUND_RUNS) -> Iterator[Sequence[RunEntry]]:
    """`runs` in rounds of `first` runs, twice that, ... up to RUNS_PER_ROUND."""
    at, size = 0, first
    while at < len(runs):
        yield runs[at:at + size]
        at, size = at + size, min(2 * size, RUNS_PER_ROUND)


def sweep(runs: list[RunEntry], after: bytes, most: int) -> tuple[list[RunEntry], bytes]:
    """F87: the next `most` of `runs` (in key order) after the key `after`, wrapping to the first, and the last key
    taken (b"" when every run is taken: the next sweep starts at the first again)."""
    if len(runs) <= most:
        return runs, b""
    start = bisect.bisect_right([r.key for r in runs], after) if after else 0
    part = (runs[start:] + runs[:start])[:most]
    return part, part[-1].key


def _asked(view: list[str], scores: dict[str, int], copies: int, me: str) -> list[str]:
    """The nodes a pass over `view` asks about a run (F18f): its replicas and those ranked above `me`, by `scores`."""
    order = sorted(view, key=lambda n: (-scores[n], n))
    return order[:max(order.index(me) + 1, min(copies, len(order)))]


def _changed_since(revision: int) -> Callable[[Membership], bool]:
    """Whether the view moved past `revision`."""
    return lambda m: m.revision != revision


async def start_repair(settings: Settings, tier: LmdbBlockTier, registration: Registration,
                       token: bytes | None) -> FleetRepairer:
    """Watch the fleet and start re-replicating (the server calls this once it is registered).

    Raises:
        Unavailable: etcd does not answer.
    """
    fleet = settings.fleet
    peers = Peers(token, settings.server.max_message_bytes, peer_credentials(settings))
    membership = Membership(session_for(fleet), fleet.cluster)
    await membership.start()
    key = repair_key(fleet.cluster, registration.record.node_id)
    drain = drain_key(fleet.cluster, registration.record.node_id)
    # The repairer's own calls go through a session of their own. An EtcdSession resets (closes) its
    # client when a call finds etcd unreachable: shared with the view's watch, that close raced the watch's
    # own reconnect inside aetcd and left the view stale for good after etcd came back (no pass ran over the
    # new membership); shared with the registration, it would cancel a keep-alive in flight.
    own = session_for(fleet)

    async def publish(progress: RepairProgress) -> None:
        if progress.drained:  # its lease is revoked (F21): the record stays until the drain is cancelled
            await own.call(lambda c: c.put(key, progress.to_json()))
            return
        lease = registration.lease_id
        if lease is not None:  # between a lost lease and its renewal: the next update writes it
            await own.call(lambda c: c.put(key, progress.to_json(), lease=lease))

    async def drain_requested() -> bool | None:
        try:
            return await own.call(lambda c: c.get(drain)) is not None
        except KVStoreError:  # etcd away: unknown (nothing changes); the next pass asks again
            return None

    async def mark_draining(draining: bool) -> None:
        await registration.set_draining(draining, own)  # F21: still under the lease, a member

    bucket = TokenBucket(fleet.repair_bytes_per_s, max(2 * BATCH_BYTES, fleet.repair_bytes_per_s / 10))
    # F18: where `[transfer] bulk` is on, a target that runs it too reads the copies from this node's map.
    bulk = BulkSource(tier, settings.transfer.bulk_host) if settings.transfer.bulk == "mooncake" else None
    repairer = FleetRepairer(tier, node_id=registration.record.node_id, membership=membership,
                             replication=fleet.replication, run_blocks=fleet.run_blocks,
                             window_s=settings.store.retention_s, bucket=bucket,
                             peers=peers, interval_s=fleet.repair_interval_s, publish=publish, bulk=bulk)
    repairer.leave, repairer.drain_requested, repairer.mark_draining = registration.stop, drain_requested, \
        mark_draining
    repairer.etcd = own
    repairer.closing.append(own.close)
    repairer.drain_changed = asyncio.Event()
    repairer.closing.append(await watch_drain(fleet, drain, repairer.drain_changed))
    repairer.start()
    return repairer


async def watch_drain(fleet: FleetSettings, key: bytes, changed: asyncio.Event) -> Callable[[], Awaitable[None]]:
    """Follow this node's drain key (`kvstore fleet drain`, F85) in etcd: `changed` is set at each put or delete of
    it, and again each time the watch resumes after etcd was away (a request made meanwhile is read by the pass it
    wakes). On a session of its own: a session resets its client when a call fails, which must not race another
    watch's reconnect (`start_repair`). Returns what stops it.

    Raises:
        Unavailable: etcd does not answer.
    """
    session = session_for(fleet)
    try:
        revision = (await session.call(lambda c: c.get_prefix(key))).header.revision
    except BaseException:
        await session.close()
        raise

    async def apply(_event: Any) -> None:
        changed.set()

    async def lost(_exc: Exception) -> None:
        return None

    async def reload() -> int:
        found = await session.call(lambda c: c.get_prefix(key))
        changed.set()
        return int(found.header.revision)

    task = asyncio.get_running_loop().create_task(
        follow_prefix(session, key, revision, apply=apply, lost=lost, reload=reload, retry_s=1.0),
        name="fleet-drain-watch")

    async def stop() -> None:
        await stop_task(task)
        await session.close()

    return stop
