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

A node that stops being a replica of a run (a node joined and ranks above it) keeps
its copy: retention evicts it in time, so copies never drop below the factor while
the new replica fills (the choice, and its cost in disk, in docs/FLEET.md F21).

Progress (`kvstore.fleet.repair_progress.RepairProgress`) is published in etcd under
the node's lease, so `kvstore fleet status` shows under-replicated bytes fleet-wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway.fleet_servicer import TOKEN_METADATA
from gateway.token_bucket import TokenBucket
from kvstore.config import Settings
from kvstore.errors import ConfigError, DeadlineExceeded, KVStoreError
from kvstore.fleet.membership import Membership, Registration, session_for
from kvstore.fleet.placement import replicas
from kvstore.fleet.repair_progress import RepairProgress, drain_key, repair_key
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tiers import namespaces, run_index
from tiers.lmdb_tier import LmdbBlockTier
from tiers.reads import ReadStatus
from tiers.run_index import RunBlock, RunDigest, RunEntry

log = logging.getLogger("kvstore.fleet.repair")
#: Bytes of block data per CopyBlocks call (and per take from the bucket).
BATCH_BYTES = 4 << 20
#: Runs planned at a time (their blocks' metas are held while planned).
RUNS_PER_ROUND = 512
#: Seconds one peer call may take.
CALL_TIMEOUT_S = 30.0


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
        self.options = [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes)]
        self._stubs: dict[str, fleet_pb2_grpc.FleetStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> fleet_pb2_grpc.FleetStub:
        """The Fleet stub of the node at `address`."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = (grpc.aio.secure_channel(address, self.credentials, options=self.options) if self.credentials
                       else grpc.aio.insecure_channel(address, options=self.options))
            self._channels.append(channel)
            stub = self._stubs[address] = fleet_pb2_grpc.FleetStub(channel)
        return stub

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


@dataclass
class RunPlan:
    """One run this node is to copy: its blocks and, per target node id, the blocks the target lacks."""

    entry: RunEntry
    blocks: list[RunBlock]
    sends: dict[str, list[RunBlock]] = field(default_factory=dict)


class FleetRepairer:
    """The node's re-replication task.

    Args:
        tier: the node's store.
        node_id: this node's id.
        membership: the live view of the fleet.
        replication: copies per run.
        run_blocks: blocks per run.
        window_s: the retention floor: only blocks used within it are copied (older ones may go anyway).
        bucket: the copy rate.
        peers: channels to the other nodes.
        interval_s: seconds between passes while membership does not change.
        publish: writes the progress record (None: not published).
    """

    def __init__(self, tier: LmdbBlockTier, *, node_id: str, membership: Membership, replication: int,
                 run_blocks: int, window_s: float, bucket: TokenBucket, peers: Peers, interval_s: float,
                 publish: Callable[[RepairProgress], Awaitable[None]] | None) -> None:
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
        self._names: dict[bytes, str] = {}
        self.progress = RepairProgress(node_id=node_id)
        #: Called once when a drain is found requested (leave the membership); None: drains are not followed.
        self.leave: Callable[[], Awaitable[None]] | None = None
        #: Whether a drain of this node was requested (None: drains are not looked for).
        self.drain_requested: Callable[[], Awaitable[bool]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._published_at = 0.0

    def start(self) -> None:
        """Run passes in the background until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-repair")

    async def stop(self) -> None:
        """Cancel the task, close the channels and the membership view."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.peers.close()
        await self.membership.close()

    async def _run(self) -> None:
        seen = -1
        while True:
            # A draining node passes again soon, until a pass finds nothing left to copy (F21).
            wait_s = 1.0 if self.progress.draining and not self.progress.drained else self.interval_s
            with contextlib.suppress(DeadlineExceeded):  # no change within the interval: a periodic pass
                await self.membership.wait_until(_changed_since(seen), wait_s)
            seen = self.membership.revision
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end re-replication: logged, and the next pass tries again
                log.exception("fleet: a re-replication pass failed")

    async def run_pass(self) -> RepairProgress:
        """One pass over every run held, against the membership as it is now; returns the progress."""
        p = self.progress
        if not p.draining and self.drain_requested is not None and await self.drain_requested():
            p.draining = True  # F21: leave the membership first, so clients and placement go elsewhere
            if self.leave is not None:
                await self.leave()
            await self.membership.wait_until(lambda m: self.node_id not in m.nodes, 30)
        nodes = {n: r for n, r in self.membership.nodes.items() if not (p.draining and n == self.node_id)}
        if self.membership.stale or not nodes or (self.node_id not in nodes and not p.draining):
            return p  # etcd away, or our own record not seen yet: the view cannot be planned over
        p.planned_nodes, p.running = sorted(nodes), True
        p.under_replicated_bytes = p.under_replicated_runs = p.failed_runs = 0
        await self._publish(force=True)
        runs = await self.tier.call(run_index.list_runs, self.tier.env)
        self._names = await self.tier.call(run_index.namespace_names, self.tier.env)
        addresses = {n: r.address for n, r in nodes.items()}
        planned = 0
        for start in range(0, len(runs), RUNS_PER_ROUND):
            plans = await self.plan(runs[start:start + RUNS_PER_ROUND], sorted(nodes), addresses)
            planned += len(plans)
            p.under_replicated_runs += len(plans)
            p.under_replicated_bytes += sum(b.meta.size_bytes for plan in plans for s in plan.sends.values()
                                            for b in s)
            await self._publish()
            for plan in plans:
                await self._copy(plan, addresses)
        p.running, p.passes = False, p.passes + 1
        p.drained = p.draining and not planned and not p.failed_runs
        await self._publish(force=True)
        return p

    async def plan(self, runs: Sequence[RunEntry], live: list[str], addresses: dict[str, str]) -> list[RunPlan]:
        """The runs among `runs` this node is to copy over the `live` node ids (at `addresses`), with what
        each target lacks. Asks the peers; copies nothing."""
        since = self.tier.retention_clock.now() - self.window_s
        env, rb = self.tier.env, self.run_blocks

        def read_all() -> list[list[RunBlock]]:
            return [[b for b in run_index.members(env, r.key, rb) if b.meta.last_access_s >= since] for r in runs]

        held = await self.tier.call(read_all)
        # A draining node ranks last for every run: it sends only what no other node holds (F21).
        last = (self.node_id,) if self.node_id not in live else ()
        orders = [replicas(r.run_key, live, len(live)) + last for r in runs]
        asked: dict[str, list[int]] = {}  # peer -> indexes of the runs it is asked about
        for i, order in enumerate(orders):
            if held[i]:
                me = order.index(self.node_id)
                for peer in {*order[:me], *order[:self.replication]} - {self.node_id}:
                    asked.setdefault(peer, []).append(i)
        theirs = await self._digests(asked, runs, addresses)
        plans = []
        for i, order in enumerate(orders):
            if held[i]:
                plan = await self._plan_run(runs[i], held[i], order, theirs, addresses)
                if plan is not None:
                    plans.append(plan)
        return plans

    async def _plan_run(self, entry: RunEntry, blocks: list[RunBlock], order: tuple[str, ...],
                        theirs: dict[tuple[str, bytes], RunDigest | None],
                        addresses: dict[str, str]) -> RunPlan | None:
        mine = RunDigest.of(blocks)
        me = order.index(self.node_id)
        above = [theirs.get((n, entry.key)) for n in order[:me]]
        if any(d == mine for d in above):
            return None  # a holder ranked above holds the same blocks: it acts, not us
        unique = blocks
        for n, d in zip(order[:me], above, strict=True):
            if d is None or d.blocks:  # unreachable (assume it holds them) or holds some: keep only what it lacks
                unique = await self._lacking(n, unique, addresses, assume_held=d is None)
        plan = RunPlan(entry=entry, blocks=blocks)
        for target in order[:self.replication]:
            if target == self.node_id or not unique:
                continue
            d = theirs.get((target, entry.key))
            if d == mine:
                continue
            send = unique if d is not None and not d.blocks else await self._lacking(target, unique, addresses)
            if send:
                plan.sends[target] = send
        return plan if plan.sends else None

    async def _digests(self, asked: dict[str, list[int]], runs: Sequence[RunEntry],
                       addresses: dict[str, str]) -> dict[tuple[str, bytes], RunDigest | None]:
        """(peer, run root) -> what the peer holds of the run (None: the peer did not answer)."""
        async def ask(peer: str, idx: list[int]) -> list[tuple[tuple[str, bytes], RunDigest | None]]:
            roots = [runs[i].key for i in idx]
            try:
                reply = await self.peers.stub(addresses[peer]).RunDigests(
                    pb.RunDigestsRequest(run_roots=roots), metadata=self.peers.metadata, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("fleet: node %s does not answer RunDigests (%s)", peer, exc.code().name)
                return [((peer, k), None) for k in roots]
            return [((peer, k), RunDigest(blocks=d.blocks, size_bytes=d.size_bytes, digest=d.digest))
                    for k, d in zip(roots, reply.runs, strict=True)]

        found = await asyncio.gather(*(ask(peer, idx) for peer, idx in asked.items()))
        return dict(pair for answers in found for pair in answers)

    async def _lacking(self, peer: str, blocks: list[RunBlock], addresses: dict[str, str], *,
                       assume_held: bool = False) -> list[RunBlock]:
        """The blocks `peer` does not hold (when it does not answer: none if `assume_held`, else all)."""
        try:
            reply = await self.peers.stub(addresses[peer]).HeldBlocks(
                pb.HeldBlocksRequest(keys=[b.key for b in blocks]), metadata=self.peers.metadata,
                timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return [] if assume_held else blocks
        return [b for b, h in zip(blocks, reply.held, strict=True) if not h]

    async def _copy(self, plan: RunPlan, addresses: dict[str, str]) -> None:
        """Send each target what it lacks of the run, in batches at the bucket's rate."""
        p = self.progress
        failed = False
        for target, blocks in plan.sends.items():
            sent = await self._send(target, addresses[target], blocks)
            failed = failed or sent is None
            p.under_replicated_bytes -= sum(b.meta.size_bytes for b in blocks)
            await self._publish()
        p.under_replicated_runs -= 1
        if failed:
            p.failed_runs += 1

    async def _send(self, target: str, address: str, blocks: list[RunBlock]) -> int | None:
        """Copy `blocks` (parents first) to one target; the bytes copied, None when a batch failed."""
        p = self.progress
        skipped: set[bytes] = set()  # blocks not sent (damaged, gone): their descendants cannot go either
        copied = 0
        step = max(1, BATCH_BYTES // max(1, blocks[0].meta.size_bytes))
        for start in range(0, len(blocks), step):
            chunk = blocks[start:start + step]
            copies = await self._read(chunk, skipped)
            if not copies:
                continue
            size = sum(len(c.data) for c in copies)
            await self.bucket.take(size)  # F18: the bounded rate
            p.sent_bytes += size
            try:
                reply = await self.peers.stub(address).CopyBlocks(
                    pb.CopyBlocksRequest(blocks=copies), metadata=self.peers.metadata, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("fleet: copying %d blocks to node %s failed: %s: %s", len(copies), target,
                            exc.code().name, exc.details())
                return None
            copied += reply.written_bytes
            p.copied_bytes += reply.written_bytes
            p.copied_blocks += reply.written_blocks
        return copied

    async def _read(self, chunk: list[RunBlock], skipped: set[bytes]) -> list[pb.CopiedBlock]:
        """The chunk's blocks as copies, each verified against its checksum by the read (F17)."""
        statuses = await self.tier.call(self.tier.read, [b.key for b in chunk])
        copies = []
        for b, (status, data) in zip(chunk, statuses, strict=True):
            parent = b.key[:-32] + b.meta.parent_hash
            if status is not ReadStatus.FOUND or parent in skipped:
                if status is ReadStatus.CORRUPT:
                    self.progress.damaged_blocks += 1
                    log.warning("fleet: block %s... is damaged here (its checksum fails): dropped, not copied; "
                                "a holder ranked below sends its copy", b.key.hex()[:24])
                skipped.add(b.key)
                continue
            namespace = self._names.get(namespaces.id_of_key(b.key))
            if namespace is None:
                skipped.add(b.key)
                continue
            copies.append(pb.CopiedBlock(key=b.key, namespace=namespace, parent_hash=b.meta.parent_hash,
                                         depth=b.meta.depth, data=bytes(data), checksum=b.meta.checksum,
                                         last_use_s=b.meta.last_access_s))
        return copies

    async def _publish(self, *, force: bool = False) -> None:
        """Write the progress record (at most once a second unless `force`)."""
        now = time.monotonic()
        if self.publish is None or (not force and now - self._published_at < 1.0):
            return
        self._published_at = now
        self.progress.updated_at = time.time()
        try:
            await self.publish(self.progress)
        except KVStoreError as exc:  # etcd away: the next update tries again
            log.warning("fleet: cannot publish re-replication progress: %s", exc)


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

    async def publish(progress: RepairProgress) -> None:
        if progress.draining:  # its lease is revoked: the record stays until the drain is cancelled
            await membership.session.call(lambda c: c.put(key, progress.to_json()))
            return
        lease = registration.lease_id
        if lease is not None:  # between a lost lease and its renewal: the next update writes it
            await registration.session.call(lambda c: c.put(key, progress.to_json(), lease=lease))

    async def drain_requested() -> bool:
        try:
            return await membership.session.call(lambda c: c.get(drain)) is not None
        except KVStoreError:  # etcd away: the next pass asks again
            return False

    bucket = TokenBucket(fleet.repair_bytes_per_s, max(2 * BATCH_BYTES, fleet.repair_bytes_per_s / 10))
    repairer = FleetRepairer(tier, node_id=registration.record.node_id, membership=membership,
                             replication=fleet.replication, run_blocks=fleet.run_blocks,
                             window_s=settings.store.retention_s, bucket=bucket,
                             peers=peers, interval_s=fleet.repair_interval_s, publish=publish)
    repairer.leave, repairer.drain_requested = registration.stop, drain_requested
    repairer.start()
    return repairer
