"""`kvstore plan` against a real server: the text and JSON plans, and its errors in one line."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.client import Client
from replay.plan_command import parse_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prompt_file(tmp_path: Path, client: Client) -> Path:
    """A 325-token prompt whose first 20 blocks are stored (a bounded replay), as a JSON array."""
    tokens = list(range(325))
    client.put(tokens[:320], [os.urandom(client.block_bytes) for _ in range(20)], extra_keys=["img"])
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(tokens))
    return path


def test_plan_prints_its_reasons_and_a_summary(server: Any, prompt_file: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tokens", str(prompt_file), "--target", server.target, "--extra-key", "img"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"plan for 325 prompt tokens at {server.target} (namespace of the token (default without "
                      f"auth), geometry deepseek-v4.1-flash, blocks of 16)")
    assert out[1].startswith("  found 320 of 325 prompt tokens")
    assert out[-2].startswith("  chose bounded-replay")
    assert out[-1].startswith("bounded-replay, fetch 320 tokens") and "replay [192, 320)" in out[-1]


def test_plan_json_and_the_fidelity_and_rate_flags(server: Any, client: Client, prompt_file: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--tokens", str(prompt_file), "--target", server.target, "--extra-key", "img", "--json"]
    assert main([*args, "--replay-windows", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["action"], plan["replay_start"], plan["usable_tokens"], plan["block_tokens"]) == (
        "bounded-replay", 64, 320, 16)
    assert plan["lease_id"] is None and client.stats().active_leases == 0  # nothing will execute it
    assert client.stats().resume_plans == 0  # nor is it counted
    assert main([*args, "--replay-windows", "exact"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "full-prefill"  # 320 < 40 x 128
    assert main([*args, "--fetch-gbps", "1e-9"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "full-prefill"
    assert main([*args, "--replay-overhead", "0.03"]) == 0  # the eager reference worker's per-replay cost
    assert json.loads(capsys.readouterr().out)["action"] == "full-prefill"  # 30 ms > the 320 tokens it saves
    assert main(["plan", "--tokens", str(prompt_file), "--target", server.target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["found_tokens"] == 0  # other extra keys: other blocks


def test_plan_reads_stdin_and_separated_integers(server: Any, prompt_file: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    text = ", ".join(str(t) for t in json.loads(prompt_file.read_text()))
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["plan", "--tokens", "-", "--target", server.target, "--extra-key", "img", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["found_tokens"] == 320
    assert parse_tokens("1 2\n3,4 ,5", "x") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(("text", "says"), [
    ("1 2 x3", "item 2 ('x3') is not a token id"),
    ("[1, 2.5]", "item 1 (2.5) is not a token id"),
    ("[1, true]", "item 1 (True) is not a token id"),
    ("4294967296", "item 0"),
    ("[1, 2", "not a JSON array"),
    ("  \n", "no token ids"),
])
def test_plan_names_a_bad_token_file_in_one_line(server: Any, tmp_path: Path, text: str, says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    assert main(["plan", "--tokens", str(path), "--target", server.target]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvstore: InvalidArgument: ") and says in err


def test_plan_with_a_missing_file_or_bad_flags(server: Any, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tokens", str(tmp_path / "none.json"), "--target", server.target]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No such file or directory" in err
    path = tmp_path / "ok.txt"
    path.write_text("1 2 3")
    assert main(["plan", "--tokens", str(path), "--target", server.target, "--replay-windows", "0"]) == 2
    assert "replay windows must be a positive integer or 'exact'" in capsys.readouterr().err
    assert main(["plan", "--tokens", str(path), "--target", server.target, "--recompute-tps", "-5"]) == 2
    assert "recompute_tokens_per_s must be a positive finite number" in capsys.readouterr().err


def test_plan_against_a_dead_server_is_one_line_or_one_json_error(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("1 2 3")
    target = f"127.0.0.1:{_free_port()}"
    base = [sys.executable, "-m", "kvstore.cli", "plan", "--tokens", str(path), "--target", target, "--timeout", "2"]
    run = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("kvstore: Unavailable: ")
    run = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and json.loads(run.stdout)["error"]["code"] == "UNAVAILABLE"


def test_plan_help_is_the_modules_docstring() -> None:
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "plan", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "Print the resume plan of a prompt" in run.stdout
    assert "--replay-windows" in run.stdout
