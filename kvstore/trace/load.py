"""`load_trace(path)`: read a trace by its path's form, and order its requests by arrival."""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.trace.mooncake import read_mooncake
from kvstore.trace.recorded import is_recorded, read_recorded
from kvstore.trace.requests import Trace, TraceRequest
from kvstore.trace.weka import parse_session, session_files

#: Seconds between the starts of consecutive weka sessions (they carry no start time of their own).
DEFAULT_SESSION_EVERY_S = 60.0


def trace_kind(path: Path) -> str:
    """"weka" (a folder, a .json, a .tar.zst), "mooncake" (.jsonl, .jsonl.zst) or "kvstore" (kvstore's own
    trace: a .kvtrace.zst, or a folder of them).

    Raises:
        InvalidArgument: the path does not exist or has neither form.
    """
    if not path.exists():
        raise InvalidArgument(f"trace {path} does not exist",
                              hint="give a weka folder, .json or .tar.zst, a Mooncake .jsonl(.zst), "
                                   "or kvstore's trace folder")
    name = path.name
    if is_recorded(path):
        return "kvstore"
    if name.endswith((".jsonl", ".jsonl.zst")):
        return "mooncake"
    if path.is_dir() or name.endswith((".json", ".tar.zst", ".tzst")):
        return "weka"
    raise InvalidArgument(f"trace {path}: unknown format (by its name)",
                          hint="a weka folder, .json or .tar.zst, a Mooncake .jsonl or .jsonl.zst, or a .kvtrace.zst")


def load_trace(path: Path, *, sessions: int | None = None, requests: int | None = None,
               session_every_s: float = DEFAULT_SESSION_EVERY_S) -> Trace:
    """The trace at `path`, its requests sorted by arrival.

    Args:
        path: a weka folder, session .json or sessions.tar.zst; a Mooncake .jsonl(.zst); or kvstore's own
            trace (a .kvtrace.zst file or its folder, docs/CAPACITY.md "Recording").
        sessions: read only the first this many weka session files (by name); None: all.
        requests: keep only the first this many arrivals; None: all.
        session_every_s: weka session i starts at i x this (the files give no start times).

    Raises:
        InvalidArgument: an unknown path, or a bad record (naming file and line or request).
    """
    kind = trace_kind(path)
    reqs: list[TraceRequest] = []
    if kind == "mooncake":
        reqs = read_mooncake(path, limit=requests)
    elif kind == "kvstore":
        reqs = read_recorded(path, limit=requests)
    else:
        for i, (name, data) in enumerate(session_files(path)):
            if sessions is not None and i >= sessions:
                break
            reqs.extend(parse_session(name, data, start_s=i * session_every_s))
    reqs.sort(key=lambda r: r.arrival_s)  # stable: file order among equal times
    if requests is not None:
        del reqs[requests:]
    names = list(dict.fromkeys(r.session for r in reqs))
    return Trace(name=str(path), kind=kind, requests=reqs, sessions=names)
