"""`kvstore.Client` over a fleet: `Client("etcd://HOST:PORT[,...]/CLUSTER")` routes every call itself.

The client follows the fleet's membership in etcd (`fleet_view`), holds one
connection per node (`fleet_nodes`), places each run of a chain with the same
rendezvous hashing as the nodes (`kvstore.fleet.placement`), and sends the data
straight between the worker and the nodes that hold it: a Put to every replica
of each run (`fleet_put`), a Lookup to one replica per run at once
(`fleet_lookup`), a Get from each run's nearest replica with failover
(`fleet_get`), and the refreshes of the copies a read did not ask in the
background (`fleet_refresh`). Hashes are the fleet's (`fleet_chain`: one chain
per run, bridged), so `hashes`, `lookup_hashes` and `stream` take and give
those. Rules: docs/FLEET.md, "Data path".

The SWA pool is the one the nodes share (`fleet_swa`: a Redis Cluster, reached
through any node, F44-F45), so `swa` and `lookup(swa_positions=...)` work as on
one server.

Resume reports go to one node (the fleet's stats sum the nodes'), so the planner
(`replay.planner.Planner`) and `restore` work over a fleet client (F47); with the
`ColocatedReader` of this host's node, restore reads that node's runs directly
(F48).

`transfer()` is a session that fetches a chain run by run from the nodes
(`fleet_transfer`, F49). Not in a fleet yet: the shared-memory paths and
store-wide stats through this client (`node_stats` gives each node's); those
raise FailedPrecondition.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, NoReturn

from kvstore.client import arguments
from kvstore.client.chain_memo import DEFAULT_MAX_BYTES
from kvstore.client.connection import DEFAULT_TENANT, Connection, TlsOptions
from kvstore.client.fleet_address import parse_fleet_address
from kvstore.client.fleet_chain import FleetChainMemo, fleet_snapshot_keys
from kvstore.client.fleet_get import stream_run_part, stream_runs
from kvstore.client.fleet_lookup import FleetLookup, FoundChains, lookup_runs, release_lease, run_found
from kvstore.client.fleet_nodes import NodePool
from kvstore.client.fleet_pins import combine, pin_grants, pin_runs
from kvstore.client.fleet_put import RunPut, put_runs
from kvstore.client.fleet_refresh import Refresher
from kvstore.client.resume_report import report_resume
from kvstore.client.retry import Retry
from kvstore.client.store import ADDRESS_SCHEMES, Buffer, Client, GetResult, LookupResult, PutResult
from kvstore.config_sections import FleetSettings
from kvstore.counted import counted
from kvstore.errors import ConfigError, FailedPrecondition, InvalidArgument, KVStoreError, Unavailable
from kvstore.fleet.endpoints import EtcdTls
from kvstore.fleet.placement import RunPlacement, place_chain, placeable, ranked
from kvstore.prefix import ExtraKey
from kvstore.prefix_hosts import fleet_hosts
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import torch

    from kvstore.client.fleet_swa import FleetSwaClient
    from kvstore.client.fleet_transfer import FleetTransferSession
    from kvstore.client.fleet_view import FleetView

#: Blocks of data per Put request to a node, as the single-server client sends.
_PUT_BATCH_BYTES = 4 << 20
#: Copies of a Put's runs made at once (a run's replicas, in parallel).
_PUT_THREADS = 8
#: The key a client's resume reports pick their node by (per client: `NodePool.read_order` salts it).
_REPORT_KEY = b"kvstore.fleet.report.v1"


@dataclass(frozen=True, kw_only=True)
class FleetLookupResult(LookupResult):
    """A fleet Lookup's result: `LookupResult`, and the nodes it asked."""

    nodes_asked: frozenset[str] = field(default_factory=frozenset)
    #: Why the SWA candidates were a miss without the pool's answer ('' when it answered, or none was asked).
    swa_error: str = ""


class FleetClient(Client):
    """A client of a fleet of storage nodes for one tenant and one geometry (see the module's docstring).

    Args:
        target: `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]` (cluster `default` when omitted), or `etcds://` for
            TLS to etcd (`fleet_address`: `?ca_file=PATH&cert_file=PATH&key_file=PATH`).
        namespace, geometry, timeout_s, token, tls: as `kvstore.Client`'s, for every node.
        replication: copies of every run a Put makes ([fleet] replication, 2 by default) for a tenant whose
            policy sets none (`copies`); fewer when fewer nodes are live (one copy on each).
        retry: the policy of failover rounds and of each copy's Put (default: 3 retries, 50 ms to 1 s).
        etcd_tls: TLS to etcd (`kvstore.fleet.endpoints.EtcdTls`: CA, certificate and key files), in place of an
            etcds:// address's query; given, etcd is spoken to over TLS whatever the scheme (F57).
        chain_memo_bytes: most bytes kept of the fleet chains this client hashed (`fleet_chain.FleetChainMemo`,
            the single server's memo run by run, F56): a conversation's next turn hashes only its new blocks.
            0: hash every prompt in full.

    Raises:
        InvalidArgument: a malformed address.
        Unavailable: etcd does not answer, no node of the cluster is live, or none answers.
        ConfigError: a node's block size differs from the fleet's recorded layout.
    """

    def __init__(self, target: str, *, namespace: str = "", geometry: str = "", timeout_s: float = 120.0,
                 token: str | None = None, tls: TlsOptions | None = None, replication: int | None = None,
                 retry: Retry | None = None, chain_memo_bytes: int = DEFAULT_MAX_BYTES,
                 etcd_tls: EtcdTls | None = None) -> None:
        address = parse_fleet_address(arguments.text(target, "target"))
        if etcd_tls is not None:
            if not isinstance(etcd_tls, EtcdTls):
                raise InvalidArgument("etcd_tls must be a kvstore.fleet.endpoints.EtcdTls, got "
                                      f"{type(etcd_tls).__name__}")
            address = dataclasses.replace(address, tls=etcd_tls)
        chain_memo_bytes = arguments.integer(chain_memo_bytes, "chain_memo_bytes")
        self.replication = arguments.integer(FleetSettings.replication if replication is None else replication,
                                             "replication", least=1)
        self.retry = retry or Retry()
        # Imported here: a single-server client never loads the etcd client (aetcd and its protobufs).
        from kvstore.client.fleet_view import FleetView

        self.view: FleetView = FleetView(address, timeout_s=min(arguments.seconds(timeout_s, "timeout_s"), 5.0))
        self.run_blocks = self.view.layout.run_blocks
        self.pool = NodePool(self.view, namespace=namespace, geometry=geometry, timeout_s=timeout_s, token=token,
                             tls=tls)
        self.refresher = Refresher(self.pool)
        #: Where this client's Lookups and Puts found or left each prompt's stored prefix: the next Lookup's
        #: boundary run is guessed from it and asked by its hashes in the one round (F81).
        self.found_chains = FoundChains()
        self._swa: FleetSwaClient | None = None
        self._node_options = {"namespace": namespace, "geometry": geometry, "timeout_s": timeout_s, "token": token,
                              "tls": tls}
        self._node_clients: dict[str, Client] = {}
        self._swa_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(_PUT_THREADS, thread_name_prefix="fleet-put")
        #: Lookups' SWA parts, asked while their blocks are (F45); threads of their own, never behind a Put.
        self._swa_executor = ThreadPoolExecutor(2, thread_name_prefix="fleet-swa")
        try:
            first = self._any_node()
        except BaseException:
            self.close()
            raise
        self.target, self.namespace, self.timeout_s = str(address), first.namespace, first.timeout_s
        self.geometry = first.geometry
        self.fingerprint, self.block_tokens, self.block_bytes = first.fingerprint, first.block_tokens, first.block_bytes
        self.max_batch_blocks, self.max_message_bytes = first.max_batch_blocks, first.max_message_bytes
        self.max_lease_ms, self.root = first.max_lease_ms, first.root
        self._batch_limit = first.batch_blocks
        #: The fleet chains hashed by this client, run by run through the chain memo (F56).
        self.chains = FleetChainMemo(block_tokens=self.block_tokens, run_blocks=self.run_blocks,
                                     max_bytes=chain_memo_bytes)
        # The tenant whose policy counts: the namespace named, else the one an empty namespace means for this
        # caller (its token's, or "default"), as the nodes resolve it.
        self.tenant = self.namespace or first.tenant or DEFAULT_TENANT
        try:  # the tenant's own replication, when its policy sets one, is the Puts' (F51)
            self.view.follow_policy(self.tenant)
        except BaseException:
            self.close()
            raise

    @property
    def copies(self) -> int:
        """Copies of every run a Put makes and reads rank: the tenant's own replication (its policy in etcd,
        F51), else `replication`; fewer while fewer nodes are live (F13)."""
        return self.view.replication_of(self.tenant) or self.replication

    def _any_node(self) -> Connection:
        """A connection to some live node (what every node serves: block size, geometry, limits)."""
        last: KVStoreError = Unavailable(f"no node of fleet {self.view.address.cluster!r} is live",
                                         hint="start a node, or wait for etcd's view")
        for node_id in sorted(self.view.nodes):
            try:
                c = self.pool.connection(node_id)
            except KVStoreError as exc:
                last = exc
                continue
            if c.block_tokens != self.view.layout.block_tokens:
                raise ConfigError(f"node {node_id} serves {c.block_tokens}-token blocks, but fleet "
                                  f"{self.view.address.cluster!r} places {self.view.layout.block_tokens}-token ones")
            return c
        raise last

    def close(self) -> None:
        """Send the queued refreshes (a few seconds at most) and the SWA client's reports, then close every
        connection and the view."""
        self.refresher.close()
        if self._swa is not None:
            self._swa.close()
        for node in self._node_clients.values():
            node.close()
        self._executor.shutdown(wait=True)
        self._swa_executor.shutdown(wait=True)
        self.pool.close()
        self.view.close()

    # -- placement ---------------------------------------------------------

    def placement(self, chain: Sequence[bytes]) -> tuple[RunPlacement, ...]:
        """Where each run of `chain` (fleet hashes from block 0) lives now, replicas best first.

        Raises:
            Unavailable: no node is live.
        """
        nodes = placeable(self.view.nodes)
        return place_chain(chain, nodes, run_blocks=self.run_blocks,
                           replication=max(1, min(self.copies, len(nodes))))

    # -- addressing --------------------------------------------------------

    def hashes(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """The fleet hashes of every full block of `tokens`, from the prompt start (`fleet_chain`); the runs
        that begin with the tokens of runs hashed before are the memo's (F56: the same hashes)."""
        return self.chains.hashes(arguments.token_ids(tokens), root=self.root,
                                  extra_keys=arguments.extra_keys(extra_keys))

    # -- calls -------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
               lease_ms: int = 0, swa_positions: Sequence[int] = (), swa_resume_limit: int = 0,
               keep_until_s: float = 0.0, hosts: bool = False) -> LookupResult:
        """How many leading tokens of `tokens` are stored on the fleet, and from where SWA state is
        (`Client.lookup`; the snapshot from the fleet's shared pool, F45)."""
        swa_positions = [arguments.integer(p, f"swa_positions[{i}]") for i, p in enumerate(swa_positions)]
        tokens = arguments.token_ids(tokens)
        chain = self.hashes(tokens, extra_keys=extra_keys)
        # The snapshot keys are anchored on this chain: made from it, not by hashing the prompt again.
        swa_keys = fleet_snapshot_keys(tokens, swa_positions, root=self.root, block_tokens=self.block_tokens,
                                       run_blocks=self.run_blocks, extra_keys=extra_keys,
                                       chain=chain) if swa_positions else []
        return self._lookup_chain(chain, own=True, lease_ms=lease_ms, swa_keys=swa_keys,
                                  swa_positions=swa_positions, swa_resume_limit=swa_resume_limit,
                                  keep_until_s=keep_until_s, hosts=hosts)

    def pin_hashes(self, hashes: list[bytes], keep_until_s: float) -> LookupResult:
        """`Client.pin_hashes` over the fleet: every live copy of every found run is pinned (R28)."""
        return self.lookup_hashes(hashes, keep_until_s=arguments.keep_time(keep_until_s, required=True))

    def lookup_hashes(self, hashes: list[bytes], *, lease_ms: int = 0, swa_keys: Sequence[bytes] = (),
                      swa_positions: Sequence[int] = (), swa_resume_limit: int = 0, keep_until_s: float = 0.0,
                      hosts: bool = False) -> FleetLookupResult:
        """`lookup` by fleet hashes from block 0: the prefix whose every run is on a live replica.

        With `lease_ms`, every node asked leases what it found; the result's `lease_id` names them all. With SWA
        candidates (`swa_keys` with their `swa_positions`), the fleet's pool answers the one that serves the longest
        resume within the found tokens (F45); a pool that cannot be asked (no node of it answers, or the nodes share
        none) is a miss, as an unreachable pool is on one server: the blocks' answer stands (the result's
        `swa_error` says why). The pool is asked while the blocks are looked up, against every token of `hashes`
        as the bound; only when the resume it names is past the blocks found is it asked again within them (the
        longest resume under the larger bound that fits the smaller is the longest under it).

        `keep_until_s` pins the found prefix on every live copy of each of its runs (docs/RETENTION.md R28);
        `hosts` names each node holding part of it, with its run ranges (`kvstore.prefix_hosts.fleet_hosts`).
        """
        # its items checked while the first calls fly (F83)
        return self._lookup_chain(arguments.hash_list(hashes, "hashes"), own=False, lease_ms=lease_ms,
                                  swa_keys=swa_keys, swa_positions=swa_positions, swa_resume_limit=swa_resume_limit,
                                  keep_until_s=keep_until_s, hosts=hosts)

    def _lookup_chain(self, chain: list[bytes], *, own: bool, lease_ms: int, swa_keys: Sequence[bytes],
                      swa_positions: Sequence[int], swa_resume_limit: int, keep_until_s: float,
                      hosts: bool) -> FleetLookupResult:
        """`lookup_hashes` of `chain`: the caller's hashes, checked while the first round's calls fly (F83), or
        (`own`) this client's own chain of a prompt (`hashes`), every item a hash already: not checked."""
        keep_until_s, hosts = arguments.keep_time(keep_until_s), arguments.flag(hosts, "hosts")
        lease_ms = arguments.integer(lease_ms, "lease_ms", most=2**32 - 1)
        swa_keys = arguments.hashes(swa_keys, "swa_keys")
        swa_positions = [arguments.integer(p, f"swa_positions[{i}]") for i, p in enumerate(swa_positions)]
        swa_resume_limit = arguments.integer(swa_resume_limit, "swa_resume_limit", most=2**64 - 1)
        if len(swa_keys) != len(swa_positions):
            raise InvalidArgument(f"swa_keys has {len(swa_keys)} entries but swa_positions has "
                                  f"{len(swa_positions)}: send one position per key")
        if not chain:  # a prompt shorter than a block: no block, so no resume (SWA resume rule 5)
            return FleetLookupResult(found_blocks=0, found_tokens=0, lease_id=None, block_hashes=[])
        ask = partial(self._swa_resume, swa_keys, swa_positions, limit=swa_resume_limit)
        early = self._swa_executor.submit(ask, len(chain) * self.block_tokens) if swa_keys else None
        try:
            runs, found = self._find_runs(chain, lease_ms,
                                          None if own else partial(arguments.exact_hashes, chain, "hashes"))
            hashes = chain
        except arguments.NotExact:  # hashes, not all bytes (nothing is held: the round released): as bytes, again
            hashes = arguments.hashes(chain, "hashes")
            runs, found = self._find_runs(hashes, lease_ms)
        found_tokens = found.found_blocks * self.block_tokens
        kept = pin_runs(self.pool, runs, hashes, found.found_blocks, keep_until_s) if keep_until_s else None
        where = fleet_hosts(runs, found.found_blocks, self.view.nodes) if hosts else ()
        resume, swa_error = early.result() if early is not None else (None, "")
        if not found_tokens:
            resume = None
        elif resume is not None and resume[1] > found_tokens:  # past the blocks found: ask within them
            resume, swa_error = ask(found_tokens)
        return FleetLookupResult(found_blocks=found.found_blocks, found_tokens=found_tokens,
                                 lease_id=found.lease_id, block_hashes=hashes, nodes_asked=found.nodes_asked,
                                 swa_position=resume[0] if resume else None,
                                 swa_resume_tokens=resume[1] if resume else None, swa_error=swa_error,
                                 kept_until_s=kept.kept_until_s if kept else 0.0, keep_note=kept.note if kept else "",
                                 hosts=where)

    def _find_runs(self, chain: list[bytes], lease_ms: int, check: Callable[[], object] | None = None
                   ) -> tuple[tuple[RunPlacement, ...], FleetLookup]:
        """The runs of `chain` and what `lookup_runs` found of it, the guess of its boundary taken and noted (F81).
        `check` (the chain's hashes checked) runs while the first round's calls fly (F83), or before an error the
        chain's items caused is raised, so that a bad hash is named rather than what it broke."""
        pending = arguments.ChainCheck(check)
        try:
            runs = self.placement(chain)
            guess = self.found_chains.guess(chain)
        except Exception:
            pending.settle()
            raise
        found = lookup_runs(self.pool, runs, chain, lease_ms=lease_ms, retry=self.retry, refresher=self.refresher,
                            guess=guess, check=pending)
        self.found_chains.found(chain, found.found_blocks, guess)  # the next Lookup guesses from here (F81)
        return runs, found

    def _swa_resume(self, keys: list[bytes], positions: list[int], found_tokens: int, *,
                    limit: int) -> tuple[tuple[int, int] | None, str]:
        """The pool's (T, R) for the candidates within `found_tokens`, or None, and why it could not be asked."""
        try:
            return self.swa.resume(keys, positions, found_tokens=found_tokens, resume_limit=limit), ""
        except (Unavailable, FailedPrecondition) as exc:  # SWA_POOL.md rule 4: a miss, never a failed Lookup
            return None, f"{type(exc).__name__}: {exc.message}"

    def release(self, lease_id: str) -> bool:
        """Drop a fleet Lookup's lease on every node; False when some part had already expired."""
        return release_lease(self.pool, arguments.text(lease_id, "lease_id"))

    def put(self, tokens: Sequence[int], blocks: Sequence[Buffer] | torch.Tensor, *,
            extra_keys: Sequence[ExtraKey] = (), first_block: int = 0, parent: bytes | None = None,
            batch_blocks: int | None = None, on_batch: Callable[[int], None] | None = None,
            keep_until_s: float = 0.0) -> PutResult:
        """Store the blocks of `tokens` from block `first_block` on every replica of their runs (`Client.put`).

        Acknowledged only when every copy is durable; `on_batch` is called with each run's block count once
        that run is on all its replicas. `parent` is accepted and checked, not needed: the client hashes the
        prefix itself (it places runs by their first hash). `keep_until_s` pins the stored prompt, from block 0,
        on every copy of every run (docs/RETENTION.md R28): each copy's Put pins its run part's last block in its
        own transaction (R22); only runs wholly before `first_block` (not in this Put) are pinned by a Lookup.
        The answer is the earliest time any copy granted, with the copies that kept less and why.

        Raises:
            PutNotReplicated: a copy failed (which runs, which nodes, how many leading blocks are on all
                their replicas; nothing after them is acknowledged). Putting the same blocks again is safe.
            InvalidArgument: wrong block count, size or type, or a bad argument (nothing stored).
            FailedPrecondition: the block before `first_block` is not stored on its run's replicas.
        """
        tokens = arguments.token_ids(tokens)
        first_block = arguments.integer(first_block, "first_block")
        until = arguments.keep_time(keep_until_s)
        if batch_blocks is not None:
            batch_blocks = arguments.integer(batch_blocks, "batch_blocks", least=1)
        if on_batch is not None and not callable(on_batch):
            raise InvalidArgument(f"on_batch must be callable, got {type(on_batch).__name__}")
        payload = arguments.buffers(blocks, "blocks", self.block_bytes)
        chain = self.hashes(tokens, extra_keys=extra_keys)
        if len(chain) - first_block != len(payload):
            given, wanted = counted(len(payload), "block"), counted(len(chain) - first_block, "full block")
            raise InvalidArgument(f"{given} given for {wanted} of tokens from block {first_block}")
        if parent and first_block and arguments.one_hash(parent, "parent") != chain[first_block - 1]:
            raise InvalidArgument(f"parent is not the fleet hash of block {first_block - 1} of these tokens")
        end = len(chain)
        if first_block:
            self._check_parent(chain, first_block)
        runs = [RunPut(placement=r, first_block=max(r.first_block, first_block), end_block=r.end_block)
                for r in self.placement(chain) if r.end_block > first_block]
        step = min(batch_blocks or max(_PUT_BATCH_BYTES // self.block_bytes, 1), self._batch_limit)
        done = put_runs(self.pool, runs, chain=chain, tokens=tokens, payload=payload, first_block=first_block,
                        extra_keys=arguments.extra_keys(extra_keys), step=step, executor=self._executor,
                        retry=self.retry, on_batch=on_batch, replace=lambda run: self.placement(chain)[run],
                        keep_until_s=until)
        if end > first_block:  # stored on every copy: a Lookup of a longer prompt guesses its prefix so far (F81)
            self.found_chains.stored(chain, end)
        kept = None
        if until and end > first_block:
            # Runs wholly before this Put are not in it: each is pinned on its copies by a Lookup (R28).
            before = [r for r in self.placement(chain) if r.end_block <= first_block]
            earlier = pin_grants(self.pool, before, chain, first_block, until) if before else []
            kept = combine(until, [*earlier, *done.grants])
        return PutResult(block_hashes=chain[first_block:end], written_blocks=done.written_blocks,
                         existing_blocks=done.existing_blocks, kept_until_s=kept.kept_until_s if kept else 0.0,
                         keep_note=kept.note if kept else ("nothing was stored to keep" if until else ""))

    def _check_parent(self, chain: Sequence[bytes], first_block: int) -> None:
        """R6 across runs: a Put from `first_block` needs block `first_block - 1` stored on some replica of its
        run (a node checks this itself within a run, but the run before a run's first block is elsewhere).

        Raises:
            FailedPrecondition: it is not.
        """
        run = self.placement(chain[:first_block])[-1]
        have = run_found(self.pool, run, chain, self.retry).found
        if run.first_block + have < first_block:
            raise FailedPrecondition(f"block {first_block - 1} (the parent of block {first_block}) is not stored "
                                     f"on any replica of its run: {have} of its run's blocks are",
                                     hint="put the prefix first; nothing was stored")

    def get(self, tokens: Sequence[int], *, extra_keys: Sequence[ExtraKey] = (),
            first_block: int = 0, num_blocks: int | None = None) -> GetResult:
        """Fetch blocks of `tokens` (from `first_block`, `num_blocks` of them or all), each run from its
        nearest live replica."""
        first_block = arguments.integer(first_block, "first_block")
        chain = self.hashes(tokens, extra_keys=extra_keys)
        end = len(chain) if num_blocks is None else min(len(chain), first_block + arguments.integer(
            num_blocks, "num_blocks"))
        blocks: list[bytes | None] = []
        statuses: list[str] = []
        for _, status, data in self._stream(chain, first_block, end):
            blocks.append(data if status == pb.BLOCK_STATUS_FOUND else None)
            statuses.append(pb.BlockStatus.Name(status).removeprefix("BLOCK_STATUS_").lower())
        return GetResult(blocks=blocks, statuses=statuses)

    def stream_part(self, chain: Sequence[bytes], first_block: int, end_block: int) -> Iterator[tuple[int, int, bytes]]:
        """(index from `first_block`, status, data) per block [first_block, end_block) of `chain` (fleet hashes from
        block 0), each run from its nearest replica with failover (F33)."""
        chain = arguments.hashes(chain, "chain")
        return self._stream(chain, arguments.integer(first_block, "first_block"),
                            min(arguments.integer(end_block, "end_block"), len(chain)))

    def node_client(self, node_id: str) -> Client:
        """A plain `kvstore.Client` of one live node, for what reads one node's store (F48); closed with this one.

        Raises:
            Unavailable: the node is not in the view, or does not answer.
        """
        record = self.view.nodes.get(node_id)
        if record is None:
            raise Unavailable(f"node {node_id} is not in fleet {self.view.address.cluster!r} now")
        with self._swa_lock:
            found = self._node_clients.get(node_id)
            if found is not None and found.target == record.address:
                return found
        fresh = Client(record.address, **self._node_options)  # type: ignore[arg-type]
        with self._swa_lock:
            old, self._node_clients[node_id] = self._node_clients.get(node_id), fresh
        if old is not None:
            old.close()
        return fresh

    def stream(self, hashes: Sequence[bytes], *, first_block: int = 0,
               run_key: bytes | None = None) -> Iterator[tuple[int, int, bytes]]:
        """(index in `hashes`, status, data) per block of `hashes`: the fleet hashes of a chain from its block
        `first_block` on (`hashes()` of a prompt from block 0, or a slice of it that says where it starts).

        A run is placed by its first hash (F10), so the index of `hashes[0]` in the chain is what places each
        run (F68): at a run boundary (`first_block` a multiple of `run_blocks`, 0 included) every run's first
        hash is in `hashes`; from inside a run, `run_key` is that run's first hash (block
        `first_block - first_block % run_blocks` of the chain). Hashes alone do not say their index: a slice
        passed without its `first_block` is placed as a chain from block 0.

        Raises:
            InvalidArgument: `first_block` inside a run without `run_key` (pass it, or the chain from block 0
                to `stream_part`), or `run_key` not a 32-byte hash.
        """
        chain = arguments.hashes(hashes, "hashes")
        first_block = arguments.integer(first_block, "first_block")
        inside = first_block % self.run_blocks
        if not inside:  # every run's first hash is in the slice: placed by its own hashes (F68)
            return self._stream(chain, 0, len(chain))
        if run_key is None:
            start = first_block - inside
            raise InvalidArgument(
                f"stream from block {first_block} starts inside a run of {self.run_blocks} blocks: pass "
                f"run_key= (the fleet hash of block {start}, the run's first, which places it), or the chain "
                f"from block 0 to stream_part(chain, {first_block}, end)")
        return self._stream_inside(chain, inside, arguments.one_hash(run_key, "run_key"))

    def _stream_inside(self, chain: list[bytes], inside: int, run_key: bytes) -> Iterator[tuple[int, int, bytes]]:
        """`stream` of a slice from block `inside` of the run keyed `run_key`: that run's part placed by its key,
        the rest (from the next run boundary) by its own first hashes. The part's other copies are refreshed at
        its deepest block read, anchored at its depth in the run (F68a: the slice lacks the hashes above it)."""
        head = min(len(chain), self.run_blocks - inside)
        nodes = placeable(self.view.nodes)
        run = RunPlacement(run=0, first_block=0, end_block=head,
                           replicas=ranked(run_key, frozenset(nodes), max(1, min(self.copies, len(nodes)))))
        yield from stream_run_part(self.pool, run, run_key, chain[:head], retry=self.retry, refresher=self.refresher,
                                   run_offset=inside)
        for index, status, data in self._stream(chain[head:], 0, len(chain) - head):
            yield head + index, status, data

    def _stream(self, chain: Sequence[bytes], first_block: int, end_block: int) -> Iterator[tuple[int, int, bytes]]:
        if first_block >= end_block:
            return iter(())
        return stream_runs(self.pool, self.placement(chain[:end_block]), chain, first_block=first_block,
                           end_block=end_block, retry=self.retry, refresher=self.refresher)

    def node_stats(self) -> dict[str, pb.StatsResponse]:
        """Each live node's Stats (node id -> its counters); a node that does not answer is left out."""
        found = {}
        for node_id in sorted(self.view.nodes):
            try:
                c = self.pool.connection(node_id)
                found[node_id] = c.call(c.kvstore.Stats, pb.StatsRequest())
            except KVStoreError:
                continue
        return found

    # -- not in a fleet yet ------------------------------------------------

    def _not_in_a_fleet(self, what: str) -> NoReturn:
        raise FailedPrecondition(f"{what}: not available through a fleet client yet (issue 23)",
                                 hint="use a kvstore.Client of one node's host:port for it")

    @property
    def swa(self) -> FleetSwaClient:  # type: ignore[override]
        """The fleet's SWA pool (`fleet_swa.FleetSwaClient`), opened at first use through a node that serves it.

        Raises:
            FailedPrecondition: the nodes share no pool (each its own memory, or two different ones: F44).
            Unavailable: no node of the pool answers.
        """
        with self._swa_lock:
            if self._swa is None:
                from kvstore.client.fleet_swa import FleetSwaClient, swa_records

                self._swa = FleetSwaClient(
                    self.pool, lambda: swa_records(self.view.nodes, placeable(self.view.nodes)), retry=self.retry,
                    run_blocks=self.run_blocks)
            return self._swa

    def transfer(self, *, path: str = "auto", ring: bool = True) -> FleetTransferSession:  # type: ignore[override]
        """A transfer session over the fleet (`fleet_transfer.FleetTransferSession`: `fetch` of a chain, the runs
        this host's nodes hold over shared memory, the others by the bulk transport from nodes that run it or
        streamed; `read`/`write` of descriptor batches; F49, F62, F71, F73). `ring` is accepted and unused: a
        fleet session asks no ring.

        Raises:
            FailedPrecondition: "shm" where no node of this host can map the session's regions (F62).
        """
        from kvstore.client.fleet_transfer import FleetTransferSession

        return FleetTransferSession(self, path=path)

    def stats(self, *, tenant: str = "", windows: Sequence[str] = (), chart_points: int = 0) -> pb.StatsResponse:
        """Not in a fleet yet: `node_stats` gives each node's."""
        self._not_in_a_fleet("store-wide stats (node_stats() gives each node's)")

    def report_resume(self, *, prompt_tokens: int, found_tokens: int, usable_tokens: int, action: str,
                      wait: bool = True) -> Future[None]:
        """Report one resume plan to one node's stats (`Client.report_resume`; F47).

        One node is enough: the fleet's stats sum the nodes' counters (`kvstore stats` over a fleet), so the
        plan counts once. This host's node first, else this client's draw; with `wait`, the next node when one
        does not answer.
        """
        last: KVStoreError = Unavailable(f"no node of fleet {self.view.address.cluster!r} is live")
        for node_id in self.pool.read_order(_REPORT_KEY, placeable(self.view.nodes)):
            try:
                done = report_resume(self.pool.connection(node_id), prompt_tokens=prompt_tokens,
                                     found_tokens=found_tokens, usable_tokens=usable_tokens, action=action,
                                     wait=wait)
            except Unavailable as exc:
                self.pool.failed(node_id)
                last = exc
                continue
            return done
        raise last

    def transfer_stats(self) -> NoReturn:
        """Not in a fleet yet."""
        self._not_in_a_fleet("transfer stats")


ADDRESS_SCHEMES["etcd"] = FleetClient
ADDRESS_SCHEMES["etcds"] = FleetClient  # TLS to etcd (F57)

__all__ = ["FleetClient", "FleetLookupResult", "placeable"]
