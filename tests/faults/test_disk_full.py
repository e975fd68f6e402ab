"""The disk fills under a running `kvstore serve`: Puts past the space are refused clearly, nothing
acknowledged is lost, the server keeps serving reads, and a restart finds every acknowledged block.

Two ways to run out of space, each where the host allows it:
- `tmpfs`: the data dir on a 48 MiB tmpfs mounted for the test (needs root with
  CAP_SYS_ADMIN), which another file then fills to 16 MiB free after the server
  started (so the start-up capacity check sees room, as it would in production);
  LMDB's writes then fail (ENOSPC, or a short write it reports as EIO).
- `rlimit`: RLIMIT_FSIZE on the server process (SIGXFSZ ignored), so a write past
  16 MiB fails (EFBIG, or a short write); works for any user.

A restart while the disk is still full serves everything (a store that holds
blocks starts with a warning where a new one would be refused for its
capacity); once space is freed the chain goes on.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import KVStoreError, ResourceExhausted, Unavailable

MiB = 1 << 20
FS_BYTES = 48 * MiB
#: Room left for the store once the disk is "full" (tmpfs: after the ballast; rlimit: the file size limit).
ROOM_BYTES = 16 * MiB
#: More than the room, so the disk fills before the store's own capacity does.
CAPACITY_BYTES = 32 * MiB
BLOCK_BYTES = 14240  # 16-token blocks of the default geometry
BATCH_BLOCKS = 32
#: Blocks of the chain that fills the disk: more than fit.
CHAIN_BLOCKS = 3 * ROOM_BYTES // (2 * BLOCK_BYTES)
#: Blocks past the found ones that a census checks are absent: more than a refused
#: stream can have had in flight (kvstore_servicer.PUT_STREAM_DEPTH batches and the one committing).
TAIL_BLOCKS = 8 * BATCH_BLOCKS


@dataclass
class SmallDisk:
    """Where a data dir runs out of space, and how."""

    mode: str
    data_dir: Path
    #: RLIMIT_FSIZE of the server (rlimit mode), else None.
    file_size_limit_bytes: int | None
    #: Fill the disk to ROOM_BYTES free (tmpfs mode); a no-op for rlimit.
    fill_from_outside: Callable[[], None]
    #: Give the space back (tmpfs mode: drop the ballast; rlimit: a higher limit for the next server).
    free_space: Callable[[], None]


def _mount_tmpfs(where: Path) -> str | None:
    """Mount a FS_BYTES tmpfs at `where`; None when done, else why it cannot be."""
    where.mkdir(parents=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if done.returncode == 0 else f"mount -t tmpfs is not permitted here: {done.stderr.strip()}"


@pytest.fixture(params=["tmpfs", "rlimit"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SmallDisk]:
    """A data dir that runs out of space at about ROOM_BYTES."""
    if request.param == "rlimit":
        disk = SmallDisk(mode="rlimit", data_dir=tmp_path / "data", file_size_limit_bytes=ROOM_BYTES,
                         fill_from_outside=lambda: None, free_space=lambda: None)

        def raise_limit() -> None:
            # Room again: the next server starts with the store's capacity as its file size limit. Kept at
            # ROOM_BYTES, "room" would be whatever free pages the full file happened to hold (none, at times:
            # the chain's next Put then failed with EIO in a clean-clone CI run).
            disk.file_size_limit_bytes = FS_BYTES

        disk.free_space = raise_limit
        yield disk
        return
    mnt = tmp_path / "small-fs"
    why = _mount_tmpfs(mnt)
    if why is not None:
        pytest.skip(f"{why} (the rlimit variant covers a full disk instead)")
    ballast = mnt / "ballast"

    def fill() -> None:
        with open(ballast, "wb") as f:
            f.write(bytes(FS_BYTES - ROOM_BYTES - MiB))  # the disk's other tenant; what is left is the room

    try:
        yield SmallDisk(mode="tmpfs", data_dir=mnt / "data", file_size_limit_bytes=None, fill_from_outside=fill,
                        free_space=lambda: ballast.unlink(missing_ok=True))
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)  # a child still holds it


def _start(serve: Callable[..., Any], disk: SmallDisk, cfg: Path) -> Any:
    return serve(disk.data_dir, config=cfg, file_size_limit_bytes=disk.file_size_limit_bytes)


def _fill_until_refused(client: Any, chain: Any) -> KVStoreError:
    """Stream the chain (a PutStream: batches commit in groups) until the server refuses a batch.

    `chain.acked` counts the blocks of the batches answered before the refusal.
    """
    def acked(n: int) -> None:
        chain.acked += n

    try:
        client.put(chain.tokens, chain.payload(), batch_blocks=BATCH_BLOCKS, on_batch=acked)
    except KVStoreError as exc:
        return exc
    pytest.fail(f"{chain.blocks} blocks fit: the disk never filled")


def _put_more(client: Any, chain: Any, other: Any) -> list[KVStoreError]:
    """After the first refusal, unary Puts: one block more on the chain, one on a new chain; the refusals."""
    refusals: list[KVStoreError] = []
    for target, n in ((chain, chain.acked), (other, 0)):
        try:
            client.put(target.tokens[: (n + 1) * client.block_tokens], [target.block(n)], first_block=n)
            target.acked = n + 1
        except KVStoreError as exc:
            refusals.append(exc)
    return refusals


def _run_until_full(serve: Callable[..., Any], disk: SmallDisk, cfg: Path, kit: Any
                    ) -> tuple[Any, list[Any], list[KVStoreError]]:
    server = _start(serve, disk, cfg)
    disk.fill_from_outside()
    with server.client() as client:
        chain, other = kit.make_chains(client, 2, CHAIN_BLOCKS)
        refusals = [_fill_until_refused(client, chain)]
        refusals += _put_more(client, chain, other)
    assert server.alive, server.log()
    return server, [chain, other], refusals


def _clear(refusal: KVStoreError) -> bool:
    """Whether a refusal says what happened: no room (RESOURCE_EXHAUSTED or UNAVAILABLE), in words."""
    return (isinstance(refusal, (ResourceExhausted, Unavailable))
            and re.search(r"disk|space|full|file size", refusal.message, re.IGNORECASE) is not None)


def test_disk_full_refuses_clearly_loses_nothing_acknowledged_and_keeps_serving(
        small_disk: SmallDisk, serve: Callable[..., Any], config: Callable[..., Path], kit: Any) -> None:
    cfg = config(store={"capacity_bytes": CAPACITY_BYTES})
    server, chains, refusals = _run_until_full(serve, small_disk, cfg, kit)
    assert chains[0].acked * BLOCK_BYTES > ROOM_BYTES // 2, f"refused long before the disk was full: {refusals[0]!r}"
    with server.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains, tail=TAIL_BLOCKS))
        assert client.lookup(chains[0].tokens).found_blocks >= chains[0].acked
    assert server.alive, server.log()
    status = server.stop()
    assert status == 0, f"a clean stop on a full disk exited {status}:\n{server.log()}"

    # Restarted with the disk still full: a store holding blocks starts (with a warning), so what
    # was acknowledged stays readable.
    full = _start(serve, small_disk, cfg)
    with full.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains, tail=TAIL_BLOCKS))
    assert full.stop() == 0, full.log()

    small_disk.free_space()
    again = _start(serve, small_disk, cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains, tail=TAIL_BLOCKS))
        # With room again, the chain goes on.
        chain = chains[0]
        n = chain.acked
        client.put(chain.tokens[: (n + 1) * client.block_tokens], [chain.block(n)], first_block=n)
        chain.acked = n + 1
        kit.assert_usage_matches(client, kit.census(client, chains, tail=TAIL_BLOCKS))

    # Each refusal named the lack of room (LMDB reports a write the full disk cut short as EIO:
    # it was once answered DATA_LOSS "met a damaged page", sending operators to `kvstore check`).
    assert [f"{type(r).__name__}: {r.message}" for r in refusals if not _clear(r)] == []
