"""`kvstore purge`, `kvstore export` and `kvstore import` against a real server's Admin service.

The server binds loopback with no tenants configured, so the caller holds every right
(admin included: gateway/auth.py); the commands run in-process through `kvstore.cli.main`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.client import Client


@pytest.fixture
def stored(server: Any) -> Iterator[tuple[Client, list[int]]]:
    """Four blocks of one prompt stored for the default tenant."""
    with Client(server.target) as client:
        tokens = list(range(4 * client.block_tokens))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(4)])
        yield client, tokens


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in argv else out


def test_export_purge_import_round_trip(stored: tuple[Client, list[int]], server: Any, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    client, tokens = stored
    blocks = client.get(tokens).blocks
    path = str(tmp_path / "default.kvx")
    target = ("--target", server.target, "--json")
    code, out = cli(capsys, "export", "--tenant", "default", "--file", path, *target)
    assert code == 0 and out["records"] == 4 and out["bytes"] == Path(path).stat().st_size
    code, out = cli(capsys, "purge", "--tenant", "default", "--all", "--yes", *target)
    assert code == 0 and out["purged_blocks"] == 4
    assert client.lookup(tokens).found_blocks == 0
    code, out = cli(capsys, "import", "--file", path, *target)
    assert code == 0 and (out["records"], out["written"]) == (4, 4)
    assert client.get(tokens).blocks == blocks


def test_purge_of_a_prompt_takes_the_blocks_below_it(stored: tuple[Client, list[int]], server: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    client, tokens = stored
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(tokens[: 2 * client.block_tokens]))
    code, out = cli(capsys, "purge", "--tenant", "default", "--tokens", str(prompt), "--yes", "--target",
                    server.target)
    assert code == 0 and "4 blocks purged" in out  # its two blocks, and the two stored below them
    assert client.lookup(tokens).found_blocks == 0


def test_purge_without_yes_deletes_nothing(stored: tuple[Client, list[int]], server: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    client, tokens = stored
    assert main(["purge", "--tenant", "default", "--all", "--target", server.target]) == 2
    assert "add --yes" in capsys.readouterr().err
    assert client.lookup(tokens).found_blocks == 4


def test_a_relative_file_is_refused_before_asking(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--tenant", "default", "--file", "acme.kvx", "--target", "127.0.0.1:1"]) == 2
    assert "not absolute: it names a file on the server's disk" in capsys.readouterr().err


def test_a_damaged_file_is_a_json_error_naming_the_frame(stored: tuple[Client, list[int]], server: Any,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "default.kvx"
    assert main(["export", "--tenant", "default", "--file", str(path), "--target", server.target]) == 0
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    code, out = cli(capsys, "import", "--file", str(path), "--tenant", "copy", "--target", server.target, "--json")
    assert code == 2 and out["error"]["code"] == "DATA_LOSS" and "frame 0" in out["error"]["message"]
