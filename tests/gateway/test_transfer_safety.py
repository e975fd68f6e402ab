"""The transfer service's safety rules (gateway/transfer_sessions.py, docs/TRANSFER.md):
sessions bound to their connection, regions to their session, regions unmapped
when the client deregisters, disconnects or dies, bad descriptors failing alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.transfer_session_table import SessionTable
from kvstore.client import Client
from kvstore.errors import FailedPrecondition
from kvstore.region import Region
from kvstore.transfer import Descriptor, Op, Status, group
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def session_table(server: Any) -> SessionTable:
    """The running server's session table (the transfer service registers its closer)."""
    return next(c.__self__.table for c in server.closers
                if isinstance(getattr(getattr(c, "__self__", None), "table", None), SessionTable))


def mapped(name: str, pid: int | str = "self") -> bool:
    """Whether process `pid` maps a segment called `name`."""
    return name in Path(f"/proc/{pid}/maps").read_text()


def wait_until(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_rule_1_a_session_belongs_to_its_connection(server: Any) -> None:
    # A channel with its own subchannel pool: its own TCP connection, as another process would have.
    other = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
    with Client(server.target) as owner, owner.transfer() as session, other:
        stub = pb_grpc.TransferStub(other)
        with pytest.raises(grpc.RpcError) as info:
            stub.Submit(pb.SubmitRequest(session_id=session.session_id, op=pb.TRANSFER_OP_READ,
                                         groups=[pb.DescriptorGroup(region_id=1, length_bytes=1,
                                                                    offsets_bytes=[0])]))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "another connection" in (info.value.details() or "")


def test_rule_2_a_region_belongs_to_its_session(server: Any) -> None:
    with Client(server.target) as a, Client(server.target) as b, a.transfer() as sa, b.transfer() as sb:
        theirs = sa.register(a.block_bytes)
        mine = sb.register(b.block_bytes)
        size = b.block_bytes
        state = sb._paths["shm"].read(group([
            Descriptor(block_hash=b"\0" * 32, region_id=theirs.region_id, offset_bytes=0, length_bytes=size),
            Descriptor(block_hash=b"\0" * 32, region_id=mine.region_id, offset_bytes=0, length_bytes=size),
            Descriptor(block_hash=b"\0" * 32, region_id=987654, offset_bytes=0, length_bytes=size),
        ], Op.READ), False).wait()
        assert [r.code for r in state.results] == ["PERMISSION_DENIED", "", "NOT_FOUND"]
        assert [r.status for r in state.results] == [Status.FAILED, Status.MISSING, Status.FAILED]


def test_rule_2_bad_names_and_nonces_are_refused(server: Any, client: Client) -> None:
    with client.transfer() as s:
        with pytest.raises(grpc.RpcError) as info:
            s.stub.RegisterRegion(pb.RegisterRegionRequest(session_id=s.session_id, shm_name="../etc/passwd",
                                                           size_bytes=10, nonce=b"x"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with Region(4096) as region:
            region.write_nonce()
            pid, fd = region.handle
            with pytest.raises(grpc.RpcError) as info:
                s.stub.RegisterRegion(pb.RegisterRegionRequest(session_id=s.session_id, shm_name=region.name,
                                                               size_bytes=4096, nonce=b"not-the-nonce!!!",
                                                               pid=pid, fd=fd))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert session_table(server).mapped_regions() == 0


def test_rule_3_deregister_unmaps(server: Any, client: Client) -> None:
    table = session_table(server)
    with client.transfer() as s:
        region = s.register(1 << 16)
        assert table.mapped_regions() == 1 and mapped(region.name)
        s.deregister(region)
        assert table.mapped_regions() == 0
        assert wait_until(lambda: not mapped(region.name))


def test_rule_3_closing_the_session_unmaps(server: Any, client: Client) -> None:
    table = session_table(server)
    s = client.transfer()
    names = [s.register(1 << 16).name for _ in range(3)]
    assert table.mapped_regions() == 3
    s.close()
    # The table forgets the session before it unmaps: wait for both.
    assert wait_until(lambda: not table.sessions and not any(mapped(n) for n in names))
    assert table.mapped_regions() == 0


def test_rule_3_a_killed_client_leaves_no_mapping_or_segment(server: Any) -> None:
    table = session_table(server)
    script = textwrap.dedent(f"""
        import sys, time
        from kvstore.client import Client
        client = Client({server.target!r})
        session = client.transfer(path="shm")
        region = session.register(1 << 20)
        print(region.name, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith("kvstore-"), name
        assert table.mapped_regions() == 1 and mapped(name) and mapped(name, child.pid)
        child.kill()  # SIGKILL: no clean-up runs in the client
        child.wait(timeout=10)
        assert wait_until(lambda: not mapped(name)), "the server still maps the dead client's segment"
        assert table.mapped_regions() == 0, "the server kept the dead client's region"
        assert not (Path("/dev/shm") / name).exists(), "the segment outlived both ends"
    finally:
        if child.poll() is None:
            child.kill()


def test_rule_3_a_region_in_use_cannot_be_deregistered(server: Any, client: Client, loop_thread: Any) -> None:
    table = session_table(server)
    with client.transfer() as s:
        region = s.register(client.block_bytes)
        session = table.sessions[s.session_id]
        session.new_transfer(frozenset({region.region_id}), 1)  # in flight until its engine finishes
        with pytest.raises(FailedPrecondition, match="in use"):
            s.deregister(region)
        for transfer in session.transfers.values():  # settle the stand-in batch
            loop_thread.loop.call_soon_threadsafe(transfer.done.set)
        assert wait_until(lambda: not session.in_flight())
        s.deregister(region)


def test_rule_4_batch_limits_fail_the_call_not_the_server(server: Any, client: Client) -> None:
    with client.transfer() as s:
        with pytest.raises(grpc.RpcError) as info:
            s.stub.Submit(pb.SubmitRequest(session_id=s.session_id, op=pb.TRANSFER_OP_READ))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        region = s.register(client.block_bytes)
        assert s.read([Descriptor(block_hash=b"short", region_id=region.region_id, offset_bytes=0,
                                  length_bytes=client.block_bytes)]).wait().results[0].code == "INVALID_ARGUMENT"
        assert client.stats().blocks_stored == 0  # the server still answers


def test_rule_4_spans_are_checked_whole_groups_at_a_time(server: Any, client: Client) -> None:
    # One group on the wire; offsets near 2**64 must not wrap around the bounds check.
    with client.transfer() as s:
        size = client.block_bytes
        region = s.register(2 * size)
        group_pb = pb.DescriptorGroup(region_id=region.region_id, length_bytes=size, block_hashes=b"\0" * 96,
                                      offsets_bytes=[0, 2**64 - 1, size])
        reply = s.stub.Submit(pb.SubmitRequest(session_id=s.session_id, op=pb.TRANSFER_OP_READ, groups=[group_pb],
                                               wait=True))
        assert list(reply.state.statuses) == [pb.DESCRIPTOR_STATUS_MISSING, pb.DESCRIPTOR_STATUS_FAILED,
                                              pb.DESCRIPTOR_STATUS_MISSING]
        assert [(f.index, f.code) for f in reply.state.failures] == [(1, "INVALID_ARGUMENT")]
        assert "outside region" in reply.state.failures[0].reason
