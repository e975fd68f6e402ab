"""The ZMQ sockets of the events, as vLLM's `ZmqEventPublisher` speaks them (docs/EVENTS.md, "Wire").

PUB: each batch is the three frames `(topic, seq as 8 bytes big-endian, msgpack payload)`.
ROUTER (replay): a subscriber's REQ sends an 8-byte big-endian start number; the answer is every
logged batch from it on, each `(topic, seq, payload)`, then `(b"", -1 as 8 signed bytes, b"")`.

`submit` is all the request path does: a non-blocking put on a bounded queue (E6). A full
queue drops the batch from the live stream and counts it; the batch is still in the store's
log, so a subscriber that sees the gap in the numbers gets it by replay (E4). One thread owns
both sockets (ZMQ sockets are not thread-safe) and sends in queue order, which is commit order.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from kvstore.config_sections import EventsSettings

log = logging.getLogger(__name__)

#: The replay answer's last frame's number, as vLLM's (`ZmqEventPublisher.END_SEQ`).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Longest the thread waits on an empty queue before it looks at the replay socket again.
_POLL_S = 0.02


class Sendable(Protocol):
    """A logged batch (tiers.events.LoggedBatch): what the sockets send."""

    @property
    def seq(self) -> int: ...

    @property
    def topic(self) -> bytes: ...

    @property
    def payload(self) -> bytes: ...


@dataclass
class PublisherStats:
    """What the publisher did since it started (the kvstore_events_* series, docs/METRICS.md)."""

    published_batches: int = 0
    dropped_batches: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    #: The newest number sent live (-1: none yet).
    last_seq: int = -1


class EventPublisher:
    """Binds the PUB and replay sockets and sends batches from its own thread.

    Args:
        endpoint: the PUB socket's address (`tcp://127.0.0.1:0` picks a port: see `endpoint` after).
        replay_endpoint: the ROUTER socket's, '' for none.
        replay: the logged batches from a number on (the store's log, read on this thread).
        queue_batches: the bounded queue's size.
        hwm: the PUB socket's high-water mark.
        replay_max: most batches one replay answer holds (the log's size): the ROUTER's send HWM.

    Raises:
        zmq.ZMQError: an address cannot be bound.
    """

    def __init__(self, *, endpoint: str, replay_endpoint: str, replay: Callable[[int], Iterator[Sendable]],
                 queue_batches: int, hwm: int, replay_max: int) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replay_source = replay
        self._queue: queue.Queue[Sendable | None] = queue.Queue(maxsize=queue_batches)
        self.stats = PublisherStats()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(self._pub, endpoint)
            self._replay: zmq.Socket[bytes] | None = None
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole answer and its end marker must fit (vLLM sizes it the same way).
                self._replay.setsockopt(zmq.SNDHWM, 2 * (replay_max + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    def submit(self, batches: Iterable[Sendable]) -> None:
        """Queue batches for the live stream; never blocks: a full queue drops (and counts) them (E6)."""
        for batch in batches:
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.stats.dropped_batches += 1

    def queued(self) -> int:
        """Batches waiting to be sent."""
        return self._queue.qsize()

    def close(self) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):  # the sentinel goes after what is queued: those are sent first
            self._queue.put(None, timeout=5.0)
        self._thread.join(timeout=10.0)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            try:
                self._pub.send_multipart((batch.topic, batch.seq.to_bytes(8, "big"), batch.payload))
                self.stats.published_batches += 1
                self.stats.last_seq = batch.seq
            except zmq.ZMQError as exc:  # the batch stays in the log: a subscriber replays it
                log.warning("could not publish event batch %d: %s", batch.seq, exc)

    def _serve_replay(self) -> None:
        """Answer one replay request from the log (vLLM's protocol); a malformed one is answered with the end only."""
        sock = self._replay
        assert sock is not None
        frames = sock.recv_multipart()
        self.stats.replay_requests += 1
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed event replay request (%d frames)", len(frames))
            if len(frames) >= 2:
                sock.send_multipart((frames[0], b"", b"", END_SEQ, b""))
            return
        client, _, start = frames
        for batch in self._replay_source(int.from_bytes(start, "big")):
            sock.send_multipart((client, b"", batch.topic, batch.seq.to_bytes(8, "big"), batch.payload))
            self.stats.replayed_batches += 1
        sock.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind `endpoint`; the address bound (a port of 0 resolved)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def start_publisher(settings: EventsSettings, log_source: Callable[[int], Iterator[Sendable]],
                    opening: Sequence[Sendable]) -> EventPublisher:
    """An `EventPublisher` per `[events]`, with `opening` (a fresh log's first batches) queued first."""
    pub = EventPublisher(endpoint=settings.endpoint, replay_endpoint=settings.replay_endpoint,
                         replay=log_source, queue_batches=settings.queue_batches,
                         hwm=settings.hwm, replay_max=settings.replay_batches)
    pub.submit(opening)
    return pub
