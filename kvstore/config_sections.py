"""The sections of the service's settings, one frozen keyword-only dataclass per component.

Each field has a default and a docstring; each section checks its values at creation
(numbers against its `RANGES`, kvstore/config_ranges.py, and the rules between fields).
Components receive their section; kvstore/config.py gathers them into `Settings` and
fills them from TOML and the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvstore.config_ranges import MAX_BYTES, UINT32_MAX, Range, check_ranges
from kvstore.errors import ConfigError
from kvstore.fleet.endpoints import EtcdAuth, EtcdTls, check_cluster, endpoints_use_tls, parse_endpoints
from kvstore.host import usable_cpus

GiB = 1 << 30

#: The operator's floor: no block is evicted sooner after its last use.
RETENTION_FLOOR_HOURS = 72.0


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Where and how the gRPC service listens."""

    #: Address to bind. Loopback by default; set 0.0.0.0 to serve other hosts.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (printed at start).
    port: int = 50051
    #: Largest gRPC message in either direction.
    max_message_bytes: int = 128 * 1024 * 1024
    #: Seconds in-flight calls get to finish on SIGTERM.
    grace_s: float = 10.0

    RANGES: ClassVar[dict[str, Range]] = {
        "port": Range(0, 65535),
        "max_message_bytes": Range(1 << 20, 2**31 - 1),  # gRPC lengths are int32
        "grace_s": Range(0, 86400),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "server")


@dataclass(frozen=True, kw_only=True)
class StoreSettings:
    """The NVMe (LMDB) tier of global-KV blocks."""

    #: Folder holding the LMDB files.
    data_dir: Path = Path("kvstore-data")
    #: Bytes of block data the store may hold.
    capacity_bytes: int = 16 * GiB
    #: Hours a block is kept after its last write or read, at least.
    retention_hours: float = RETENTION_FLOOR_HOURS
    #: Tokens per block (a multiple of the geometry's alignment; see docs/BLOCK_SIZE.md).
    block_tokens: int = 64
    #: Most blocks in one Put, Get or Lookup.
    max_batch_blocks: int = 1024
    #: Most hashes in one Lookup (a 1M-token prompt is 15,625 blocks of 64).
    max_lookup_blocks: int = 65536
    #: Longest lease a Lookup may take, in milliseconds.
    max_lease_ms: int = 60_000
    #: Threads of the tier's executor for blocking LMDB work.
    io_threads: int = 4
    #: Window over which the recent write rate is measured, in seconds.
    write_rate_window_s: float = 3600.0
    #: Longest a pin (a Put's or Lookup's keep-until, docs/RETENTION.md R22-R27) may run past now, in hours,
    #: for a tenant without its own; 0: pins refused.
    pin_max_hours: float = 0.0
    #: Bytes of pinned prefixes one tenant may hold at once, for a tenant without its own; 0: pins refused.
    pin_budget_bytes: int = 0

    RANGES: ClassVar[dict[str, Range]] = {
        "capacity_bytes": Range(1, MAX_BYTES),
        "retention_hours": Range(RETENTION_FLOOR_HOURS, 100 * 365 * 24.0,
                                 why=f"the {RETENTION_FLOOR_HOURS:g}-hour guarantee may only be raised"),
        "block_tokens": Range(8, 1 << 16),
        "max_batch_blocks": Range(1, 1 << 20),
        "max_lookup_blocks": Range(1, 1 << 24),
        "max_lease_ms": Range(0, UINT32_MAX),
        "io_threads": Range(1, 1024),
        "write_rate_window_s": Range(0, 366 * 86400.0, lo_open=True),
        "pin_max_hours": Range(0, 100 * 365 * 24.0),
        "pin_budget_bytes": Range(0, MAX_BYTES),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "store")
        if self.block_tokens % 8:
            raise ConfigError(f"store.block_tokens = {self.block_tokens} is not a multiple of 8")

    @property
    def retention_s(self) -> float:
        """Retention in seconds."""
        return self.retention_hours * 3600.0


@dataclass(frozen=True, kw_only=True)
class SwaSettings:
    """The time-bounded DRAM pool of SWA snapshots (docs/SWA_POOL.md)."""

    #: Pool backend: "memory" (in-process, the embedded default), "redis" or "redis-cluster".
    backend: str = "memory"
    #: Seconds a snapshot lives after its put; a Put may ask for less, never more.
    ttl_s: float = 300.0
    #: Share of this node's DRAM (MemTotal in /proc/meminfo) the pool may use, when cap_bytes is 0.
    memory_fraction: float = 0.10
    #: Byte cap of the pool (per Redis node for the Redis backends); 0 derives it from memory_fraction.
    cap_bytes: int = 0
    #: The single Redis of backend "redis".
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Startup nodes of backend "redis-cluster", comma-separated host:port.
    cluster_nodes: str = "127.0.0.1:7000"
    #: Set maxmemory and maxmemory-policy on each Redis at connect (CONFIG SET); off for managed Redis.
    configure_redis: bool = True
    #: The Redis eviction policy set at connect (every pool key has a TTL, so volatile-* policies apply).
    eviction_policy: str = "volatile-lru"
    #: Prefix of every pool key in Redis, so a shared Redis can tell them apart.
    key_prefix: str = "kvstore:swa:"
    #: Seconds a Redis command may take before the pool counts an error and answers a miss.
    socket_timeout_s: float = 1.0
    #: Most snapshots in one Put, Get or Delete.
    max_batch_snapshots: int = 64
    #: Offer the direct path (SwaPool.OpenDirect) on the Redis backends: clients read and write
    #: Redis themselves as per-tenant ACL users confined to their key prefix (docs/SWA_POOL.md).
    direct: bool = True
    #: Lifetime of a direct-path ACL user; a new one is handed out at half of it, and each is
    #: deleted when its lifetime ends (so the older one has half a lifetime of grace).
    direct_user_lifetime_s: float = 600.0
    #: The Redis address clients are told ('' : redis_url's, without its credentials).
    direct_redis_url: str = ""

    RANGES: ClassVar[dict[str, Range]] = {
        "ttl_s": Range(0, UINT32_MAX / 1000, lo_open=True),  # sent as uint32 milliseconds
        "memory_fraction": Range(0, 1, lo_open=True),
        "cap_bytes": Range(0, MAX_BYTES),  # 0 derives it from memory_fraction
        "socket_timeout_s": Range(0, 3600, lo_open=True),
        "max_batch_snapshots": Range(1, 1 << 16),
        "direct_user_lifetime_s": Range(1, UINT32_MAX / 1000),  # sent as uint32 milliseconds
    }

    def __post_init__(self) -> None:
        check_ranges(self, "swa")


#: Values of `transfer.bulk`.
BULK_TRANSPORTS = ("off", "mooncake")


@dataclass(frozen=True, kw_only=True)
class TransferSettings:
    """Batched transfers into client-registered memory regions (docs/TRANSFER.md)."""

    #: Most bytes one descriptor adds to a batch's TransferState on the wire: a
    #: status byte, a write's 32-byte hash, and a failure whose reason the server
    #: cuts to 256 bytes (kvstore.transfer.MAX_REASON_BYTES).
    TRANSFER_STATE_BYTES_PER_DESCRIPTOR: ClassVar[int] = 330

    #: Unused: regions are sealed memfds now, with no name in any folder (docs/TRANSFER.md).
    #: Kept so that config files naming it still load.
    shm_dir: Path = Path("/dev/shm")
    #: Most descriptors in one batch.
    max_descriptors: int = 4096
    #: Largest region a client may register.
    max_region_bytes: int = 64 * GiB
    #: Most regions one session may hold at once.
    max_regions: int = 64
    #: Finished batches a session remembers for GetTransfer(s) (oldest dropped
    #: first); also the most batches a session may run at once.
    keep_finished: int = 1024
    #: Descriptors copied per executor call: small enough for progress to show in
    #: GetTransfer, large enough to amortise the hop to the LMDB thread.
    chunk_descriptors: int = 128
    #: Threads copying read chunks into regions at once (default: one per CPU but
    #: one, left to the lookups and the event loop; at least 1, at most 8). The
    #: native copy loop (kvstore/native/_blockcopy.c) releases the GIL, so they copy in
    #: parallel; where it is not built, copies hold the GIL and one thread is
    #: used whatever this says.
    copy_threads: int = field(default_factory=lambda: min(8, max(1, usable_cpus() - 1)))
    #: Most bytes of regions one session may map at once (their sizes summed).
    max_session_mapped_bytes: int = 64 * GiB
    #: Most bytes of regions mapped at once across every session.
    max_mapped_bytes: int = 256 * GiB
    #: Most regions mapped at once across every session: each is a mapping, and the
    #: process's mappings (vm.max_map_count, 65530 by default) are shared with LMDB
    #: and every thread's stack.
    max_mapped_regions: int = 4096
    #: Most transfer sessions open at once.
    max_sessions: int = 256
    #: Most descriptors one session's batches hold at once, running or finished and
    #: still remembered (the oldest finished are forgotten first to make room).
    max_session_descriptors: int = 1 << 18
    #: Most descriptors of running batches across every session.
    max_inflight_descriptors: int = 1 << 20
    #: Most descriptors of batches held across every session, running or finished
    #: and still remembered: what bounds the memory their results take.
    max_held_descriptors: int = 1 << 22
    #: Largest GetTransfers reply: the batches past it are left out (the reply says
    #: how many) and asked for again. Must hold one whole batch's results
    #: (TRANSFER_STATE_BYTES_PER_DESCRIPTOR each). A reply is built on the event
    #: loop: 4 MiB of failures took about 0.1 s to build on the dev box.
    max_reply_bytes: int = 4 << 20
    #: Bulk transport for clients whose regions the server cannot map (docs/TRANSFER.md
    #: "Bulk transport"): "off", or "mooncake" (Mooncake's transfer engine writes fetched
    #: blocks straight into the client's registered memory; gRPC stays the fallback).
    #: Off by default: Mooncake's engines do not authenticate peers, so any host that
    #: reaches one reads and writes its registered memory (a trusted fabric only).
    bulk: str = "off"
    #: The address the server's transfer engine names itself by: its host on the fabric.
    bulk_host: str = "127.0.0.1"
    #: Bytes of the staging pool blocks are verified into before the engine writes them
    #: (allocated and registered at the first accepted OpenBulk; pages are touched as used).
    bulk_staging_bytes: int = 256 << 20
    #: Most blocks in one BulkFetch: one staging slot (the pool holds bulk_staging_bytes of slots).
    #: Mooncake's batches of 512 writes ran 2x those of 128 on the dev box (1.4 against 0.6 GB/s).
    bulk_max_blocks: int = 512
    #: Serve BulkFetch from LMDB's map (a TCP engine registers it as bookkeeping: no copy, nothing
    #: pinned); false: every call through a staging slot (as an RDMA engine would need: it pins).
    bulk_from_map: bool = True
    #: The one-copy TCP transport (docs/TRANSFER.md "The one-copy TCP transport"): a listener
    #: beside gRPC that sends verified blocks from LMDB's map with sendmsg, offered to sessions
    #: as "tcp" (preferred over "mooncake" by clients). Its connections authenticate by a
    #: session's token (OpenBulk over the authenticated gRPC channel hands it out) but are not
    #: encrypted: off by default, on a trusted network or loopback only.
    tcp_bulk: bool = False
    #: Put over the same listener (docs/TRANSFER.md "Put over the one-copy TCP transport"): a
    #: client's large Put gets a one-use grant from OpenPut over gRPC (the "write" right and the
    #: request rate checked as for PutStream) and sends its blocks as raw bytes. Not encrypted
    #: either: on by default because the listener binds `tcp_host`, loopback unless an operator
    #: names another address; off, every Put goes by gRPC.
    tcp_put: bool = True
    #: Where the listener binds; clients dial the host they dial for gRPC at `tcp_port`.
    tcp_host: str = "127.0.0.1"
    #: The listener's port (0: a free port, told to clients in OpenBulk's reply).
    tcp_port: int = 0
    #: Most connections served at once; one past it gets a RESOURCE_EXHAUSTED frame and is closed.
    tcp_max_connections: int = 64
    #: Most block bytes one request may ask for (its blocks times the block size).
    tcp_max_request_bytes: int = 64 << 20
    #: Seconds a frame's rest (and a reply's send) may take once begun; an idle connection is
    #: closed after `tcp_idle_s`.
    tcp_timeout_s: float = 30.0
    tcp_idle_s: float = 300.0

    RANGES: ClassVar[dict[str, Range]] = {
        "max_session_mapped_bytes": Range(1, MAX_BYTES),
        "max_mapped_bytes": Range(1, MAX_BYTES),
        "max_mapped_regions": Range(1, 1 << 20),
        "max_sessions": Range(1, 1 << 20),
        "max_session_descriptors": Range(1, 1 << 32),
        "max_inflight_descriptors": Range(1, 1 << 32),
        "max_held_descriptors": Range(1, 1 << 32),
        "max_reply_bytes": Range(1 << 16, 1 << 31),
        "max_descriptors": Range(1, 1 << 20),
        "max_region_bytes": Range(1, MAX_BYTES),
        "max_regions": Range(1, 1 << 16),
        "keep_finished": Range(1, 1 << 20),
        "chunk_descriptors": Range(1, 1 << 20),
        "copy_threads": Range(1, 256),
        "bulk_staging_bytes": Range(1 << 20, 1 << 40),
        # Mooncake's TCP transport refused a batch of 4,096 writes (its lane queue was full).
        "bulk_max_blocks": Range(1, 512),
        "tcp_port": Range(0, 65535),
        "tcp_max_connections": Range(1, 4096),
        "tcp_max_request_bytes": Range(1 << 16, 1 << 31),
        "tcp_timeout_s": Range(0, 3600, lo_open=True),
        "tcp_idle_s": Range(0, 86400, lo_open=True),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "transfer")
        if self.bulk not in BULK_TRANSPORTS:
            raise ConfigError(f"transfer.bulk = {self.bulk!r}: use one of {', '.join(BULK_TRANSPORTS)}")
        if not (self.max_descriptors <= self.max_session_descriptors <= self.max_inflight_descriptors
                <= self.max_held_descriptors):
            raise ConfigError(f"transfer: max_descriptors ({self.max_descriptors}) <= max_session_descriptors "
                              f"({self.max_session_descriptors}) <= max_inflight_descriptors "
                              f"({self.max_inflight_descriptors}) <= max_held_descriptors "
                              f"({self.max_held_descriptors}) must hold, else a batch could never run")
        need = self.max_descriptors * self.TRANSFER_STATE_BYTES_PER_DESCRIPTOR + (1 << 10)
        if self.max_reply_bytes < need:
            raise ConfigError(f"transfer.max_reply_bytes = {self.max_reply_bytes} cannot hold one batch's results: "
                              f"max_descriptors {self.max_descriptors} needs {need}")


@dataclass(frozen=True, kw_only=True)
class AuthSettings:
    """Tenants and their API tokens (docs/SECURITY.md)."""

    #: The tenants file (token hashes, `kvstore tenant`); '' means `<store.data_dir>/tenants.json`.
    #: Auth is on once it exists.
    tenants_file: str = ""
    #: Demand a token on every call even while no tenants file exists (every call refused until one does).
    required: bool = False
    #: Seconds between checks of the tenants file for changes (a created or revoked token takes effect).
    reload_s: float = 1.0
    #: Serve beyond loopback without tokens or TLS (`kvstore serve --insecure`): a trusted network only.
    insecure: bool = False

    RANGES: ClassVar[dict[str, Range]] = {"reload_s": Range(0, 3600, lo_open=True)}

    def __post_init__(self) -> None:
        check_ranges(self, "auth")

    def tenants_path(self, data_dir: Path) -> Path:
        """Where the tenants file is for a store in `data_dir`."""
        return Path(self.tenants_file) if self.tenants_file else data_dir / "tenants.json"


@dataclass(frozen=True, kw_only=True)
class TlsSettings:
    """TLS of the gRPC port, from PEM files (off while cert_file is empty)."""

    #: The server's certificate chain (PEM); setting it turns TLS on.
    cert_file: str = ""
    #: The server's private key (PEM).
    key_file: str = ""
    #: CA certificates (PEM) that client certificates must chain to; setting it demands one (mutual TLS).
    client_ca_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls.cert_file and tls.key_file go together: set both or neither")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.client_ca_file (mutual TLS) needs tls.cert_file and tls.key_file")

    @property
    def enabled(self) -> bool:
        """Whether the port speaks TLS."""
        return bool(self.cert_file)


@dataclass(frozen=True, kw_only=True)
class MetricsSettings:
    """The Prometheus endpoint (docs/METRICS.md): plain HTTP, showing tenant names; keep it off public networks."""

    #: Bind address of the HTTP endpoint. Beyond loopback `kvstore serve` refuses it unless `insecure`
    #: (or auth.insecure) is set: the endpoint has no tokens nor TLS and shows tenant names.
    host: str = "127.0.0.1"
    #: TCP port of the endpoint; 0 (the default) leaves it off. The deploy files use 9464.
    port: int = 0
    #: Distinct tenants with a label of their own; later ones are counted as "other".
    tenant_labels: int = 64
    #: Serve the endpoint beyond loopback (a Prometheus on another host): a trusted network only.
    insecure: bool = False

    RANGES: ClassVar[dict[str, Range]] = {"port": Range(0, 65535), "tenant_labels": Range(1, 10000)}

    def __post_init__(self) -> None:
        check_ranges(self, "metrics")


@dataclass(frozen=True, kw_only=True)
class EventsSettings:
    """KV cache events in vLLM's format over ZMQ (docs/EVENTS.md): what the store stores and evicts, for routers.

    Off by default. The sockets are plain ZMQ without tokens or TLS and the events name tenants and block
    hashes: beyond loopback `kvstore serve` refuses them unless `insecure` (or auth.insecure) is set.
    """

    #: Publish events. Needs pyzmq and msgspec (`pip install kvstore[events]`).
    enabled: bool = False
    #: The PUB socket subscribers connect to (bound by the server).
    endpoint: str = "tcp://127.0.0.1:5557"
    #: The ROUTER socket answering replay requests (a start sequence number); '' = no replay socket.
    replay_endpoint: str = "tcp://127.0.0.1:5558"
    #: First part of every batch's topic: `<topic>/<tenant>/` (a router of one tenant subscribes to its own).
    topic: str = "kv-events"
    #: Batches waiting to be sent; past it a batch is dropped from the live stream (counted; still replayable).
    queue_batches: int = 10_000
    #: Batches kept in the store's event log for replay, the newest; older ones are trimmed as new ones commit.
    replay_batches: int = 10_000
    #: ZMQ high-water mark of the PUB socket (messages queued per subscriber before ZMQ drops for it).
    hwm: int = 100_000
    #: Bind the sockets beyond loopback (routers on other hosts): a trusted network only.
    insecure: bool = False
    #: Put each stored block's token ids (the Put's own) on its live BlockStored event, for routers that key
    #: blocks by hashes of the tokens (Dynamo's KV router, llm-d's indexer; docs/EVENTS.md E10). Memory only:
    #: the replay log's copies carry none. The tokens are the tenant's prompt: subscribers see them.
    token_ids: bool = False

    RANGES: ClassVar[dict[str, Range]] = {
        "queue_batches": Range(1, 10_000_000),
        "replay_batches": Range(1, 10_000_000),
        "hwm": Range(0, 10_000_000),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "events")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if (value or name == "endpoint") and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"events.{name} = {value!r} is not a ZMQ endpoint",
                                  hint="write tcp://HOST:PORT (or ipc://PATH)")
        if "/" in self.topic:
            raise ConfigError(f"events.topic = {self.topic!r} may not hold '/': it separates the tenant")


@dataclass(frozen=True, kw_only=True)
class TraceSettings:
    """The server's own access trace (docs/CAPACITY.md, "Recording"): one record per call, zstd-compressed files.

    Off by default. Records hold times, tenants, block hashes cut to `hash_bytes` and counts, never tokens
    nor block bytes. A writer task writes them off the request path; when it falls behind (a full queue) or
    the disk fails, records are dropped and counted (kvstore_trace_dropped_records), never a call.
    """

    #: Record the trace.
    enabled: bool = False
    #: The folder of the trace files; '' = <store.data_dir>/trace.
    dir: str = ""
    #: Start a new file once the current one would pass this many (compressed) bytes.
    file_bytes: int = 64 * 1024 * 1024
    #: Bytes of trace files kept in the folder, all together: the oldest files go to stay under it.
    max_bytes: int = GiB
    #: Records waiting for the writer; past it (or past `queue_bytes`) a record is dropped and counted.
    queue_records: int = 10_000
    #: Bytes waiting for the writer (a record: its hashes, `hash_bytes` each, and 200); past it records are dropped.
    queue_bytes: int = 64 * 1024 * 1024
    #: Leading bytes of each block hash recorded (8: a collision among a trace's blocks is ~never).
    hash_bytes: int = 8
    #: Seconds the writer gathers records into one compressed frame (a frame is the unit a crash can cut).
    flush_s: float = 1.0
    #: zstd compression level.
    level: int = 3

    RANGES: ClassVar[dict[str, Range]] = {
        "file_bytes": Range(4096, MAX_BYTES),
        "max_bytes": Range(4096, MAX_BYTES),
        "queue_records": Range(1, 10_000_000),
        "queue_bytes": Range(1024, MAX_BYTES),
        "hash_bytes": Range(4, 32, why="a block hash is 32 bytes; fewer than 4 would make ids collide"),
        "flush_s": Range(0, 3600),
        "level": Range(1, 22),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "trace")
        if self.file_bytes > self.max_bytes:
            raise ConfigError(f"trace.file_bytes = {self.file_bytes} is more than trace.max_bytes = "
                              f"{self.max_bytes}: one file would pass the cap on all of them",
                              hint="raise max_bytes or lower file_bytes")

    def path(self, data_dir: Path) -> Path:
        """The trace folder: `dir`, or <data_dir>/trace."""
        return Path(self.dir) if self.dir else data_dir / "trace"


@dataclass(frozen=True, kw_only=True)
class FleetSettings:
    """Membership of a fleet of storage nodes in etcd (docs/FLEET.md); off, a single node, while `etcd` is ''."""

    #: etcd client endpoints, comma-separated `host:port`, `http://host:port` or `https://host:port` (TLS, every
    #: member alike); '' = no fleet (today's single node).
    etcd: str = ""
    #: CA certificates (PEM) etcd's own certificate is checked against; setting it (or any etcd_* file, or
    #: https:// endpoints) speaks TLS to etcd; '' with TLS on = the system's roots (docs/FLEET.md F57).
    etcd_ca_file: str = ""
    #: This process's certificate (PEM) shown to an etcd run with --client-cert-auth; '' = none. With etcd_key_file.
    etcd_cert_file: str = ""
    #: The key of etcd_cert_file; '' = none.
    etcd_key_file: str = ""
    #: The etcd user this process authenticates as, where etcd's auth is enabled (F70); '' = none. With
    #: etcd_password_file.
    etcd_user: str = ""
    #: A file holding etcd_user's password (its first line; never the password itself in the config);
    #: '' = none.
    etcd_password_file: str = ""
    #: The fleet's name: its records live under `/kvstore/<cluster>/` (one etcd may hold several fleets).
    cluster: str = "default"
    #: Seconds a node's registration outlives its last keep-alive: a node that dies leaves the view within this.
    lease_ttl_s: int = 10
    #: Contiguous blocks placed together (256 blocks of 64 tokens = 16,384 tokens: a 1M-token prompt is 62 runs).
    run_blocks: int = 256
    #: Copies of every block, where the fleet has that many nodes (fewer nodes: one copy on each).
    replication: int = 2
    #: The address clients and other nodes reach this node at; '' = server.host:port (this host's name when the
    #: server binds every address).
    advertise: str = ""
    #: A file holding the fleet's token, which nodes present to each other's Fleet service (a right no tenant
    #: token has); '' = none: nodes take Fleet calls only while tenant auth is off (docs/FLEET.md F20).
    token_file: str = ""
    #: CA certificates (PEM) a node checks other nodes' certificates against when [tls] is on; '' = the node's
    #: own tls.cert_file (one certificate naming every node, or a bundle). Under mutual TLS a node shows its own
    #: certificate to the others, so it must allow client auth too.
    ca_file: str = ""
    #: Bytes a second a node copies to other nodes while re-replicating (token bucket): a tenth of an NVMe's
    #: ~2 GB/s, so foreground Puts and Gets keep the rest of the disk (F18).
    repair_bytes_per_s: int = 200_000_000
    #: Seconds between re-replication passes while membership does not change (a change starts one at once); a
    #: pass reads every held block's meta record, minutes of a core on a full 8 TB node.
    repair_interval_s: float = 300.0
    #: A gateway's Get of several runs reads the next run while it answers this one (F69); false: one run
    #: after another.
    read_ahead: bool = True

    RANGES: ClassVar[dict[str, Range]] = {
        "lease_ttl_s": Range(2, 3600, why="etcd grants no lease shorter than 2 s"),
        "run_blocks": Range(1, 1 << 20),
        "replication": Range(1, 5),
        "repair_bytes_per_s": Range(1 << 16, 1 << 40),
        "repair_interval_s": Range(0.1, 86_400),
    }

    def __post_init__(self) -> None:
        check_ranges(self, "fleet")
        check_cluster(self.cluster)
        parse_endpoints(self.etcd)  # refuse a malformed endpoint at load, not at the first call
        _ = self.etcd_tls  # refuse mixed schemes, or a certificate without its key, at load too
        _ = self.etcd_auth  # refuse a user without its password file, or the other way round (F70)

    @property
    def etcd_tls(self) -> EtcdTls | None:
        """TLS to etcd: on with https:// endpoints or any etcd_* file set (F57); None: plaintext."""
        files = EtcdTls(ca_file=self.etcd_ca_file, cert_file=self.etcd_cert_file, key_file=self.etcd_key_file)
        if endpoints_use_tls(self.etcd) or files != EtcdTls():
            return files
        return None

    @property
    def etcd_auth(self) -> EtcdAuth | None:
        """etcd's user authentication (F70): etcd_user with etcd_password_file; None: none."""
        if not self.etcd_user and not self.etcd_password_file:
            return None
        return EtcdAuth(user=self.etcd_user, password_file=self.etcd_password_file)

    @property
    def enabled(self) -> bool:
        """Whether this node joins a fleet (etcd endpoints are set)."""
        return bool(parse_endpoints(self.etcd))  # " , " names none: a single node, not a fleet of nothing
