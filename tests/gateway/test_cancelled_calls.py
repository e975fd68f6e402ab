"""A client's cancel is normal: Get and Fetch calls cancelled while the server answers log no ERROR and
no traceback, one DEBUG line at most (gateway.grpc_log), on a real server with real LMDB."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.grpc_log import GRPC_LOGGER, CancelledReplyFilter
from kvstore.client import Client
from kvstore.config import StoreSettings
from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc, transfer_pb2, transfer_pb2_grpc

TOKENS = 64
BLOCKS = 128  # a 7 MB Fetch reply: still on its way out when the cancel lands
#: Each round cancels a Get mid-stream and a Fetch mid-reply; rounds go on past the least until grpc's
#: race (below) has happened once, at most the most.
LEAST_ROUNDS, MOST_ROUNDS = 8, 400
DEADLINE_S = 60.0
QUIET = "ended before its reply went out"


def until(what: str, condition: Callable[[], bool]) -> None:
    """Poll `condition` closely (the cancel must land while the reply goes out); fail past the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {DEADLINE_S:g} s")
        time.sleep(0.001)


def _asked(server: Any) -> int:
    """Tokens the server has counted as asked for by Get and Fetch calls (each counts once it has read)."""
    return int(server.tier.stats().counters.get_tokens_asked)


def _fetch_counted(server: Any, asked: int) -> bool:
    """Whether the server counted a whole Fetch since `asked` (a Get asks half as many: it cannot pass for one)."""
    return _asked(server) - asked >= BLOCKS * TOKENS


async def _calls_in_flight() -> int:
    """Calls the server's loop still runs (grpc.aio names each call's task HandleExceptions[method])."""
    return sum(not t.done() and t.get_name().startswith("HandleExceptions[") for t in asyncio.all_tasks())


@pytest.fixture
def stored(start_server: Callable[..., Any], tmp_path: Path) -> tuple[Any, list[bytes]]:
    """A server holding one chain of BLOCKS blocks, and their hashes."""
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 30, block_tokens=TOKENS)
    server = start_server(store)
    with Client(server.target) as client:
        tokens = list(range(BLOCKS * TOKENS))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(BLOCKS)])
        return server, client.hashes(tokens)


def test_cancelled_gets_and_fetches_log_no_error(stored: tuple[Any, list[bytes]], loop_thread: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    server, hashes = stored
    caplog.set_level(logging.DEBUG, logger="kvstore.gateway")
    options = [("grpc.max_receive_message_length", 1 << 30)]
    rounds = 0
    with grpc.insecure_channel(server.target, options=options) as channel:
        kv, transfer = kvstore_pb2_grpc.KVStoreStub(channel), transfer_pb2_grpc.TransferStub(channel)
        # grpc learns of a cancel on one completion and of the failed send on another; when the send's
        # comes first it logged ERROR with a traceback. Which comes first is the machine's timing: go on
        # until it happened (told quietly with the fix, an ERROR without), or something was logged loudly.
        while rounds < LEAST_ROUNDS or not any(QUIET in r.getMessage() or r.levelno >= logging.WARNING
                                               for r in caplog.records):
            if rounds == MOST_ROUNDS:
                break
            stream = kv.Get(kvstore_pb2.GetRequest(block_hashes=hashes[:BLOCKS // 2]))
            for _ in range(rounds % 8 + 1):  # mid-stream: after 1 to 8 of its blocks
                next(stream)
            stream.cancel()
            # Fetch: cancelled once the server has read the blocks, while its reply goes out.
            asked = _asked(server)
            fetch = transfer.Fetch.future(transfer_pb2.FetchRequest(block_hashes=b"".join(hashes)))
            until("the server reading the fetch", partial(_fetch_counted, server, asked))
            fetch.cancel()
            assert fetch.cancelled() or fetch.exception() is not None or len(fetch.result().data) > 0
            rounds += 1
    until("every cancelled call ending on the server", lambda: loop_thread.run(_calls_in_flight()) == 0)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, f"after {rounds} rounds:\n" + "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}"
                                                             for r in loud)
    assert not any(r.exc_info for r in caplog.records)
    quiet = [r for r in caplog.records if QUIET in r.getMessage()]
    if not quiet:
        pytest.skip(f"grpc's race did not happen in {rounds} rounds on this machine: nothing was shown")
    assert all(r.levelno == logging.DEBUG and r.name == "kvstore.gateway" for r in quiet)
    assert all(r.getMessage().startswith(("/kvstore.v1.Transfer/Fetch: ", "/kvstore.v1.KVStore/Get: ")) for r in quiet)


def _grpc_record(message: str, exc: BaseException | None) -> logging.LogRecord:
    """A record as grpc.aio's server writes it (`_LOGGER.exception(...)` on its own logger)."""
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(GRPC_LOGGER, logging.ERROR, "server.pyx.pxi", 1, message, None, exc_info)


def test_only_a_failed_send_under_a_cancel_is_quieted(caplog: pytest.LogCaptureFixture) -> None:
    from grpc._cython import cygrpc  # the real error class grpc raises

    caplog.set_level(logging.DEBUG, logger="kvstore.gateway")
    keep = CancelledReplyFilter().filter
    failed_send = cygrpc.ExecuteBatchError('Failed "execute_batch"')
    assert not keep(_grpc_record("ExecuteBatchError raised in core by servicer method [/kvstore.v1.KVStore/Get]",
                                 failed_send))
    assert caplog.records[-1].getMessage().startswith("/kvstore.v1.KVStore/Get: the call ended before its reply")
    # Anything else grpc logs is a fault of the server's and stays as it was.
    assert keep(_grpc_record("Unexpected [ValueError] raised by servicer method [/kvstore.v1.KVStore/Get]",
                             ValueError("boom")))
    assert keep(_grpc_record("ExecuteBatchError raised in core by servicer method [/x]", None))
    assert keep(_grpc_record("Failed sending error status from server", failed_send))
