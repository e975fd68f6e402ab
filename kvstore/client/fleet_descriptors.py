"""A fleet transfer session's `read` and `write` of descriptor batches (F71).

On one node a `Descriptor` names a block by its hash, and the node holds it or not. In a fleet a block
lives on its run's replicas, and a run is placed by its first fleet hash (F10): a block's hash alone does
not say which nodes to ask. So a fleet session's read descriptors carry their run: `RunDescriptor` is a
`Descriptor` with `run_key`, the fleet hash of its run's first block (block `i - i % run_blocks` of the
chain), and `FleetTransferSession.descriptors(chain, region)` makes them for a chain's slots.

    descriptors = session.descriptors(chain, region, first_block=4, end_block=12)
    state = session.read(descriptors).wait()

`read_runs` groups a batch by run, asks each run's replicas in the session's read order (this host's
mapping first, F62; then F33's), and from a node that does not answer (UNAVAILABLE, its session gone) or
a block answered MISSING or DATA_LOSS (a copy lost, or not yet re-replicated) goes on to the next replica
with the descriptors still short; a descriptor refused for itself (a bad span) is not asked again. A
write needs no run on its descriptors: its tokens place every run, and `write_blocks` stores the blocks
through `FleetClient.put` (F30: every copy durable, runs in chain order).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from kvstore.client import arguments
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, PutNotReplicated, Unavailable, to_status
from kvstore.prefix import HASH_BYTES
from kvstore.region import Region
from kvstore.transfer import DONE, FAILED, MISSING, SKIPPED, BatchResults, Descriptor, TransferState

#: Most descriptors in one fleet batch (each node's part goes in batches its session takes).
MAX_DESCRIPTORS = 1 << 16
#: Failure codes that another replica may not share: the descriptor is asked of the next one.
RETRIED_CODES = frozenset({"DATA_LOSS", "UNAVAILABLE", "DEADLINE_EXCEEDED", "NOT_FOUND"})


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDescriptor(Descriptor):
    """A read `Descriptor` that carries the run placing its block (a fleet session's `read`).

    Attributes:
        run_key: the fleet hash of the first block of the block's run (what places the run, F10).
        run_depth: the block's depth in its run's chain on a node, 1 + its index in the run (1 for the block
            `run_key` names): what refreshes the run's other copies from inside the run (F71a).
    """

    run_key: bytes = b""
    run_depth: int = 0

    def __post_init__(self) -> None:
        Descriptor.__post_init__(self)  # explicit: zero-argument super() fails in a slots dataclass (3.11)
        if not isinstance(self.run_key, bytes) or len(self.run_key) != HASH_BYTES:
            raise InvalidArgument(
                f"RunDescriptor.run_key must be the {HASH_BYTES}-byte fleet hash of the run's first "
                f"block, got {self.run_key!r:.60}"
            )
        depth = self.run_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InvalidArgument(
                f"RunDescriptor.run_depth must be an int of at least 1 (1 + the block's index in "
                f"its run), got {depth!r}"
            )
        if (depth == 1) != (bytes(self.block_hash) == self.run_key):  # the run's first block is its key
            raise InvalidArgument(
                f"RunDescriptor.run_depth is {depth} but block_hash {'is' if depth > 1 else 'is not'} run_key: "
                "the run's first block alone is at depth 1"
            )


def run_descriptors(
    chain: Sequence[bytes],
    region: Region,
    *,
    run_blocks: int,
    block_bytes: int,
    first_block: int = 0,
    end_block: int | None = None,
    offset_bytes: int = 0,
) -> list[RunDescriptor]:
    """Descriptors of blocks [first_block, end_block) of `chain` (fleet hashes from block 0) into consecutive slots
    of `region`, block `first_block` at `offset_bytes`, each carrying its run's first hash.

    Raises:
        InvalidArgument: bad hashes or bounds, or slots that do not fit in `region`.
    """
    chain = arguments.hashes(chain, "chain")
    first_block = arguments.integer(first_block, "first_block")
    end = len(chain) if end_block is None else arguments.integer(end_block, "end_block")
    offset_bytes = arguments.integer(offset_bytes, "offset_bytes")
    if not first_block <= end <= len(chain):
        raise InvalidArgument(f"blocks [{first_block}, {end}) are not within the chain's {len(chain)} blocks")
    if offset_bytes + (end - first_block) * block_bytes > region.size_bytes:
        raise InvalidArgument(
            f"{end - first_block} blocks of {block_bytes} bytes from offset {offset_bytes} do not "
            f"fit in region {region.name} of {region.size_bytes} bytes"
        )
    return [
        RunDescriptor(
            block_hash=chain[i],
            run_key=chain[i - i % run_blocks],
            run_depth=i % run_blocks + 1,
            region_id=region.region_id,
            offset_bytes=offset_bytes + (i - first_block) * block_bytes,
            length_bytes=block_bytes,
        )
        for i in range(first_block, end)
    ]


def checked_reads(descriptors: Any) -> list[RunDescriptor]:
    """A read batch: 1 to `MAX_DESCRIPTORS` `RunDescriptor`s.

    Raises:
        InvalidArgument: not a sequence, a descriptor without its run (a plain `Descriptor`), or a bad count.
    """
    if not isinstance(descriptors, Sequence) or isinstance(descriptors, str | bytes):
        raise InvalidArgument(f"descriptors must be a sequence of RunDescriptor, got {type(descriptors).__name__}")
    for i, d in enumerate(descriptors):
        if not isinstance(d, RunDescriptor):
            raise InvalidArgument(
                f"descriptors[{i}] is a {type(d).__name__}, not a RunDescriptor: a fleet read needs "
                "each block's run to find its nodes",
                hint="make them with session.descriptors(chain, region) (docs/FLEET.md F71)",
            )
    if not 1 <= len(descriptors) <= MAX_DESCRIPTORS:
        raise InvalidArgument(f"a batch holds 1 to {MAX_DESCRIPTORS} descriptors; got {len(descriptors)}")
    return list(descriptors)


def read_run(session: Any, run_key: bytes, members: list[tuple[int, RunDescriptor]], results: BatchResults) -> None:
    """Read one run's descriptors (batch index, descriptor) into `results`, replica after replica (F71).

    `session` is the `FleetTransferSession` (its read order, node sessions and regions' aliases). A descriptor
    still short when every replica was asked is MISSING (FAILED with the last replica's reason where it gave one),
    or FAILED with UNAVAILABLE when no replica answered. The replicas that did not answer are refreshed to the
    deepest block read (F71a: a use of every copy, as F34's).
    """
    region_ids = {d.region_id for _, d in members}
    short = [(i, d) for i, d in members if results.statuses[i] == 0]
    last: KVStoreError | None = None
    answered: set[str] = set()
    replicas = session.client.placement([run_key])[0].replicas  # a run is placed by its first hash alone
    for node_id in session.order_of(run_key, region_ids, replicas):
        if not short:
            break
        node = None
        try:
            with session.node_for(node_id, region_ids) as (node, local):
                got = _ask(node, [local(d) for _, d in short])
        except (Unavailable, NotFound) as exc:
            session.node_failed(node_id, exc, node)
            last = exc
            continue
        answered.add(node_id)
        session.count(node_id, session.path_of(node), got.statuses.count(DONE))
        again = []
        for j, ((i, d), code) in enumerate(zip(short, got.statuses, strict=True)):
            failure = got.failures.get(j)
            if code == DONE:
                results.statuses[i] = DONE
                results.failures.pop(i, None)
            elif code == FAILED and failure is not None and failure[0] not in RETRIED_CODES:
                results.fail(i, *failure)  # refused for itself (a bad span): no replica would take it
            else:
                if failure is not None:
                    results.failures[i] = failure  # kept while the next replica is asked
                again.append((i, d))
        short = again
    refresh_copies(session.client.refresher, run_key, [n for n in replicas if n not in answered], members, results)
    for i, _ in short:
        if i in results.failures:
            results.statuses[i] = FAILED
        elif answered:
            results.statuses[i] = MISSING
        else:
            reason = last.message if last is not None else "the run has no live replica"
            results.fail(i, "UNAVAILABLE", f"no replica of its run answered: {reason}")


def refresh_copies(
    refresher: Any,
    run_key: bytes,
    nodes: Sequence[str],
    members: list[tuple[int, RunDescriptor]],
    results: BatchResults,
) -> None:
    """Queue on `refresher` (the fleet client's, F34) a refresh of the run's deepest block read on each of `nodes`
    (its replicas that did not answer this read): the run's hashes from its first block where the read holds them
    all, else that block alone at its depth (F71a)."""
    read = {d.run_depth: d.block_hash for i, d in members if results.statuses[i] == DONE}
    if not read or not nodes:
        return
    deepest = max(read)
    above = [read.get(depth) for depth in range(1, deepest + 1)]
    if all(h is not None for h in above):  # a plain Lookup, as `fetch` sends (answered by any node)
        chain = [bytes(h) for h in above if h is not None]
        refresher.add_many([(node_id, chain, 0, deepest) for node_id in nodes])
    else:
        for node_id in nodes:
            refresher.add_at(node_id, run_key, read[deepest], deepest)


def _ask(node: Any, descriptors: list[Descriptor]) -> TransferState:
    """One node's part of a batch, in batches its session takes, awaited together; their states joined."""
    most = max(1, node.max_descriptors)
    parts = [node.read(descriptors[lo : lo + most], prefix_only=False) for lo in range(0, len(descriptors), most)]
    return TransferState.concat(node.wait_all(parts))


def prefix(results: BatchResults) -> None:
    """`prefix_only`: every descriptor after the first not loaded is SKIPPED (a later one may have landed, as on one
    node: load `done_prefix`)."""
    cut = next((i for i, c in enumerate(results.statuses) if c != DONE), len(results.statuses))
    for i in range(cut + 1, len(results.statuses)):
        results.statuses[i] = SKIPPED
        results.failures.pop(i, None)


def checked_writes(descriptors: Any) -> list[Descriptor]:
    """A write batch: 1 to `MAX_DESCRIPTORS` `Descriptor`s (a write's runs are its tokens', so any descriptor).

    Raises:
        InvalidArgument: not a sequence of descriptors, or a bad count.
    """
    if not isinstance(descriptors, Sequence) or isinstance(descriptors, str | bytes):
        raise InvalidArgument(f"descriptors must be a sequence of Descriptor, got {type(descriptors).__name__}")
    for i, d in enumerate(descriptors):
        if not isinstance(d, Descriptor):
            raise InvalidArgument(f"descriptors[{i}] is a {type(d).__name__}, not a Descriptor")
    if not 1 <= len(descriptors) <= MAX_DESCRIPTORS:
        raise InvalidArgument(f"a batch holds 1 to {MAX_DESCRIPTORS} descriptors; got {len(descriptors)}")
    return list(descriptors)


def start_reads(
    session: Any, batch: list[RunDescriptor], results: BatchResults, prefix_only: bool, pool: Executor
) -> Future[None]:
    """Read a checked batch into `results`, its runs at once on `pool` (`read_run` each); done when all are.

    A descriptor naming a region the session does not hold, or deeper in its run than the fleet's runs go, is FAILED
    (INVALID_ARGUMENT) and asked of no node.
    """
    runs: dict[bytes, list[tuple[int, RunDescriptor]]] = {}
    run_blocks = session.client.run_blocks
    for i, d in enumerate(batch):
        if d.region_id not in session.regions:
            results.fail(
                i, "INVALID_ARGUMENT", f"descriptor {i} names region {d.region_id}, not registered in this session"
            )
        elif d.run_depth > run_blocks:
            results.fail(
                i,
                "INVALID_ARGUMENT",
                f"descriptor {i} is at depth {d.run_depth} of its run; the fleet's runs are {run_blocks} blocks",
            )
        else:
            runs.setdefault(d.run_key, []).append((i, d))
    parts = [pool.submit(read_run, session, key, members, results) for key, members in runs.items()]
    done: Future[None] = Future()
    left, lock = [len(parts)], threading.Lock()

    def settle() -> None:  # every run read: the batch's last steps, then it is done
        if prefix_only:
            prefix(results)
        # Summed here, not per run: the runs' threads would race on one counter.
        results.bytes_moved = sum(d.length_bytes for d, c in zip(batch, results.statuses, strict=True) if c == DONE)
        error = next((e for e in (f.exception() for f in parts) if e is not None), None)
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    def finished(_: Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            settle()

    if not parts:
        settle()
    for part in parts:
        part.add_done_callback(finished)
    return done


def write_blocks(
    client: Any,
    session_regions: dict[int, Region],
    tokens: Sequence[int],
    descriptors: Sequence[Descriptor],
    first_block: int,
    extra_keys: Sequence[Any],
    results: BatchResults,
) -> None:
    """Store the blocks the descriptors name (one per full block of `tokens` from `first_block`) through
    `FleetClient.put` (F30), their bytes taken from the session's regions as views (no copy here), into `results`.

    DONE for the blocks stored on every replica, with their fleet hashes; on a Put that stopped part-way
    (`PutNotReplicated`), or one refused whole, the rest are FAILED with its code and message.
    """
    views = []
    for i, d in enumerate(descriptors):
        region = session_regions.get(d.region_id)
        if region is None or d.offset_bytes + d.length_bytes > region.size_bytes:
            where = "is not registered in this session" if region is None else f"of {region.size_bytes} bytes"
            results.fail(
                i,
                "INVALID_ARGUMENT",
                f"descriptor {i} span [{d.offset_bytes}, "
                f"{d.offset_bytes + d.length_bytes}) is outside region {d.region_id} "
                f"({where})",
            )
            continue
        views.append(region.view[d.offset_bytes : d.offset_bytes + d.length_bytes])
    if len(views) < len(descriptors):  # one bad descriptor stores nothing: the rest would break R6 after it
        results.fail_pending(range(len(descriptors)), "INVALID_ARGUMENT", "another descriptor of the batch is bad")
        return
    try:
        put = client.put(tokens, views, first_block=first_block, extra_keys=extra_keys)
        stored, hashes = len(descriptors), put.block_hashes
    except PutNotReplicated as exc:
        stored, hashes = exc.stored_blocks, client.hashes(tokens, extra_keys=extra_keys)[first_block:]
        results.fail_pending(range(stored, len(descriptors)), to_status(exc).name, exc.message)
    except KVStoreError as exc:
        stored, hashes = 0, []
        results.fail_pending(range(len(descriptors)), to_status(exc).name, exc.message)
    for i in range(stored):
        results.statuses[i] = DONE
        results.block_hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] = hashes[i]
        results.bytes_moved += descriptors[i].length_bytes


__all__ = [
    "MAX_DESCRIPTORS",
    "RunDescriptor",
    "checked_reads",
    "checked_writes",
    "prefix",
    "read_run",
    "refresh_copies",
    "run_descriptors",
    "start_reads",
    "write_blocks",
]
