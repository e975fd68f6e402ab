"""One structured JSON log line per failed request: method, tenant, status, message.

`RequestLog` observes call outcomes (gateway.call_outcome) and writes, for
every call that ended with a status other than OK, one line on the
"kvstore.requests" logger whose message is a JSON object:

    {"event": "rpc_failed", "method": "kvstore.v1.KVStore/Put", "tenant": "acme",
     "status": "RESOURCE_EXHAUSTED", "reason": "StoreFull", "message": "...",
     "duration_ms": 1.2, "peer": "ipv4:127.0.0.1:53124"}

Never the payload: the message is the status details only, cut at
`MESSAGE_CHARS`. Never a token: whatever the call's credential metadata held
(`authorization`, any key naming a token) is replaced by "[redacted]" wherever
the message repeats it, and so is any "Bearer ..." text. Every failure is
logged at WARNING but a call the client cancelled (the client went away, or
closed its transfer session, whose event stream it cancels): no failure of the
server, it is logged at DEBUG only.

Under the process's root format the JSON follows its time, level and logger
name; `use_json_lines()` (`kvstore serve` calls it) writes each line as the
bare JSON object with "time" (UTC, ISO 8601) and "level" inside, for a log
shipper to read as is.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from collections.abc import Iterable
from typing import Any, TextIO

import grpc

from gateway.call_outcome import CallOutcome, OutcomeInterceptor

log = logging.getLogger("kvstore.requests")

#: Longest message logged, in characters (status details can name what a request held).
MESSAGE_CHARS = 1000
REDACTED = "[redacted]"
_BEARER = re.compile(r"(?i)\bbearer\s+\S+")
#: Metadata keys whose values are credentials.
_SECRET_KEYS = re.compile(r"authorization|token|secret|password|api[-_]?key", re.IGNORECASE)


def _secrets(metadata: Iterable[Any] | None) -> list[str]:
    """Credential values in the call's metadata, each also without its scheme ("Bearer x" -> also "x")."""
    found: list[str] = []
    for key, value in metadata or ():
        if not _SECRET_KEYS.search(str(key)):
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        found.append(text)
        found.extend(part for part in text.split()[1:] if part)
    # The longest first: a token is replaced whole before any part of it.
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def redact(message: str, metadata: Iterable[Any] | None) -> str:
    """`message` without the credentials of `metadata` nor any bearer token, cut at MESSAGE_CHARS."""
    for secret in _secrets(metadata):
        message = message.replace(secret, REDACTED)
    message = _BEARER.sub(f"Bearer {REDACTED}", message)
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + "..."
    return message


def _metadata(context: Any) -> Iterable[Any] | None:
    try:
        return context.invocation_metadata()  # type: ignore[no-any-return]
    except Exception:  # a context that no longer has it: redact bearer text only
        return None


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:
        return ""


def record(outcome: CallOutcome) -> dict[str, Any]:
    """The fields of a failed call's log line."""
    metadata = _metadata(outcome.context)
    return {
        "event": "rpc_failed",
        "method": outcome.method,
        "tenant": outcome.tenant,
        "status": outcome.code.name,
        "reason": outcome.reason,
        "message": redact(outcome.message, metadata),
        "duration_ms": round(outcome.duration_s * 1000.0, 3),
        "peer": _peer(outcome.context),
    }


class RequestLog:
    """Writes one JSON line per failed call (an observer of call outcomes)."""

    def __call__(self, outcome: CallOutcome) -> None:
        if outcome.code is grpc.StatusCode.OK:
            return
        level = logging.DEBUG if outcome.code is grpc.StatusCode.CANCELLED else logging.WARNING
        if log.isEnabledFor(level):
            fields = record(outcome)
            log.log(level, json.dumps(fields, ensure_ascii=False), extra={"kvstore_fields": fields})


class JsonLines(logging.Formatter):
    """Formats a request-log record as one JSON object alone on its line, its time and level inside
    (`use_json_lines`); any other record as `%(levelname)s %(name)s: %(message)s`."""

    def format(self, rec: logging.LogRecord) -> str:
        fields = getattr(rec, "kvstore_fields", None)
        if not isinstance(fields, dict):
            return f"{rec.levelname} {rec.name}: {rec.getMessage()}"
        when = datetime.datetime.fromtimestamp(rec.created, datetime.UTC).isoformat(timespec="milliseconds")
        return json.dumps({"time": when.replace("+00:00", "Z"), "level": rec.levelname, **fields},
                          ensure_ascii=False)


def use_json_lines(stream: TextIO | None = None) -> logging.Handler:
    """Write the request log as bare JSON lines on `stream` (default stderr), not through the root
    logger's format, so a log shipper reads each line as one JSON object. Returns the handler added."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonLines())
    log.addHandler(handler)
    log.propagate = False
    return handler


class RequestLogInterceptor(OutcomeInterceptor):
    """The failed-request log on its own (gateway.metrics.MetricsInterceptor can carry a RequestLog instead)."""

    def __init__(self) -> None:
        super().__init__([RequestLog()])
