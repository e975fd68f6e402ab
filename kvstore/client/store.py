"""The worker-side client: lookup, put and get global-KV blocks by token ids.

Hashes are computed here with `kvstore.prefix`, so a Lookup of a 1M-token prompt
sends 15,625 hashes rather than a million token ids. Large calls are split into
batches the server accepts; every gRPC failure surfaces as a `KVStoreError`
subclass (`kvstore.errors`), never as a raw `grpc.RpcError` (the plumbing is
`kvstore.client.connection`, shared with the SWA and transfer clients).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Self

import grpc

from kvstore.client import arguments, started_calls
from kvstore.client.blocks import stream_blocks
from kvstore.client.chain_memo import DEFAULT_MAX_BYTES, HashChain, token_array
from kvstore.client.connection import Connection, TlsOptions, status_error
from kvstore.client.puts import put_blocks
from kvstore.client.resume_report import report_resume
from kvstore.client.retry import Retry
from kvstore.client.swa import SwaClient
from kvstore.client.transfer import TransferSession
from kvstore.counted import counted
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.lookup_result import LookupResult  # re-exported: kvstore.client.LookupResult
from kvstore.prefix import ExtraKey
from kvstore.prefix_hosts import hosts_of
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import transfer_pb2, transfer_pb2_grpc

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview
#: Largest value of a uint32 wire field (lease milliseconds).
_UINT32_MAX = 2**32 - 1
#: Bytes of blocks per Put batch by default: big enough to amortise a call,
#: small enough that the next batch's transfer overlaps this one's fsync.
_PUT_BATCH_BYTES = 4 << 20
#: CPUs this process may run on, at least, for C7's overlap (a next turn's request sent while a worker runs C1's
#: compare) to be on by default (`Client.overlap_compare`): the compare needs a core besides the caller's, gRPC's
#: I/O and, on loopback, the server's. On the 2-CPU dev box under other sessions' load it measured a wash in the
#: median (docs/BENCHMARKS.md, `kvstore bench lookup`), the compare's core taken from the round trip.
OVERLAP_MIN_CPUS = 4


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform says, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: Client classes by the scheme of their target ("etcd" -> kvstore.client.fleet.FleetClient, which
#: registers itself); a target without a registered scheme is one server.
ADDRESS_SCHEMES: dict[str, type[Client]] = {}


@dataclass(frozen=True, kw_only=True)
class PutResult:
    """What a put stored, and the pin granted when `put(keep_until_s=)` asked one (0: none; why less)."""

    block_hashes: list[bytes] = field(repr=False)
    written_blocks: int
    existing_blocks: int
    kept_until_s: float = 0.0
    keep_note: str = ""


@dataclass(frozen=True, kw_only=True)
class GetResult:
    """Blocks fetched, in request order; None where missing or corrupt."""

    blocks: list[bytes | None] = field(repr=False)
    statuses: list[str]

    @property
    def found_prefix_blocks(self) -> int:
        """Leading blocks that came back (what a worker can load contiguously)."""
        n = 0
        for block in self.blocks:
            if block is None:
                break
            n += 1
        return n


class Client:
    """A connection to a kvstore server for one tenant and one geometry.

    Args:
        target: "host:port" of the server (or the gateway), or a fleet's
            "etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]" (etcds:// for TLS to etcd; then the client is a
            `kvstore.client.fleet.FleetClient`, which routes each call to the nodes
            holding the blocks: docs/FLEET.md).
        namespace: the tenant; blocks of two tenants never mix. '' (the default) is the
            token's tenant ("default" on a server without auth); only an admin token may
            name another.
        geometry: profile name; '' means the server's default.
        timeout_s: deadline of each call.
        token: the API token (`kvstore tenant create`); None for a server without auth.
        tls: TLS options (`kvstore.client.TlsOptions`); None for plaintext.
        retry: the policy (`kvstore.client.retry.Retry`) of the calls safe to repeat: a
            Lookup without a lease and Stats, retried on UNAVAILABLE (default: 2 retries,
            50 ms to 1 s of jittered backoff). Puts, leased Lookups, Gets and Release are
            sent once: a lost reply would make a retry answer otherwise.
        chain_memo_bytes: most bytes kept of the chains this client hashed (about 4.5 bytes per
            token; `kvstore.client.chain_memo`): a prompt that begins with one's tokens (a
            conversation's next turn) hashes only its new blocks. 0: hash every prompt in full.

    Every method raises a `kvstore.errors` class, never a bare ValueError or
    TypeError: `InvalidArgument` for a bad argument (nothing sent), the class
    of the server's status otherwise.
    """

    #: A next turn's Lookup is sent on the chain memo's guess while C1's compare runs on a worker (C7); False:
    #: the compare first, then the request (the serial path, `kvstore bench lookup`'s baseline for it). On by
    #: default where the process may use `OVERLAP_MIN_CPUS` CPUs; set it on a client (or the class) to choose.
    overlap_compare: bool = _usable_cpus() >= OVERLAP_MIN_CPUS
    #: `lookup_hashes` without a pin checks the caller's hashes while its call flies (docs/FLEET.md F83, as a fleet
    #: client's first round does): ~0.45 ms of a 1M-token prompt's cold Lookup off its path where a core is free
    #: for the server and gRPC's I/O; False: checked first, then sent. On by default as `overlap_compare` is.
    overlap_check: bool = _usable_cpus() >= OVERLAP_MIN_CPUS

    def __new__(cls, target: str, *args: Any, **kwargs: Any) -> Client:
        """The class of `target`'s scheme (`ADDRESS_SCHEMES`: a fleet client for etcd://), else this one."""
        if cls is Client and isinstance(target, str) and "://" in target:
            cls = ADDRESS_SCHEMES.get(target.split("://", 1)[0], cls)
        return object.__new__(cls)

    def __init__(self, target: str, *, namespace: str = "", geometry: str = "",
                 timeout_s: float = 120.0, token: str | None = None, tls: TlsOptions | None = None,
                 retry: Retry | None = None, chain_memo_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.retry = retry or Retry(retries=2)
        #: The channel, its call plumbing and what the server said; `swa` and `transfer()` share it.
        self.connection = c = Connection(target, namespace=namespace, geometry=geometry, timeout_s=timeout_s,
                                         token=token, tls=tls, chain_memo_bytes=chain_memo_bytes)
        # Fixed at connect: copied so the client reads as before.
        self.target, self.namespace, self.timeout_s = c.target, c.namespace, c.timeout_s
        self.geometry: str = c.geometry
        self.fingerprint: bytes = c.fingerprint
        self.block_tokens: int = c.block_tokens
        self.block_bytes: int = c.block_bytes
        self.max_batch_blocks: int = c.max_batch_blocks
        self.max_message_bytes: int = c.max_message_bytes
        self.max_lease_ms: int = c.max_lease_ms
        self.root: bytes = c.root

    def close(self) -> None:
        """Close the SWA client when it was used (it reports its direct gets and closes its Redis
        connections), then the channel."""
        swa = self.__dict__.get("swa")  # the cached property, only if something used it
        if swa is not None:
            swa.close()
        worker = self.__dict__.get("_compare_worker")  # likewise (C7's compares)
        if worker is not None:
            worker.shutdown(wait=False)
        self.connection.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addressing --------------------------------------------------------

    def hashes(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """Chain hashes of every full block of `tokens`, from the prompt start."""
        return self.connection.hashes(tokens, extra_keys=extra_keys)

    # -- calls -------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
               lease_ms: int = 0, swa_positions: Sequence[int] = (), swa_resume_limit: int = 0,
               keep_until_s: float = 0.0, hosts: bool = False) -> LookupResult:
        """How many leading tokens of `tokens` are loadable now, and from where SWA state is.

        Args:
            tokens: the prompt's token ids.
            extra_keys: the keys the blocks were stored with.
            lease_ms: hold the found blocks against eviction this long (0: no lease;
                the server grants at most its `max_lease_ms`).
            swa_positions: snapshot points to ask the SWA pool about (for example
                each block boundary and the prompt end); the result's
                `swa_position` is the live one that serves the longest resume,
                `swa_resume_tokens` that resume's length.
            swa_resume_limit: the longest resume wanted (0: no limit), for example
                len(tokens) - 1 so the last token is computed for its logits.
            keep_until_s: keep the found prefix until this Unix time beyond the tenant's retention (a pin,
                docs/RETENTION.md R22-R28; 0: none): the result's `kept_until_s` and `keep_note` say
                what was granted.
            hosts: answer `hosts` too: the nodes holding the found prefix on their hosts, and whether a
                same-host reader can open their stores (docs/PLANNER.md "Where a prefix lives").
        """
        swa_positions = [arguments.integer(p, f"swa_positions[{i}]") for i, p in enumerate(swa_positions)]
        lease_ms = arguments.integer(lease_ms, "lease_ms", most=_UINT32_MAX)
        keep_until_s, hosts = arguments.keep_time(keep_until_s), arguments.flag(hosts, "hosts")
        if not (swa_positions or lease_ms or keep_until_s) and self._may_guess():
            # C7: a plain next turn is sent on the memo's guess while C1's compare runs on a worker.
            tokens = token_array(tokens)  # converted once, for the guess and the safe path after it
            found = self._lookup_guessed(tokens, arguments.extra_keys(extra_keys), swa_resume_limit, hosts)
            if found is not None:
                return found
        swa_keys = self.swa.keys(tokens, swa_positions, extra_keys=extra_keys) if swa_positions else []
        return self._lookup(self.connection.chain(tokens, extra_keys=extra_keys), lease_ms=lease_ms, swa_keys=swa_keys,
                            swa_positions=swa_positions, swa_resume_limit=swa_resume_limit,
                            keep_until_s=keep_until_s, hosts=hosts)

    def lookup_hashes(self, hashes: list[bytes], *, lease_ms: int = 0, swa_keys: Sequence[bytes] = (),
                      swa_positions: Sequence[int] = (), swa_resume_limit: int = 0, keep_until_s: float = 0.0,
                      hosts: bool = False) -> LookupResult:
        """`lookup` for a prompt whose chain hashes (and SWA snapshot keys) the caller already has.

        Without a pin, with `overlap_check`, the hashes are checked while the call flies (docs/FLEET.md F83, as a
        fleet client's first round): a hash refused then is refused as before, what the call leased released first.
        """
        keep_until_s, hosts = arguments.keep_time(keep_until_s), arguments.flag(hosts, "hosts")
        if keep_until_s or not self.overlap_check:  # a pin outlives the call (R22): granted only for checked hashes
            chain: list[Any] = arguments.hashes(hashes, "hashes")
            check = arguments.ChainCheck()
        else:
            chain = arguments.hash_list(hashes, "hashes")
            check = arguments.ChainCheck(partial(arguments.exact_hashes, chain, "hashes"))
        ask = partial(self._lookup, lease_ms=lease_ms, swa_keys=swa_keys, swa_positions=swa_positions,
                      swa_resume_limit=swa_resume_limit, keep_until_s=keep_until_s, hosts=hosts)
        try:
            return ask(chain, check=check)
        except arguments.NotExact:  # hashes, not all bytes (what the call leased is released): as bytes, again
            return ask(arguments.hashes(chain, "hashes"))

    def pin(self, tokens: Sequence[int], keep_until_s: float, *, extra_keys: Sequence[ExtraKey] = ()) -> LookupResult:
        """Keep the stored prefix of `tokens` until the Unix time `keep_until_s`, beyond the tenant's retention.

        A Lookup that pins the found prefix's deepest block (docs/RETENTION.md R22-R27): the result's
        `kept_until_s` is the time granted (0: none) and `keep_note` why less than asked (the tenant's
        longest pin, its pin budget). Through a gateway or a fleet client, every copy of every found run is
        pinned (R28).

        Raises:
            InvalidArgument: `keep_until_s` is not a finite time.
        """
        until = arguments.keep_time(keep_until_s, required=True)
        return self.pin_hashes(self.hashes(tokens, extra_keys=extra_keys), until)

    def pin_hashes(self, hashes: list[bytes], keep_until_s: float) -> LookupResult:
        """`pin` for a prompt whose chain hashes (from its start) the caller already has."""
        return self._lookup(arguments.hashes(hashes, "hashes"), lease_ms=0, swa_keys=[], swa_positions=[],
                            swa_resume_limit=0, keep_until_s=arguments.keep_time(keep_until_s, required=True))

    def _lookup(self, hashes: Sequence[bytes], *, lease_ms: int, swa_keys: Sequence[bytes],
                swa_positions: Sequence[int], swa_resume_limit: int, keep_until_s: float = 0.0,
                hosts: bool = False, check: arguments.ChainCheck | None = None) -> LookupResult:
        """The Lookup of `hashes` (the caller's, checked or to be checked by `check` while the call flies, or this
        client's own chain)."""
        fields = self._lookup_fields(lease_ms=lease_ms, swa_keys=swa_keys, swa_positions=swa_positions,
                                     swa_resume_limit=swa_resume_limit, keep_until_s=keep_until_s, hosts=hosts)
        if not hashes and not fields["swa_keys"]:
            return LookupResult(found_blocks=0, found_tokens=0, lease_id=None, block_hashes=[])
        # Without a lease a Lookup may run twice (it only refreshes); with one, a lost reply's lease would leak.
        retry = self.retry if not fields["lease_ms"] else Retry(retries=0)
        conn, check = self.connection, check or arguments.ChainCheck()
        try:
            anchored = conn.anchors.best(hashes) if conn.lookup_anchors else 0
            reply = self._anchored_call(hashes, anchored, fields, retry, check) if anchored else None
            if reply is None:
                # One packed field where the server reads it: one parse on each side, not one per hash.
                chain = ({"block_hashes_packed": b"".join(hashes)} if conn.lookup_packed_hashes
                         else {"block_hashes": hashes})
                reply = self._checked_call(pb.LookupRequest(**chain, **fields), retry, check)
                anchored = 0
        except Exception:
            check.settle()  # a bad hash is named, not what it broke
            raise
        return self._found(reply, hashes, anchored, hosts)

    def _checked_call(self, request: pb.LookupRequest, retry: Retry, check: arguments.ChainCheck) -> Any:
        """A Lookup call under `retry`; the hashes' `check`, if no call has taken it yet, runs while its first
        attempt flies (docs/FLEET.md F83): when it raises, the reply's lease is released before its error."""
        conn = self.connection
        run = check.take()
        if run is None:
            return retry.call(lambda: conn.call(conn.kvstore.Lookup, request))
        first = [started_calls.start(conn.kvstore.Lookup, request, timeout=conn.timeout_s, metadata=conn.metadata)]
        try:
            run()
        except Exception:
            try:
                refused = first[0]()
            except grpc.RpcError:
                refused = None
            if refused is not None and refused.lease_id:
                self._release_quietly(refused.lease_id)
            raise

        def attempt() -> Any:
            if not first:
                return conn.call(conn.kvstore.Lookup, request)
            try:
                return first.pop()()
            except grpc.RpcError as exc:
                raise status_error(exc) from None

        return retry.call(attempt)

    def _release_quietly(self, lease_id: str) -> None:
        """Release a lease no caller was given; one the server could not drop lapses on its own (R9)."""
        with contextlib.suppress(KVStoreError):
            self.release(lease_id)

    def _lookup_fields(self, *, lease_ms: int, swa_keys: Sequence[bytes], swa_positions: Sequence[int],
                       swa_resume_limit: int, keep_until_s: float, hosts: bool) -> dict[str, Any]:
        """A LookupRequest's fields other than the chain, checked."""
        return {"geometry": self.geometry, "namespace": self.namespace,
                "lease_ms": arguments.integer(lease_ms, "lease_ms", most=_UINT32_MAX),
                "swa_keys": arguments.hashes(swa_keys, "swa_keys"),
                "swa_positions": [arguments.integer(p, f"swa_positions[{i}]") for i, p in enumerate(swa_positions)],
                "swa_resume_limit": arguments.integer(swa_resume_limit, "swa_resume_limit", most=2**64 - 1),
                "keep_until_s": keep_until_s, "want_hosts": hosts}

    def _anchored_call(self, hashes: Sequence[bytes], anchored: int, fields: dict[str, Any],
                       retry: Retry, check: arguments.ChainCheck | None = None) -> pb.LookupResponse | None:
        """A next turn's request: the anchor (the chain the server found before, `anchored` blocks) and the
        hashes after it; None when the server has forgotten the anchor (A4: then forgotten here too). `check`:
        the hashes' check, run while the call flies (`_checked_call`)."""
        conn = self.connection
        request = pb.LookupRequest(anchor_hash=hashes[anchored - 1], anchor_blocks=anchored,
                                   block_hashes_packed=b"".join(hashes[anchored:]), **fields)
        reply = self._checked_call(request, retry, check or arguments.ChainCheck())
        if reply.anchor_unknown:  # forgotten (or a restarted server): the caller sends the whole chain
            conn.anchors.forget(hashes[anchored - 1])
            return None
        return reply  # type: ignore[no-any-return]

    def _found(self, reply: pb.LookupResponse, hashes: Sequence[bytes], anchored: int, hosts: bool) -> LookupResult:
        """The result of `reply` to the Lookup of `hashes` (anchored at `anchored` blocks, 0: none); its found
        chain noted as an anchor for the next turn."""
        conn = self.connection
        if conn.lookup_anchors and reply.found_blocks:
            conn.anchors.note(hashes[reply.found_blocks - 1], reply.found_blocks,
                              replaces=hashes[anchored - 1] if anchored else b"")
        return LookupResult(found_blocks=reply.found_blocks, found_tokens=reply.found_tokens,
                            lease_id=reply.lease_id or None, block_hashes=hashes,
                            swa_position=reply.swa_position if reply.swa_found else None,
                            swa_resume_tokens=reply.swa_resume_tokens if reply.swa_found else None,
                            kept_until_s=reply.kept_until_s, keep_note=reply.keep_note, hosts=hosts_of(reply))

    # -- a next turn overlapped with C1's compare (docs/PREFIX_HASHING.md C7) ----

    def _may_guess(self) -> bool:
        """Whether a Lookup of tokens may go on the memo's guess: one server that reads anchors, a memo, an
        anchor noted (a next turn's request is the anchor and the new hashes)."""
        conn = self.connection
        return (self.overlap_compare and conn.lookup_anchors and conn.fleet_chains is None
                and conn.chain_memo.max_bytes > 0 and len(conn.anchors) > 0)

    def _lookup_guessed(self, tokens: Sequence[int], extra_keys: Sequence[ExtraKey], swa_resume_limit: int,
                        hosts: bool) -> LookupResult | None:
        """A next turn without lease, pin or SWA: the memo's guess's new blocks hashed and its anchored request
        sent while a worker runs C1's compare; the reply used only if the compare holds. None when there is no
        guess or anchor, or the compare failed: the caller then looks up the safe way (the memo's `chain`)."""
        conn, memo = self.connection, self.connection.chain_memo
        guess = memo.guess(tokens, root=conn.root, extra_keys=extra_keys)
        if guess is None:
            return None
        base = guess.base  # usually the chain the turn before was found as: its end is an anchor, one probe
        anchored = base.blocks if conn.anchors.ends(base.last, base.blocks) else conn.anchors.best(
            HashChain(base.pieces))
        if not anchored:
            return None
        compare = self._compare_worker.submit(memo.holds, guess)  # first: the worker wakes while this thread works
        error: KVStoreError | None = None
        try:
            # `_lookup_fields` of a Lookup without lease, pin or SWA: the other fields' defaults are sent as absent.
            fields = {"geometry": self.geometry, "namespace": self.namespace, "want_hosts": hosts,
                      "swa_resume_limit": arguments.integer(swa_resume_limit, "swa_resume_limit", most=2**64 - 1)}
            chain = memo.extend(guess)
            reply = self._anchored_call(chain, anchored, fields, self.retry)
        except KVStoreError as exc:  # raised below only if the guess holds: a wrong guess's error is not the answer
            error, reply = exc, None
        finally:
            held = compare.result()  # always awaited: the worker reads the caller's tokens
        if not held:
            memo.refuse(guess)
            return None
        if error is not None:
            raise error
        memo.take(guess, chain)
        if reply is None:  # A4: the anchor forgotten; the chain is right, so it is looked up the usual way
            return self._lookup(chain, lease_ms=0, swa_keys=[], swa_positions=[], swa_resume_limit=swa_resume_limit,
                                hosts=hosts)
        return self._found(reply, chain, anchored, hosts)

    @cached_property
    def _compare_worker(self) -> ThreadPoolExecutor:
        """The thread that runs a guessed next turn's C1 compare while the caller's thread sends the request."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-c1-compare")

    @cached_property
    def swa(self) -> SwaClient:
        """The SWA pool of this server, on the same channel, tenant and geometry."""
        return SwaClient(self.connection)

    def release(self, lease_id: str) -> bool:
        """Drop a lease; False when it had already expired."""
        lease_id = arguments.text(lease_id, "lease_id")
        reply = self.connection.call(self.connection.kvstore.Release, pb.ReleaseRequest(lease_id=lease_id))
        return bool(reply.released)

    def put(self, tokens: Sequence[int], blocks: Sequence[Buffer] | torch.Tensor, *,
            extra_keys: Sequence[ExtraKey] = (), first_block: int = 0, parent: bytes | None = None,
            batch_blocks: int | None = None, on_batch: Callable[[int], None] | None = None,
            keep_until_s: float = 0.0) -> PutResult:
        """Store the blocks of `tokens` from block `first_block` on.

        Args:
            tokens: the whole prompt's token ids (the prefix before `first_block`
                is hashed locally to find the parent; given `parent`, a node's Put
                reads only those from `first_block` on).
            blocks: one block per full block of `tokens` from `first_block`: a
                sequence of `block_bytes`-long buffers (bytes, bytearray,
                memoryview, 1-D uint8 numpy arrays or tensors), or one uint8
                tensor or numpy array of shape [n, block_bytes].
            extra_keys: keys mixed into every block's hash.
            first_block: index of the first block sent; earlier blocks must be stored.
            parent: the hash of block `first_block - 1` when the caller has it
                (a previous put's last hash), which saves re-hashing the prefix.
            batch_blocks: blocks per request (default: about 4 MiB worth). Longer
                puts stream their batches so transfer overlaps the server's fsync;
                they stop at the first failed batch, and the batches before it stay stored.
            on_batch: called with the number of blocks of each acknowledged batch.
            keep_until_s: keep the stored prompt (its last block, and so its whole prefix) until this Unix
                time beyond the tenant's retention (a pin, docs/RETENTION.md R22-R28; 0: none). On a node it
                is pinned in the last batch's own transaction; through a gateway, on every copy of every run
                of the Put in that copy's own Put (R28), and the runs wholly before `first_block` by a Lookup.
                The result's `kept_until_s` and `keep_note` say what was granted (through a gateway: the
                earliest time any copy granted, and why less).

        Raises:
            InvalidArgument: wrong block count, size or type, or a bad argument (nothing stored).
            FailedPrecondition: the block before `first_block` is not stored.
            ResourceExhausted: the store is full of protected blocks.
        """
        until = arguments.keep_time(keep_until_s)
        first_block = arguments.integer(first_block, "first_block")
        gateway = bool(self.connection.run_blocks)
        # A node's Put given its parent hashes and sends only the tokens from `first_block` on, so only those
        # are checked and converted: the prefix's were O(prompt) for nothing (a next turn's Put of a 1M-token
        # prompt: ~5 ms on the dev box before anything was sent; docs/BENCHMARKS.md, `bench store`).
        count, skip, tokens = _put_tokens(tokens, first_block * self.block_tokens if parent and not gateway else 0)
        extra_keys = arguments.extra_keys(extra_keys)
        if batch_blocks is not None:
            batch_blocks = arguments.integer(batch_blocks, "batch_blocks", least=1)
        if parent is not None and parent != b"":
            parent = arguments.one_hash(parent, "parent")
        if on_batch is not None and not callable(on_batch):
            raise InvalidArgument(f"on_batch must be callable, got {type(on_batch).__name__}")
        payload = arguments.buffers(blocks, "blocks", self.block_bytes)
        total = count // self.block_tokens - first_block
        if total != len(payload):
            raise InvalidArgument(f"{counted(len(payload), 'block')} given for {counted(total, 'full block')} "
                                  f"of tokens from block {first_block}")
        if parent is None:
            parent = (self.hashes(tokens[: first_block * self.block_tokens], extra_keys=extra_keys)[-1:] or [b""])[0]
        step = min(batch_blocks or max(_PUT_BATCH_BYTES // self.block_bytes, 1), self.connection.batch_blocks)
        # With the prefix skipped, `tokens` starts at block `first_block`: the requests are the same.
        replies = put_blocks(self.connection, tokens, payload, first_block=first_block - skip // self.block_tokens,
                             parent=parent, extra_keys=extra_keys, step=step, on_batch=on_batch, keep_until_s=until)
        hashes = [h for r in replies for h in r.block_hashes]
        written = sum(r.written_blocks for r in replies)
        existing = sum(r.existing_blocks for r in replies)
        kept, note = (replies[-1].kept_until_s, replies[-1].keep_note) if replies else (0.0, "")
        if until and gateway and replies:  # every copy of every run of the prompt, from block 0 (R28)
            kept, note = self._gateway_grant(tokens, extra_keys, first_block, until, replies)
        elif until and not replies:
            note = "nothing was stored to keep"
        return PutResult(block_hashes=hashes, written_blocks=written, existing_blocks=existing,
                         kept_until_s=kept, keep_note=note)

    def _gateway_grant(self, tokens: Sequence[int], extra_keys: Sequence[ExtraKey], first_block: int, until: float,
                       replies: Sequence[pb.PutResponse]) -> tuple[float, str]:
        """A Put's pin through a gateway (R28): the replies that carried it (each the earliest time its parts'
        copies granted), and for runs wholly before `first_block` (not in the Put) a Lookup's pin; the earliest
        time of them all, and the notes of those that kept less."""
        rb = self.connection.run_blocks
        answers = [(r.kept_until_s, r.keep_note) for r in replies if r.kept_until_s or r.keep_note]
        before = first_block - first_block % rb
        if before:
            got = self.pin_hashes(self.hashes(tokens, extra_keys=extra_keys)[:before], until)
            answers.append((got.kept_until_s, got.keep_note))
        if not answers:
            return 0.0, "nothing was stored to keep"
        return min(k for k, _ in answers), "; ".join(n for _, n in answers if n)

    def get(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
            first_block: int = 0, num_blocks: int | None = None) -> GetResult:
        """Fetch blocks of `tokens` (from `first_block`, `num_blocks` of them or all)."""
        first_block = arguments.integer(first_block, "first_block")
        if num_blocks is not None:
            num_blocks = arguments.integer(num_blocks, "num_blocks")
        chain = self.hashes(tokens, extra_keys=extra_keys)
        hashes = chain[first_block:]
        if first_block and self.connection.run_blocks:  # a gateway finds the run from where the Get starts
            return self._collect(stream_blocks(self.connection, hashes[:num_blocks] if num_blocks is not None
                                               else hashes, chain=chain, first_block=first_block))
        return self.get_hashes(hashes[:num_blocks] if num_blocks is not None else hashes)

    def get_hashes(self, hashes: Sequence[bytes]) -> GetResult:
        """Fetch blocks by chain hash, in order (through a gateway: hashes from block 0)."""
        return self._collect(self.stream(hashes))

    @staticmethod
    def _collect(replies: Iterator[tuple[int, int, bytes]]) -> GetResult:
        blocks: list[bytes | None] = []
        statuses: list[str] = []
        for _, status, data in replies:
            blocks.append(data if status == pb.BLOCK_STATUS_FOUND else None)
            statuses.append(pb.BlockStatus.Name(status).removeprefix("BLOCK_STATUS_").lower())
        return GetResult(blocks=blocks, statuses=statuses)

    def get_tensor(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Fetch the prompt's blocks into a uint8 tensor [n, block_bytes].

        Returns:
            The tensor (`out` if given) and how many leading blocks were filled;
            rows after the first missing block are left as they were.
        """
        import torch

        hashes = self.hashes(tokens, extra_keys=extra_keys)
        if out is None:
            out = torch.empty((len(hashes), self.block_bytes), dtype=torch.uint8)
        elif out.dtype != torch.uint8 or tuple(out.shape) != (len(hashes), self.block_bytes):
            raise InvalidArgument(f"out must be uint8 of shape ({len(hashes)}, {self.block_bytes}), "
                                  f"got {out.dtype} {tuple(out.shape)}")
        filled = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer on read-only bytes; we only read
            for index, status, data in self.stream(hashes):
                if status != pb.BLOCK_STATUS_FOUND or index != filled:
                    break
                out[filled].copy_(torch.frombuffer(data, dtype=torch.uint8))
                filled += 1
        return out, filled

    def stream(self, hashes: Sequence[bytes]) -> Iterator[tuple[int, int, bytes]]:
        """Fetch blocks by hash as they arrive: (index, status, data) per block, in
        order, across as many Get calls as the batch limit needs. `status` is a
        `kvstore.v1.kvstore_pb2.BlockStatus`; `data` is empty unless found."""
        return stream_blocks(self.connection, hashes)

    def transfer(self, *, path: str = "auto", ring: bool = True) -> TransferSession:
        """A batched-transfer session on this connection (`kvstore.client.transfer`).

        Args:
            path: "auto" (shared memory when the server can map this host's
                regions, else the bulk transport when the server offers it, else
                streamed), "shm", "stream" or "bulk" to force one.
            ring: answer small shared-memory reads through the session's request
                ring (docs/TRANSFER.md); False sends every batch by Submit.
        """
        return TransferSession(self.connection, path=path, ring=ring)

    def stats(self, *, tenant: str = "", windows: Sequence[str] = (), chart_points: int = 0) -> pb.StatsResponse:
        """The server's counters, hit rates and headroom; hit windows of `tenant` ("": every tenant
        the caller may see), only `windows` if named, and a 24-hour series of `chart_points` slices."""
        request = pb.StatsRequest(tenant=tenant, windows=list(windows), chart_points=chart_points)
        return self.retry.call(lambda: self.connection.call(self.connection.kvstore.Stats, request))

    def report_resume(self, *, prompt_tokens: int, found_tokens: int, usable_tokens: int, action: str,
                      wait: bool = True) -> Future[None]:
        """Report one resume plan, so the server's stats count usable tokens (ReportResume).

        Args:
            prompt_tokens: the prompt's length.
            found_tokens: the store's raw hit for it.
            usable_tokens: the tokens the plan serves from cache (0 for a full prefill).
            action: the plan's action: "fetch+snapshot", "bounded-replay", "exact-replay" or "full-prefill".
            wait: wait for the answer (and raise its error); False sends it and returns at once.

        Returns:
            A future that completes when the server answered; its exception is the call's
            KVStoreError. Without `wait`, a failure reaches the caller only through it.

        Raises:
            InvalidArgument: a bad count or an unknown action (nothing sent).
            KVStoreError: with `wait`, the class of the server's status.
        """
        return report_resume(self.connection, prompt_tokens=prompt_tokens, found_tokens=found_tokens,
                             usable_tokens=usable_tokens, action=action, wait=wait)

    def transfer_stats(self) -> transfer_pb2.TransferStatsResponse:
        """The transfer service's counters: its copy loop, sessions, mapped regions, batches, bytes moved."""
        stub = transfer_pb2_grpc.TransferStub(self.connection.channel)
        return self.connection.call(stub.Stats, transfer_pb2.TransferStatsRequest())


def _put_tokens(tokens: Any, skip: int) -> tuple[int, int, array[int]]:
    """A Put's token ids: (how many `tokens` holds, how many leading ones were skipped, the rest converted).

    The first `skip` are neither checked nor converted when `tokens` is a `Sequence` (a list, a tuple, an
    `array`, a range); anything else (an iterator, a numpy array) is converted whole, nothing skipped.
    """
    if skip and isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes | bytearray | memoryview):
        return len(tokens), skip, arguments.token_ids(tokens[skip:])
    converted = arguments.token_ids(tokens)
    return len(converted), 0, converted


def as_buffer(data: Any) -> bytes:
    """Bytes of a buffer, a uint8 numpy array or a uint8 tensor (any shape, any device; copied to host bytes).

    Raises:
        InvalidArgument: anything else (named, with what is accepted).
    """
    return arguments.buffer(data, "data")


__all__ = ["Client", "GetResult", "KVStoreError", "LookupResult", "PutResult"]
