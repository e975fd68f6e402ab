"""The server's own trace (`[trace]`, gateway/trace_recorder.py): its bounds on disk (rotation, the cap on
bytes), and that it never holds a call: a stalled disk drops records, counted, while every call is answered."""

from __future__ import annotations

import asyncio
import os
import selectors
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gateway.trace_recorder import TraceRecorder
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, TraceSettings
from kvstore.errors import ConfigError
from kvstore.prefix import FINGERPRINT_BYTES, BlockScope
from kvstore.trace import recorded
from tests.waiting import DEADLINE_S, wait_until

SCOPE = BlockScope(b"\x01" * FINGERPRINT_BYTES, "acme")


def _metric(srv: Any, name: str) -> float:
    for line in generate_latest(srv.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no series {name}")


async def until(holds: Callable[[], bool], what: str) -> None:
    """Return once `holds()` is true, giving the writer its turns on the loop; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not holds():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S:g} s"
        await asyncio.sleep(0.001)


def _handled(rec: TraceRecorder, n: int) -> bool:
    return rec.stats.written_records + rec.stats.dropped_records == n


async def _record_puts(folder: Path, settings: TraceSettings, puts: int, *, blocks: int = 32) -> TraceRecorder:
    """A recorder on `folder` told of `puts` Puts of random hashes, each written before the next is told."""
    rec = TraceRecorder(settings, folder=folder, block_tokens=64, node="n1", clock=ManualClock())
    await rec.start()
    for i in range(puts):
        rec.put(SCOPE, [os.urandom(32) for _ in range(blocks)], written=blocks, existing=0, evicted_blocks=0,
                evicted_bytes=0)
        await until(partial(_handled, rec, i + 1), "the record written")
    await rec.close()
    return rec


SMALL = TraceSettings(enabled=True, file_bytes=8192, max_bytes=24576, hash_bytes=32, flush_s=0, level=1)


def test_files_rotate_at_file_bytes_and_the_oldest_go_to_stay_under_max_bytes(tmp_path: Path) -> None:
    rec = asyncio.run(_record_puts(tmp_path, SMALL, 60))
    files = recorded.trace_files(tmp_path)
    s = rec.stats
    assert s.dropped_records == 0 and s.written_records == 60
    assert s.files_written > len(files) >= 2 and s.files_removed == s.files_written - len(files)
    assert sum(p.stat().st_size for p in files) <= SMALL.max_bytes
    assert all(p.stat().st_size <= SMALL.file_bytes for p in files)
    # The newest files are the ones kept, each whole: a header, then its records.
    assert [int(p.name.split("-")[1]) for p in files] == list(range(s.files_written - len(files) + 1,
                                                                    s.files_written + 1))
    kept = [r for _, _, r in recorded.records(tmp_path)]
    assert 0 < len(kept) < 60 and all(r["op"] == "put" and len(r["hashes"]) == 32 * 64 for r in kept)


def test_files_already_in_the_folder_count_toward_the_cap_and_numbering_goes_on(tmp_path: Path) -> None:
    first = asyncio.run(_record_puts(tmp_path, SMALL, 20))
    before = recorded.trace_files(tmp_path)
    second = asyncio.run(_record_puts(tmp_path, SMALL, 20))
    after = recorded.trace_files(tmp_path)
    assert sum(p.stat().st_size for p in after) <= SMALL.max_bytes
    assert int(after[-1].name.split("-")[1]) == first.stats.files_written + second.stats.files_written
    assert before[0] not in after  # the older run's oldest file went first


def test_a_batch_larger_than_the_cap_is_dropped_and_counted(tmp_path: Path) -> None:
    tiny = TraceSettings(enabled=True, file_bytes=4096, max_bytes=4096, hash_bytes=32, flush_s=0, level=1)
    rec = asyncio.run(_record_puts(tmp_path, tiny, 1, blocks=400))  # ~26 KB of random hex: no room
    assert rec.stats.dropped_records == 1 and rec.stats.written_records == 0
    assert sum(p.stat().st_size for p in recorded.trace_files(tmp_path)) <= tiny.max_bytes


def test_settings_refuse_a_file_larger_than_the_cap() -> None:
    with pytest.raises(ConfigError, match=r"trace\.file_bytes = 8192 is more than trace\.max_bytes = 4096"):
        TraceSettings(file_bytes=8192, max_bytes=4096)
    with pytest.raises(ConfigError, match=r"trace\.hash_bytes = 2 is out of range"):
        TraceSettings(hash_bytes=2)


def test_off_by_default_no_folder_and_zero_series(start_server: Callable[..., Any],
                                                  store_settings: StoreSettings) -> None:
    srv = start_server(store_settings)
    assert not srv.trace.enabled
    assert not (store_settings.data_dir / "trace").exists()
    assert _metric(srv, "kvstore_trace_written_records_total") == 0


def test_stats_shows_the_trace_counters_moving(start_server: Callable[..., Any], store_settings: StoreSettings,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvstore.cli import main
    from kvstore.client import Client

    srv = start_server(store_settings, trace=TraceSettings(enabled=True, flush_s=0))

    def shown() -> dict[str, Any]:
        assert main(["stats", "--target", srv.target, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["trace"]  # type: ignore[no-any-return]

    before = shown()
    assert before["enabled"] and before["written_records"] == 0 and before["dropped_records"] == 0
    with Client(srv.target) as client:
        tokens = list(range(client.block_tokens * 2))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
        assert client.lookup(tokens).found_blocks == 2
    wait_until(lambda: srv.trace.stats.written_records == 2, "the Put's and the Lookup's records written")
    after = shown()
    assert after["written_records"] == 2 and after["dropped_records"] == 0 and after["files_written"] == 1
    assert after["written_bytes"] == srv.trace.stats.written_bytes > 0 and after["bytes_on_disk"] > 0
    # the same counters as the Prometheus series
    assert _metric(srv, "kvstore_trace_written_records_total") == 2
    assert _metric(srv, "kvstore_trace_written_files_total") == 1
    assert _metric(srv, "kvstore_trace_written_bytes_total") == after["written_bytes"]
    assert main(["stats", "--target", srv.target]) == 0
    text = capsys.readouterr().out
    assert "Records written" in text and "Records dropped" in text


def test_stats_says_the_trace_is_off(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main

    assert main(["stats", "--target", server.target]) == 0
    assert "Trace ([trace]): off" in capsys.readouterr().out


def test_a_stalled_disk_drops_records_and_every_call_is_answered(start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings) -> None:
    from kvstore.client import Client

    settings = TraceSettings(enabled=True, queue_records=4, flush_s=0)
    srv = start_server(store_settings, trace=settings)
    released = threading.Event()
    stalled = threading.Event()

    async def stalled_disk() -> None:  # the write waits for the test, as a hung disk would
        stalled.set()
        await asyncio.to_thread(released.wait, 60)

    srv.trace.before_write = stalled_disk
    calls = 20
    try:
        with Client(srv.target) as client:
            tokens = list(range(client.block_tokens * 3))
            client.put(tokens, [os.urandom(client.block_bytes) for _ in range(3)])
            wait_until(stalled.is_set, "the writer reached the stalled disk")
            hashes = client.hashes(tokens)
            for _ in range(calls):
                assert client.get_hashes(hashes).blocks[-1] is not None  # answered while the disk is stalled
        s = srv.trace.stats
        assert s.written_records == 0 and not released.is_set()
        # The Put's record is in the writer's hands, 4 wait in the queue, the rest were dropped.
        assert s.queued_records == 4 and s.dropped_records == calls - 4
        assert _metric(srv, "kvstore_trace_dropped_records_total") == calls - 4
        with Client(srv.target) as client:  # `kvstore stats` shows the drops (its Stats answer's trace)
            shown = client.stats().trace
        assert shown.enabled and shown.dropped_records == calls - 4 and shown.queued_records == 4
        assert shown.written_records == 0
    finally:
        released.set()
    wait_until(lambda: srv.trace.stats.written_records == 5, "the queued records written once the disk answers")
    got = [r["op"] for _, _, r in recorded.records(store_settings.data_dir / "trace")]
    assert got == ["put", "get", "get", "get", "get"]
    assert _metric(srv, "kvstore_trace_written_records_total") == 5


def test_a_put_that_evicts_records_what_it_evicted(start_server: Callable[..., Any], tmp_path: Path,
                                                   clock: ManualClock) -> None:
    from kvstore.client import Client
    from kvstore.geometry import V4_1_FLASH

    tokens, chain = 16, 4
    block = V4_1_FLASH.block_bytes(tokens)
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=chain * block, block_tokens=tokens)
    srv = start_server(store, trace=TraceSettings(enabled=True, flush_s=0))
    with Client(srv.target) as client:
        first, second = list(range(tokens * chain)), list(range(10_000, 10_000 + tokens * chain))
        client.put(first, [os.urandom(block) for _ in range(chain)])
        clock.advance(73 * 3600.0)  # past the retention floor: the first chain may go
        client.put(second, [os.urandom(block) for _ in range(chain)])
        evicted = client.stats().evictions
        assert client.lookup(second).found_blocks == chain
        hashes = client.hashes(second)
    wait_until(lambda: srv.trace.stats.written_records == 3, "both Puts' records and the Lookup's written")
    *puts, look = [r for _, _, r in recorded.records(store.data_dir / "trace")]
    assert evicted == chain
    assert [(r["written"], r["evicted_blocks"], r["evicted_bytes"]) for r in puts] == [
        (chain, 0, 0), (chain, chain, chain * block)]
    # The hashes recorded are the chain's own, each cut to its first hash_bytes (8).
    assert puts[1]["hashes"] == look["hashes"] == "".join(h[:8].hex() for h in hashes)
    assert (look["op"], look["tenant"], look["geometry"], look["found"]) == ("lookup", "default", V4_1_FLASH.name,
                                                                             chain)


def test_a_failing_disk_drops_and_counts_the_batch_and_the_next_one_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "trace"

    async def scenario() -> TraceRecorder:
        rec = TraceRecorder(SMALL, folder=folder, block_tokens=64, node="n1", clock=ManualClock())
        await rec.start()
        folder.rmdir()
        folder.write_bytes(b"")  # where the files go is no folder now: opening one fails (ENOTDIR)

        async def told(n: int) -> None:
            rec.get(SCOPE, [os.urandom(32)], 1)
            await until(lambda: rec.stats.written_records + rec.stats.dropped_records == n, "the record handled")

        await told(1)
        assert (rec.stats.written_records, rec.stats.dropped_records) == (0, 1)
        folder.unlink()
        folder.mkdir()  # the disk is back
        await told(2)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.stats.written_records, rec.stats.dropped_records) == (1, 1)
    assert [r["op"] for _, _, r in recorded.records(folder)] == ["get"]


def test_a_name_taken_since_start_is_skipped_never_overwritten(tmp_path: Path) -> None:
    import datetime

    clock = ManualClock()
    started = datetime.datetime.fromtimestamp(clock.now(), datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    theirs = tmp_path / recorded.file_name(started, 1)

    async def scenario() -> TraceRecorder:
        rec = TraceRecorder(SMALL, folder=tmp_path, block_tokens=64, node="n1", clock=clock)
        await rec.start()
        theirs.write_bytes(b"another writer's")  # after start: the recorder's next name is taken
        rec.get(SCOPE, [os.urandom(32)], 1)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert rec.stats.written_records == 1 and theirs.read_bytes() == b"another writer's"
    assert [p.name for p in recorded.trace_files(tmp_path)] == [theirs.name, recorded.file_name(started, 2)]


# A child process, so the file size limit holds for it alone: writes past it fail (EFBIG), the first
# one after writing what fits, as a full disk does.
_FULL_DISK = r"""
import asyncio, os, resource, signal, sys
from pathlib import Path
from gateway.trace_recorder import TraceRecorder
from kvstore.clock import ManualClock
from kvstore.config import TraceSettings
from kvstore.prefix import FINGERPRINT_BYTES, BlockScope

async def main() -> None:
    folder = Path(sys.argv[1])
    rec = TraceRecorder(TraceSettings(enabled=True, hash_bytes=32, flush_s=0, level=1), folder=folder,
                        block_tokens=64, node="n1", clock=ManualClock())
    await rec.start()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
    scope = BlockScope(b"\x01" * FINGERPRINT_BYTES, "acme")
    for i in range(20):
        rec.put(scope, [os.urandom(32) for _ in range(16)], written=16, existing=0, evicted_blocks=0, evicted_bytes=0)
        while rec.stats.written_records + rec.stats.dropped_records < i + 1:
            await asyncio.sleep(0.001)
    await rec.close()
    print(rec.stats.written_records, rec.stats.dropped_records)

asyncio.run(main())
"""


def test_a_write_the_disk_cuts_short_leaves_only_whole_frames(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=DEADLINE_S, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    written, dropped = map(int, out.stdout.split())
    assert written > 0 and dropped > 0 and written + dropped == 20
    # Each file a failed write cut short was cut back to its last whole frame (the next batch went to a
    # new file): every file reads, and together they hold exactly what was written.
    files = recorded.trace_files(tmp_path)
    assert len(files) > 1 and all(p.stat().st_size <= 5000 for p in files)
    assert len([r for _, _, r in recorded.records(tmp_path)]) == written


class _Watched(selectors.DefaultSelector):
    """The loop's selector, telling a thread once the loop blocks in it (nothing to run, waiting for I/O)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.blocked = threading.Event()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.armed and (timeout is None or timeout > 0):
            self.blocked.set()
        return super().select(timeout)


def test_a_record_from_another_thread_wakes_the_idle_writer(tmp_path: Path) -> None:
    """The shared-memory sessions record on their own threads: a record told while the loop sleeps in its
    selector must wake the writer (an asyncio.Event set from another thread does not wake the loop)."""
    selector = _Watched()

    async def scenario() -> TraceRecorder:
        rec = TraceRecorder(SMALL, folder=tmp_path, block_tokens=64, node="n1", clock=ManualClock())
        await rec.start()
        written = asyncio.get_running_loop().create_future()

        async def before_write() -> None:
            if not written.done():
                written.set_result(None)

        rec.before_write = before_write

        def session_thread() -> None:
            assert selector.blocked.wait(DEADLINE_S)
            rec.swa_get(SCOPE, [b"k" * 32], found=1, via="shm")

        thread = threading.Thread(target=session_thread)
        thread.start()
        selector.armed = True
        await asyncio.wait_for(written, DEADLINE_S)  # the loop sleeps here until the record wakes it
        thread.join()
        await rec.close()
        return rec

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        rec = runner.run(scenario())
    assert (rec.stats.written_records, rec.stats.dropped_records) == (1, 0)
    [(_, _, record)] = list(recorded.records(tmp_path))
    assert record["op"] == "swa_get" and record["via"] == "shm" and record["hashes"] == (b"k" * 32).hex()


@pytest.mark.parametrize("queue_records", [100_000, 16])
def test_records_from_many_threads_are_each_written_or_counted_dropped(tmp_path: Path, queue_records: int) -> None:
    """Threads recording at once while the writer takes batches: every record is written or counted as dropped
    (none lost between a take and the next append), and a full queue drops instead of growing."""
    settings = TraceSettings(enabled=True, hash_bytes=8, flush_s=0, level=1, queue_records=queue_records)
    threads, each = 8, 500

    async def scenario() -> TraceRecorder:
        rec = TraceRecorder(settings, folder=tmp_path, block_tokens=64, node="n1", clock=ManualClock())
        await rec.start()

        def session_thread(i: int) -> None:
            scope = BlockScope(b"\x01" * FINGERPRINT_BYTES, f"tenant-{i}")
            for n in range(each):
                rec.swa_put(scope, [n.to_bytes(32, "big")], stored=1, via="shm")

        await asyncio.gather(*(asyncio.to_thread(session_thread, i) for i in range(threads)))
        await until(partial(_handled, rec, threads * each), "every record written or dropped")
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    got = [r for _, _, r in recorded.records(tmp_path)]
    assert len(got) == rec.stats.written_records and rec.stats.queued_records == 0
    assert rec.stats.written_records + rec.stats.dropped_records == threads * each
    if queue_records > threads * each:
        assert rec.stats.dropped_records == 0
        assert {r["tenant"] for r in got} == {f"tenant-{i}" for i in range(threads)}
        assert all(sum(r["tenant"] == f"tenant-{i}" for r in got) == each for i in range(threads))
