"""The server's side of the KV cache events (docs/EVENTS.md): the bind check, the start, the series.

The events themselves come from the tier's commits (tiers/events.py) and leave through
kvstore/events/publisher.py; this module only decides whether they may be served on the
addresses configured, turns them on, and reads the publisher's counters at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.auth import is_loopback
from kvstore.config_sections import EventsSettings, StoreSettings
from kvstore.errors import ConfigError
from tiers.datadir import node_id

if TYPE_CHECKING:
    from kvstore.events.publisher import EventPublisher
    from tiers.events import EventLog


class EventedStore(Protocol):
    """What this module needs of the store (LmdbBlockTier): its events' log and publisher."""

    settings: StoreSettings
    events: EventLog | None
    publisher: EventPublisher | None

    def publish_events(self, settings: EventsSettings, node_id: str) -> EventPublisher:
        """Log and publish every stored and removed block from now on."""
        ...


def note_put_tokens(tier: Any, keys: Sequence[bytes], token_ids: Sequence[int], block_tokens: int) -> None:
    """A Put's blocks' token ids, for their live BlockStored events when `[events] token_ids` is on (E10)."""
    events = getattr(tier, "events", None)
    tokens = getattr(events, "tokens", None)
    if tokens is not None:
        tokens.note(keys, token_ids, block_tokens)


def endpoint_host(endpoint: str) -> str | None:
    """The host a `tcp://HOST:PORT` endpoint binds; None for ipc:// and inproc:// (this machine only)."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rpartition(":")[0]


def check_events_bind(settings: EventsSettings, *, insecure: bool) -> None:
    """Refuse the event sockets beyond loopback unless `insecure`: plain ZMQ, no tokens, tenants' names (E7).

    Raises:
        ConfigError: naming the endpoint and the ways out.
    """
    if not settings.enabled or settings.insecure or insecure:
        return
    for name in ("endpoint", "replay_endpoint"):
        host = endpoint_host(getattr(settings, name))
        if host is not None and not is_loopback(host):
            raise ConfigError(
                f"refusing to publish KV cache events on {getattr(settings, name)} (events.{name}) beyond "
                "loopback: ZMQ has no tokens nor TLS here, and the events name every tenant and its block hashes",
                hint="bind tcp://127.0.0.1:PORT (a router on this host or through a tunnel), or set "
                     "events.insecure = true on a trusted network")


def start_events(settings: EventsSettings, tier: EventedStore) -> str:
    """Turn the tier's events on when `[events] enabled`; the line `kvstore serve` prints of them.

    Raises:
        ConfigError: pyzmq or msgspec is not installed, or an endpoint cannot be bound.
    """
    if not settings.enabled:
        return "off ([events] enabled = false)"
    try:
        import msgspec  # noqa: F401
        import zmq
    except ImportError as exc:
        raise ConfigError(f"[events] enabled needs pyzmq and msgspec: {exc}",
                          hint="pip install 'kvstore[events]'") from None
    try:
        pub = tier.publish_events(settings, node_id(tier.settings.data_dir))
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind the event sockets ({settings.endpoint}, {settings.replay_endpoint}): {exc}",
                          hint="pick free ports in [events] endpoint and replay_endpoint") from None
    assert tier.events is not None
    replay = f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ", no replay socket"
    return f"on {pub.endpoint}{replay}, topic {settings.topic}/<tenant>/, from sequence {tier.events.next_seq()}"


class EventsCollector(Collector):
    """The kvstore_events_* series: all 0 while events are off (docs/METRICS.md, "Events")."""

    def __init__(self, tier: EventedStore) -> None:
        self.tier = tier

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        pub = self.tier.publisher
        s = pub.stats if pub is not None else None
        yield CounterMetricFamily("kvstore_events_published_batches", "Event batches sent on the PUB socket.",
                                  value=s.published_batches if s else 0)
        yield CounterMetricFamily("kvstore_events_dropped_batches", "Event batches left out of the live stream "
                                  "because its queue was full (still in the log: a subscriber replays them).",
                                  value=s.dropped_batches if s else 0)
        yield CounterMetricFamily("kvstore_events_replay_requests", "Replay requests answered.",
                                  value=s.replay_requests if s else 0)
        yield CounterMetricFamily("kvstore_events_replayed_batches", "Event batches sent in replay answers.",
                                  value=s.replayed_batches if s else 0)
        yield GaugeMetricFamily("kvstore_events_queued_batches", "Event batches waiting to be sent.",
                                value=pub.queued() if pub is not None else 0)
        yield GaugeMetricFamily("kvstore_events_last_sequence", "The newest sequence number sent live "
                                "(-1: none yet, or events off).", value=s.last_seq if s else -1)
