"""A Lookup in a fleet: the chain prefix whose every run is found on a live replica, with one composite lease.

Within a run R6 is the node's own rule (its Lookup counts the run's leading
blocks). Across runs the client keeps it: the prefix ends at the first run no
replica holds in full. Without a lease the last run is asked first, of one
replica: a prompt sent again is found in one call, since a run stored means
every run before it was stored on all its replicas (F30: runs are put in order)
and every use of a run is a use of every run before it on every copy (F34), so
while a run is inside its retention the runs before it are too (F31). Otherwise
every run is asked of the first replica of its read order (`NodePool.read_order`);
with a lease, of the fewest nodes whose copies hold every run (`fleet_cover`, F82),
one Lookup per node naming all of that node's runs
(`run_lengths`: each run its own chain, looked up and leased on its own), all
nodes at once: one round trip, whatever the prompt's length (docs/FLEET.md F50).
Without a lease, after a probe that fell short, that round asks every node of
each run's read order instead, so the walk's asks of a short run's other copies
are already answered (F76). The runs of a node that failed go to their next
replica, again one call per node; then the runs are walked in order, and the
first that falls short is asked of its other replicas not yet asked (F31, F33):
R6 across runs is checked on every run.

The probe, the leased round and F76's round name each run by its last hash (`run_anchors`, F77): a node answers
a run whole or not (a node's whole runs under one lease), and a run not whole is asked by its hashes in the walk.
Where one node comes first in every run's read order, the probe asks it every run so, leased or not (F78): one
call for a prompt sent again, two for one half stored. A prompt whose stored prefix this client saw end inside
it (`FoundChains`: a Put's end, a Lookup's find) skips the probe: one round asks the runs before the boundary of
the node read first by their last blocks and the boundary run of every copy by its hashes in the same calls
(`run_hashed`, F81): one round trip where it took three.

With `lease_ms` each run's found blocks are leased on the node that found them;
the leases past the prefix's end are released at once, the others make one
composite lease id (`fleet:` + JSON of (node, lease) pairs) that
`FleetClient.release` releases on every node (F32). The copies of the found
prefix that were not asked are queued for a refresh (`fleet_refresh`).
A node that predates `run_lengths` answers no `run_found_blocks`: its runs are
asked again one call each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import grpc

from kvstore.client import started_calls
from kvstore.client.arguments import ChainCheck
from kvstore.client.connection import Connection, status_error
from kvstore.client.fleet_cover import cover_runs
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_refresh import Refresher
from kvstore.client.lookup_anchors import DEFAULT_MAX_ENTRIES, AnchorTable
from kvstore.client.retry import Retry
from kvstore.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    NotFound,
    Unavailable,
)
from kvstore.fleet.placement import RunPlacement
from kvstore.v1 import kvstore_pb2 as pb

#: Bytes of one chain hash in block_hashes_packed.
HASH_BYTES = 32
#: Marks a composite lease id.
LEASE_PREFIX = "fleet:"
#: Errors after which the run is asked of its next replica.
FAIL_OVER = (Unavailable, DeadlineExceeded, DataLoss)

T = TypeVar("T")
#: A call's outcome: its reply, or the error it failed with.
Outcome = Callable[[], T | KVStoreError]


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
    #: Leading blocks each replica that answered found (each of them used what it found: R5).
    found_on: dict[str, int] = field(default_factory=dict)
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


class FoundChains:
    """Where this client last saw each prompt's stored prefix end, to guess the next Lookup's boundary run (F81).

    Two tables, by hash: the last block of a chain stored whole (a Put's end, a Lookup that found all of its
    prompt), whose blocks are the guess for any prompt that goes on from it; and the first block a Lookup did not
    find, which guesses the same prefix only for a prompt that goes on the same way (one that parts from it
    there says nothing of its own next block). A guess the nodes did not bear out is forgotten. Thread-safe.

    Args:
        max_entries: most chains kept in each table, least recently used forgotten first.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._ends = AnchorTable(max_entries, min_blocks=1)
        self._short = AnchorTable(max_entries, min_blocks=2)  # found + 1, keyed by the block after the found

    def guess(self, chain: Sequence[bytes]) -> int:
        """The blocks of `chain` guessed stored (0: no guess)."""
        return max(self._ends.best(chain), self._short.best(chain) - 1, 0)

    def stored(self, chain: Sequence[bytes], end: int) -> None:
        """`chain[:end]` is stored on every copy (a Put acknowledged)."""
        if end:
            self._ends.note(chain[end - 1], end)

    def found(self, chain: Sequence[bytes], found: int, guess: int) -> None:
        """A Lookup of `chain` guessed `guess` blocks and found `found`."""
        if guess and guess != found:
            self._ends.forget(chain[guess - 1])
            if guess < len(chain):
                self._short.forget(chain[guess])
        if found == len(chain):
            self._ends.note(chain[found - 1], found)
        elif found:
            self._short.note(chain[found], found + 1)


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


def _lookup(pool: NodePool, node: str, hashes: Sequence[bytes], lease_ms: int) -> pb.LookupResponse:
    """One blocking Lookup of a run's hashes on `node` (a future would start a thread to wait on it)."""
    c = pool.connection(node)
    request = pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, block_hashes_packed=b"".join(hashes),
                               lease_ms=lease_ms)
    return c.kvstore.Lookup(request, timeout=c.timeout_s, metadata=c.metadata)  # type: ignore[no-any-return]


def _note(answer: RunAnswer, node: str, reply: pb.LookupResponse) -> None:
    _note_found(answer, node, reply.found_blocks, reply.lease_id)


def _note_found(answer: RunAnswer, node: str, found: int, lease_id: str) -> None:
    if lease_id:
        answer.leases.append((node, lease_id))
    answer.found_on[node] = max(found, answer.found_on.get(node, 0))
    if found > answer.found or answer.node is None:
        answer.found, answer.node = found, node


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
        _note(answer, node, _lookup(pool, node, hashes, lease_ms))
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
                retry: Retry, refresher: Refresher, guess: int = 0, check: ChainCheck | None = None) -> FleetLookup:
    """Find the prefix of `chain` stored across its runs (see the module's docstring).

    Args:
        guess: the blocks of `chain` the caller believes stored (`FoundChains.guess`; 0: none): the run where
            they end is asked by its hashes in the round (F81). Only a guess: what is found is the nodes' answer.
        check: the chain's check, run while the first round's calls fly (F83); when it raises, what those calls
            leased is released and its error raised.

    Raises:
        KVStoreError: no replica of the first run answered (the error of the last), or a node refused the
            request for a reason another replica would share (a bad argument, say); what `check` raises.
    """
    check = check or ChainCheck()
    answers: dict[int, RunAnswer] = {}
    try:
        orders = _Orders(pool, runs, chain)
        end = _ask_by_node(pool, runs, orders, chain, answers, lease_ms, retry, guess, check)  # its first round checks
    except BaseException:
        _release(pool, [p for a in answers.values() for p in a.leases])
        check.settle()  # a bad hash is named, not what it broke
        raise
    # A node's runs found by their last blocks share one lease (F77): kept while any run inside the prefix has it.
    kept = list(dict.fromkeys(p for i in sorted(answers) if i < end for p in answers[i].leases))
    held = set(kept)
    _release(pool, [p for i in sorted(answers) if i >= end for p in answers[i].leases if p not in held])
    found = runs[end - 1].first_block + answers[end - 1].found if end else 0
    refresher.add_many(_unasked_copies(runs[:end], answers, chain))  # one lock, off the read path (F34)
    return FleetLookup(found_blocks=found, lease_id=composite_lease(kept),
                       nodes_asked=frozenset(n for a in answers.values() for n in a.asked))


def _unasked_copies(runs: Sequence[RunPlacement], answers: dict[int, RunAnswer],
                    chain: Sequence[bytes]) -> list[tuple[str, Sequence[bytes], int, int]]:
    """Every copy of the found prefix a Lookup did not ask, as (node, chain, first, end) for the refresher:
    each is used, asked or not (F34)."""
    unasked = []
    for i, run in enumerate(runs):
        answer = answers.get(i)
        used = answer.found if answer is not None else run.end_block - run.first_block
        if not used:
            continue
        used_on = answer.found_on if answer is not None else {}
        unasked += [(other, chain, run.first_block, run.first_block + used) for other in run.replicas
                    if used_on.get(other, 0) < used]
    return unasked


class _Orders:
    """Each run's read order (`NodePool.read_order`), made when first asked: a prompt sent again asks one."""

    def __init__(self, pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes]) -> None:
        self.pool, self.runs, self.chain = pool, runs, chain
        self._made: dict[int, list[str]] = {}

    def __getitem__(self, i: int) -> list[str]:
        found = self._made.get(i)
        if found is None:
            run = self.runs[i]
            found = self._made[i] = self.pool.read_order(self.chain[run.first_block], run.replicas)
        return found


def _one_first_reader(runs: Sequence[RunPlacement], orders: _Orders) -> str | None:
    """The node that comes first in every run's read order, if one does (F78); None otherwise. Only runs that
    all name the same replicas can share it, so the read orders are made only then (a check of the placement)."""
    replicas = runs[0].replicas
    if any(run.replicas != replicas for run in runs):
        return None
    if len(replicas) == 1:
        return replicas[0]  # one copy: first in its order, whatever the order adds after it (F42)
    first = {orders[i][0] for i in range(len(runs))}
    return first.pop() if len(first) == 1 else None


def _check_first(answer: RunAnswer, i: int) -> None:
    """No replica of the first run could answer: the Lookup learned nothing, so it says why."""
    if i == 0 and answer.node is None and answer.error is not None:
        raise answer.error


def _boundary(runs: Sequence[RunPlacement], chain: Sequence[bytes], guess: int) -> int | None:
    """The run holding block `guess`, the first past a guessed stored prefix (F81); None without a guess inside
    the chain (none, or the whole chain: a prompt sent again is the probe's)."""
    if not 0 < guess < len(chain):
        return None
    return next(i for i, run in enumerate(runs) if run.first_block <= guess < run.end_block)


def _ask_by_node(pool: NodePool, runs: Sequence[RunPlacement], orders: _Orders, chain: Sequence[bytes],
                 answers: dict[int, RunAnswer], lease_ms: int, retry: Retry, guess: int = 0,
                 check: ChainCheck | None = None) -> int:
    """Without a lease, the last run first, on one replica (a prompt sent again: done, F31), then every run on
    every node of its read order (F76). With a lease, every run on one of the fewest nodes that hold them all
    (F82). One call per node, all nodes at once (F50); the runs of a node that failed on their next replica,
    again one call per node; then in order, the run that falls short asked of its other replicas (F31): the
    prefix ends at the first run no replica holds in full.

    Returns:
        The number of runs the prefix reaches into (the boundary run, complete or partly found, is the last).
    """
    one = _one_first_reader(runs, orders)
    boundary = _boundary(runs, chain, guess)
    hashed = (boundary,) if boundary is not None else ()
    if one is not None and len(runs) > 1:
        # F78: one node reads first every run, so the probe asks it every run by its last block, in the one call
        # the last run's probe would take (F77): a prompt sent again is found whole; else its runs held whole
        # there are done and the walk asks the first that is not of every copy, by its hashes (F81: the guessed
        # boundary run rides by its hashes in that call).
        _round(pool, runs, chain, answers, check, [(i, one) for i in range(len(runs))], lease_ms, anchors=True,
               hashed=hashed)
    elif not lease_ms and len(runs) > 1 and boundary is not None:
        # F81: a prompt guessed stored up to inside run `boundary` skips the probe (it would fall short): one round
        # asks the runs before it of the node read first by their last blocks (stored, as guessed, on every
        # copy: F30), the boundary run of every node of its order by its hashes (each copy's count in hand, as
        # F76's round would give the walk) and the last run by its last block (stored since the guess: F31's
        # answer). A guess that is wrong costs what F76/F77 do: the walk asks what the round did not answer.
        last = len(runs) - 1
        ask = [(i, orders[i][0]) for i in range(boundary)]
        ask += [(boundary, n) for k, n in enumerate(orders[boundary]) if not k or not pool.suspect(n)]
        if last > boundary:
            ask.append((last, orders[last][0]))
        _round(pool, runs, chain, answers, check, ask, 0, anchors=True, hashed=hashed)
        if last > boundary and answers[last].found == runs[last].end_block - runs[last].first_block:
            return len(runs)  # every run before a stored run is stored, inside retention (F31)
    elif not lease_ms and len(runs) > 1:  # a prompt sent again: its last run, on one node, by its last block
        last, probed = len(runs) - 1, orders[len(runs) - 1][0]
        _round(pool, runs, chain, answers, check, [(last, probed)], 0, anchors=True)
        if answers[last].found == runs[last].end_block - runs[last].first_block:
            return len(runs)  # every run before a stored run is stored, inside retention (F31)
        # Short: some run's other copies will be asked (the walk's ask, F31), so every run is asked of every
        # node of its read order now by its last block, in one call per node (F76, F77): the walk then asks by
        # hashes only the first run no copy holds whole. A node that just failed is asked only where it comes
        # first (every copy is suspect): a stopped one would hold the round for its timeout; the walk asks it
        # later if it must.
        suspect = {n: pool.suspect(n) for n in {n for i in range(len(runs)) for n in orders[i]}}
        _round(pool, runs, chain, answers, check, [(i, n) for i in range(len(runs)) for k, n in enumerate(orders[i])
                                            if (i, n) != (last, probed) and n not in answers.get(i, _NONE).asked
                                            and (not k or not suspect[n])], 0, anchors=True)
    else:  # leased: every run by its last block (F77) on the fewest nodes that hold them all (F82), leased there
        _round(pool, runs, chain, answers, check, cover_runs(pool, runs, chain), lease_ms, anchors=True)
    while True:  # a node away: its runs go to their next replica, together
        again = []
        for i, answer in answers.items():
            if answer.node is not None or answer.error is None:
                continue  # answered, or not asked yet: its read order is not made (64 runs: ~0.4 ms)
            left = [n for n in orders[i] if n not in answer.asked]
            if left:
                again.append((i, left[0]))
        if not again:
            break
        _round(pool, runs, chain, answers, check, again, lease_ms)
    for i, run in enumerate(runs):
        if i not in answers:  # past a guessed boundary found whole (F81): the rest of every copy, in one round
            _round(pool, runs, chain, answers, check, [(j, n) for j in range(i, len(runs)) if j not in answers
                                                for n in orders[j]], lease_ms, anchors=True)
        if answers[i].found < run.end_block - run.first_block:
            hashes = chain[run.first_block:run.end_block]
            _ask_the_rest(pool, answers[i], orders[i], hashes, lease_ms)
            _settle(pool, answers[i], orders[i], hashes, lease_ms, retry)
            _check_first(answers[i], i)
            if answers[i].found < run.end_block - run.first_block:
                return i + 1
    return len(runs)


def _ask_the_rest(pool: NodePool, answer: RunAnswer, order: list[str], hashes: Sequence[bytes],
                  lease_ms: int) -> None:
    """A run that fell short: every replica of its order not yet asked, at once (one round trip, not one per
    replica); `_settle` then retries the run while none answered."""
    left = [n for n in order if n not in answer.asked]
    if len(left) < 2:
        return  # `_settle` asks the one left
    answer.asked.extend(left)

    packed = b"".join(hashes)

    def request(c: Connection) -> pb.LookupRequest:
        return pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, lease_ms=lease_ms,
                                block_hashes_packed=packed)

    outcomes, _ = _at_once([partial(_started, pool, node, "Lookup", request) for node in left])
    refused: KVStoreError | None = None
    for node, outcome in zip(left, outcomes, strict=True):
        if isinstance(outcome, KVStoreError):
            if isinstance(outcome, FAIL_OVER):
                pool.failed(node)
                answer.error = outcome
            else:
                refused = refused or outcome
        else:
            _note(answer, node, outcome)
    if refused is not None:
        raise refused


#: An answer of no run (nothing asked yet).
_NONE = RunAnswer()


def _round(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes], answers: dict[int, RunAnswer],
           check: ChainCheck | None, ask: Sequence[tuple[int, str]], lease_ms: int, *, anchors: bool = False,
           hashed: Sequence[int] = ()) -> None:
    """Ask run i of node n for every (i, n) in `ask`: one Lookup per node naming all its runs (run_lengths), the
    nodes at once (one round trip). A node's failure is noted on each of its runs; an error another replica would
    share is raised once every call was answered (the caller releases what they leased).

    With `anchors` each run is named by its last hash (F77): a run whole on its node is noted; one that is not
    is left unasked there (its count is unknown), so the walk asks it of that node too, by its hashes. A node that
    cannot find runs so (it predates run_anchors) is asked again at once by the runs' hashes. With `anchors`, the
    runs in `hashed` ride by their hashes in the same calls (run_hashed, F81): each answered with its count; a node
    that predates run_hashed refuses the call as one that predates run_anchors, and is asked again so.

    The chain's `check` (F83), not yet taken, is run once this round's calls are sent, while they fly: when it
    raises, every call is still waited on, what they leased released, and its error raised."""
    by_node: dict[str, list[int]] = {}
    for i, node in ask:
        by_node.setdefault(node, []).append(i)
        answers.setdefault(i, RunAnswer()).asked.append(node)
    # A round that sends at least the chain's worth of hashes joins the chain once and its requests cut runs from
    # it (a slice each), rather than each joining its runs' hashes one by one (F76: 0.43 ms for 64 runs here).
    whole = not anchors and sum(runs[i].end_block - runs[i].first_block for i, _ in ask) >= len(chain)
    packed = b"".join(chain) if whole else None
    counted = frozenset(hashed) if anchors else frozenset()
    jobs = [(node, indices, _runs_request(pool, node, runs, indices, chain, lease_ms, packed, anchors=anchors,
                                          hashed=counted))
            for node, indices in by_node.items()]
    # F83: the calls go out first; the chain's check (the first round's) runs while they fly
    outcomes, failed = _at_once([start for _, _, start in jobs], check.take() if check is not None else None)
    if failed is not None:  # a bad hash: nothing this round found stands, so what it leased goes back
        _release(pool, [(node, lease) for (node, _, _), outcome in zip(jobs, outcomes, strict=True)
                        if not isinstance(outcome, KVStoreError)
                        for lease in {outcome.lease_id, *outcome.run_lease_ids} if lease])
        raise failed
    refused: KVStoreError | None = None
    for (node, indices, _), outcome in zip(jobs, outcomes, strict=True):
        by_anchor = anchors
        if anchors and isinstance(outcome, InvalidArgument | FailedPrecondition):  # predates run_anchors
            outcome, by_anchor = _runs_request(pool, node, runs, indices, chain, lease_ms)()(), False
        if isinstance(outcome, KVStoreError):
            refused = refused or _node_failed(pool, answers, indices, node, outcome)
        elif len(outcome.run_found_blocks) != len(indices):  # a node that predates run_lengths: a run per call
            if outcome.lease_id:
                _release(pool, [(node, outcome.lease_id)])
            for i in indices:
                answers[i].asked.remove(node)
                _ask_next(pool, answers[i], [node], chain[runs[i].first_block:runs[i].end_block], lease_ms, set())
        elif by_anchor:  # F77's answer: each run whole or not
            for i, found, lease in zip(indices, outcome.run_found_blocks, outcome.run_lease_ids, strict=True):
                if found == runs[i].end_block - runs[i].first_block or i in counted:  # F81: its count, by hashes
                    _note_found(answers[i], node, found, lease)
                else:  # not whole here: how much is unknown, so the walk asks it again by its hashes
                    answers[i].asked.remove(node)
        else:
            for i, found, lease in zip(indices, outcome.run_found_blocks, outcome.run_lease_ids, strict=True):
                _note_found(answers[i], node, found, lease)
    if refused is not None:
        raise refused


def _at_once(starts: Sequence[Callable[[], Outcome[T]]], meanwhile: Callable[[], object] | None = None
             ) -> tuple[list[T | KVStoreError], BaseException | None]:
    """Each call started from this thread (`started_calls`: its request sent), then `meanwhile`, then each waited
    on: the outcomes in order, and what `meanwhile` raised. No pool's hand-off there and back per call (a round of
    four leased Lookups 1.26 -> 1.06 ms, best of 200 on a 2-core box); a gRPC future starts a thread of its own per
    channel while its call is in flight, which costs more than the call on a small prompt."""
    return started_calls.at_once(starts, meanwhile)


def _started(pool: NodePool, node: str, method: str, request_of: Callable[[Connection], object]) -> Outcome[T]:
    """`method` of `node` called now with `request_of(connection)`: the wait for its reply or the error it failed
    with (`pool.connection` refusing, the call failing)."""
    try:
        c = pool.connection(node)
        wait = started_calls.start(getattr(c.kvstore, method), request_of(c), timeout=c.timeout_s,
                                   metadata=c.metadata)
    except KVStoreError as exc:
        refused = exc
        return lambda: refused

    def outcome() -> T | KVStoreError:
        try:
            return wait()  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            return status_error(exc)
        except KVStoreError as exc:
            return exc

    return outcome


def _runs_request(pool: NodePool, node: str, runs: Sequence[RunPlacement], indices: Sequence[int],
                  chain: Sequence[bytes], lease_ms: int, packed: bytes | None = None, *,
                  anchors: bool = False, hashed: frozenset[int] = frozenset()
                  ) -> Callable[[], Outcome[pb.LookupResponse]]:
    """A Lookup of several runs on one node (each its own chain: run_lengths), to be started (`_started`): the
    wait for its reply, or the error it failed with. Only the asked runs' hashes are joined (a prompt sent again
    asks one run of 62), cut from `packed` (the chain's hashes joined) when given; with `anchors`, only each run's
    last hash (F77), but all the hashes of the runs in `hashed`, flagged in run_hashed (F81)."""
    flags = [i in hashed for i in indices] if anchors and not hashed.isdisjoint(indices) else []
    if flags:
        hashes = b"".join([h for i in indices for h in (chain[runs[i].first_block:runs[i].end_block] if i in hashed
                                                         else (chain[runs[i].end_block - 1],))])
    elif anchors:
        hashes = b"".join([chain[runs[i].end_block - 1] for i in indices])
    elif packed is not None:
        hashes = b"".join(packed[runs[i].first_block * HASH_BYTES:runs[i].end_block * HASH_BYTES] for i in indices)
    else:
        hashes = b"".join(_runs_hashes(chain, runs, indices))

    def request(c: Connection) -> pb.LookupRequest:
        return pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, lease_ms=lease_ms,
                                block_hashes_packed=hashes, run_anchors=anchors, run_hashed=flags,
                                run_lengths=[runs[i].end_block - runs[i].first_block for i in indices])

    return partial(_started, pool, node, "Lookup", request)


def _runs_hashes(chain: Sequence[bytes], runs: Sequence[RunPlacement], indices: Sequence[int]) -> Sequence[bytes]:
    """The hashes of runs[i] for each i, in order (a slice of `chain` for one run)."""
    if len(indices) == 1:
        return chain[runs[indices[0]].first_block:runs[indices[0]].end_block]
    hashes: list[bytes] = []
    for i in indices:
        hashes += chain[runs[i].first_block:runs[i].end_block]
    return hashes


def _node_failed(pool: NodePool, answers: dict[int, RunAnswer], indices: Sequence[int], node: str,
                 exc: KVStoreError) -> KVStoreError | None:
    """Note a node's failure on each of its runs; the error itself when another replica would refuse it too."""
    if not isinstance(exc, FAIL_OVER):
        return exc
    pool.failed(node)
    for i in indices:
        answers[i].error = exc
    return None


def _release(pool: NodePool, leases: Sequence[tuple[str, str]]) -> int:
    """Release (node, lease) pairs, each on its node; how many were still held (a node away lets its lapse)."""
    def release(node: str, lease: str) -> Outcome[pb.ReleaseResponse]:
        return _started(pool, node, "Release", lambda _: pb.ReleaseRequest(lease_id=lease))

    # a lease shared by a node's runs (F77) is released once; a node away lets its lapse (R9)
    outcomes, _ = _at_once([partial(release, node, lease) for node, lease in dict.fromkeys(leases)])
    return sum(not isinstance(o, KVStoreError) and bool(o.released) for o in outcomes)


def release_lease(pool: NodePool, lease_id: str) -> bool:
    """Release a composite lease on every node; True when every part was still held."""
    pairs = parse_lease(lease_id)
    return _release(pool, pairs) == len(set(pairs))
