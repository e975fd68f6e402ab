"""Reporting a resume plan to the server (ReportResume), so its stats count usable tokens.

A worker plans each resume (replay.plan) and tells the store what the plan served: the
store's raw hit is not what an engine could use. `kvstore.client.store.Client.report_resume`
sends it here, checked, waiting for the answer or not.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import grpc

from kvstore.client import arguments
from kvstore.client.connection import Connection, status_error
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.v1 import kvstore_pb2 as pb

#: The resume actions `report_resume` takes, by the names replay.plan.Action gives them.
RESUME_ACTIONS: dict[str, pb.ResumeAction] = {
    "fetch+snapshot": pb.RESUME_ACTION_FETCH_SNAPSHOT,
    "bounded-replay": pb.RESUME_ACTION_BOUNDED_REPLAY,
    "exact-replay": pb.RESUME_ACTION_EXACT_REPLAY,
    "full-prefill": pb.RESUME_ACTION_FULL_PREFILL,
}


def report_resume(connection: Connection, *, prompt_tokens: int, found_tokens: int, usable_tokens: int,
                  action: str, wait: bool = True) -> Future[None]:
    """Report one resume plan on `connection` (its geometry and tenant): `Client.report_resume`."""
    if action not in RESUME_ACTIONS:
        raise InvalidArgument(f"unknown resume action {action!r}; one of {', '.join(RESUME_ACTIONS)}")
    request = pb.ReportResumeRequest(
        geometry=connection.geometry, namespace=connection.namespace, action=RESUME_ACTIONS[action],
        prompt_tokens=arguments.integer(prompt_tokens, "prompt_tokens", most=2**64 - 1),
        found_tokens=arguments.integer(found_tokens, "found_tokens", most=2**64 - 1),
        usable_tokens=arguments.integer(usable_tokens, "usable_tokens", most=2**64 - 1))
    done: Future[None] = Future()
    try:
        call = connection.kvstore.ReportResume.future(request, timeout=connection.timeout_s,
                                                      metadata=connection.metadata)
    except ValueError as exc:  # grpc refuses a call on a closed channel
        raise InvalidArgument(f"cannot report on this client: {exc}", hint="the client is closed") from None

    def finished(call: Any) -> None:
        try:
            call.result()
        except grpc.RpcError as exc:
            done.set_exception(status_error(exc))
        except BaseException as exc:  # cancelled: still a KVStoreError for the caller
            done.set_exception(KVStoreError(f"ReportResume did not complete: {exc!r}"))
        else:
            done.set_result(None)

    call.add_done_callback(finished)
    if wait:
        done.result()
    return done
