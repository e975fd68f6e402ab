from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATUS_UNSPECIFIED: _ClassVar[BlockStatus]
    BLOCK_STATUS_FOUND: _ClassVar[BlockStatus]
    BLOCK_STATUS_MISSING: _ClassVar[BlockStatus]
    BLOCK_STATUS_CORRUPT: _ClassVar[BlockStatus]

class ResumeAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESUME_ACTION_UNSPECIFIED: _ClassVar[ResumeAction]
    RESUME_ACTION_FETCH_SNAPSHOT: _ClassVar[ResumeAction]
    RESUME_ACTION_BOUNDED_REPLAY: _ClassVar[ResumeAction]
    RESUME_ACTION_EXACT_REPLAY: _ClassVar[ResumeAction]
    RESUME_ACTION_FULL_PREFILL: _ClassVar[ResumeAction]
BLOCK_STATUS_UNSPECIFIED: BlockStatus
BLOCK_STATUS_FOUND: BlockStatus
BLOCK_STATUS_MISSING: BlockStatus
BLOCK_STATUS_CORRUPT: BlockStatus
RESUME_ACTION_UNSPECIFIED: ResumeAction
RESUME_ACTION_FETCH_SNAPSHOT: ResumeAction
RESUME_ACTION_BOUNDED_REPLAY: ResumeAction
RESUME_ACTION_EXACT_REPLAY: ResumeAction
RESUME_ACTION_FULL_PREFILL: ResumeAction

class GeometryInfo(_message.Message):
    __slots__ = ("name", "fingerprint", "block_bytes", "bytes_per_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: bytes
    block_bytes: int
    bytes_per_token: float
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., bytes_per_token: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("block_tokens", "geometries", "max_batch_blocks", "max_message_bytes", "retention_hours", "max_lease_ms", "version", "tenant", "run_blocks", "lookup_packed_hashes", "lookup_anchors", "replay_fidelity")
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HOURS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RUN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ANCHORS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIDELITY_FIELD_NUMBER: _ClassVar[int]
    block_tokens: int
    geometries: _containers.RepeatedCompositeFieldContainer[GeometryInfo]
    max_batch_blocks: int
    max_message_bytes: int
    retention_hours: float
    max_lease_ms: int
    version: str
    tenant: str
    run_blocks: int
    lookup_packed_hashes: bool
    lookup_anchors: bool
    replay_fidelity: str
    def __init__(self, block_tokens: _Optional[int] = ..., geometries: _Optional[_Iterable[_Union[GeometryInfo, _Mapping]]] = ..., max_batch_blocks: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., retention_hours: _Optional[float] = ..., max_lease_ms: _Optional[int] = ..., version: _Optional[str] = ..., tenant: _Optional[str] = ..., run_blocks: _Optional[int] = ..., lookup_packed_hashes: _Optional[bool] = ..., lookup_anchors: _Optional[bool] = ..., replay_fidelity: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "block_hashes", "lease_ms", "swa_keys", "swa_positions", "swa_resume_limit", "swa_found_tokens", "block_hashes_packed", "anchor_hash", "anchor_blocks", "keep_until_s", "want_hosts", "run_lengths", "run_anchors", "run_hashed")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SWA_KEYS_FIELD_NUMBER: _ClassVar[int]
    SWA_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SWA_RESUME_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SWA_FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_PACKED_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_HASH_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEEP_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    WANT_HOSTS_FIELD_NUMBER: _ClassVar[int]
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    RUN_ANCHORS_FIELD_NUMBER: _ClassVar[int]
    RUN_HASHED_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    swa_keys: _containers.RepeatedScalarFieldContainer[bytes]
    swa_positions: _containers.RepeatedScalarFieldContainer[int]
    swa_resume_limit: int
    swa_found_tokens: int
    block_hashes_packed: bytes
    anchor_hash: bytes
    anchor_blocks: int
    keep_until_s: float
    want_hosts: bool
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    run_anchors: bool
    run_hashed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., swa_keys: _Optional[_Iterable[bytes]] = ..., swa_positions: _Optional[_Iterable[int]] = ..., swa_resume_limit: _Optional[int] = ..., swa_found_tokens: _Optional[int] = ..., block_hashes_packed: _Optional[bytes] = ..., anchor_hash: _Optional[bytes] = ..., anchor_blocks: _Optional[int] = ..., keep_until_s: _Optional[float] = ..., want_hosts: _Optional[bool] = ..., run_lengths: _Optional[_Iterable[int]] = ..., run_anchors: _Optional[bool] = ..., run_hashed: _Optional[_Iterable[bool]] = ...) -> None: ...

class PrefixHost(_message.Message):
    __slots__ = ("node_id", "host", "host_id", "address", "block_ranges", "colocated", "data_dir")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_RANGES_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    DATA_DIR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    host_id: str
    address: str
    block_ranges: _containers.RepeatedScalarFieldContainer[int]
    colocated: bool
    data_dir: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., host_id: _Optional[str] = ..., address: _Optional[str] = ..., block_ranges: _Optional[_Iterable[int]] = ..., colocated: _Optional[bool] = ..., data_dir: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found_blocks", "found_tokens", "lease_id", "lease_ms", "swa_found", "swa_position", "swa_resume_tokens", "swa_index", "anchor_unknown", "kept_until_s", "keep_note", "hosts", "run_found_blocks", "run_lease_ids")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SWA_FOUND_FIELD_NUMBER: _ClassVar[int]
    SWA_POSITION_FIELD_NUMBER: _ClassVar[int]
    SWA_RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_INDEX_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    KEPT_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_NOTE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    RUN_FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUN_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    found_tokens: int
    lease_id: str
    lease_ms: int
    swa_found: bool
    swa_position: int
    swa_resume_tokens: int
    swa_index: int
    anchor_unknown: bool
    kept_until_s: float
    keep_note: str
    hosts: _containers.RepeatedCompositeFieldContainer[PrefixHost]
    run_found_blocks: _containers.RepeatedScalarFieldContainer[int]
    run_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, found_blocks: _Optional[int] = ..., found_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., swa_found: _Optional[bool] = ..., swa_position: _Optional[int] = ..., swa_resume_tokens: _Optional[int] = ..., swa_index: _Optional[int] = ..., anchor_unknown: _Optional[bool] = ..., kept_until_s: _Optional[float] = ..., keep_note: _Optional[str] = ..., hosts: _Optional[_Iterable[_Union[PrefixHost, _Mapping]]] = ..., run_found_blocks: _Optional[_Iterable[int]] = ..., run_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "parent_hash", "token_ids", "extra_keys", "blocks", "first_block", "run_key", "run_bridge", "keep_until_s", "parent_run_key")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    RUN_BRIDGE_FIELD_NUMBER: _ClassVar[int]
    KEEP_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    blocks: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    run_key: bytes
    run_bridge: bytes
    keep_until_s: float
    parent_run_key: bytes
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., blocks: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., run_key: _Optional[bytes] = ..., run_bridge: _Optional[bytes] = ..., keep_until_s: _Optional[float] = ..., parent_run_key: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("block_hashes", "written_blocks", "existing_blocks", "kept_until_s", "keep_note")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEPT_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_NOTE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    written_blocks: int
    existing_blocks: int
    kept_until_s: float
    keep_note: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., written_blocks: _Optional[int] = ..., existing_blocks: _Optional[int] = ..., kept_until_s: _Optional[float] = ..., keep_note: _Optional[str] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "block_hashes", "first_block", "run_key")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    run_key: bytes
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., run_key: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("index", "status", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: BlockStatus
    data: bytes
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[BlockStatus, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant", "windows", "chart_points")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    CHART_POINTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    windows: _containers.RepeatedScalarFieldContainer[str]
    chart_points: int
    def __init__(self, tenant: _Optional[str] = ..., windows: _Optional[_Iterable[str]] = ..., chart_points: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("lookups", "lookup_tokens_asked", "lookup_tokens_found", "gets", "get_tokens_asked", "get_tokens_returned", "puts", "blocks_written", "bytes_written", "rejected_puts", "evictions", "evicted_bytes", "corrupt_blocks", "blocks_stored", "bytes_stored", "capacity_bytes", "bytes_free", "write_rate_bytes_per_s", "headroom_hours", "retention_hours", "active_leases", "uptime_s", "stored_by_geometry", "resume_plans", "resume_prompt_tokens", "resume_found_tokens", "resume_usable_tokens", "resume_fetch_snapshot_plans", "resume_bounded_replay_plans", "resume_exact_replay_plans", "resume_full_prefill_plans", "windows", "tenants", "chart", "run_started_at_s", "counted_since_s", "capacity_hours", "write_rate_window_s", "headroom_warning", "store_wide", "trace")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_ASKED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FOUND_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GET_TOKENS_ASKED_FIELD_NUMBER: _ClassVar[int]
    GET_TOKENS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREE_FIELD_NUMBER: _ClassVar[int]
    WRITE_RATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_HOURS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HOURS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STORED_BY_GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    RESUME_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FETCH_SNAPSHOT_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_BOUNDED_REPLAY_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_EXACT_REPLAY_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FULL_PREFILL_PLANS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    CHART_FIELD_NUMBER: _ClassVar[int]
    RUN_STARTED_AT_S_FIELD_NUMBER: _ClassVar[int]
    COUNTED_SINCE_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_HOURS_FIELD_NUMBER: _ClassVar[int]
    WRITE_RATE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_WARNING_FIELD_NUMBER: _ClassVar[int]
    STORE_WIDE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    lookup_tokens_asked: int
    lookup_tokens_found: int
    gets: int
    get_tokens_asked: int
    get_tokens_returned: int
    puts: int
    blocks_written: int
    bytes_written: int
    rejected_puts: int
    evictions: int
    evicted_bytes: int
    corrupt_blocks: int
    blocks_stored: int
    bytes_stored: int
    capacity_bytes: int
    bytes_free: int
    write_rate_bytes_per_s: float
    headroom_hours: float
    retention_hours: float
    active_leases: int
    uptime_s: float
    stored_by_geometry: _containers.RepeatedCompositeFieldContainer[GeometryUsage]
    resume_plans: int
    resume_prompt_tokens: int
    resume_found_tokens: int
    resume_usable_tokens: int
    resume_fetch_snapshot_plans: int
    resume_bounded_replay_plans: int
    resume_exact_replay_plans: int
    resume_full_prefill_plans: int
    windows: _containers.RepeatedCompositeFieldContainer[HitWindow]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantHits]
    chart: _containers.RepeatedCompositeFieldContainer[HitPoint]
    run_started_at_s: float
    counted_since_s: float
    capacity_hours: float
    write_rate_window_s: float
    headroom_warning: bool
    store_wide: bool
    trace: TraceCounters
    def __init__(self, lookups: _Optional[int] = ..., lookup_tokens_asked: _Optional[int] = ..., lookup_tokens_found: _Optional[int] = ..., gets: _Optional[int] = ..., get_tokens_asked: _Optional[int] = ..., get_tokens_returned: _Optional[int] = ..., puts: _Optional[int] = ..., blocks_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., rejected_puts: _Optional[int] = ..., evictions: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., bytes_free: _Optional[int] = ..., write_rate_bytes_per_s: _Optional[float] = ..., headroom_hours: _Optional[float] = ..., retention_hours: _Optional[float] = ..., active_leases: _Optional[int] = ..., uptime_s: _Optional[float] = ..., stored_by_geometry: _Optional[_Iterable[_Union[GeometryUsage, _Mapping]]] = ..., resume_plans: _Optional[int] = ..., resume_prompt_tokens: _Optional[int] = ..., resume_found_tokens: _Optional[int] = ..., resume_usable_tokens: _Optional[int] = ..., resume_fetch_snapshot_plans: _Optional[int] = ..., resume_bounded_replay_plans: _Optional[int] = ..., resume_exact_replay_plans: _Optional[int] = ..., resume_full_prefill_plans: _Optional[int] = ..., windows: _Optional[_Iterable[_Union[HitWindow, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantHits, _Mapping]]] = ..., chart: _Optional[_Iterable[_Union[HitPoint, _Mapping]]] = ..., run_started_at_s: _Optional[float] = ..., counted_since_s: _Optional[float] = ..., capacity_hours: _Optional[float] = ..., write_rate_window_s: _Optional[float] = ..., headroom_warning: _Optional[bool] = ..., store_wide: _Optional[bool] = ..., trace: _Optional[_Union[TraceCounters, _Mapping]] = ...) -> None: ...

class TraceCounters(_message.Message):
    __slots__ = ("enabled", "written_records", "dropped_records", "written_bytes", "files_written", "files_removed", "queued_records", "bytes_on_disk")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    FILES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    written_records: int
    dropped_records: int
    written_bytes: int
    files_written: int
    files_removed: int
    queued_records: int
    bytes_on_disk: int
    def __init__(self, enabled: _Optional[bool] = ..., written_records: _Optional[int] = ..., dropped_records: _Optional[int] = ..., written_bytes: _Optional[int] = ..., files_written: _Optional[int] = ..., files_removed: _Optional[int] = ..., queued_records: _Optional[int] = ..., bytes_on_disk: _Optional[int] = ...) -> None: ...

class HitCounts(_message.Message):
    __slots__ = ("lookups", "lookup_blocks_asked", "lookup_blocks_found", "lookup_tokens_asked", "lookup_tokens_found", "gets", "get_blocks_asked", "get_blocks_returned", "get_tokens_asked", "get_tokens_returned", "swa_gets", "swa_snapshots_asked", "swa_snapshots_found", "resume_plans", "resume_prompt_tokens", "resume_found_tokens", "resume_usable_tokens", "resume_fetch_snapshot_plans", "resume_bounded_replay_plans", "resume_exact_replay_plans", "resume_full_prefill_plans")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_ASKED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FOUND_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_ASKED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FOUND_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCKS_ASKED_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCKS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    GET_TOKENS_ASKED_FIELD_NUMBER: _ClassVar[int]
    GET_TOKENS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    SWA_GETS_FIELD_NUMBER: _ClassVar[int]
    SWA_SNAPSHOTS_ASKED_FIELD_NUMBER: _ClassVar[int]
    SWA_SNAPSHOTS_FOUND_FIELD_NUMBER: _ClassVar[int]
    RESUME_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FETCH_SNAPSHOT_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_BOUNDED_REPLAY_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_EXACT_REPLAY_PLANS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FULL_PREFILL_PLANS_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    lookup_blocks_asked: int
    lookup_blocks_found: int
    lookup_tokens_asked: int
    lookup_tokens_found: int
    gets: int
    get_blocks_asked: int
    get_blocks_returned: int
    get_tokens_asked: int
    get_tokens_returned: int
    swa_gets: int
    swa_snapshots_asked: int
    swa_snapshots_found: int
    resume_plans: int
    resume_prompt_tokens: int
    resume_found_tokens: int
    resume_usable_tokens: int
    resume_fetch_snapshot_plans: int
    resume_bounded_replay_plans: int
    resume_exact_replay_plans: int
    resume_full_prefill_plans: int
    def __init__(self, lookups: _Optional[int] = ..., lookup_blocks_asked: _Optional[int] = ..., lookup_blocks_found: _Optional[int] = ..., lookup_tokens_asked: _Optional[int] = ..., lookup_tokens_found: _Optional[int] = ..., gets: _Optional[int] = ..., get_blocks_asked: _Optional[int] = ..., get_blocks_returned: _Optional[int] = ..., get_tokens_asked: _Optional[int] = ..., get_tokens_returned: _Optional[int] = ..., swa_gets: _Optional[int] = ..., swa_snapshots_asked: _Optional[int] = ..., swa_snapshots_found: _Optional[int] = ..., resume_plans: _Optional[int] = ..., resume_prompt_tokens: _Optional[int] = ..., resume_found_tokens: _Optional[int] = ..., resume_usable_tokens: _Optional[int] = ..., resume_fetch_snapshot_plans: _Optional[int] = ..., resume_bounded_replay_plans: _Optional[int] = ..., resume_exact_replay_plans: _Optional[int] = ..., resume_full_prefill_plans: _Optional[int] = ...) -> None: ...

class HitWindow(_message.Message):
    __slots__ = ("window", "seconds", "counts")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    window: str
    seconds: float
    counts: HitCounts
    def __init__(self, window: _Optional[str] = ..., seconds: _Optional[float] = ..., counts: _Optional[_Union[HitCounts, _Mapping]] = ...) -> None: ...

class TenantHits(_message.Message):
    __slots__ = ("tenant", "windows", "usage_known", "token_hours", "blocks_stored", "bytes_stored", "pins", "pinned_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    USAGE_KNOWN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HOURS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    windows: _containers.RepeatedCompositeFieldContainer[HitWindow]
    usage_known: bool
    token_hours: float
    blocks_stored: int
    bytes_stored: int
    pins: int
    pinned_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., windows: _Optional[_Iterable[_Union[HitWindow, _Mapping]]] = ..., usage_known: _Optional[bool] = ..., token_hours: _Optional[float] = ..., blocks_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., pins: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class HitPoint(_message.Message):
    __slots__ = ("start_s", "seconds", "counts")
    START_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    start_s: float
    seconds: float
    counts: HitCounts
    def __init__(self, start_s: _Optional[float] = ..., seconds: _Optional[float] = ..., counts: _Optional[_Union[HitCounts, _Mapping]] = ...) -> None: ...

class GeometryUsage(_message.Message):
    __slots__ = ("fingerprint", "name", "blocks_stored", "bytes_stored")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    name: str
    blocks_stored: int
    bytes_stored: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., name: _Optional[str] = ..., blocks_stored: _Optional[int] = ..., bytes_stored: _Optional[int] = ...) -> None: ...

class ReportResumeRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "prompt_tokens", "found_tokens", "usable_tokens", "action")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FOUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    prompt_tokens: int
    found_tokens: int
    usable_tokens: int
    action: ResumeAction
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., found_tokens: _Optional[int] = ..., usable_tokens: _Optional[int] = ..., action: _Optional[_Union[ResumeAction, str]] = ...) -> None: ...

class ReportResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "block_hashes")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ("statuses", "dropped_blocks")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[BlockStatus]
    dropped_blocks: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., dropped_blocks: _Optional[int] = ...) -> None: ...
