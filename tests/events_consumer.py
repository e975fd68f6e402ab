"""A consumer of kvstore's KV cache events as a router would write one, on vLLM's own classes.

It subscribes to the PUB socket, decodes every batch with vLLM's decoder
(`vllm.distributed.kv_events.KVEventBatch`) and with kvstore's (for the tenant, the
geometry and the node, which vLLM's classes skip), and keeps a view: which block hashes
are stored, per (tenant, geometry). A gap in the sequence numbers is filled from the
replay socket, as vLLM's example subscriber does. Shared by the events' tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.events import wire

kv_events = pytest.importorskip("vllm.distributed.kv_events",
                                reason="vLLM is not installed (scripts/install_engines.sh)")
VLLM_DECODER = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
END_SEQ = -1


@dataclass
class Consumer:
    """A SUB socket on `endpoint` (topics `topics`), a REQ to `replay_endpoint`, and the view they build."""

    endpoint: str
    replay_endpoint: str
    topics: tuple[bytes, ...] = (b"",)
    ctx: Any = field(default_factory=zmq.Context)
    #: (tenant, geometry) -> block hashes stored.
    view: dict[tuple[str, str], set[bytes]] = field(default_factory=dict)
    #: Every batch applied, by sequence number: (topic, vLLM's decoding, kvstore's decoding).
    batches: dict[int, tuple[bytes, Any, wire.KVEventBatch]] = field(default_factory=dict)
    last_seq: int = -1
    replays: int = 0
    clears: int = 0

    def __post_init__(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        for topic in self.topics:
            self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(self.endpoint)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def reconnect(self, endpoint: str, replay_endpoint: str) -> None:
        """Subscribe again at a restarted server's sockets, keeping the view."""
        self.sub.close(linger=0)
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.__post_init__()

    def poll(self, timeout_ms: int = 50) -> int:
        """Apply what the PUB socket has; replay a gap first. How many batches were applied."""
        applied = 0
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue  # had it from a replay
            if seq > self.last_seq + 1:
                applied += self.replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
            self.apply(seq, topic, payload)
            applied += 1
            timeout_ms = 0
        return applied

    def replay(self, start: int) -> int:
        """Ask the replay socket for every batch from `start`; apply those not seen. How many were applied."""
        self.replays += 1
        # A DEALER, not a REQ: a REQ takes one reply per request, and the answer is many messages.
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        applied = 0
        try:
            while True:
                assert req.poll(30_000), "the replay socket did not answer"
                _, topic, seq_bytes, payload = req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return applied
                if seq > self.last_seq and (not self.topics[0] or topic.startswith(self.topics)):
                    self.apply(seq, topic, payload)
                    applied += 1
                elif seq > self.last_seq:
                    self.last_seq = seq  # another topic's: not ours, but not a gap either
        finally:
            req.close(linger=0)

    def apply(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Decode with both decoders and apply the batch to the view."""
        theirs = VLLM_DECODER.decode(payload)  # what any vLLM consumer sees
        ours = wire.decode(payload)
        self.batches[seq] = (topic, theirs, ours)
        self.last_seq = seq
        for event in ours.events:
            if isinstance(event, wire.AllBlocksCleared):
                self.view.clear()
                self.clears += 1
                continue
            hashes = self.view.setdefault((event.kvstore_tenant, event.kvstore_geometry), set())
            if isinstance(event, wire.BlockStored):
                hashes.update(event.block_hashes)
            else:
                hashes.difference_update(event.block_hashes)

    def catch_up(self, seq: int, deadline_s: float = 30.0) -> None:
        """Poll until batch `seq` was applied (replaying if the live stream lost it)."""
        end = time.monotonic() + deadline_s
        while self.last_seq < seq:
            assert time.monotonic() < end, f"the consumer did not reach batch {seq} (at {self.last_seq})"
            if not self.poll(20) and self.last_seq < seq:
                self.replay(self.last_seq + 1)

    def stored(self, tenant: str, geometry: str) -> set[bytes]:
        """The block hashes the view holds for one tenant and geometry."""
        return {h for h in self.view.get((tenant, geometry), set())}
