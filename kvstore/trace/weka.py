"""The weka/kv-cache-tester trace: one JSON object per session, 64-token blocks.

A session file holds `block_size`, `hash_id_scope` and `requests` in time order; a
request of type `subagent` nests its own `requests` (times from the subagent's start),
replayed as a concurrent session of its own (the upstream tester spawns one user per
subagent), in the parent's id scope. Files come as a folder of `trace_NNNN.json`, one
such file, or the published `sessions.tar.zst`, read as a stream (never unpacked).
Sessions have no absolute start time: session i (in file-name order) starts at
`i * session_every_s`.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvstore.trace import fields
from kvstore.trace.requests import TraceRequest

#: Subagent entries nest sessions; deeper than this is a damaged file, not a workload.
MAX_NESTING = 8


def session_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(file name, its bytes) of every session in `path`, in name order.

    Raises:
        InvalidArgument: the archive is damaged or truncated (naming the member it was in).
    """
    if path.is_dir():
        for f in sorted(path.glob("*.json")):
            yield str(f), f.read_bytes()
    elif path.name.endswith((".tar.zst", ".tzst")):
        yield from _archive(path)
    else:
        yield str(path), path.read_bytes()


def _archive(path: Path) -> Iterator[tuple[str, bytes]]:
    import zstandard

    member = "its first member"
    try:
        with path.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            files: list[tuple[str, bytes]] = []
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for info in tar:
                    member = info.name
                    if info.isfile() and info.name.endswith(".json"):
                        data = _read_member(tar.extractfile(info))
                        files.append((f"{path}:{info.name}", data))
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
        raise fields.bad(str(path), f"the archive is damaged or truncated at {member}: {exc}") from None
    yield from sorted(files)


def _read_member(f: IO[bytes] | None) -> bytes:
    return f.read() if f is not None else b""


def parse_session(name: str, data: bytes, *, start_s: float = 0.0) -> list[TraceRequest]:
    """Every request of one session file, its subagents' included, with absolute arrival times.

    Args:
        name: the file's name (in messages, and the session's name).
        data: the file's bytes.
        start_s: the session's start, from the trace's.

    Raises:
        InvalidArgument: not JSON (naming the line and column where it stops) or a field
            that is not as the format says (naming the request, e.g. `requests[3].requests[1]`).
    """
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as exc:
        raise fields.bad(name, f"line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg}); "
                         "a truncated file stops like this") from None
    except UnicodeDecodeError as exc:
        raise fields.bad(name, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    block_tokens = fields.count(doc, "block_size", name)
    if block_tokens < 1:
        raise fields.bad(name, "block_size must be at least 1")
    scope_kind = doc.get("hash_id_scope", "local")
    if scope_kind not in ("local", "global"):
        raise fields.bad(name, f"hash_id_scope must be 'local' or 'global', got {scope_kind!r}")
    session = str(doc.get("id") or Path(name.rsplit(":", 1)[-1]).stem)
    scope = session if scope_kind == "local" else ""
    out: list[TraceRequest] = []
    _walk(fields.field(doc, "requests", name), session=session, scope=scope, start_s=start_s,
          block_tokens=block_tokens, where=f"{name}: requests", out=out, depth=0)
    return out


def _walk(requests: Any, *, session: str, scope: str, start_s: float, block_tokens: int, where: str,
          out: list[TraceRequest], depth: int) -> None:
    if not isinstance(requests, list):
        raise fields.bad(where, f"must be a list of requests, got {type(requests).__name__}")
    if depth > MAX_NESTING:
        raise fields.bad(where, f"subagents nested deeper than {MAX_NESTING}")
    for i, r in enumerate(requests):
        at = f"{where}[{i}]"
        t = start_s + fields.seconds(r, "t", at)
        if r.get("type") == "subagent":
            agent = str(r.get("agent_id") or f"sub{i}")
            _walk(fields.field(r, "requests", at), session=f"{session}/{agent}", scope=scope, start_s=t,
                  block_tokens=block_tokens, where=f"{at}.requests", out=out, depth=depth + 1)
            continue
        out.append(TraceRequest(session=session, scope=scope, arrival_s=t,
                                input_tokens=fields.count(r, "in", at), output_tokens=fields.count(r, "out", at),
                                block_ids=fields.block_ids(r, "hash_ids", at), source_block_tokens=block_tokens,
                                where=at))
