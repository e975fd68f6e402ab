"""The store's event log: each write transaction's stored and removed blocks as KV cache event batches.

docs/EVENTS.md numbers the rules. The one hook is the tier's write transaction
(`LmdbBlockTier._write`): `BlockTxn.insert` and `BlockTxn.delete` record every change
(tiers/block_txn.py), and before the transaction commits `EventLog.log` turns them into
batches, numbers them and writes them into the `events` database of the same transaction
(E1: an event exists exactly when its change is durable; an aborted write leaves neither).
After the commit the tier hands the batches to the publisher (kvstore/events/publisher.py),
which sends them off the request path; the log answers replays, across restarts too (E3).

A batch holds one tenant's events (E2): a commit that changed two tenants' blocks makes
two batches, each on its tenant's topic. The log keeps the newest `keep_batches` batches;
a fresh log starts with an AllBlocksCleared batch (E5).
"""

from __future__ import annotations

import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import lmdb
import msgspec

from kvstore.events import wire
from kvstore.prefix import FINGERPRINT_BYTES
from tiers.block_txn import BlockTxn, Change
from tiers.namespaces import id_of_key

#: The log's database in the store's environment (opened only while events are on).
EVENTS_DB = b"events"
_SEQ = struct.Struct(">Q")  # big-endian: keys sort by sequence number, as vLLM's 8-byte frames
_TOPIC_LEN = struct.Struct("<H")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggedBatch:
    """One batch as the PUB socket sends it: (topic, sequence number, msgpack payload)."""

    seq: int
    topic: bytes
    payload: bytes


def tenant_topic(topic: str, tenant: str | None) -> bytes:
    """`<topic>/<tenant>/` with the tenant percent-encoded, so no tenant's topic is a prefix of another's (E2).

    None (a node-wide batch, AllBlocksCleared) is `<topic>/*/`: `*` is never left bare by the encoding.
    """
    return f"{topic}/{'*' if tenant is None else quote(tenant, safe='')}/".encode()


#: Blocks whose Put tokens `EventTokens` holds at most, waiting for their commit (~256 B each at 64 tokens).
TOKEN_BLOCKS = 65_536


class EventTokens:
    """The token ids of blocks a Put is about to store, for their live BlockStored events (E10).

    Memory only, bounded (`max_blocks`, the oldest forgotten first): the Put's handler notes each block's
    tokens by storage key before the tier's write (`note`); the commit that stores the block takes them
    (`take`) onto the event it publishes. Never written to LMDB: the log's copy of the batch, and so a
    replay, carries no tokens. A block a Put did not store (already there, or the Put refused) is not
    taken and ages out.
    """

    def __init__(self, max_blocks: int = TOKEN_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._tokens: OrderedDict[bytes, array[int]] = OrderedDict()
        self._lock = threading.Lock()  # noted on the Put's reader thread, taken in the tier's write

    def note(self, keys: Sequence[bytes], token_ids: Sequence[int], block_tokens: int) -> None:
        """Hold block i's tokens (`token_ids[i * block_tokens:(i + 1) * block_tokens]`) under `keys[i]`."""
        tokens = array("I", token_ids)
        with self._lock:
            for i, key in enumerate(keys):
                self._tokens[key] = tokens[i * block_tokens:(i + 1) * block_tokens]
                self._tokens.move_to_end(key)
            while len(self._tokens) > self.max_blocks:
                self._tokens.popitem(last=False)

    def take(self, keys: Iterable[bytes]) -> list[int] | None:
        """The tokens of `keys`' blocks, in order, forgotten here; None (and none forgotten) unless all are held."""
        keys = list(keys)
        with self._lock:
            if not all(k in self._tokens for k in keys):
                return None
            out: list[int] = []
            for k in keys:
                out.extend(self._tokens.pop(k))
        return out


class EventLog:
    """The `events` database: batches numbered in commit order, the newest `keep_batches` kept.

    Args:
        env: the store's environment.
        node_id: the node holding the blocks (its store id).
        block_tokens: the store's tokens per block (each BlockStored's `block_size`).
        topic: the first part of every topic (`[events] topic`).
        keep_batches: batches kept for replay.
        now: wall-clock seconds, for each batch's `ts`.
        token_ids: put the stored blocks' token ids on the live BlockStored events (`[events] token_ids`,
            E10): `tokens` holds what Puts note; the log's copies carry none.
    """

    def __init__(self, env: lmdb.Environment, *, node_id: str, block_tokens: int, topic: str,
                 keep_batches: int, now: Callable[[], float], token_ids: bool = False) -> None:
        self.env = env
        #: The Puts' token ids waiting for their blocks' events (None: events carry none).
        self.tokens: EventTokens | None = EventTokens() if token_ids else None
        self.node_id = node_id
        self.block_tokens = block_tokens
        self.topic = topic
        self.keep_batches = keep_batches
        self.now = now
        #: The batches a fresh log starts with (E5), for the publisher's first send.
        self.opening: list[LoggedBatch] = []
        # Created, opened and begun in one commit: the store flushes each commit before the next (R35).
        with env.begin(write=True) as txn:
            self.db = env.open_db(EVENTS_DB, txn=txn)
            if not txn.cursor(db=self.db).last():
                clear = wire.KVEventBatch(ts=now(), events=[wire.AllBlocksCleared(kvstore_node=node_id)])
                self.opening = [self._append(txn, tenant_topic(topic, None), wire.encode(clear))]

    def next_seq(self) -> int:
        """The sequence number the next batch gets (as last committed): numbers go on across restarts (E3)."""
        with self.env.begin(db=self.db) as txn:
            cursor = txn.cursor(db=self.db)
            return _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0

    def log(self, w: BlockTxn, changes: Sequence[Change]) -> list[LoggedBatch]:
        """Write `changes`' batches into `w`'s transaction (before it commits); the batches to publish after."""
        by_tenant: dict[bytes, list[Change]] = {}
        for change in changes:
            by_tenant.setdefault(id_of_key(change.key), []).append(change)
        out: list[LoggedBatch] = []
        ts = self.now()
        for ns_id, mine in by_tenant.items():
            tenant = w.namespace_name(ns_id) or ns_id.hex()  # a store from before names were kept: its id
            runs = list(self._events(mine, tenant))
            payload = wire.encode(wire.KVEventBatch(ts=ts, events=[event for event, _ in runs]))
            live = None
            if self.tokens is not None:  # E10: the live copy carries the tokens the Puts noted, the log's none
                events = [self._with_tokens(event, run) for event, run in runs]
                live = wire.encode(wire.KVEventBatch(ts=ts, events=events))
            out.append(self._append(w.txn, tenant_topic(self.topic, tenant), payload, live=live))
        return out

    def _with_tokens(self, event: Any, run: list[Change]) -> Any:
        """A BlockStored with its blocks' token ids when every one was noted; any other event as it is."""
        if not isinstance(event, wire.BlockStored) or self.tokens is None:
            return event
        tokens = self.tokens.take(c.key for c in run)
        return event if tokens is None else msgspec.structs.replace(event, token_ids=tokens)

    def _append(self, txn: lmdb.Transaction, topic: bytes, payload: bytes, *,
                live: bytes | None = None) -> LoggedBatch:
        """Put one batch under the next free number and trim the oldest past `keep_batches`.

        The number is read inside the write transaction (LMDB's one writer at a time), so numbers
        follow commit order and an aborted write takes none.
        """
        cursor = txn.cursor(db=self.db)
        seq = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
        txn.put(_SEQ.pack(seq), _TOPIC_LEN.pack(len(topic)) + topic + payload, db=self.db)
        oldest = seq - self.keep_batches  # E4: the newest keep_batches stay; older ones go as new ones come
        while oldest >= 0 and cursor.first() and _SEQ.unpack(cursor.key())[0] <= oldest:
            cursor.delete()
        return LoggedBatch(seq=seq, topic=topic, payload=payload if live is None else live)

    def _events(self, changes: Sequence[Change], tenant: str) -> Iterator[tuple[Any, list[Change]]]:
        """Consecutive changes of one kind and geometry as one event (with its changes); a stored run only
        while it is a chain."""
        run: list[Change] = []
        for change in changes:
            if run and not _continues(run[-1], change):
                yield self._event(run, tenant), run
                run = []
            run.append(change)
        if run:
            yield self._event(run, tenant), run

    def _event(self, run: list[Change], tenant: str) -> Any:
        geometry = run[0].key[:FINGERPRINT_BYTES].hex()
        hashes = [c.key[-32:] for c in run]
        if run[0].stored:
            return wire.BlockStored(block_hashes=hashes, parent_block_hash=run[0].parent_hash, token_ids=[],
                                    block_size=self.block_tokens, lora_id=None, medium=wire.MEDIUM, lora_name=None,
                                    kvstore_node=self.node_id, kvstore_tenant=tenant, kvstore_geometry=geometry)
        return wire.BlockRemoved(block_hashes=hashes, medium=wire.MEDIUM, kvstore_node=self.node_id,
                                 kvstore_tenant=tenant, kvstore_geometry=geometry)

    def read_from(self, start_seq: int) -> Iterator[LoggedBatch]:
        """The logged batches numbered `start_seq` and after, oldest first (one read transaction)."""
        with self.env.begin(db=self.db, buffers=False) as txn:
            cursor = txn.cursor(db=self.db)
            if not cursor.set_range(_SEQ.pack(max(start_seq, 0))):
                return
            for key, value in cursor.iternext():
                n = _TOPIC_LEN.unpack_from(value)[0]
                yield LoggedBatch(seq=_SEQ.unpack(key)[0], topic=value[2:2 + n], payload=value[2 + n:])


def _continues(last: Change, change: Change) -> bool:
    """Whether `change` extends the event `last` ends: same kind and geometry; a stored block must be its child."""
    if last.stored != change.stored or last.key[:FINGERPRINT_BYTES] != change.key[:FINGERPRINT_BYTES]:
        return False
    return not change.stored or change.parent_hash == last.key[-32:]
