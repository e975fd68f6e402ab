"""A Put in a fleet: every run of the chain to each of its replicas, run after run, acknowledged when all are durable.

Blocks never change once written (a block's hash names its tokens and its whole
prefix), so no consensus is needed per write: each copy is a plain Put on its
node (durable before it answers, R1), the copies of one run go out at once, and
the Put is acknowledged only when every copy of every run answered OK. Runs go
in chain order, the next only once the last is on all its replicas: so a run
stored anywhere had every run before it stored on all their replicas (the rule
docs/FLEET.md gives across runs). When a copy fails (after the retry policy's
rounds), the Put stops at that run and raises `PutNotReplicated`, naming the
failed runs and nodes and how many leading blocks are on all their replicas;
nothing after those is reported stored. Putting the same blocks again is safe:
stored blocks are refreshed, not rewritten (R5), and the missing copies made.

With `keep_until_s` each copy's Put pins its run part's last block in that Put's own
transaction (docs/RETENTION.md R22, R28): one call per copy, and each copy's grant is
collected (`ReplicatedPut.grants`) for one answer (`fleet_pins.combine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from kvstore.client import fleet_metrics
from kvstore.client.fleet_chain import run_extra_keys
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_pins import CopyGrant, copy_grant
from kvstore.client.puts import put_blocks
from kvstore.client.retry import Retry
from kvstore.counted import counted
from kvstore.errors import Internal, KVStoreError, PutNotReplicated
from kvstore.fleet.placement import RunPlacement
from kvstore.prefix import ExtraKey
from kvstore.v1 import kvstore_pb2 as pb

#: How many times one run is placed again when copies fail on nodes that left the view meanwhile.
REPLACE_ROUNDS = 2


@dataclass(frozen=True, kw_only=True)
class RunPut:
    """One run's part of a Put: blocks [first_block, end_block) of the chain to every replica."""

    placement: RunPlacement
    first_block: int
    end_block: int


@dataclass(frozen=True, kw_only=True)
class ReplicatedPut:
    """What a replicated Put stored: per block, whether some replica newly wrote it."""

    written_blocks: int
    existing_blocks: int
    #: With `keep_until_s`: what each copy of each run granted its part's last block in its own Put.
    grants: tuple[CopyGrant, ...] = ()


def put_runs(pool: NodePool, runs: Sequence[RunPut], *, chain: Sequence[bytes], tokens: Sequence[int],
             payload: Sequence[bytes], first_block: int, extra_keys: Sequence[ExtraKey], step: int,
             executor: Executor, retry: Retry, on_batch: Callable[[int], None] | None,
             replace: Callable[[int], RunPlacement] | None = None, keep_until_s: float = 0.0) -> ReplicatedPut:
    """Put each run on all its replicas, in chain order (see the module's docstring).

    Args:
        pool: the fleet's node connections.
        runs: the runs this Put covers, in order.
        chain: the fleet hashes of the chain, at least to the Put's last block.
        tokens: the whole prompt's token ids.
        payload: the Put's blocks, from `first_block`.
        first_block: the chain index of payload[0].
        extra_keys: the caller's extra keys (each run adds its bridge).
        step: blocks per request to a node.
        executor: runs the copies of a run at once.
        retry: the policy each copy's Put is retried under.
        on_batch: called with a run's block count once it is on all its replicas.
        replace: run index -> its placement over the nodes live now (for a copy whose node left).
        keep_until_s: pin each run part's last block until this Unix time on every copy, in the copy's own
            Put (R22, R28); 0: none.

    Raises:
        PutNotReplicated: a copy failed; `stored_blocks` leading blocks are on all their replicas.
    """
    written = existing = 0
    grants: list[CopyGrant] = []
    for part in runs:
        run = part.placement
        parent = chain[part.first_block - 1] if part.first_block > run.first_block else b""
        keys = run_extra_keys(extra_keys, chain[run.first_block - 1] if run.first_block else None)
        blocks = list(payload[part.first_block - first_block: part.end_block - first_block])

        def copy(node_id: str, parent: bytes = parent, keys: list[ExtraKey] = keys, blocks: list[bytes] = blocks,
                 start: int = part.first_block) -> list[pb.PutResponse]:
            return retry.call(lambda: put_blocks(pool.connection(node_id), tokens, blocks, first_block=start,
                                                 parent=parent, extra_keys=keys, step=step, on_batch=None,
                                                 keep_until_s=keep_until_s))

        most_written = _copy_run(pool, part, copy, chain, executor, replace, first_block=first_block,
                                 total=len(payload), grants=grants if keep_until_s else None)
        written += most_written
        existing += len(blocks) - most_written
        if on_batch is not None:
            on_batch(len(blocks))
    return ReplicatedPut(written_blocks=written, existing_blocks=existing, grants=tuple(grants))


def _copy_run(pool: NodePool, part: RunPut, copy: Callable[[str], list[pb.PutResponse]], chain: Sequence[bytes],
              executor: Executor, replace: Callable[[int], RunPlacement] | None, *, first_block: int,
              total: int, grants: list[CopyGrant] | None = None) -> int:
    """Put one run on all its replicas; the most blocks any replica newly wrote. With `grants`, each copy's
    pin grant (its last reply's) is added to it.

    A copy that failed because its node left the view (a SIGTERMed node deregisters at once, F4) is
    not the end: the run is placed again over the nodes live now and the copies the new placement
    names that are not yet made go out, up to `REPLACE_ROUNDS` times (F43). A failed node still in
    the view ends the Put as before.

    Raises:
        PutNotReplicated: a copy failed on a node still in the view, or the rounds ran out.
    """
    placement = part.placement
    done: set[str] = set()
    most_written = 0
    for round_ in range(REPLACE_ROUNDS + 1):
        futures = {node: executor.submit(copy, node) for node in placement.replicas if node not in done}
        failures: list[tuple[int, str, KVStoreError]] = []
        for node, future in futures.items():
            try:
                replies = future.result()
            except KVStoreError as exc:
                pool.failed(node)
                failures.append((placement.run, node, exc))
                continue
            _check_hashes(replies, chain[part.first_block:part.end_block], node)
            done.add(node)
            if grants is not None and replies:
                grants.append(copy_grant(node, placement.run, part.end_block - part.first_block, replies[-1]))
            most_written = max(most_written, sum(r.written_blocks for r in replies))
        if not failures:
            return most_written
        left = [node for _, node, _ in failures if node not in pool.view.nodes]
        if replace is None or not left or round_ == REPLACE_ROUNDS:
            break
        placement = replace(placement.run)
    fleet_metrics.not_replicated()
    raise _not_replicated(failures, RunPut(placement=placement, first_block=part.first_block,
                                           end_block=part.end_block),
                          stored=part.first_block - first_block, total=total)


def _check_hashes(replies: Sequence[pb.PutResponse], expected: Sequence[bytes], node: str) -> None:
    """A node that hashes a run otherwise than the client (another block size, say) is a misconfigured fleet."""
    got = [h for r in replies for h in r.block_hashes]
    if got != list(expected):
        raise Internal(f"node {node} stored the run under other hashes than the client computed: nodes and "
                       "clients of a fleet must share block_tokens and geometry")


def _not_replicated(failures: list[tuple[int, str, KVStoreError]], part: RunPut, *, stored: int,
                    total: int) -> PutNotReplicated:
    why = "; ".join(f"node {node}: {type(e).__name__}: {e.message}" for _, node, e in failures)
    return PutNotReplicated(
        f"put not replicated: run {part.placement.run} (blocks {part.first_block}-{part.end_block - 1}) failed on "
        f"{counted(len(failures), 'replica')} of {len(part.placement.replicas)} ({why}); {stored} of "
        f"{counted(total, 'block')} are stored on all their replicas, nothing after them is acknowledged",
        stored_blocks=stored, failures=tuple(failures))
