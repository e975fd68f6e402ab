"""One structured JSON line per failed request, from a real server on loopback (gateway.request_log)."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import grpc
import pytest

from gateway.request_log import MESSAGE_CHARS, REDACTED, redact, use_json_lines
from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KV = "kvstore.v1.KVStore"
SECRET = "kvs_S3CRET-token-0123456789"


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvstore.requests"]


def test_a_failed_call_logs_one_json_line_with_its_fields_and_never_the_token(
        start_metered: Any, caplog: pytest.LogCaptureFixture) -> None:
    m = start_metered()
    kv = pb_grpc.KVStoreStub(grpc.insecure_channel(m.target))
    token = [("authorization", f"Bearer {SECRET}")]
    caplog.set_level(logging.INFO, logger="kvstore.requests")
    kv.GetInfo(pb.GetInfoRequest(), metadata=token)
    assert _lines(caplog) == []  # a call that succeeds logs nothing
    with pytest.raises(grpc.RpcError) as refused:
        # A geometry name the status repeats: here the client put its token there.
        kv.Lookup(pb.LookupRequest(geometry=SECRET, block_hashes=[bytes(32)]), metadata=token)
    assert SECRET in (refused.value.details() or "")
    [line] = _lines(caplog)
    assert line.levelno == logging.WARNING
    entry = json.loads(line.getMessage())
    assert {k: entry[k] for k in ("event", "method", "tenant", "status", "reason")} == {
        "event": "rpc_failed", "method": f"{KV}/Lookup", "tenant": "default", "status": "INVALID_ARGUMENT",
        "reason": "InvalidArgument"}
    assert entry["message"].startswith(f"unknown geometry '{REDACTED}'")
    assert SECRET not in line.getMessage()


def test_a_refused_token_is_logged_as_unauthenticated_and_never_shown(
        start_metered: Any, issue: Any, caplog: pytest.LogCaptureFixture) -> None:
    issue("acme")  # auth on
    m = start_metered()
    caplog.set_level(logging.INFO, logger="kvstore.requests")
    kv = pb_grpc.KVStoreStub(grpc.insecure_channel(m.target))
    with pytest.raises(grpc.RpcError) as refused:
        kv.Lookup(pb.LookupRequest(block_hashes=[bytes(32)]), metadata=[("authorization", f"Bearer {SECRET}")])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    [line] = _lines(caplog)
    entry = json.loads(line.getMessage())
    assert (entry["tenant"], entry["status"], entry["method"]) == ("unauthenticated", "UNAUTHENTICATED", f"{KV}/Lookup")
    assert entry["message"] and SECRET not in line.getMessage()


def test_a_call_the_client_cancelled_is_no_failure(start_metered: Any, caplog: pytest.LogCaptureFixture) -> None:
    m = start_metered()
    caplog.set_level(logging.INFO, logger="kvstore.requests")
    with Client(m.target) as client, client.transfer():
        pass  # closing the session cancels its OpenSession stream
    s = m.scrape_until(lambda s: s.value("kvstore_rpc_requests_total", method="kvstore.v1.Transfer/OpenSession",
                                         tenant="default", code="CANCELLED") is not None)
    assert s.value("kvstore_rpc_requests_total", method="kvstore.v1.Transfer/OpenSession", tenant="default",
                   code="CANCELLED") == 1
    assert s.where("kvstore_rpc_rejections_total") == []
    assert _lines(caplog) == []


def test_redaction_covers_bearer_text_and_long_messages() -> None:
    assert redact(f"saw Bearer {SECRET} here", None) == f"saw Bearer {REDACTED} here"
    assert redact(f"x{SECRET}y", [("x-api-token", SECRET.encode())]) == f"x{REDACTED}y"
    assert redact("a" * (MESSAGE_CHARS + 50), []) == "a" * MESSAGE_CHARS + "..."


def test_json_lines_write_each_failure_as_one_bare_json_object(start_metered: Any) -> None:
    stream = io.StringIO()
    handler = use_json_lines(stream)
    try:
        m = start_metered()
        kv = pb_grpc.KVStoreStub(grpc.insecure_channel(m.target))
        with pytest.raises(grpc.RpcError):
            kv.Lookup(pb.LookupRequest(geometry="no-such-geometry", block_hashes=[bytes(32)]))
    finally:
        logging.getLogger("kvstore.requests").removeHandler(handler)
        logging.getLogger("kvstore.requests").propagate = True
    [line] = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["time"].endswith("Z") and entry["method"] == f"{KV}/Lookup"
    assert entry["status"] == "INVALID_ARGUMENT" and entry["tenant"] == "default"
