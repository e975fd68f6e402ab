"""`kvstore bench transfer`'s one-copy TCP transport figures (docs/TRANSFER.md "The one-copy TCP transport").

The bench's server runs both bulk transports; a session asks for "tcp" first, so the Mooncake
session is opened with `KVSTORE_CLIENT_BULK=mooncake` (`mooncake_session`) and the TCP one
without it (`tcp_session`). Each round fetches over TCP, then over Mooncake's bulk path, then
Mooncake's raw read runs (`kvstore.bench.transfer._bulk`): the TCP figure is set against the
raw read, the bulk fetch and the gRPC fetch of the same run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.bench.report import Figure, Report
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_tcp import IN_FLIGHT, PREFER_ENV, TcpPath
from kvstore.region import Region


@contextmanager
def mooncake_session(connection: Any, streams: int | None) -> Iterator[TransferSession]:
    """A session on path "bulk" that asks for Mooncake's transport even where "tcp" is offered."""
    was = os.environ.get(PREFER_ENV)
    os.environ[PREFER_ENV] = "mooncake"
    try:
        session = TransferSession(connection, path="bulk", streams=streams)  # negotiates here
    finally:
        if was is None:
            del os.environ[PREFER_ENV]
        else:
            os.environ[PREFER_ENV] = was
    with session:
        yield session


@dataclass
class TcpRun:
    """A session on the TCP transport and its pre-faulted region."""

    session: TransferSession
    region: Region
    nbytes: int


def tcp_session(stack: ExitStack, report: Report, connection: Any, streams: int | None, nbytes: int) -> TcpRun | None:
    """A session fetching over the TCP transport (closed with `stack`), or None and a note why not."""
    session = stack.enter_context(TransferSession(connection, path="bulk", streams=streams))
    if not isinstance(session.bulk, TcpPath):
        report.notes["tcp"] = f"skipped: {session.bulk_reason}; no figure"
        return None
    region = session.register(nbytes)
    region.view[:] = b"\1" * nbytes  # pre-faulted, as the other figures' regions are
    return TcpRun(session=session, region=region, nbytes=nbytes)


def tcp_turn(run: TcpRun, hashes: list[bytes], batch: int, best_s: list[float]) -> None:
    """One whole fetch over TCP; `best_s[0]` keeps the fastest."""
    t0 = time.perf_counter()
    state = run.session.fetch(hashes, run.region, batch_descriptors=batch)
    best_s[0] = min(best_s[0], time.perf_counter() - t0)
    if state.done_prefix != len(hashes):
        raise RuntimeError(f"tcp fetch loaded {state.done_prefix} of {len(hashes)} blocks")


def tcp_checked(run: TcpRun, source: np.ndarray, best_s: float) -> float:
    """The TCP fetch's GB/s, once its bytes are checked and the transport was used to the end."""
    bulk = run.session.bulk
    if not isinstance(bulk, TcpPath):
        raise RuntimeError(f"the tcp transport failed during the run: {run.session.bulk_reason}")
    if not np.array_equal(np.frombuffer(run.region.view, dtype=np.uint8), source):
        raise RuntimeError("tcp fetch landed the wrong bytes")
    return run.nbytes / best_s / 1e9


def tcp_alone(run: TcpRun, hashes: list[bytes], batch: int, repeat: int, source: np.ndarray) -> float:
    """The TCP fetch's GB/s where Mooncake's transport cannot run (no turns to take)."""
    best = [float("inf")]
    for _ in range(max(repeat, 1)):
        tcp_turn(run, hashes, batch, best)
    return tcp_checked(run, source, best[0])


def tcp_figures(
    report: Report, tcp_gbs: float | None, grpc_gbs: float, bulk_gbs: float | None, mooncake_gbs: float | None
) -> None:
    """The TCP fetch's figure and its ratios to the same run's other paths and Mooncake's raw read."""
    if tcp_gbs is None:
        return
    report.notes.setdefault(
        "tcp",
        f"one-copy TCP on loopback, {IN_FLIGHT} requests in flight; each round a tcp "
        "fetch, then the bulk fetch, then Mooncake's raw read",
    )
    report.add(Figure(name="tcp fetch", value=tcp_gbs, unit="GB/s"))
    if mooncake_gbs is not None:
        report.add(
            Figure.against(
                "tcp fetch vs mooncake",
                tcp_gbs,
                "GB/s",
                "Mooncake transfer engine TCP batch read, same bytes, in turns",
                mooncake_gbs,
            )
        )
    if bulk_gbs is not None:
        report.add(
            Figure.against("tcp fetch vs bulk fetch", tcp_gbs, "GB/s", "bulk fetch (Mooncake), in turns", bulk_gbs)
        )
    report.add(Figure.against("tcp fetch vs grpc fetch", tcp_gbs, "GB/s", "grpc fetch, same run", grpc_gbs))
