"""Each error's hint is true of the call that raised it (issue 28 item 5).

A class's default hint speaks of the store's data calls ("nothing was stored", "the
damaged blocks were dropped"); every operator command and every Admin call that
stops on such an error says what it left as it was instead, and an error that
crossed the wire carries the server's hint once, never a second default one. The
commands run in-process (`kvstore.cli.main`) against a real server on loopback,
which holds every right there without tenants (gateway/auth.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore import errors
from kvstore.cli import COMMAND_HINTS, build_parser, command_hint, main
from kvstore.client import Client

#: The class default every InvalidArgument raised without a hint of its own carries.
STORE_HINT = errors.InvalidArgument.hint


def err(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `kvstore ARGV` wrote to stderr, after checking that it failed with 2."""
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_status_brings_back_the_servers_hint_and_no_default() -> None:
    message = "export file /x.kvx is damaged: frame 0 fails its checksum (export the tenant again)"
    back = errors.from_status(grpc.StatusCode.DATA_LOSS, message)
    assert type(back) is errors.DataLoss and back.message == message and back.hint == ""
    assert errors.from_status(grpc.StatusCode.INVALID_ARGUMENT, "bad (fix it)").hint == ""
    # The transport's own UNAVAILABLE (no server answered) keeps the default that is true of any call,
    # once: the server's own Unavailable already carries it in its message.
    assert errors.from_status(grpc.StatusCode.UNAVAILABLE, "failed to connect").hint == "retry with backoff"
    assert errors.from_status(grpc.StatusCode.UNAVAILABLE, "pool down (retry with backoff)").hint == ""


def test_a_hint_given_where_the_error_is_raised_is_not_a_default() -> None:
    assert errors.has_default_hint(errors.InvalidArgument("x"))
    assert not errors.has_default_hint(errors.InvalidArgument("x", hint="name 72 hours or more"))


def test_purge_without_yes_says_nothing_was_deleted(capsys: pytest.CaptureFixture[str]) -> None:
    line = err(capsys, "purge", "--tenant", "acme", "--all", "--target", "127.0.0.1:1")
    assert line.endswith("add --yes to go ahead (nothing was deleted)") and STORE_HINT not in line


def test_policy_set_with_nothing_to_set_says_no_policy_changed(capsys: pytest.CaptureFixture[str]) -> None:
    line = err(capsys, "policy", "set", "acme", "--target", "127.0.0.1:1")
    assert line.endswith("(no policy was changed)") and STORE_HINT not in line


@pytest.mark.parametrize(("argv", "says"), [
    (["acme", "--rights", "fly,read"], "unknown right 'fly' in --rights: the rights are read, write, admin"),
    (["acme", "--rights", "fly,read,swim"], "unknown rights 'fly', 'swim' in --rights"),
    (["bad name"], "tenant 'bad name' is not 1-128"),
])
def test_tenant_create_refused_says_no_token_was_issued(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], says: str) -> None:
    line = err(capsys, "tenant", "create", *argv, "--data-dir", str(tmp_path))
    assert says in line and line.endswith("(no token was issued; the tenants file is unchanged)")
    assert STORE_HINT not in line and not (tmp_path / "tenants.json").exists()


def test_a_servers_hint_comes_once(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    line = err(capsys, "policy", "set", "acme", "--retention-hours", "10", "--target", server.target)
    assert line.endswith("below the 72-hour floor (name 72 hours or more)") and STORE_HINT not in line


def test_the_admin_service_gives_each_call_its_own_hint(server: Any, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "prompt.json"
    prompt.write_text("[1, 2, 3]")  # no full block: refused by the server's Purge
    line = err(capsys, "purge", "--tenant", "default", "--tokens", str(prompt), "--yes", "--target", server.target)
    assert line.endswith("nothing is stored for them (nothing was deleted)") and STORE_HINT not in line
    line = err(capsys, "policy", "set", "acme", "--requests-per-s", "1e12", "--target", server.target)
    assert line.endswith("0 means unlimited (no policy was changed)") and STORE_HINT not in line


def test_a_damaged_export_file_says_the_file_not_the_store(server: Any, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with Client(server.target) as client:
        client.put(list(range(2 * client.block_tokens)), [os.urandom(client.block_bytes) for _ in range(2)])
    path = tmp_path / "default.kvx"
    assert main(["export", "--tenant", "default", "--file", str(path), "--target", server.target]) == 0
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    line = err(capsys, "import", "--file", str(path), "--tenant", "copy", "--target", server.target)
    assert "fails its checksum (export the tenant again" in line
    assert "dropped" not in line and "kvstore check" not in line and line.count("(") == 1
    assert main(["import", "--file", str(path), "--tenant", "copy", "--target", server.target, "--json"]) == 2
    out = json.loads(capsys.readouterr().out)["error"]
    assert out["code"] == "DATA_LOSS" and out["hint"] == "" and "export the tenant again" in out["message"]


def test_every_command_hint_names_a_command() -> None:
    parser = build_parser([])
    commands = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {name.split()[0] for name in COMMAND_HINTS} <= commands
    args = build_parser(["tenant"]).parse_args(["tenant", "create", "acme"])
    assert command_hint(args) == COMMAND_HINTS["tenant create"]
    args = build_parser(["tenant"]).parse_args(["tenant", "list"])
    assert command_hint(args) == ""  # a read says nothing of what it left
