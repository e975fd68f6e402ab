"""No client action may crash the server: regions are memfds sealed against
shrinking (safety rule 5, docs/TRANSFER.md), mapped without touching their pages.
Each test runs a real `kvstore serve` process, so a SIGBUS would show as its death."""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client import Client
from kvstore.region import NONCE_BYTES, Region
from kvstore.transfer import Descriptor, Status
from kvstore.v1 import transfer_pb2 as pb

MiB = 1 << 20


class Serve:
    """A `kvstore serve` child process on a free port."""

    def __init__(self, data_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        assert match, f"no address in {line!r}"
        self.target = f"127.0.0.1:{match.group(1)}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        """The server's resident memory (VmRSS), shared-memory pages included."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    server = Serve(tmp_path / "data")
    yield server
    server.proc.kill()
    server.proc.wait(timeout=30)


def stored(client: Client, n: int) -> tuple[list[int], list[bytes]]:
    tokens = list(range(5, 5 + n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return tokens, blocks


def an_unsealed_memfd(size: int) -> tuple[str, int, bytes]:
    """What a hostile (or old) client registers: a memfd it may still shrink. (name, fd, nonce)."""
    name = f"kvstore-{uuid.uuid4().hex}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    nonce = os.urandom(NONCE_BYTES)
    os.pwrite(fd, nonce, 0)
    return name, fd, nonce


def test_rule_5_a_registered_region_cannot_be_shrunk_and_batches_still_run(serve: Serve) -> None:
    with Client(serve.target) as client, client.transfer(path="shm") as session:
        tokens, blocks = stored(client, 4)
        size = client.block_bytes
        # Registered by hand, so the test still holds the region's descriptor.
        region = Region(4 * size)
        nonce = region.write_nonce()
        pid, fd = region.handle
        reply = session.stub.RegisterRegion(pb.RegisterRegionRequest(
            session_id=session.session_id, shm_name=region.name, size_bytes=region.size_bytes, nonce=nonce,
            pid=pid, fd=fd))
        assert reply.shared, reply.reason
        region.region_id, region.shared = reply.region_id, True
        session.regions[region.region_id] = region
        for victim in (fd, os.open(f"/proc/self/fd/{fd}", os.O_RDWR)):  # a reopened descriptor too
            with pytest.raises(PermissionError):
                os.ftruncate(victim, 0)  # EPERM: F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8 * size)  # EPERM: F_SEAL_GROW
        # READ, then WRITE batches on the region: the server copies and lives.
        state = session.fetch(client.hashes(tokens), region)
        assert state.done_prefix == 4 and bytes(region.view) == b"".join(blocks)
        more = list(range(7_000, 7_000 + 2 * client.block_tokens))
        written = session.write(more, [Descriptor(region_id=region.region_id, offset_bytes=i * size,
                                                  length_bytes=size) for i in range(2)]).wait(timeout_s=30)
        assert written.count(Status.DONE) == 2
        assert serve.alive() and client.stats().blocks_stored == 6


def test_rule_5_an_unsealed_region_is_refused_and_shrinking_it_harms_nothing(serve: Serve) -> None:
    with Client(serve.target) as client, client.transfer(path="shm") as session:
        tokens, _ = stored(client, 2)
        name, fd, nonce = an_unsealed_memfd(2 * client.block_bytes)
        try:
            with pytest.raises(grpc.RpcError) as info:
                session.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=session.session_id, shm_name=name, size_bytes=2 * client.block_bytes, nonce=nonce,
                    pid=os.getpid(), fd=fd))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "not sealed against shrinking (F_SEAL_SHRINK)" in (info.value.details() or "")
            os.ftruncate(fd, 0)  # what killed the server with SIGBUS when it mapped such a region
        finally:
            os.close(fd)
        region = session.register(2 * client.block_bytes)
        assert session.fetch(client.hashes(tokens), region).done_prefix == 2
        assert serve.alive()


def test_rule_5_a_file_that_is_not_a_memfd_is_not_mapped(serve: Serve, tmp_path: Path) -> None:
    # A plain file (as the old /dev/shm segments were) cannot be sealed: the server never maps it.
    with Client(serve.target) as client, client.transfer(path="auto") as session:
        path = tmp_path / f"kvstore-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 4096)
            nonce = os.urandom(NONCE_BYTES)
            os.pwrite(fd, nonce, 0)
            reply = session.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=session.session_id, shm_name=path.name, size_bytes=4096, nonce=nonce,
                pid=os.getpid(), fd=fd))
            assert not reply.shared and "no memfd" in reply.reason
        finally:
            os.close(fd)
        assert serve.alive() and client.stats().blocks_stored == 0


def test_rule_5_a_hugetlb_memfd_is_refused(serve: Serve) -> None:
    # Huge pages can run out at fault time, which is SIGBUS too.
    name = f"kvstore-{uuid.uuid4().hex}"
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(fd, 2 * MiB)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except OSError as exc:
        pytest.skip(f"no hugetlb memfd here: {exc}")
    try:
        with Client(serve.target) as client, client.transfer(path="shm") as session:
            with pytest.raises(grpc.RpcError) as info:
                session.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=session.session_id, shm_name=name, size_bytes=2 * MiB, nonce=bytes(NONCE_BYTES),
                    pid=os.getpid(), fd=fd))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ordinary pages" in (info.value.details() or "")
    finally:
        os.close(fd)
    assert serve.alive()


def test_registering_a_large_sparse_region_commits_no_memory_in_the_server(serve: Serve) -> None:
    with Client(serve.target) as client, client.transfer(path="shm") as session:
        tokens, blocks = stored(client, 2)
        before = serve.rss_bytes()
        region = session.register(1024 * MiB)
        after = serve.rss_bytes()
        assert after - before < 32 * MiB, f"registering 1 GiB grew the server by {(after - before) / MiB:.0f} MiB"
        # A fetch touches only the pages its descriptors name, here at the region's far end.
        offset = region.size_bytes - 2 * client.block_bytes
        assert session.fetch(client.hashes(tokens), region, offset_bytes=offset).done_prefix == 2
        assert bytes(region.view[offset:]) == b"".join(blocks)
        assert serve.rss_bytes() - before < 32 * MiB
        assert mmap.PAGESIZE <= 64 * 1024  # the bound above holds with room for any page size


def test_registration_names_a_process_the_server_cannot_see_as_not_shared(serve: Serve) -> None:
    with Client(serve.target) as client, client.transfer(path="auto") as session:
        name, fd, nonce = an_unsealed_memfd(4096)
        try:
            reply = session.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=session.session_id, shm_name=name, size_bytes=4096, nonce=nonce,
                pid=(1 << 22) + 1, fd=fd))  # above Linux's largest pid: as from another host
        finally:
            os.close(fd)
        assert not reply.shared and reply.reason


def test_rule_5_the_server_opens_nothing_but_the_memfd_it_was_named(monkeypatch: pytest.MonkeyPatch,
                                                                    client: Client) -> None:
    # A client may point the server at any descriptor it holds (a FIFO, a device):
    # the server reads the link first and opens only a memfd of the name it was sent.
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    read_end, write_end = os.pipe()
    try:
        with client.transfer(path="auto") as session:
            monkeypatch.setattr(os, "open", spy)
            reply = session.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=session.session_id, shm_name=f"kvstore-{uuid.uuid4().hex}", size_bytes=4096,
                nonce=bytes(NONCE_BYTES), pid=os.getpid(), fd=write_end))
            monkeypatch.undo()
        assert not reply.shared and "no memfd" in reply.reason
        assert not [p for p in opened if p.startswith("/proc/")], f"the server opened {opened}"
    finally:
        os.close(read_end)
        os.close(write_end)
