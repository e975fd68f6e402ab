"""A transfer session through a fleet client: `fetch` of a prompt's chain into this process's regions (F49, F62).

    with client.transfer() as session:                  # client = kvstore.Client("etcd://...")
        region = session.register(n * client.block_bytes)
        state = session.fetch(client.hashes(tokens), region)   # a chain from block 0
        usable = region.view[: state.done_prefix * client.block_bytes]

A prompt's runs lie on several nodes. The session's regions are this process's
memfds (`kvstore.region`); each is mapped into this host's nodes (F62:
`kvstore.client.fleet_local`, one shared-memory session per such node, the
region registered with it as a single node's session registers it), and the
runs such a node holds are read by it over shared memory (the node copies
from its map into the region: only descriptors cross the channel). Every other
run is streamed by a stream-path session (`TransferSession(path="stream")`:
no server session, blocks over `Transfer.Fetch`) per node and thread, written
here at the run's offset. Each run is read from this host's replica first,
then in its read order (F33), and from the block a node lacks (or when it does
not answer) from the next; the copies a fetch did not ask are refreshed in the
background (F34). `fetch` takes a chain from block 0 (each run is placed by its
first hash), as `FleetClient.stream` does.

A node of this host that restarts (its record names a new incarnation) has the regions mapped into it
again at the next `fetch` or `read` (F72).

`read` and `write` take descriptor batches (F71, `kvstore.client.fleet_descriptors`): a read
descriptor carries its run (`RunDescriptor.run_key`, made by `descriptors(chain, region)`), so each
run's blocks go to its replicas in the same order, with failover; a write's runs are its tokens',
stored as `FleetClient.put` stores them (F30).

On paths "auto" and "bulk" a run that is not read over shared memory goes by the bulk transport from a
node that runs it (F74): one batch per node, by the node's bulk-path session (`fleet_remote`), the region
registered with this process's Mooncake engines once however many sessions hold it (F73,
`transfer_bulk.register_counted`), the node's engine writing the blocks straight into it; a node that
runs none streams (`bulk_reasons` says why).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvstore.client import arguments
from kvstore.client.fleet_descriptors import (
    RunDescriptor,
    checked_reads,
    checked_writes,
    run_descriptors,
    start_reads,
    write_blocks,
)
from kvstore.client.fleet_local import LocalMaps
from kvstore.client.fleet_remote import RemoteSessions, close_node_session, path_of
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_batches import fetch_arguments
from kvstore.client.transfer_path import LocalTransfer, Transfer, timeout
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, Unavailable
from kvstore.fleet.placement import RunPlacement
from kvstore.region import Region
from kvstore.transfer import DONE, MISSING, SKIPPED, BatchResults, Descriptor, DescriptorGroup, TransferState

#: Ids of a fleet session's regions (this process's memory; the nodes that map one know it by ids of their own).
_IDS = itertools.count(1 << 61)
#: Ids of a fleet session's `read` and `write` batches.
_TRANSFERS = itertools.count(1)
#: Runs fetched at once (each on a thread of its own, with node sessions of its own).
RUNS_AT_ONCE = 8
#: The paths a fleet session takes.
PATHS = ("auto", "stream", "shm", "bulk")


def _state(codes: bytes, block_bytes: int, failures: dict[int, tuple[str, str]] | None = None) -> TransferState:
    return TransferState(transfer_id=0, done=True, statuses=codes, bytes_moved=codes.count(DONE) * block_bytes,
                         block_bytes=block_bytes, failures=failures or {})


@dataclass(eq=False)
class _RunRead:
    """One run of a fetch: its replicas in read order, the blocks landed so far and by whom."""

    run: RunPlacement
    order: list[str]
    #: Index in the chain of the run's first block not landed yet.
    at: int = -1
    asked: set[str] = field(default_factory=set)
    paths: list[str] = field(default_factory=list)
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)
    last: KVStoreError | None = None

    def __post_init__(self) -> None:
        if self.at < 0:
            self.at = self.run.first_block

    @property
    def complete(self) -> bool:
        """Whether every block of the run has landed."""
        return self.at >= self.run.end_block

    def delivered(self, node_id: str, path: str, blocks: int) -> None:
        """`blocks` more leading blocks landed, from `node_id` over `path`."""
        self.at += blocks
        if blocks and path not in self.paths:
            self.paths.append(path)


class FleetTransferSession:
    """Fetches from a fleet's nodes into regions of this process (the module's docstring).

    Args:
        client: the `kvstore.client.fleet.FleetClient` (its nodes, placement, read order and refreshes; not
            imported here: the fleet client imports this module).
        path: "auto" (this host's nodes map the regions where they can, every other run by the bulk transport
            from a node that runs it, else streamed), "stream" (every run streams), "shm" (this host's nodes map,
            the rest streamed; a region no node on this host maps is refused) or "bulk" (nothing mapped: every
            run by the bulk transport where its node runs it, else streamed; F74).
        streams: Fetch calls each node's stream path keeps in flight (as `TransferSession`'s).
        local: the ids of this host's nodes (default: the live nodes whose records name this host,
            `fleet_local.local_nodes`); `restore` passes a `ColocatedReader`'s node (F48).

    Raises:
        InvalidArgument: an unknown path, or `local` not a collection of node ids.
    """

    def __init__(self, client: Any, *, path: str = "auto", streams: int | None = None,
                 local: Collection[str] | None = None) -> None:
        if not isinstance(path, str) or path not in PATHS:
            raise InvalidArgument(f"path must be one of {', '.join(PATHS)}; got {path!r}")
        if local is not None and (isinstance(local, str) or not all(isinstance(n, str) for n in local)):
            raise InvalidArgument(f"local must be a collection of node ids, got {type(local).__name__}")
        self.client = client
        self.path = path
        self.streams = streams
        self.regions: dict[int, Region] = {}
        #: The node sessions that read over the network: the stream, and the bulk transport (F74).
        self._remote = RemoteSessions(client, streams=streams, bulk=path in ("auto", "bulk"))
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        #: This host's nodes' shared-memory sessions and the regions mapped into them (F62, F72).
        self._maps = LocalMaps(client, path=path, streams=streams, only=None if local is None else frozenset(local))
        #: Why a node on this host maps no region of this session (node id -> reason).
        self.shm_reasons = self._maps.reasons
        #: The nodes this session has read from.
        self.nodes_read: set[str] = set()
        #: Blocks delivered per (node, path), path "shm", "bulk" or "stream", since the session opened.
        self.blocks_read: Counter[tuple[str, str]] = Counter()
        #: Each run of the last `fetch`: the paths that delivered its blocks ("shm", "bulk", "stream", "shm+stream",
        #: ...; "" when none).
        self.last_paths: list[str] = []
        #: Why a node's runs are not read by the bulk transport (node id -> its session's `bulk_reason`, F74).
        self.bulk_reasons = self._remote.bulk_reasons
        #: Why the bulk transport and the ring are not used (as `TransferSession`'s fields say).
        self.bulk_reason = (f"off: path={path!r} reads no node by it" if path in ("stream", "shm")
                            else "per node: each node's session negotiates it (bulk_reasons)")
        self.ring_reason = "the ring is each shared-memory node session's own"

    # -- regions -----------------------------------------------------------

    def register(self, size_bytes: int) -> Region:
        """A region of `size_bytes` in this process (a sealed memfd, `kvstore.region`), for `fetch`, mapped
        into this host's nodes (not on path "stream").

        Raises:
            InvalidArgument: `size_bytes` is not a positive int.
            FailedPrecondition: path "shm", and no node of this host can map the region (none is in the
                fleet, or one refuses; a node that does not answer is failed over: its runs stream).
            ResourceExhausted: a node of this host maps its most regions or bytes.
        """
        region = Region(arguments.integer(size_bytes, "size_bytes", least=1))
        region.region_id = next(_IDS)
        try:
            if self.path not in ("stream", "bulk"):
                self._maps.map(region)
        except BaseException:
            self._maps.unmap(region)
            region.close()
            raise
        if self.path in ("stream", "bulk"):  # kept otherwise: a node of this host that restarts maps it again (F72)
            region.release_fd()
        self.regions[region.region_id] = region
        return region

    def _own(self, region: Any) -> Region:
        if not isinstance(region, Region):
            raise InvalidArgument(f"region must be a Region from this session's register(), "
                                  f"got {type(region).__name__}")
        if self.regions.get(region.region_id) is not region:
            raise NotFound(f"region {region.name} is not registered in this session")
        return region

    def deregister(self, region: Region) -> None:
        """Close a region of this session (the nodes that map it unmap it first).

        Raises:
            NotFound: `region` is not registered in this session.
        """
        self._own(region)
        self._maps.unmap(region)
        self._remote.forget(region)
        self.regions.pop(region.region_id, None)
        region.close()

    def shared_with(self, region: Region) -> list[str]:
        """The nodes of this host that map `region` (its runs on them are read over shared memory)."""
        return self._maps.shared_with(region)

    # -- fetch -------------------------------------------------------------

    def fetch(self, hashes: Sequence[bytes], region: Region, *, offset_bytes: int = 0,
              batch_descriptors: int = 512, prefix_only: bool = True) -> TransferState:
        """Fetch the blocks of a chain (fleet hashes from block 0) into consecutive slots of `region` and wait.

        Each run from this host's replica over shared memory where one maps `region` (all of one node's runs in
        one batch), else from its nearest replica over the stream, falling over from the block a node lacks; a
        block no replica holds is MISSING, and the rest of its run too (a node holds no block past a gap: R6).
        With `prefix_only`, every block after the first not loaded is SKIPPED and not asked.

        Raises:
            InvalidArgument: bad hashes, offset or batch size, or more blocks than fit in `region`.
            NotFound: `region` is not registered in this session.
            Unavailable: no replica of a run answered.
        """
        chain = arguments.hashes(hashes, "hashes")
        region = self._own(region)
        self._maps.remap(region)
        size = self.client.block_bytes
        offset_bytes, batch_descriptors = fetch_arguments(len(chain), size, region, offset_bytes, batch_descriptors,
                                                          prefix_only)
        if not chain:
            self.last_paths = []
            return TransferState.concat([])
        runs = self.client.placement(chain)
        reads = [_RunRead(run, self._order(run, chain, region)) for run in runs]
        by_node: dict[str, list[_RunRead]] = {}
        for read in reads:  # the runs whose first replica maps the region: one shm batch per node (F62)
            if read.order and region.region_id in self._maps.mapped.get(read.order[0], {}):
                by_node.setdefault(read.order[0], []).append(read)
        by_bulk: dict[str, list[_RunRead]] = {}
        for read in reads:  # the others whose first replica may run the bulk transport: one batch per node (F74)
            if read.order and read.order[0] not in by_node and self._remote.may_bulk(read.order[0]):
                by_bulk.setdefault(read.order[0], []).append(read)
        streamed = [r for r in reads if not r.order or (r.order[0] not in by_node and r.order[0] not in by_bulk)]
        batched = [*((n, m, "shm") for n, m in by_node.items()), *((n, m, "bulk") for n, m in by_bulk.items())]
        if len(batched) + len(streamed) == 1:  # one node's batch or one run: on this thread
            for node_id, members, kind in batched:
                self._node_runs(node_id, members, chain, region, offset_bytes, kind)
            for read in reads:
                self._fetch_run(read, chain, region, offset_bytes, batch_descriptors)
        else:  # different nodes, different slots: all at once
            pool = self._pool()
            first = [pool.submit(self._fetch_run, r, chain, region, offset_bytes, batch_descriptors) for r in streamed]
            batches = [pool.submit(self._node_runs, n, m, chain, region, offset_bytes, k) for n, m, k in batched]
            for f in batches:
                f.result()
            rest = [pool.submit(self._fetch_run, r, chain, region, offset_bytes, batch_descriptors)
                    for _, members, _ in batched for r in members if not r.complete]
            for f in [*first, *rest]:
                f.result()
        self.last_paths = ["+".join(r.paths) for r in reads]
        for read in reads:  # a use of every copy (F34): those not asked are refreshed off the read path
            if read.at > read.run.first_block:
                for other in read.run.replicas:
                    if other not in read.asked:
                        self.client.refresher.add(other, chain[read.run.first_block:read.at])
        states, stopped = [], False
        for read in reads:
            run = read.run
            n, done = run.end_block - run.first_block, read.at - run.first_block
            if stopped:  # as on one node, later blocks may have landed: only `done_prefix` counts
                states.append(_state(bytes([SKIPPED]) * n, size))
                continue
            after = bytes([SKIPPED if prefix_only else MISSING]) * (n - done - 1)
            tail = bytes([MISSING]) + after if done < n else b""
            failures = {i - run.first_block: f for i, f in read.failures.items() if i >= read.at}
            states.append(_state(bytes([DONE]) * done + tail, size, failures))
            stopped = prefix_only and done < n
        return TransferState.concat(states)

    def _order(self, run: RunPlacement, chain: list[bytes], region: Region) -> list[str]:
        """The run's read order (F33) with the replicas that map `region` first (F62), suspects still last."""
        return self.order_of(chain[run.first_block], {region.region_id}, run.replicas)

    def order_of(self, run_key: bytes, region_ids: Collection[int],
                 replicas: Sequence[str] | None = None) -> list[str]:
        """The read order (F33) of the run keyed `run_key` (its replicas placed now unless given), the replicas that
        map every region of `region_ids` first (F62), then the others, suspects last."""
        pool = self.client.pool
        if replicas is None:
            replicas = self.client.placement([run_key])[0].replicas  # a run is placed by its first hash alone
        order = pool.read_order(run_key, replicas)
        k = len(replicas)
        mapped = {n for n, aliases in self._maps.mapped.items() if all(r in aliases for r in region_ids)}
        # A node that maps the regions answered since it last failed (a failed shm read drops its mappings: F64), so
        # a restarted node mapped again (F72) is read first at once, not after the suspects' seconds.
        return sorted(order[:k], key=lambda n: (n not in mapped and pool.suspect(n), n not in mapped)) + order[k:]

    def _node_runs(self, node_id: str, members: list[_RunRead], chain: list[bytes], region: Region,
                   offset_bytes: int, kind: str) -> None:
        """Every run of `members` read by `node_id` into the region over shared memory (`kind` "shm", F62) or by
        the bulk transport ("bulk", F74), in as few batches as its session takes (one group per run, so one call,
        ring request or BulkFetch for a prompt's runs on a node); a node that fails, or runs no bulk transport, is
        noted, and the runs go on to their next replicas or the stream (`_fetch_run`)."""
        with contextlib.ExitStack() as held:
            if kind == "shm":
                session, alias = self._maps.sessions.get(node_id), self._maps.alias(node_id, region.region_id)
                if session is None or alias is None:
                    return
                region_id, reader = alias.region_id, session._paths["shm"]
            else:
                try:
                    session = held.enter_context(self._remote.remote(node_id, [region]))
                except Unavailable as exc:
                    self.client.pool.failed(node_id)
                    for read in members:
                        read.last = exc
                    return
                if session.bulk is None:  # runs none (or it failed here): `_fetch_run` streams the runs
                    return
                region_id, reader = region.region_id, session.bulk
            self._read_node_runs(node_id, members, chain, offset_bytes, kind, session, region_id, reader)

    def _read_node_runs(self, node_id: str, members: list[_RunRead], chain: list[bytes], offset_bytes: int,
                        kind: str, session: TransferSession, region_id: int, reader: Any) -> None:
        """`_node_runs`' batches through `reader` (the session's shm or bulk path) into region `region_id`."""
        size, most = self.client.block_bytes, max(1, session.max_descriptors)
        pieces: list[tuple[_RunRead, int, int]] = []  # (run, first, end) of at most `most` blocks each
        for read in members:
            for lo in range(read.at, read.run.end_block, most):
                pieces.append((read, lo, min(lo + most, read.run.end_block)))
        batches: list[list[tuple[_RunRead, int, int]]] = []
        for piece in pieces:  # whole pieces, at most `most` descriptors a batch
            if not batches or sum(e - f for _, f, e in batches[-1]) + piece[2] - piece[1] > most:
                batches.append([])
            batches[-1].append(piece)
        groups = [[DescriptorGroup.slots(chain[f:e], region_id=region_id, length_bytes=size,
                                         offset_bytes=offset_bytes + f * size) for _, f, e in batch]
                  for batch in batches]
        try:  # prefix_only off: one run's gap must not stop the others; a node holds nothing past it anyway (R6)
            states = session.wait_all(reader.read_many(groups, False))
        except (Unavailable, NotFound) as exc:
            if kind == "shm":
                self._maps.failed(node_id, exc)
            else:
                self.client.pool.failed(node_id)
            for read in members:
                read.last = exc
            return
        path = kind if kind == "shm" else self.path_of(session)  # "stream" when the bulk transport fell back
        for batch, state in zip(batches, states, strict=True):
            at = 0
            for read, f, e in batch:
                codes = state.statuses[at:at + e - f]
                got = next((i for i, c in enumerate(codes) if c != DONE), len(codes))
                for i, failure in state.failures.items():
                    if at <= i < at + e - f:
                        read.failures.setdefault(f + i - at, failure)
                if read.at == f:  # this piece follows what the run has so far
                    read.delivered(node_id, path, got)
                    self.count(node_id, path, got)
                at += e - f
        for read in members:
            read.asked.add(node_id)

    def _fetch_run(self, read: _RunRead, chain: list[bytes], region: Region, offset_bytes: int,
                   batch_descriptors: int) -> None:
        """The rest of one run into `region`, from its replicas in order (from the block each lacks), skipping the
        nodes already asked (Unavailable when none answered)."""
        run, size = read.run, self.client.block_bytes
        for node_id in read.order:
            if read.complete:
                break
            if node_id in read.asked:
                continue
            alias = self._maps.alias(node_id, region.region_id)
            try:
                if alias is not None:
                    path, state = "shm", self._maps.sessions[node_id].fetch(
                        chain[read.at:run.end_block], alias, offset_bytes=offset_bytes + read.at * size,
                        batch_descriptors=batch_descriptors, prefix_only=True)
                else:
                    path = "stream"
                    with self._remote.remote(node_id, [region]) as session:
                        path = self.path_of(session)
                        state = session.fetch(chain[read.at:run.end_block], region,
                                              offset_bytes=offset_bytes + read.at * size,
                                              batch_descriptors=batch_descriptors, prefix_only=True)
                        path = self.path_of(session)  # "stream" when its bulk transport failed and it fell back
            except (Unavailable, NotFound) as exc:
                if alias is None and path == "stream" and isinstance(exc, NotFound):
                    raise  # a stream has no server session to lose: the region is not this session's
                if alias is not None:
                    self._maps.failed(node_id, exc)
                else:
                    self.client.pool.failed(node_id)
                read.last = exc
                continue
            read.asked.add(node_id)
            for index, failure in state.failures.items():
                read.failures.setdefault(read.at + index, failure)
            with self._lock:
                self.nodes_read.add(node_id)
                self.blocks_read[node_id, path] += state.done_prefix
            read.delivered(node_id, path, state.done_prefix)
        if read.at == run.first_block and read.last is not None and not read.asked:
            raise read.last

    def bulk_sessions(self) -> dict[str, str]:
        """Node id -> the server's session id of this session's bulk-path session with it (F74)."""
        return self._remote.bulk_sessions()

    @staticmethod
    def path_of(session: TransferSession) -> str:
        """What a node session reads by: "shm", "bulk" (while its bulk transport is on) or "stream"."""
        return path_of(session)

    # -- read and write by descriptors (F71) --------------------------------

    def descriptors(self, hashes: Sequence[bytes], region: Region, *, first_block: int = 0,
                    end_block: int | None = None, offset_bytes: int = 0) -> list[RunDescriptor]:
        """Read descriptors of blocks [first_block, end_block) of a chain (fleet hashes from block 0) into consecutive
        slots of `region` from `offset_bytes`, each carrying its run (`fleet_descriptors.RunDescriptor`).

        Raises:
            InvalidArgument: bad hashes or bounds, or slots that do not fit in `region`.
            NotFound: `region` is not registered in this session.
        """
        return run_descriptors(hashes, self._own(region), run_blocks=self.client.run_blocks,
                               block_bytes=self.client.block_bytes, first_block=first_block, end_block=end_block,
                               offset_bytes=offset_bytes)

    def read(self, descriptors: Sequence[RunDescriptor], *, prefix_only: bool = False) -> Transfer:
        """Start fetching blocks into this session's regions, each from its run's replicas; returns at once (F71).

        Each run's descriptors go to its first replica in read order (this host's mapping first), and those a node
        lacks, or all when it does not answer, to the next (`fleet_descriptors.read_run`). With `prefix_only`,
        every descriptor after the first not loaded is SKIPPED (one may have landed: load `done_prefix`).

        Raises:
            InvalidArgument: a descriptor that is not a `RunDescriptor` (make them with `descriptors`), an empty or
                too long batch, or `prefix_only` not a bool.
        """
        batch = checked_reads(descriptors)
        if not isinstance(prefix_only, bool):
            raise InvalidArgument(f"prefix_only must be a bool, got {type(prefix_only).__name__}")
        for region_id in {d.region_id for d in batch}:
            if region_id in self.regions:
                self._maps.remap(self.regions[region_id])
        results = BatchResults(len(batch))
        done = start_reads(self, batch, results, prefix_only, self._pool())
        return LocalTransfer(next(_TRANSFERS), results, self.client.block_bytes, done)

    def write(self, tokens: Sequence[int], descriptors: Sequence[Descriptor], *, first_block: int = 0,
              extra_keys: Sequence[Any] = ()) -> Transfer:
        """Start storing blocks from this session's regions on every replica of their runs; returns at once (F71).

        One descriptor per full block of `tokens` from `first_block`, in order (their runs are the tokens'; a
        plain `Descriptor` will do). Stored as `FleetClient.put` stores (F30), its bytes the regions' views: DONE
        for the blocks on all their replicas, with their fleet hashes; the rest FAILED with the Put's error.

        Raises:
            InvalidArgument: bad tokens, extra keys, `first_block` or descriptors, or fewer full blocks of tokens
                than descriptors.
        """
        tokens = arguments.token_ids(tokens)
        first_block = arguments.integer(first_block, "first_block")
        extra_keys = arguments.extra_keys(extra_keys)
        descriptors = checked_writes(descriptors)
        end = (first_block + len(descriptors)) * self.client.block_tokens
        if end > len(tokens):
            raise InvalidArgument(f"{len(descriptors)} descriptors from block {first_block} need {end} tokens; "
                                  f"got {len(tokens)}")
        results = BatchResults(len(descriptors), writes=True)
        future = self._pool().submit(write_blocks, self.client, self.regions, tokens[:end], descriptors,
                                     first_block, extra_keys, results)
        return LocalTransfer(next(_TRANSFERS), results, self.client.block_bytes, future)

    def wait_all(self, transfers: Sequence[Transfer], timeout_s: float | None = None) -> list[TransferState]:
        """Wait for several of this session's batches; their states, in order."""
        timeout_s = timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return [t.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)) for t in transfers]

    # -- the nodes a batch is read from (`fleet_descriptors.read_run`) -----

    @contextlib.contextmanager
    def node_for(self, node_id: str, region_ids: Collection[int]
                 ) -> Iterator[tuple[TransferSession, Callable[[Descriptor], Descriptor]]]:
        """The session to read `node_id` by, held while the caller reads, and how a descriptor is named there: its
        shm session with the regions' aliases where it maps every region of `region_ids`, else its bulk session or
        this thread's stream session (`_remote`).

        Raises:
            Unavailable: the node is not in the view, or does not answer.
        """
        aliases = self._maps.mapped.get(node_id, {})
        shm = self._maps.sessions.get(node_id)
        if shm is not None and all(r in aliases for r in region_ids):
            ids = {r: aliases[r].region_id for r in region_ids}
            yield shm, lambda d: Descriptor(block_hash=d.block_hash, region_id=ids[d.region_id],
                                            offset_bytes=d.offset_bytes, length_bytes=d.length_bytes)
            return
        with self._remote.remote(node_id, [self.regions[r] for r in region_ids]) as session:
            yield session, lambda d: d

    def node_failed(self, node_id: str, exc: KVStoreError, session: TransferSession | None) -> None:
        """A read of `node_id` failed: read it last for a while (F33), and forget its mappings if they are gone."""
        if session is not None and session.path == "shm":
            self._maps.failed(node_id, exc)
        else:
            self.client.pool.failed(node_id)

    def count(self, node_id: str, path: str, blocks: int) -> None:
        """`blocks` delivered by `node_id` over `path`."""
        with self._lock:
            self.nodes_read.add(node_id)
            self.blocks_read[node_id, path] += blocks

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(RUNS_AT_ONCE, thread_name_prefix="fleet-transfer")
            return self._threads

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Close every node's session (the nodes unmap this session's regions), then the regions."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        for session in [*self._remote.close(), *self._maps.close()]:
            close_node_session(session)
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def __enter__(self) -> FleetTransferSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PATHS", "RUNS_AT_ONCE", "FleetTransferSession"]
