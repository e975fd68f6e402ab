"""A Lookup in a fleet: the chain prefix whose every run is found on a live replica, with one composite lease.

Within a run R6 is the node's own rule (its Lookup counts the run's leading
blocks). Across runs the client keeps it: the prefix ends at the first run no
replica holds in full. A run is asked of the first replica of its read order
(`NodePool.read_order`), and of the next ones while the answer falls short or
the node fails (docs/FLEET.md F31, F33).

Without a lease the runs are binary-searched: the last run first (a prompt sent
again is found in one call), then halving, so a 1M-token prompt (62 runs) costs
about log2(62) = 6 calls, one after another, each to one node (two where a run
falls short: its other replica is asked too). That is sound because a run stored
means every run before it was stored on all its replicas (F30: runs are put in
order, and a Put starting at a run needs the run before it), and every use of a
run is a use of every run before it on every copy (F34), so while a run is inside
its retention the runs before it are too. With `lease_ms`, every run must be
leased on the node that holds it: all runs are asked at once (gRPC futures, one
round trip), then walked in order; the leases past the prefix's end are released
at once, the others make one composite lease id (`fleet:` + JSON of (node, lease)
pairs) that `FleetClient.release` releases on every node. Either way the copies
of the found prefix that were not asked are queued for a refresh (`fleet_refresh`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kvstore.client.connection import status_error
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_refresh import Refresher
from kvstore.client.retry import Retry
from kvstore.errors import DataLoss, DeadlineExceeded, KVStoreError, NotFound, Unavailable
from kvstore.fleet.placement import RunPlacement
from kvstore.v1 import kvstore_pb2 as pb

#: Marks a composite lease id.
LEASE_PREFIX = "fleet:"
#: Errors after which the run is asked of its next replica.
FAIL_OVER = (Unavailable, DeadlineExceeded, DataLoss)


@dataclass(kw_only=True)
class RunAnswer:
    """What the replicas asked about one run said."""

    #: Leading blocks of the run found on the best replica that answered.
    found: int = 0
    #: The replica that found them.
    node: str | None = None
    #: Replicas asked, in order (again after a backoff when none answered).
    asked: list[str] = field(default_factory=list)
    #: (node, lease id) of every lease taken for this run.
    leases: list[tuple[str, str]] = field(default_factory=list)
    #: The last error a replica answered with.
    error: KVStoreError | None = None


@dataclass(frozen=True, kw_only=True)
class FleetLookup:
    """A fleet Lookup's outcome."""

    found_blocks: int
    #: The composite lease id, or None when no lease is held.
    lease_id: str | None
    #: Every node asked (the bound docs/FLEET.md states).
    nodes_asked: frozenset[str]


def composite_lease(leases: Sequence[tuple[str, str]]) -> str | None:
    """One lease id naming each (node, lease) pair (None for none)."""
    return LEASE_PREFIX + json.dumps([list(p) for p in leases], separators=(",", ":")) if leases else None


def parse_lease(lease_id: str) -> list[tuple[str, str]]:
    """The (node, lease) pairs of a composite lease id.

    Raises:
        NotFound: not a fleet lease id (as a server answers an unknown lease).
    """
    try:
        if not lease_id.startswith(LEASE_PREFIX):
            raise ValueError(lease_id)
        return [(str(node), str(lease)) for node, lease in json.loads(lease_id.removeprefix(LEASE_PREFIX))]
    except (ValueError, TypeError):
        raise NotFound(f"{lease_id[:60]!r} is not a lease id of a fleet Lookup",
                       hint="give the lease_id a fleet client's lookup returned") from None


def _request(pool: NodePool, node: str, hashes: Sequence[bytes], lease_ms: int) -> tuple[pb.LookupRequest, object]:
    c = pool.connection(node)
    request = pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, block_hashes=hashes, lease_ms=lease_ms)
    return request, c.kvstore.Lookup.future(request, timeout=c.timeout_s, metadata=c.metadata)


def _note(answer: RunAnswer, node: str, reply: pb.LookupResponse) -> None:
    if reply.lease_id:
        answer.leases.append((node, reply.lease_id))
    if reply.found_blocks > answer.found or answer.node is None:
        answer.found, answer.node = reply.found_blocks, node


def _ask_next(pool: NodePool, answer: RunAnswer, order: list[str], hashes: Sequence[bytes], lease_ms: int,
              tried: set[str]) -> bool:
    """Ask the next replica not yet `tried` this round, synchronously; False when none is left."""
    left = [n for n in order if n not in tried]
    if not left:
        return False
    node = left[0]
    tried.add(node)
    answer.asked.append(node)
    try:
        _, call = _request(pool, node, hashes, lease_ms)
        _note(answer, node, call.result())  # type: ignore[attr-defined]
    except grpc.RpcError as exc:
        _failed(pool, answer, node, status_error(exc))
    except KVStoreError as exc:
        _failed(pool, answer, node, exc)
    return True


def _failed(pool: NodePool, answer: RunAnswer, node: str, exc: KVStoreError) -> None:
    if not isinstance(exc, FAIL_OVER):
        raise exc
    pool.failed(node)
    answer.error = exc


def _settle(pool: NodePool, answer: RunAnswer, order: list[str], hashes: Sequence[bytes], lease_ms: int,
            retry: Retry) -> None:
    """Ask the run's replicas in order until one holds it all or all were asked; back off and ask them
    again (the retry policy's rounds) while none could answer."""
    retries = 0
    tried = set(answer.asked)
    while answer.found < len(hashes):
        if _ask_next(pool, answer, order, hashes, lease_ms, tried):
            continue
        if answer.node is not None or answer.error is None or retries >= retry.retries \
                or not retry.retries_on(answer.error):
            return
        retries += 1  # no replica answered: back off and ask them all again
        retry.pause(retries)
        tried.clear()


def run_found(pool: NodePool, run: RunPlacement, chain: Sequence[bytes], retry: Retry) -> RunAnswer:
    """How much of one run some replica holds (asked in read order, falling over), without a lease."""
    answer = RunAnswer()
    _settle(pool, answer, pool.read_order(chain[run.first_block], run.replicas),
            chain[run.first_block:run.end_block], 0, retry)
    return answer


def lookup_runs(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes], *, lease_ms: int,
                retry: Retry, refresher: Refresher) -> FleetLookup:
    """Find the prefix of `chain` stored across its runs (see the module's docstring).

    Raises:
        KVStoreError: no replica of the first run answered (the error of the last), or a node refused the
            request for a reason another replica would share (a bad argument, say).
    """
    orders = [pool.read_order(chain[r.first_block], r.replicas) for r in runs]
    if lease_ms:
        answers, end = _ask_every_run(pool, runs, orders, chain, lease_ms, retry)
    else:
        answers, end = _search(pool, runs, orders, chain, retry)
    kept = [p for i in sorted(answers) if i < end for p in answers[i].leases]
    _release(pool, [p for i in sorted(answers) if i >= end for p in answers[i].leases])
    found = runs[end - 1].first_block + answers[end - 1].found if end else 0
    for i, run in enumerate(runs[:end]):  # every copy of the found prefix is used, asked or not (F34)
        used = answers[i].found if i in answers else run.end_block - run.first_block
        for other in run.replicas:
            if used and (i not in answers or other != answers[i].node):
                refresher.add(other, chain[run.first_block:run.first_block + used])
    return FleetLookup(found_blocks=found, lease_id=composite_lease(kept),
                       nodes_asked=frozenset(n for a in answers.values() for n in a.asked))


def _check_first(answer: RunAnswer, i: int) -> None:
    """No replica of the first run could answer: the Lookup learned nothing, so it says why."""
    if i == 0 and answer.node is None and answer.error is not None:
        raise answer.error


def _search(pool: NodePool, runs: Sequence[RunPlacement], orders: list[list[str]], chain: Sequence[bytes],
            retry: Retry) -> tuple[dict[int, RunAnswer], int]:
    """Binary search for the first run not complete on any replica: the last run first (a prompt sent
    again), then halving. Sound while runs are within retention (docs/FLEET.md F31).

    Returns:
        The runs asked (index -> answer) and the number of runs the prefix reaches into (the boundary run,
        complete or partly found, is the last of them).
    """
    answers: dict[int, RunAnswer] = {}

    def complete(i: int) -> bool:
        run = runs[i]
        answer = answers[i] = RunAnswer()
        _settle(pool, answer, orders[i], chain[run.first_block:run.end_block], 0, retry)
        _check_first(answer, i)
        return answer.found == run.end_block - run.first_block

    lo, hi = 0, len(runs) - 1  # runs before lo are complete; run hi is the first not, or the last run
    if not complete(hi):
        while lo < hi:
            mid = (lo + hi) // 2
            if complete(mid):
                lo = mid + 1
            else:
                hi = mid
    if hi not in answers:
        complete(hi)
    return answers, hi + 1


def _ask_every_run(pool: NodePool, runs: Sequence[RunPlacement], orders: list[list[str]], chain: Sequence[bytes],
                   lease_ms: int, retry: Retry) -> tuple[dict[int, RunAnswer], int]:
    """Every run at once (each must lease what it found), then in order: the prefix ends at the first run
    no replica holds in full."""
    answers = {i: RunAnswer() for i in range(len(runs))}
    calls = []
    for i, run in enumerate(runs):
        node = orders[i][0]
        answers[i].asked.append(node)
        try:
            calls.append((answers[i], node, _request(pool, node, chain[run.first_block:run.end_block], lease_ms)[1]))
        except KVStoreError as exc:
            _failed(pool, answers[i], node, exc)
    for answer, node, call in calls:
        try:
            _note(answer, node, call.result())  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            _failed(pool, answer, node, status_error(exc))
    for i, run in enumerate(runs):
        _settle(pool, answers[i], orders[i], chain[run.first_block:run.end_block], lease_ms, retry)
        try:
            _check_first(answers[i], i)
        except KVStoreError:
            _release(pool, [p for a in answers.values() for p in a.leases])
            raise
        if answers[i].found < run.end_block - run.first_block:
            return answers, i + 1
    return answers, len(runs)


def _release(pool: NodePool, leases: Sequence[tuple[str, str]]) -> int:
    """Release (node, lease) pairs, each on its node; how many were still held (a node away lets its lapse)."""
    held = 0
    calls = []
    for node, lease in leases:
        try:
            c = pool.connection(node)
            calls.append(c.kvstore.Release.future(pb.ReleaseRequest(lease_id=lease), timeout=c.timeout_s,
                                                  metadata=c.metadata))
        except KVStoreError:
            continue  # its lease expires on its own (R9)
    for call in calls:
        try:
            held += bool(call.result().released)
        except grpc.RpcError:
            continue
    return held


def release_lease(pool: NodePool, lease_id: str) -> bool:
    """Release a composite lease on every node; True when every part was still held."""
    pairs = parse_lease(lease_id)
    return _release(pool, pairs) == len(pairs)
