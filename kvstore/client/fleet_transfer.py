"""A transfer session through a fleet client: `fetch` of a prompt's chain into this process's regions (F49).

    with client.transfer() as session:                  # client = kvstore.Client("etcd://...")
        region = session.register(n * client.block_bytes)
        state = session.fetch(client.hashes(tokens), region)   # a chain from block 0
        usable = region.view[: state.done_prefix * client.block_bytes]

A prompt's runs lie on several nodes, so the session holds a stream-path
session (`TransferSession(path="stream")`: no server session, blocks over
`Transfer.Fetch`) per node it reads from, and its regions are this process's
memory, written by each of them at the run's offset. Each run is fetched from
the first node of its read order (F33) and, from the block a node lacks (or
when it does not answer), from the next; the copies a fetch did not ask are
refreshed in the background (F34). `fetch` takes a chain from block 0 (each
run is placed by its first hash), as `FleetClient.stream` does.

Not through a fleet session: the shared-memory and bulk paths (a region would
be mapped by one node, while the runs lie on several), and `read`/`write` of
descriptor batches (a descriptor names a block but not its run):
FAILED_PRECONDITION naming `fetch` and `FleetClient.put`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from kvstore.client import arguments
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_batches import fetch_arguments
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvstore.fleet.placement import RunPlacement
from kvstore.region import Region
from kvstore.transfer import DONE, MISSING, SKIPPED, TransferState

#: Ids of a fleet session's regions (this process's memory; no node hands them out).
_IDS = itertools.count(1 << 61)
#: Runs fetched at once (each on a thread of its own, with node sessions of its own).
RUNS_AT_ONCE = 8


def _state(codes: bytes, block_bytes: int) -> TransferState:
    return TransferState(transfer_id=0, done=True, statuses=codes, bytes_moved=codes.count(DONE) * block_bytes,
                         block_bytes=block_bytes)


class FleetTransferSession:
    """Fetches from a fleet's nodes into regions of this process (the module's docstring).

    Args:
        client: the `kvstore.client.fleet.FleetClient` (its nodes, placement, read order and refreshes; not
            imported here: the fleet client imports this module).
        path: "auto" or "stream" (the only path a fleet session takes); "shm" and "bulk" are refused.
        streams: Fetch calls each node's stream path keeps in flight (as `TransferSession`'s).

    Raises:
        FailedPrecondition: path "shm" or "bulk".
        InvalidArgument: an unknown path.
    """

    def __init__(self, client: Any, *, path: str = "auto", streams: int | None = None) -> None:
        if path in ("shm", "bulk"):
            raise FailedPrecondition(f"path {path} is not available through a fleet session: it would map a region "
                                     "into one node, and a prompt's runs lie on several",
                                     hint='use path="auto" or "stream" (docs/FLEET.md F49)')
        if path not in ("auto", "stream"):
            raise InvalidArgument(f"path must be one of auto, stream, shm, bulk; got {path!r}")
        self.client = client
        self.path = "stream"
        self.streams = streams
        self.regions: dict[int, Region] = {}
        #: Node sessions per thread (a stream session is not shared between threads), and all of them.
        self._local = threading.local()
        self._all: list[TransferSession] = []
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        #: The nodes this session has read from.
        self.nodes_read: set[str] = set()
        #: Why the bulk transport and the ring are not used (as `TransferSession`'s fields say).
        self.bulk_reason = "off: a fleet session streams each run from its node"
        self.ring_reason = "off: a fleet session streams each run from its node"

    # -- regions -----------------------------------------------------------

    def register(self, size_bytes: int) -> Region:
        """A region of `size_bytes` in this process (a sealed memfd, `kvstore.region`), for `fetch`.

        Raises:
            InvalidArgument: `size_bytes` is not a positive int.
        """
        region = Region(arguments.integer(size_bytes, "size_bytes", least=1))
        region.region_id = next(_IDS)
        region.release_fd()  # no node maps it: the descriptor has no one to go to
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
        """Close a region of this session.

        Raises:
            NotFound: `region` is not registered in this session.
        """
        self._own(region)
        with self._lock:
            sessions = list(self._all)
        for session in sessions:
            session.regions.pop(region.region_id, None)
        self.regions.pop(region.region_id, None)
        region.close()

    # -- fetch -------------------------------------------------------------

    def fetch(self, hashes: Sequence[bytes], region: Region, *, offset_bytes: int = 0,
              batch_descriptors: int = 512, prefix_only: bool = True) -> TransferState:
        """Fetch the blocks of a chain (fleet hashes from block 0) into consecutive slots of `region` and wait.

        Each run from its nearest replica, falling over from the block a node lacks; a block no replica holds is
        MISSING, and the rest of its run too (a node holds no block past a gap: R6). With `prefix_only`, every
        block after the first not loaded is SKIPPED and not asked.

        Raises:
            InvalidArgument: bad hashes, offset or batch size, or more blocks than fit in `region`.
            NotFound: `region` is not registered in this session.
            Unavailable: no replica of a run answered.
        """
        chain = arguments.hashes(hashes, "hashes")
        region = self._own(region)
        size = self.client.block_bytes
        offset_bytes, batch_descriptors = fetch_arguments(len(chain), size, region, offset_bytes, batch_descriptors,
                                                          prefix_only)
        if not chain:
            return TransferState.concat([])
        runs = self.client.placement(chain)
        if len(runs) == 1:
            landed = [self._fetch_run(runs[0], chain, region, offset_bytes, batch_descriptors)]
        else:  # runs lie on different nodes and land in different slots: all at once
            if self._threads is None:
                self._threads = ThreadPoolExecutor(RUNS_AT_ONCE, thread_name_prefix="fleet-transfer")
            futures = [self._threads.submit(self._fetch_run, run, chain, region, offset_bytes, batch_descriptors)
                       for run in runs]
            landed = [f.result() for f in futures]
        states, stopped = [], False
        for run, done in zip(runs, landed, strict=True):
            n = run.end_block - run.first_block
            if stopped:  # as on one node, later blocks may have landed: only `done_prefix` counts
                states.append(_state(bytes([SKIPPED]) * n, size))
                continue
            after = bytes([SKIPPED if prefix_only else MISSING]) * (n - done - 1)
            tail = bytes([MISSING]) + after if done < n else b""
            states.append(_state(bytes([DONE]) * done + tail, size))
            stopped = prefix_only and done < n
        return TransferState.concat(states)

    def _fetch_run(self, run: RunPlacement, chain: list[bytes], region: Region, offset_bytes: int,
                   batch_descriptors: int) -> int:
        """Leading blocks of `run` landed in `region`, from its replicas in read order (from the block each lacks)."""
        pool, size = self.client.pool, self.client.block_bytes
        at, end, asked, last = run.first_block, run.end_block, set(), None
        for node_id in pool.read_order(chain[run.first_block], run.replicas):
            try:
                session = self._session(node_id)
                session.regions[region.region_id] = region  # its stream path writes into this process's region
                state = session.fetch(chain[at:end], region, offset_bytes=offset_bytes + at * size,
                                      batch_descriptors=batch_descriptors, prefix_only=True)
            except Unavailable as exc:
                pool.failed(node_id)
                last = exc
                continue
            asked.add(node_id)
            with self._lock:
                self.nodes_read.add(node_id)
            at += state.done_prefix
            if at == end:
                break
        if at == run.first_block and last is not None and not asked:
            raise last
        if at > run.first_block:  # a use of every copy (F34): those not asked are refreshed off the read path
            for other in run.replicas:
                if other not in asked:
                    self.client.refresher.add(other, chain[run.first_block:at])
        return at - run.first_block

    def _session(self, node_id: str) -> TransferSession:
        """This thread's stream session with `node_id` (made again when the node's connection was)."""
        mine: dict[str, TransferSession] = self._local.__dict__.setdefault("sessions", {})
        session = mine.get(node_id)
        connection = self.client.pool.connection(node_id)
        if session is None or session.connection is not connection:
            session = TransferSession(connection, path="stream", streams=self.streams, ring=False)
            mine[node_id] = session
            with self._lock:
                self._all.append(session)
        return session

    # -- what a fleet session does not do --------------------------------

    def read(self, descriptors: Sequence[Any], *, prefix_only: bool = False) -> NoReturn:
        """Not through a fleet session: a descriptor names a block, not its run (use `fetch` of the chain)."""
        raise FailedPrecondition("read() of descriptors is not available through a fleet session: a descriptor "
                                 "names a block, not the run that places it",
                                 hint="fetch() the prompt's chain from block 0 (docs/FLEET.md F49)")

    def write(self, tokens: Sequence[int], descriptors: Sequence[Any], *, first_block: int = 0,
              extra_keys: Sequence[Any] = ()) -> NoReturn:
        """Not through a fleet session: `FleetClient.put` stores a prompt's blocks on every replica."""
        raise FailedPrecondition("write() is not available through a fleet session",
                                 hint="put the blocks with the fleet client's put() (docs/FLEET.md F49)")

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """Close every node's stream session, then this session's regions."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        with self._lock:
            sessions, self._all = self._all, []
        for session in sessions:
            session.regions.clear()  # the regions are this session's: a node session must not close them
            session.close()
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def __enter__(self) -> FleetTransferSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["FleetTransferSession"]
