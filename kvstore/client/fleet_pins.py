"""Pins in a fleet: a prefix kept until a time on every copy of every run (docs/RETENTION.md R28).

A node's pin holds its chain's prefix (R6: a pinned block keeps every block above it), but in a
fleet each run is a chain of its own on its replicas (docs/FLEET.md F29). So a fleet pin is one
pin per run of the found prefix on each of the run's live replicas: the run's deepest found block,
asked as a Lookup with `keep_until_s` of the run's hashes (the node checks its tenant's limits in
its own transaction, R24, and audits the grant, R27). The answer is the earliest time any copy
granted (0 when one granted none) and, when less than asked, which copies said why. The fleet
client and the gateway (`gateway.fleet_store`) both pin through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from kvstore.client.connection import status_error
from kvstore.client.fleet_nodes import NodePool
from kvstore.errors import KVStoreError
from kvstore.fleet.placement import RunPlacement
from kvstore.v1 import kvstore_pb2 as pb

#: Copies named in a note before "and N more" (a long prompt has many runs).
NOTE_COPIES = 4


@dataclass(frozen=True, kw_only=True)
class CopyGrant:
    """What one replica of one run granted."""

    node: str
    run: int
    kept_until_s: float
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class FleetPin:
    """A fleet pin's outcome: the earliest time every copy keeps (0: some copy keeps none), and why less."""

    kept_until_s: float
    note: str = ""


def combine(asked_until_s: float, grants: Iterable[CopyGrant]) -> FleetPin:
    """One answer for the copies' grants: the earliest kept time, and the notes of the copies that kept less
    than asked (or said why), by node and run."""
    grants = list(grants)
    if not grants:
        return FleetPin(kept_until_s=0.0, note="nothing was found to keep")
    kept = min(g.kept_until_s for g in grants)
    short = [g for g in grants if g.note or g.kept_until_s < asked_until_s]
    if not short:
        return FleetPin(kept_until_s=kept)
    parts = [f"node {g.node}, run {g.run}: {g.note or f'kept until {g.kept_until_s:.0f}'}"
             for g in short[:NOTE_COPIES]]
    more = f"; and {len(short) - NOTE_COPIES} more copies" if len(short) > NOTE_COPIES else ""
    return FleetPin(kept_until_s=kept, note=f"{len(short)} of {len(grants)} copies kept less: "
                                            + "; ".join(parts) + more)


def pin_runs(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes], found_blocks: int,
             until_s: float) -> FleetPin:
    """Pin the found prefix (`found_blocks` blocks of the fleet chain `chain`, placed as `runs`) until
    `until_s` on every live replica of each run it reaches into: all copies asked at once.

    A replica that cannot be reached keeps no pin (said in the note); the others' pins stand.
    """
    return combine(until_s, pin_grants(pool, runs, chain, found_blocks, until_s))


def pin_grants(pool: NodePool, runs: Sequence[RunPlacement], chain: Sequence[bytes], found_blocks: int,
               until_s: float) -> list[CopyGrant]:
    """`pin_runs`, each copy's grant on its own (to `combine` with others, e.g. a Put's own pins)."""
    calls: list[tuple[str, int, int, object]] = []
    grants: list[CopyGrant] = []
    for run in runs:
        end = min(run.end_block, found_blocks)
        if end <= run.first_block:
            break
        hashes = chain[run.first_block:end]
        for node in run.replicas:
            try:
                c = pool.connection(node)
                request = pb.LookupRequest(geometry=c.geometry, namespace=c.namespace, block_hashes=hashes,
                                           keep_until_s=until_s)
                calls.append((node, run.run, len(hashes),
                              c.kvstore.Lookup.future(request, timeout=c.timeout_s, metadata=c.metadata)))
            except KVStoreError as exc:
                grants.append(CopyGrant(node=node, run=run.run, kept_until_s=0.0,
                                        note=f"not pinned: {type(exc).__name__}: {exc.message}"))
    for node, run_index, wanted, call in calls:
        try:
            reply = call.result()  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            err = status_error(exc)
            grants.append(CopyGrant(node=node, run=run_index, kept_until_s=0.0,
                                    note=f"not pinned: {type(err).__name__}: {err.message}"))
            continue
        grants.append(copy_grant(node, run_index, wanted, reply))
    return grants


def copy_grant(node: str, run: int, wanted: int, reply: pb.LookupResponse | pb.PutResponse) -> CopyGrant:
    """One copy's grant from its reply (a copy holding less of the run than asked says so)."""
    note = reply.keep_note
    found = getattr(reply, "found_blocks", wanted)
    if found < wanted and reply.kept_until_s:
        note = f"holds {found} of the run's {wanted} blocks asked: kept those" + (f"; {note}" if note else "")
    return CopyGrant(node=node, run=run, kept_until_s=reply.kept_until_s, note=note)
