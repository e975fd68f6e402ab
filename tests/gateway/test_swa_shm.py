"""The SWA shared-memory path (embedded pool) against a real `kvstore serve` child, real memfds and sockets.

docs/SWA_POOL.md "Shared-memory path": a same-host client copies snapshots in
and out of its tenant's arena itself; the gateway keeps keys, TTLs, sizes, the
cap, quotas and hit counts. Each rule has a test here; the server is a child
process (tests/children.py) whose clock the test moves (SKEWED_CLOCK).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore import api_tokens
from kvstore.client import Client, SwaClient
from kvstore.client import swa_shm as client_shm
from kvstore.client.admin import AdminClient
from kvstore.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from kvstore.native import swa_digest
from kvstore.prefix import namespace_id
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tests.children import SKEWED_CLOCK, Child, ServerClock
from tests.shm_attacks import routes_as_nobody, routes_that_write

ATTACKS = Path(__file__).parents[1] / "shm_attacks.py"

RW = frozenset({"read", "write"})
TOKENS = list(range(300))
SNAP = 2_703_360  # a full window, even T (V4.1-Flash)


@dataclass
class Server:
    """A served store with tenants a and b (read and write), r (read only), a read-only token of a (ra)
    and an admin."""

    child: Child
    clock: ServerClock
    tokens: dict[str, str]
    data_dir: Path
    env: dict[str, str]
    logs: Path

    def client(self, who: str = "a", **kwargs: object) -> Client:
        return Client(self.child.target, token=self.tokens[who], **kwargs)  # type: ignore[arg-type]

    def restart(self) -> None:
        """Stop the child and serve the same store on the same port again (the SWA pool starts empty)."""
        port = self.child.port
        assert self.child.stop() == 0
        self.child = Child("serve", ["serve", "--port", str(port), "--data-dir", str(self.data_dir)], self.logs,
                           prelude=SKEWED_CLOCK, env=self.env)


def serve(tmp_path: Path, **swa: str) -> Server:
    data_dir = tmp_path / "store"
    data_dir.mkdir(parents=True)
    tenants = data_dir / "tenants.json"
    tokens = {who: api_tokens.create(tenants, f"tenant-{who}", RW)[1] for who in ("a", "b")}
    tokens["r"] = api_tokens.create(tenants, "tenant-r", frozenset({"read"}))[1]
    tokens["ra"] = api_tokens.create(tenants, "tenant-a", frozenset({"read"}))[1]
    tokens["admin"] = api_tokens.create(tenants, "ops", frozenset({"read", "write", "admin"}))[1]
    clock = ServerClock(tmp_path / "clock")
    env = {**clock.env, "KVSTORE_STORE_CAPACITY_BYTES": str(1 << 30), "KVSTORE_SWA_CAP_BYTES": str(256 << 20),
           **{f"KVSTORE_SWA_{k.upper()}": v for k, v in swa.items()}}
    logs = tmp_path / "logs"
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(data_dir)], logs, prelude=SKEWED_CLOCK, env=env)
    return Server(child=child, clock=clock, tokens=tokens, data_dir=data_dir, env=env, logs=logs)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = serve(tmp_path)
    yield srv
    srv.child.kill_if_alive()


def snap(client: Client, position: int = 200) -> bytes:
    return os.urandom(client.swa.snapshot_bytes(position))


def admin_stats(server: Server) -> pb.SwaStatsResponse:
    with server.client("admin") as admin:
        return admin.swa.stats()


def open_direct(client: Client) -> pb.SwaOpenDirectResponse:
    stub = pb_grpc.SwaPoolStub(client.connection.channel)
    reply: pb.SwaOpenDirectResponse = client.connection.call(stub.OpenDirect, pb.SwaOpenDirectRequest())
    return reply


class Raw:
    """A hand-driven control connection (the protocol under test, without the client's checks)."""

    def __init__(self, grant: pb.SwaOpenDirectResponse, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect("\0" + grant.shm_socket)
        self.fds: list[int] = []
        if hello:
            self.hello = self.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_HELLO, ticket=grant.shm_ticket))

    def call(self, request: pb.SwaShmRequest | bytes) -> pb.SwaShmReply:
        self.sock.sendall(request if isinstance(request, bytes) else request.SerializeToString())
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        self.fds += fds
        reply = pb.SwaShmReply()
        reply.ParseFromString(data)
        return reply

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.sock.close()


def test_round_trip_is_byte_exact_on_the_shm_path_and_shared_with_the_gateway(server: Server) -> None:
    with server.client() as c:
        swa, gateway = c.swa, SwaClient(c.connection, path="gateway")
        items = [(swa.key(TOKENS, t), t, snap(c, t)) for t in (1, 127, 128, 129, 200, 201)]
        assert swa.put_many(items).stored == 6 and swa.last_path == "shm"
        assert swa.get_many([k for k, _, _ in items]) == [d for _, _, d in items] and swa.last_path == "shm"
        assert gateway.get_many([k for k, _, _ in items]) == [d for _, _, d in items]  # the same records
        other = snap(c, 250)
        assert gateway.put(TOKENS, other, position=250).stored == 1
        assert swa.get(TOKENS, 250) == other and swa.last_path == "shm"
        assert swa.get(TOKENS, 251) is None  # never stored: a miss, not an error
        many = [(swa.key(TOKENS, t), t, snap(c, t)) for t in range(2, 72)]  # more than max_batch_snapshots (64)
        assert swa.put_many(many).stored == 70
        assert swa.get_many([k for k, _, _ in many]) == [d for _, _, d in many]
    stats = admin_stats(server)
    assert stats.hits >= 6 + 1 + 70 and stats.snapshots_put == 6 + 1 + 70


def test_shm_gets_count_as_hits_in_the_tenants_stats(server: Server) -> None:
    with server.client() as c:
        c.swa.put(TOKENS, snap(c))
        assert c.swa.get(TOKENS) is not None and c.swa.get(TOKENS, 7) is None and c.swa.last_path == "shm"
    with server.client("admin") as admin:
        tenant = next(t for t in admin.stats().tenants if t.tenant == "tenant-a")
        counts = next(w.counts for w in tenant.windows if w.window == "5m")
        assert counts.swa_snapshots_asked == 2 and counts.swa_snapshots_found == 1


def test_snapshots_expire_after_their_ttl_on_the_shm_path(server: Server) -> None:
    with server.client() as c:
        swa = c.swa
        assert swa.put(TOKENS, snap(c), position=200).stored == 1
        assert swa.put(TOKENS, snap(c), position=202, ttl_s=5).ttl_ms == 5000
        server.clock.advance(6)
        assert swa.get(TOKENS, 202) is None and swa.get(TOKENS, 200) is not None and swa.last_path == "shm"
        server.clock.advance(300)  # past the server's TTL (300 s)
        assert swa.get(TOKENS, 200) is None and swa.last_path == "shm"
        assert swa.put(TOKENS, snap(c), position=204, ttl_s=10_000).ttl_ms == 300_000  # never longer than it
    assert admin_stats(server).expirations >= 2


def test_the_cap_evicts_the_least_recently_used_on_the_shm_path(tmp_path: Path) -> None:
    srv = serve(tmp_path, cap_bytes=str(10 * SNAP))
    try:
        with srv.client() as c:
            swa = c.swa
            keys = [swa.key(TOKENS, t) for t in range(200, 240, 2)]  # 20 even T: 2 x the cap
            for key, t in zip(keys, range(200, 240, 2), strict=True):
                assert swa.put_many([(key, t, snap(c, t))]).stored == 1 and swa.last_path == "shm"
                assert swa.get_many([keys[0]])[0] is not None  # kept recently used: never evicted
            got = swa.get_many(keys)
            assert got[0] is not None and got[-1] is not None and sum(g is not None for g in got) <= 10
        stats = admin_stats(srv)
        assert stats.evictions >= 10 and stats.bytes_used <= stats.cap_bytes == 10 * SNAP
    finally:
        srv.child.kill_if_alive()


def test_sizes_and_batches_are_the_gateways_on_the_shm_path(server: Server) -> None:
    with server.client() as c:
        with pytest.raises(InvalidArgument, match="SWA snapshot at T = 200 is 2703360 bytes"):
            c.swa.put(TOKENS, b"x" * 1000, position=200)
        grant = open_direct(c)
        raw = Raw(grant)
        try:
            assert raw.hello.writable and raw.hello.max_batch == 64 and raw.hello.ttl_ms == 300_000
            begin = pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32], positions=[0])
            reply = raw.call(begin)
            assert reply.code == 3 and "positions[0]" in reply.message  # INVALID_ARGUMENT
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 31], positions=[200]))
            assert reply.code == 3 and "keys[0] is 31 bytes" in reply.message
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32] * 65, positions=[200] * 65))
            assert reply.code == 3 and "max_batch_snapshots" in reply.message
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32] * 2, positions=[200]))
            assert reply.code == 3 and "positions has 1 entries for 2 keys" in reply.message
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_COMMIT))
            assert reply.code == 9  # FAILED_PRECONDITION: nothing reserved
            ok = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32] * 2, positions=[200, 201]))
            assert ok.code == 0 and len(ok.offsets) == 2
            raw.sock.sendall(pb.SwaShmRequest(op=pb.SWA_SHM_OP_WRITTEN, index=2).SerializeToString())  # no reply
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_COMMIT))
            assert reply.code == 3 and "index 2 names no reserved snapshot" in reply.message
            assert "nothing of the batch is stored" in reply.message
            ok = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32], positions=[200]))
            raw.sock.sendall(pb.SwaShmRequest(op=pb.SWA_SHM_OP_WRITTEN, index=0, written=SNAP + 1).SerializeToString())
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_COMMIT))
            assert reply.code == 3 and f"at most its {SNAP}" in reply.message
            reply = raw.call(b"\xff\xff\xff")
            assert reply.code == 3 and "unreadable" in reply.message
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_GET, keys=[b"k" * 32]))
            assert reply.code == 0 and list(reply.offsets) == [-1]  # the uncommitted batch stored nothing
        finally:
            raw.close()
    stats = admin_stats(server)
    assert stats.items == 0 and stats.bytes_used == 0  # the aborted reservation was given back


def test_a_session_needs_a_valid_ticket(server: Server) -> None:
    with server.client() as c:
        grant = open_direct(c)
        raw = Raw(grant, hello=False)
        try:
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_GET, keys=[b"k" * 32]))
            assert reply.code == 16  # UNAUTHENTICATED: no HELLO yet
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_HELLO, ticket=b"t" * 32))
            assert reply.code == 7 and "ticket" in reply.message and not raw.fds  # PERMISSION_DENIED, no arena
        finally:
            raw.close()


def test_a_session_ends_with_its_lifetime_and_the_client_asks_again(tmp_path: Path) -> None:
    srv = serve(tmp_path, direct_user_lifetime_s="60")
    try:
        with srv.client() as c:
            data = snap(c)
            grant = open_direct(c)
            assert grant.expires_in_ms == 60_000 and grant.renew_after_ms == 30_000
            raw = Raw(grant)
            assert c.swa.put(TOKENS, data).stored == 1 and c.swa.last_path == "shm"
            srv.clock.advance(61)
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_GET, keys=[b"k" * 32]))
            assert reply.code == 7 and "ended" in reply.message
            raw.close()
            # The client's session ended too: it re-opens once and keeps to the shm path.
            assert c.swa.get(TOKENS) == data and c.swa.last_path == "shm"
    finally:
        srv.child.kill_if_alive()


def test_a_tenant_cannot_reach_another_tenants_snapshot_through_shm(server: Server) -> None:
    with server.client("a") as a, server.client("b") as b:
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1 and a.swa.last_path == "shm"
        assert b.swa.get(TOKENS) is None and b.swa.last_path == "shm"  # same key, b's scope
        assert b.swa.get_many([a.swa.key(TOKENS)]) == [None]
        # Not even the bytes are in b's arena: each tenant is handed its own.
        grant_b = open_direct(b)
        assert grant_b.tenant == "tenant-b"
        raw = Raw(grant_b)
        try:
            arena = mmap.mmap(raw.fds[0], raw.hello.arena_bytes, prot=mmap.PROT_READ)
            assert arena.find(data[:4096]) == -1
            arena.close()
        finally:
            raw.close()
        grant_a = open_direct(a)
        raw = Raw(grant_a)
        try:
            arena = mmap.mmap(raw.fds[0], raw.hello.arena_bytes, prot=mmap.PROT_READ)
            assert arena.find(data[:4096]) >= 0  # and they are in a's (the test above is not vacuous)
            arena.close()
        finally:
            raw.close()


def test_a_read_only_session_cannot_write_the_arena(server: Server) -> None:
    with server.client("a") as a, server.client("r") as r:
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1
        grant = open_direct(r)
        assert grant.offered and not grant.writable
        raw = Raw(grant)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(raw.fds[0], raw.hello.arena_bytes)  # a read-only descriptor
            reply = raw.call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[b"k" * 32], positions=[200]))
            assert reply.code == 7 and "may not write" in reply.message
        finally:
            raw.close()
        assert r.swa.get(TOKENS) is None and r.swa.last_path == "shm"
        with pytest.raises(PermissionDenied):  # the gateway refuses the write too
            r.swa.put(TOKENS, data)
        assert r.swa.last_path == "gateway"


def test_a_tenant_with_a_byte_quota_writes_through_the_gateways_ledger(server: Server) -> None:
    with server.client("admin") as admin:
        admin_client = AdminClient(admin.target, token=server.tokens["admin"])
        admin_client.set_policy("tenant-a", swa_quota_bytes=2 * SNAP + 100, swa_ttl_s=5.0)
        admin_client.close()
    with server.client("a") as a:
        grant = open_direct(a)
        assert grant.offered and not grant.writable and grant.ttl_ms == 5000
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1 and a.swa.last_path == "gateway"  # charged to the ledger
        assert a.swa.get(TOKENS) == data and a.swa.last_path == "shm"
        assert a.swa.put(TOKENS, snap(a), position=202).stored == 1
        with pytest.raises(ResourceExhausted, match="swa_quota_bytes"):
            a.swa.put(TOKENS, snap(a), position=204)
        assert a.swa.get(TOKENS, 204) is None


def test_a_client_on_another_host_uses_the_gateway(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_shm, "host_id", lambda: "another-host")
    with server.client() as c:
        data = snap(c)
        assert c.swa.put(TOKENS, data).stored == 1 and c.swa.last_path == "gateway"
        assert c.swa.get(TOKENS) == data and c.swa.last_path == "gateway"
        assert "another host" in c.swa.direct_reason
        with pytest.raises(Unavailable, match="another host"):
            SwaClient(c.connection, path="direct").get(TOKENS)


def test_an_unreachable_control_socket_falls_back_to_the_gateway(server: Server,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = client_shm.ShmPath.__init__

    def elsewhere(self: client_shm.ShmPath, grant: pb.SwaOpenDirectResponse, **kwargs: object) -> None:
        moved = pb.SwaOpenDirectResponse()
        moved.CopyFrom(grant)
        moved.shm_socket = "kvstore-swa-not-in-this-network-namespace"
        real(self, moved, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client_shm.ShmPath, "__init__", elsewhere)
    with server.client() as c:
        data = snap(c)
        assert c.swa.put(TOKENS, data).stored == 1 and c.swa.last_path == "gateway"
        assert "control socket failed" in c.swa.direct_reason


def test_the_client_comes_back_after_a_server_restart(server: Server) -> None:
    with server.client() as c:
        swa = c.swa
        data = snap(c)
        assert swa.put(TOKENS, data).stored == 1 and swa.last_path == "shm"
        server.restart()
        assert swa.get(TOKENS) is None and swa.last_path == "shm"  # the new pool is empty; a new session
        assert swa.put(TOKENS, data).stored == 1 and swa.last_path == "shm"
        assert swa.get(TOKENS) == data


def test_no_client_can_write_its_tenants_arena_by_any_route(server: Server) -> None:
    """docs/SECURITY.md "Shared memory": a read-only token's session gets one descriptor, of a file sealed
    against writes; reopening it read-write (here, or from another process through /proc), mapping it
    shared and writable, mprotect() on a read-only mapping, pwrite, punching or truncating it: none
    writes, and the snapshot a read-write client of the same tenant then gets is the one put."""
    with server.client("a") as a, server.client("ra") as ra:
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1 and a.swa.last_path == "shm"
        reader, writer = Raw(open_direct(ra)), Raw(open_direct(a))
        try:
            assert not reader.hello.writable and len(reader.fds) == 1  # a reader is never handed staging
            assert writer.hello.writable and len(writer.fds) == 2
            size = reader.hello.arena_bytes
            for fd in (reader.fds[0], writer.fds[0]):  # the arena, as a reader and as a writer get it
                assert routes_that_write(fd, size) == []
                out = subprocess.run([sys.executable, str(ATTACKS), f"/proc/{os.getpid()}/fd/{fd}", str(size)],
                                     capture_output=True, text=True, check=True).stdout
                assert json.loads(out) == []
            # The server's own descriptor of the arena, from another process (root may open it).
            name = f"/memfd:kvstore-swa-{namespace_id('tenant-a').hex()} (deleted)"
            fd_dir = Path(f"/proc/{server.child.proc.pid}/fd")
            own = [p for p in fd_dir.iterdir() if os.readlink(p) == name]
            assert own
            for path in own:
                out = subprocess.run([sys.executable, str(ATTACKS), str(path), str(size)],
                                     capture_output=True, text=True, check=True).stdout
                assert json.loads(out) == []
            assert routes_that_write(writer.fds[1], os.fstat(writer.fds[1]).st_size)  # staging: not vacuous
        finally:
            reader.close()
            writer.close()
        assert ra.swa.get(TOKENS) == data and ra.swa.last_path == "shm"
        assert a.swa.get(TOKENS) == data and a.swa.last_path == "shm"


def test_a_reader_of_another_user_cannot_write_its_tenants_arena(server: Server) -> None:
    """The memfd's mode is 0777, so a read-only descriptor handed to a worker of another user used to be
    reopened read-write by it: the seal keeps that user out too."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    with server.client("a") as a, server.client("ra") as ra:
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1
        reader = Raw(open_direct(ra))
        try:
            assert routes_as_nobody(reader.fds[0], reader.hello.arena_bytes) == []
        finally:
            reader.close()
        assert a.swa.get(TOKENS) == data


def test_a_writer_cannot_change_a_committed_snapshot(server: Server) -> None:
    """A writer copies into its staging range; once the server has copied a snapshot into the arena and
    checksummed it there, what the writer does to its staging arena changes nothing readers get."""
    with server.client("a") as a, server.client("ra") as ra:
        data = snap(a)
        assert a.swa.put(TOKENS, data).stored == 1 and a.swa.get(TOKENS) == data  # settled by then
        writer = Raw(open_direct(a))
        try:
            staging = mmap.mmap(writer.fds[1], os.fstat(writer.fds[1]).st_size)  # sized to the cap
            at = staging.find(data[:4096])
            assert at >= 0  # freed, its bytes still there
            staging[at:at + 64] = bytes(64)
            staging.close()
        finally:
            writer.close()
        assert ra.swa.get(TOKENS) == data and SwaClient(ra.connection, path="gateway").get(TOKENS) == data


def _server_mapping_of(pid: int, tenant: str) -> int:
    """Where the server maps `tenant`'s arena (its writable mapping: the one way left to change it)."""
    name = f"/memfd:kvstore-swa-{namespace_id(tenant).hex()} (deleted)"
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == name and fields[1].startswith("rw"):
            return int(fields[0].split("-")[0], 16)
    raise AssertionError(f"no writable mapping of {name} in {pid}")


@pytest.mark.parametrize("forms", ["native", "python"])
def test_a_snapshot_changed_in_the_arena_is_a_counted_miss(server: Server, monkeypatch: pytest.MonkeyPatch,
                                                           forms: str) -> None:
    """Whatever changes a committed snapshot in the arena (no client can: this test writes the server's
    own mapping through /proc/<pid>/mem, as root), no get returns the changed bytes: a shm get checks
    every copy against the server's checksum, by default (`verify` or not), and misses, counted as
    corrupt; the gateway's unseal agrees. Where kvstore.native._blockcopy is built the copy and the checksum are
    one pass; the Python forms (a copy, then a checksum) stand in elsewhere, with the same results."""
    if os.geteuid() != 0:
        pytest.skip("needs root to write the server's memory")
    if forms == "python":
        monkeypatch.setattr(client_shm, "copy_digest", swa_digest.copy_digest_python)
        monkeypatch.setattr(client_shm, "stream_into", swa_digest.stream_into_python)
    with server.client() as c:
        data = snap(c)
        checked = SwaClient(c.connection, verify=True)
        assert checked.put(TOKENS, data).stored == 1  # sealed when COMMIT answers (WRITTEN notes)
        assert checked.get(TOKENS) == data and checked.last_path == "shm"  # intact: the checksums agree
        assert c.swa.get(TOKENS) == data and c.swa.last_path == "shm"
        raw = Raw(open_direct(c))
        try:
            arena = mmap.mmap(raw.fds[0], raw.hello.arena_bytes, prot=mmap.PROT_READ)
            at = arena.find(data[:4096])
            arena.close()
        finally:
            raw.close()
        base = _server_mapping_of(server.child.proc.pid, "tenant-a")
        with open(f"/proc/{server.child.proc.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(base + at + 100)
            mem.write(bytes([data[100] ^ 1]))
        assert c.swa.get(TOKENS) is None and c.swa.last_path == "shm"  # the default reader: a miss
        assert checked.get(TOKENS) is None and checked.last_path == "shm"
        assert checked.get(TOKENS, 7) is None and c.swa.get(TOKENS, 7) is None  # the next GETs carry the counts
        assert SwaClient(c.connection, path="gateway").get(TOKENS) is None  # the gateway's unseal agrees
        checked.close()
    assert admin_stats(server).corrupt >= 3
