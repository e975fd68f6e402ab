"""The shared-memory path: the server copies between LMDB's map and regions it mapped.

Batches go out as Submit / SubmitMany and are collected with GetTransfer(s); a lone
small batch goes through the session's request ring when it has one
(`kvstore.client.transfer_ring`). Only descriptors and results cross the channel.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.client.transfer_path import Transfer, TransferPath, timeout
from kvstore.client.transfer_ring import RingUnusable
from kvstore.transfer import DescriptorGroup, TransferState
from kvstore.v1 import transfer_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.transfer_path import SessionView


def state_of(reply: pb.TransferState, block_bytes: int) -> TransferState:
    # Kept as columns: per-descriptor results are built only if the caller asks.
    return TransferState(transfer_id=reply.transfer_id, done=reply.done, bytes_moved=reply.bytes_moved,
                         statuses=reply.statuses, block_bytes=block_bytes, block_hashes=reply.block_hashes,
                         failures={f.index: (f.code, f.reason) for f in reply.failures})


class _ShmTransfer(Transfer):
    def __init__(self, path: ShmPath, transfer_id: int) -> None:
        self.path = path
        self.transfer_id = transfer_id
        self._final: TransferState | None = None

    def status(self) -> TransferState:
        return self._final or self._get(0)

    def wait(self, timeout_s: float | None = None) -> TransferState:
        timeout_s = timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._final is None:
            left_ms = 10_000 if deadline is None else int(max(deadline - time.monotonic(), 0) * 1000)
            state = self._get(min(left_ms, 10_000))
            if state.done:
                self._final = state
            elif left_ms == 0:
                return state
        return self._final

    def _get(self, wait_ms: int) -> TransferState:
        return state_of(self.path.call(self.path.stub.GetTransfer, pb.GetTransferRequest(
            session_id=self.path.session_id, transfer_id=self.transfer_id, wait_ms=wait_ms)), self.path.block_bytes)


class ShmPath(TransferPath):
    """One-sided copies by the server, between LMDB's map and regions it mapped."""

    def __init__(self, session: SessionView) -> None:
        self.stub = session.stub
        self.call = session.call
        self.session_id = session.session_id
        self.block_bytes = session.connection.block_bytes
        self.timeout_s = session.connection.timeout_s
        self.keep_finished = session.keep_finished
        self.session = session

    def read(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> Transfer:
        return self._submit(self._read_request(groups, prefix_only))

    def read_many(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[Transfer]:
        """Start several read batches with one SubmitMany per `keep_finished` of them.

        One batch alone (a small fetch) is one Submit that answers when it is done:
        one round trip, where SubmitMany then GetTransfers take two.
        """
        requests = [self._read_request(groups, prefix_only) for groups in batches]
        ring = self.session.ring
        if len(requests) == 1 and ring is not None and sum(len(g) for g in batches[0]) <= ring.max_descriptors:
            try:
                done = _ShmTransfer(self, 0)
                done._final = state_of(ring.read(requests[0]), self.block_bytes)
                return [done]
            except RingUnusable:
                pass  # busy with another thread's request, or broken: Submit serves it
        if len(requests) == 1:
            requests[0].wait = True
            reply = self.call(self.stub.Submit, requests[0])
            done = _ShmTransfer(self, reply.transfer_id)
            done._final = state_of(reply.state, self.block_bytes)
            return [done]
        step = self.keep_finished or len(requests)
        out: list[Transfer] = []
        for start in range(0, len(requests), step):
            reply = self.call(self.stub.SubmitMany, pb.SubmitManyRequest(
                session_id=self.session_id, batches=requests[start:start + step]))
            out.extend(_ShmTransfer(self, tid) for tid in reply.transfer_ids)
        return out

    def wait_many(self, transfers: Sequence[Transfer], timeout_s: float | None) -> None:
        """Wait with one GetTransfers per `keep_finished` batches rather than a call per batch."""
        if not self.keep_finished:
            return  # not a shared-memory session: nothing of this path to wait for
        waiting = [t for t in transfers if isinstance(t, _ShmTransfer) and t.path is self and t._final is None]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            left_ms = 10_000 if deadline is None else int(max(deadline - time.monotonic(), 0) * 1000)
            for start in range(0, len(waiting), self.keep_finished):
                part = waiting[start:start + self.keep_finished]
                reply = self.call(self.stub.GetTransfers, pb.GetTransfersRequest(
                    session_id=self.session_id, transfer_ids=[t.transfer_id for t in part],
                    wait_ms=min(left_ms, 10_000)))
                # The server answers the first ids whose states fit its reply limit
                # (`omitted` says how many it left out): the rest are asked again.
                for transfer, state in zip(part, reply.states, strict=False):
                    if state.done:
                        transfer._final = state_of(state, self.block_bytes)
            waiting = [t for t in waiting if t._final is None]
            if left_ms == 0:
                return

    def _read_request(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> pb.SubmitRequest:
        return pb.SubmitRequest(session_id=self.session_id, op=pb.TRANSFER_OP_READ, prefix_only=prefix_only,
                                groups=wire(groups))

    def write(self, groups: Sequence[DescriptorGroup], parent_hash: bytes, token_ids: Sequence[int],
              extra_keys: Sequence[bytes]) -> Transfer:
        return self._submit(pb.SubmitRequest(op=pb.TRANSFER_OP_WRITE, groups=wire(groups),
                                             parent_hash=parent_hash, token_ids=token_ids, extra_keys=extra_keys))

    def _submit(self, request: pb.SubmitRequest) -> Transfer:
        request.session_id = self.session_id
        reply = self.call(self.stub.Submit, request)
        return _ShmTransfer(self, reply.transfer_id)


def wire(groups: Sequence[DescriptorGroup]) -> list[pb.DescriptorGroup]:
    return [pb.DescriptorGroup(region_id=g.region_id, length_bytes=g.length_bytes, block_hashes=g.block_hashes,
                               offsets_bytes=g.offsets_bytes.tolist()) for g in groups]
