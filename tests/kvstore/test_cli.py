"""The operator CLI: `kvstore stats` against a real server, and its errors."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli import main


def test_stats_table_and_json(server: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bt = client.block_tokens
    tokens = list(range(bt * 4))
    client.put(tokens[: bt * 2], [os.urandom(client.block_bytes) for _ in range(2)])
    client.lookup(tokens)
    client.get(tokens)
    assert main(["stats", "--target", server.target]) == 0
    table = capsys.readouterr().out
    assert "Lookup hit rate (tokens found / asked)       50.0%" in table
    assert "Retrieve hit rate (tokens returned / asked)  50.0%" in table
    assert "Headroom (hours at that rate)" in table
    assert main(["stats", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lookup_hit_rate"] == 0.5 and data["retrieve_hit_rate"] == 0.5
    assert data["blocks_stored"] == 2 and data["rejected_puts"] == 0 and data["corrupt_blocks"] == 0
    assert data["bytes_free"] == data["capacity_bytes"] - 2 * client.block_bytes


def test_stats_show_the_transfer_service(server: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.native import blockcopy

    tokens = list(range(client.block_tokens * 2))
    blocks = [os.urandom(client.block_bytes) for _ in range(2)]
    client.put(tokens, blocks)
    with client.transfer(path="shm") as session:
        region = session.register(3 * client.block_bytes)
        session.fetch([*client.hashes(tokens), b"\x09" * 32], region)
        assert main(["stats", "--target", server.target, "--json"]) == 0
        transfer = json.loads(capsys.readouterr().out)["transfer"]
        assert transfer["copy_loop"] == ("native" if blockcopy.NATIVE else "python")
        assert (transfer["sessions"], transfer["regions"], transfer["mapped_bytes"]) == (1, 1, 3 * client.block_bytes)
        assert (transfer["read_batches"], transfer["descriptors_done"], transfer["descriptors_missing"]) == (1, 2, 1)
        assert transfer["bytes_moved"] == 2 * client.block_bytes and transfer["descriptors_failed"] == 0
    assert main(["stats", "--target", server.target]) == 0
    table = capsys.readouterr().out
    assert "\nTransfer\n" in table and "Sessions open" in table and re.search(r"Descriptors done +2\n", table)
    assert "Refresh failures" in table and "Descriptors in flight" in table


def _row(table: str, label: str) -> str:
    """The value a `kvstore stats` table shows beside `label` ('' when the row is absent)."""
    found = re.search(rf"^  {re.escape(label)} +(\S+)$", table, re.MULTILINE)
    return found.group(1) if found else ""


def test_stats_show_the_request_rings(server: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
    with client.transfer(path="shm") as session:
        region = session.register(2 * client.block_bytes)
        assert session.ring is not None, session.ring_reason
        session.fetch(client.hashes(tokens), region)
        session.fetch(client.hashes(tokens)[:1], region)
        stats = client.transfer_stats()
        assert (stats.rings, stats.ring_requests) == (1, 2)
        assert main(["stats", "--target", server.target]) == 0
    table = capsys.readouterr().out
    assert _row(table, "Request rings mapped") == "1" and _row(table, "Ring requests answered") == "2"
    assert _row(table, "Bulk transport sessions") == "0" and _row(table, "Bulk fetches answered") == "0"


def _bulk_engine_missing() -> str:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # the package absent, or libibverbs missing
        return f"mooncake-transfer-engine cannot run here ({exc}); pip install '.[bulk]', apt-get install libibverbs1"
    return ""


@pytest.mark.skipif(bool(_bulk_engine_missing()), reason=_bulk_engine_missing())
def test_stats_show_the_bulk_transport(start_server: Any, store_settings: Any,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.client import Client
    from kvstore.config import TransferSettings

    # Two blocks a BulkFetch: a fetch of five blocks takes three calls.
    server = start_server(store_settings, transfer=TransferSettings(bulk="mooncake", bulk_max_blocks=2,
                                                                    bulk_staging_bytes=1 << 20))
    with Client(server.target) as client:
        tokens = list(range(client.block_tokens * 5))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(5)])
        with client.transfer(path="bulk") as session:
            region = session.register(5 * client.block_bytes)
            assert session.bulk is not None, session.bulk_reason
            assert session.fetch(client.hashes(tokens), region, batch_descriptors=5).done_prefix == 5
            stats = client.transfer_stats()
            assert (stats.bulk_sessions, stats.bulk_fetches, stats.bulk_staged) == (1, 3, 0) and stats.bulk_lanes >= 1
            assert main(["stats", "--target", server.target]) == 0
            table = capsys.readouterr().out
            assert main(["stats", "--target", server.target, "--json"]) == 0
            transfer = json.loads(capsys.readouterr().out)["transfer"]
    assert _row(table, "Bulk transport sessions") == "1" and _row(table, "Bulk fetches answered") == "3"
    assert _row(table, "Bulk fetches through staging") == "0" and _row(table, "Bulk lanes") == str(stats.bulk_lanes)
    assert (transfer["bulk_sessions"], transfer["bulk_fetches"], transfer["bulk_lanes"]) == (1, 3, stats.bulk_lanes)
    assert _row(table, "Descriptors done") == "5"  # the bulk transport's blocks are counted with the batches


def test_stats_on_an_empty_store_has_no_rates(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lookup_hit_rate"] is None and data["headroom_hours"] is None


def test_stats_names_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["stats", "--target", f"127.0.0.1:{port}", "--timeout", "2"]) == 2
    assert "Unavailable" in capsys.readouterr().err


def test_bench_lists_its_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "store" in out and "codec" in out


# -- errors, pipes and start-up failures through the real command (issue 9 item 17) ---------------


def _kvstore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_stats_into_a_closed_pipe_exits_quietly(server: Any, flags: list[str]) -> None:
    """`kvstore stats | head -3`: the reader is gone before the table is written; no traceback.

    stdout is buffered, as for a user (no PYTHONUNBUFFERED): what is printed reaches the pipe when
    flushed, at the end of the command or at exit.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "stats", "--target", server.target, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as head does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert err == ""


def test_stats_through_head_has_no_traceback(server: Any, tmp_path: Path) -> None:
    err = tmp_path / "err"
    shell = f"unset PYTHONUNBUFFERED; {sys.executable} -m kvstore.cli stats --target {server.target} 2>{err} | head -3"
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60).stdout
    assert out.splitlines()[0] == f"kvstore at {server.target}" and len(out.splitlines()) == 3
    assert err.read_text() == ""


def test_stats_json_against_a_dead_server_is_one_json_error() -> None:
    run = _kvstore("stats", "--target", f"127.0.0.1:{_free_port()}", "--timeout", "2", "--json")
    assert run.returncode == 2
    error = json.loads(run.stdout)["error"]
    assert (error["code"], error["type"], error["retryable"]) == ("UNAVAILABLE", "Unavailable", True)
    assert error["message"] and run.stderr == ""


def test_stats_json_with_a_bad_timeout_is_one_json_error() -> None:
    run = _kvstore("stats", "--target", "127.0.0.1:1", "--timeout", "-1", "--json")
    assert run.returncode == 2
    assert json.loads(run.stdout)["error"]["code"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(("config", "flags", "says"), [
    ("", ["--port", "99999"], "server.port = 99999 is out of range: allowed [0, 65535]"),
    ("[store]\nretention_hours = nan\n", [], "store.retention_hours = nan is out of range"),
    ("[swa]\nttl_s = inf\n", [], "swa.ttl_s = inf is out of range"),
    ("[server]\ncolour = 1\n", [], "unknown setting(s) in [server]: colour"),
])
def test_serve_refuses_bad_settings_in_one_line(tmp_path: Path, config: str, flags: list[str], says: str) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(config)
    run = _kvstore("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "store"), *flags)
    assert run.returncode == 2 and "listening" not in run.stdout
    assert run.stderr.splitlines() == [run.stderr.strip()] and run.stderr.startswith("kvstore: ConfigError: ")
    assert says in run.stderr


def test_serve_on_a_data_dir_that_is_a_file_says_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("not a folder")
    run = _kvstore("serve", "--port", "0", "--data-dir", str(tmp_path / "store"))
    assert run.returncode == 2 and "Traceback" not in run.stderr and "listening" not in run.stdout
    assert len(run.stderr.strip().splitlines()) == 1 and str(tmp_path / "store") in run.stderr


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path) -> None:
    first = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                              str(tmp_path / "one")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first.stdout is not None
        match = re.search(r"listening on [\d.]+:(\d+)", first.stdout.readline())
        assert match, "the first kvstore serve did not start"
        port = match.group(1)
        run = _kvstore("serve", "--port", port, "--data-dir", str(tmp_path / "two"))
        assert run.returncode == 1 and "listening" not in run.stdout
        assert run.stderr.splitlines() == [f"kvstore: cannot listen on 127.0.0.1:{port}: port {port} is in use by "
                                           "another process (stop it, or give --port another port; 0 picks a "
                                           "free one)"]
        assert not (tmp_path / "two").exists()  # refused before the store was opened
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_error_dict_names_os_errors() -> None:
    from kvstore.cli import error_dict

    err = error_dict(FileNotFoundError(2, "No such file or directory", "x"))["error"]
    assert err["code"] == "ENOENT" and err["type"] == "FileNotFoundError"  # type: ignore[index]


# -- kvstore check (issue 9 item 15; the walk is tiers.integrity) --------------------------------


def _stored(start_server: Any, loop_thread: Any, store_settings: Any, blocks: int = 3) -> Path:
    """A data dir holding one chain of `blocks`, its server stopped."""
    from kvstore.client import Client

    srv = start_server(store_settings)
    with Client(srv.target) as c:
        c.put(list(range(c.block_tokens * blocks)), [os.urandom(c.block_bytes) for _ in range(blocks)])
    loop_thread.run(srv.stop(0))
    return Path(store_settings.data_dir)


def _drop_first_meta(data_dir: Path) -> None:
    """Delete the meta record of the chain's first block: the blocks below it become orphans."""
    import lmdb

    from kvstore.native.records import META_TAG

    env = lmdb.open(str(data_dir), max_dbs=8)
    try:
        records = env.open_db(b"records", create=False)
        with env.begin(write=True, db=records) as txn:
            metas = [bytes(k) for k, _ in txn.cursor() if bytes(k).endswith(META_TAG) and len(k) == 49]
            first = metas[0]
            for key in metas:  # the chain's root: no other block lists it as a child
                if not any(txn.get(parent[:-1] + b"c" + key[16:48]) for parent in metas):
                    first = key
            assert txn.delete(first)
    finally:
        env.close()


def test_check_a_sound_store(start_server: Any, loop_thread: Any, store_settings: Any) -> None:
    pytest.importorskip("tiers.integrity")
    data_dir = _stored(start_server, loop_thread, store_settings)
    run = _kvstore("check", "--data-dir", str(data_dir))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout
    assert run.stderr == ""  # stderr is a pipe here: no progress bar frames to glue to anything
    run = _kvstore("check", "--data-dir", str(data_dir), "--json")
    assert run.returncode == 0 and "kvstore check" not in run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is True and report["blocks_checked"] == 3


def test_check_finds_problems_and_repair_fixes_them(start_server: Any, loop_thread: Any,
                                                    store_settings: Any) -> None:
    pytest.importorskip("tiers.integrity")
    data_dir = _stored(start_server, loop_thread, store_settings)
    _drop_first_meta(data_dir)
    run = _kvstore("check", "--data-dir", str(data_dir), "--json")
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["ok"] is False
    run = _kvstore("check", "--data-dir", str(data_dir))
    assert run.returncode == 1 and "--repair" in run.stdout
    run = _kvstore("check", "--data-dir", str(data_dir), "--repair", "--no-progress")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr == ""
    assert _kvstore("check", "--data-dir", str(data_dir)).returncode == 0


@pytest.mark.parametrize("json_flag", [False, True])
def test_check_a_data_dir_that_does_not_exist(tmp_path: Path, json_flag: bool) -> None:
    run = _kvstore("check", "--data-dir", str(tmp_path / "nowhere"), *(["--json"] if json_flag else []))
    assert run.returncode == 2
    if json_flag:
        error = json.loads(run.stdout)["error"]
        assert error["type"] == "ConfigError" and f"{tmp_path / 'nowhere'} does not exist" in error["message"]
    else:
        assert run.stderr.startswith("kvstore: ConfigError: data dir") and "does not exist" in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_check_a_store_with_damaged_headers_could_not_be_checked(start_server: Any, loop_thread: Any,
                                                                 store_settings: Any) -> None:
    data_dir = _stored(start_server, loop_thread, store_settings)
    with (data_dir / "data.mdb").open("r+b") as f:
        f.write(bytes(2 * 4096))  # both LMDB meta pages
    run = _kvstore("check", "--data-dir", str(data_dir), "--no-progress")
    assert run.returncode == 2 and "cannot check" in run.stdout


def test_check_a_file_is_not_a_data_dir(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    run = _kvstore("check", "--data-dir", str(tmp_path / "f"))
    assert run.returncode == 2 and "is not a folder" in run.stderr


def test_check_an_empty_folder_holds_no_store(tmp_path: Path) -> None:
    pytest.importorskip("tiers.integrity")
    run = _kvstore("check", "--data-dir", str(tmp_path), "--json")
    assert run.returncode == 2 and json.loads(run.stdout)["error"]["code"] == "FAILED_PRECONDITION"


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, so the progress bar draws into it."""

    def isatty(self) -> bool:
        return True


def test_check_draws_its_last_count_on_a_terminal(start_server: Any, loop_thread: Any, store_settings: Any,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The real bar, on a stderr that is a terminal: its last frame shows every record walked."""
    pytest.importorskip("tiers.integrity")
    data_dir = _stored(start_server, loop_thread, store_settings, blocks=2)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["check", "--data-dir", str(data_dir)]) == 0
    frames = [f.strip() for f in terminal.getvalue().split("\r") if f.strip()]
    assert frames and frames[-1].startswith("kvstore check: records: 100%"), frames
    walked = re.search(r"(\d+)/(\d+) \[", frames[-1])
    assert walked and walked.group(1) == walked.group(2) != "0", frames[-1]
    assert "OK" in capsys.readouterr().out


def test_stats_show_blocks_of_a_geometry_no_longer_served(start_server: Any, store_settings: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Blocks an earlier codec wrote (another fingerprint) show under their own until they age out."""
    from kvstore.client import Client
    from kvstore.prefix import BlockScope, chain_hashes, root_hash
    from tiers.lmdb_tier import LmdbBlockTier

    old = bytes.fromhex("2d76cb51b8017512")
    tier = LmdbBlockTier(store_settings)
    hashes = chain_hashes(list(range(48)), block_tokens=16, parent=root_hash(old, 16))
    tier.put(BlockScope(old, "default"), root_hash(old, 16), hashes, [b"o" * 100] * 3, True)
    tier.close()
    srv = start_server(store_settings)
    with Client(srv.target) as c:
        c.put(list(range(c.block_tokens)), [os.urandom(c.block_bytes)])
        served = c.geometry
    assert main(["stats", "--target", srv.target]) == 0
    table = capsys.readouterr().out
    assert "\nStored by geometry\n" in table
    assert re.search(rf"  {served} +1 block, ", table)  # one block, in the singular
    assert re.search(r"  2d76cb51b8017512 \(not served: ages out\) +3 blocks, 300 bytes", table)
    assert main(["stats", "--target", srv.target, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["stored_by_geometry"]
    assert [(r["name"], r["blocks_stored"]) for r in rows] == [(served, 1), (None, 3)]
    assert rows[1]["fingerprint"] == old.hex() and rows[1]["bytes_stored"] == 300


def test_the_worker_is_not_called_a_gpu_worker_when_it_defaults_to_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import LAZY_COMMANDS, build_parser

    worker_help = LAZY_COMMANDS["worker"][1]
    args = build_parser(["worker"]).parse_args(["worker"])
    assert args.device == "cpu" and "GPU" not in worker_help and "CPU by default" in worker_help


def test_serve_counts_one_copy_thread_in_the_singular(tmp_path: Path) -> None:
    env = {**os.environ, "KVSTORE_TRANSFER_COPY_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                             str(tmp_path / "store")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # the start lines, up to the copy loop's
            lines.append(line)
            if "transfer copies" in line:
                break
        assert lines and "1 thread" in lines[-1] and "1 threads" not in lines[-1], lines
    finally:
        proc.terminate()
        proc.wait(timeout=60)
