"""gateway.tenants under a running server: the reload survives whatever the tenants file holds (issue 29 item 2).

Each test damages the tenants file of a real server on loopback (re-reading it
every 50 ms), sees the last good table still served and the failure logged
once, then repairs the file as docs/SECURITY.md says (restore it, revoke with
`api_tokens.revoke`, what `kvstore tenant revoke` runs) and waits for the
revoked token to be refused: before the fix, a non-UTF-8 file killed the
reload task and revocation stopped for good.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import api_tokens
from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import AuthSettings, StoreSettings
from kvstore.errors import Unauthenticated
from tests.waiting import wait_until

READ_WRITE = frozenset({"read", "write"})
#: What the tenants file is turned into, from its good text; None: the case damages it otherwise (below).
BAD: dict[str, Callable[[bytes], bytes] | None] = {
    "binary": lambda good: bytes(range(256)) * 8,
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "a JSON array": lambda good: b"[1, 2, 3]",
    "JSON null": lambda good: b"null",
    "tokens not a list": lambda good: b'{"version": 1, "tokens": {"a": 1}}',
    "a record of the wrong shape": lambda good: b'{"version": 1, "tokens": [{"tenant": 5}]}',
    "a hash that is not hex": lambda good: _edit(good, sha256="zz" * 32),
    "an unknown right": lambda good: _edit(good, rights=["root"]),
    "a number past a double": lambda good: _edit(good, created_at=1e400),
    "a later format version": lambda good: good.replace(b'"version": 1', b'"version": 2'),
    "nested too deeply": lambda good: b"[" * 200_000,
    "larger than the bound": None,
    "a folder": None,
    "a symlink loop": None,
}


def _edit(good: bytes, **fields: object) -> bytes:
    data = json.loads(good)
    data["tokens"][0].update(fields)
    return json.dumps(data).encode().replace(b"Infinity", b"1e400")


def damage(path: Path, case: str, good: bytes) -> None:
    """Put `case` where the tenants file is: renamed over it, so no reload sees the file gone in between
    (but for the folder: a folder cannot be renamed over a file)."""
    tmp = path.with_name("tenants.damaged")
    make = BAD[case]
    if make is not None:
        tmp.write_bytes(make(good))
    elif case == "larger than the bound":
        tmp.touch()
        os.truncate(tmp, api_tokens.MAX_FILE_BYTES + 1)  # sparse: no disk, and never read (its size refuses it)
    elif case == "a folder":
        path.unlink()
        path.mkdir()
        return
    else:
        tmp.symlink_to(path.name)  # stat() fails with ELOOP: an OSError the reload did not foresee
    os.replace(tmp, path)


def restore(path: Path, good: bytes) -> None:
    """Put the backup back as an operator would (a new file renamed over whatever is there)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    tmp = path.with_name("tenants.restored")
    tmp.write_bytes(good)
    os.replace(tmp, path)


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; fail naming `what` past the deadline (the reload runs every 50 ms)."""
    wait_until(condition, what, timeout_s)


def accepted(target: str, token: str) -> bool:
    try:
        Client(target, token=token, timeout_s=5).close()
    except Unauthenticated:
        return False
    return True


def scrape(server: Any) -> dict[str, float]:
    """The tenants file's series of the server's registry, as a scrape shows them."""
    text = generate_latest(server.metrics.registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("kvstore_tenants_")}


@pytest.fixture
def watched(start_server: Callable[..., Any], store_settings: StoreSettings) -> tuple[Any, Path, dict[str, str]]:
    """A server re-reading its tenants file every 50 ms, with tenants acme and keeper."""
    path = store_settings.data_dir / "tenants.json"
    tokens = {t: api_tokens.create(path, t, READ_WRITE)[1] for t in ("acme", "keeper")}
    return start_server(store_settings, auth=AuthSettings(reload_s=0.05)), path, tokens


@pytest.mark.parametrize("case", list(BAD))
def test_a_revocation_after_a_damaged_tenants_file_takes_effect(
        watched: tuple[Any, Path, dict[str, str]], clock: ManualClock, caplog: pytest.LogCaptureFixture,
        case: str) -> None:
    server, path, tokens = watched
    caplog.set_level(logging.ERROR, logger="kvstore.auth")
    good = path.read_bytes()
    before = server.tenants.status()
    clock.advance(1)  # a load from now on has another time
    damage(path, case, good)
    wait_for("the reload seeing the damage", lambda: server.tenants.status().failures == before.failures + 1)
    seen = server.tenants.status()
    assert not seen.file_ok
    if seen.last_load_s == before.last_load_s:  # always, but for a reload that ran between unlink and mkdir
        assert accepted(server.target, tokens["acme"])  # the last good table is still served
    else:
        assert case == "a folder"
    wait_for("five more checks", lambda: server.tenants.status().checks >= seen.checks + 5)
    failures = [r for r in caplog.records if "tenants" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]  # logged once, not every poll
    assert "\n" not in failures[0].getMessage()
    assert server.tenants.status().failures == seen.failures

    clock.advance(60)
    restore(path, good)  # from the backup, then revoke as `kvstore tenant revoke acme` does
    api_tokens.revoke(path, "acme")
    wait_for("the revoked token refused", lambda: not accepted(server.target, tokens["acme"]))
    assert accepted(server.target, tokens["keeper"])
    after = server.tenants.status()
    assert after.file_ok and after.last_load_s == clock.now()
    metrics = scrape(server)
    assert metrics["kvstore_tenants_file_ok"] == 1
    assert metrics["kvstore_tenants_last_load_timestamp_seconds"] == clock.now()
    assert metrics["kvstore_tenants_load_failures_total"] == after.failures == before.failures + 1
    assert metrics["kvstore_tenants_file_checks_total"] >= seen.checks + 5


def test_a_file_that_vanishes_refuses_every_token_and_serves_again_when_it_returns(
        watched: tuple[Any, Path, dict[str, str]], clock: ManualClock) -> None:
    server, path, tokens = watched
    good = path.read_bytes()
    path.unlink()
    wait_for("every token refused", lambda: not accepted(server.target, tokens["keeper"]))
    assert server.tenants.status().file_ok  # a gone file is no failure: it refuses every token, as documented
    restore(path, good)
    api_tokens.revoke(path, "acme")
    wait_for("the file taken back", lambda: accepted(server.target, tokens["keeper"]))
    assert not accepted(server.target, tokens["acme"])


def test_damage_while_damaged_is_logged_once_per_version_and_a_gauge_says_so(
        watched: tuple[Any, Path, dict[str, str]], caplog: pytest.LogCaptureFixture) -> None:
    server, path, tokens = watched
    caplog.set_level(logging.ERROR, logger="kvstore.auth")
    good = path.read_bytes()
    for n, text in enumerate((b"\xff\xfe", b"{", b"[]"), start=1):
        restore(path, text)
        wait_for(f"damage {n} seen", lambda n=n: server.tenants.status().failures == n)  # type: ignore[misc]
        assert scrape(server)["kvstore_tenants_file_ok"] == 0
    assert len([r for r in caplog.records if "kept the previous tenants table" in r.getMessage()]) == 3
    restore(path, good)
    wait_for("the good file loaded", lambda: server.tenants.status().file_ok)
    assert accepted(server.target, tokens["acme"])
