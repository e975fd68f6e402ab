from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_OP_UNSPECIFIED: _ClassVar[TransferOp]
    TRANSFER_OP_READ: _ClassVar[TransferOp]
    TRANSFER_OP_WRITE: _ClassVar[TransferOp]

class DescriptorStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DESCRIPTOR_STATUS_PENDING: _ClassVar[DescriptorStatus]
    DESCRIPTOR_STATUS_DONE: _ClassVar[DescriptorStatus]
    DESCRIPTOR_STATUS_MISSING: _ClassVar[DescriptorStatus]
    DESCRIPTOR_STATUS_SKIPPED: _ClassVar[DescriptorStatus]
    DESCRIPTOR_STATUS_FAILED: _ClassVar[DescriptorStatus]
TRANSFER_OP_UNSPECIFIED: TransferOp
TRANSFER_OP_READ: TransferOp
TRANSFER_OP_WRITE: TransferOp
DESCRIPTOR_STATUS_PENDING: DescriptorStatus
DESCRIPTOR_STATUS_DONE: DescriptorStatus
DESCRIPTOR_STATUS_MISSING: DescriptorStatus
DESCRIPTOR_STATUS_SKIPPED: DescriptorStatus
DESCRIPTOR_STATUS_FAILED: DescriptorStatus

class OpenSessionRequest(_message.Message):
    __slots__ = ("geometry", "namespace")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "max_descriptors", "max_region_bytes", "max_regions", "keep_finished", "max_session_descriptors", "max_session_mapped_bytes", "bulk_transports")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    MAX_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REGIONS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BULK_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_descriptors: int
    max_region_bytes: int
    max_regions: int
    keep_finished: int
    max_session_descriptors: int
    max_session_mapped_bytes: int
    bulk_transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., max_descriptors: _Optional[int] = ..., max_region_bytes: _Optional[int] = ..., max_regions: _Optional[int] = ..., keep_finished: _Optional[int] = ..., max_session_descriptors: _Optional[int] = ..., max_session_mapped_bytes: _Optional[int] = ..., bulk_transports: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("session_id", "shm_name", "size_bytes", "nonce", "pid", "fd", "ring")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shm_name: str
    size_bytes: int
    nonce: bytes
    pid: int
    fd: int
    ring: bool
    def __init__(self, session_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., nonce: _Optional[bytes] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., ring: _Optional[bool] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id", "shared", "reason", "ring_descriptors", "ring_lease_ms")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RING_DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    RING_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    shared: bool
    reason: str
    ring_descriptors: int
    ring_lease_ms: int
    def __init__(self, region_id: _Optional[int] = ..., shared: _Optional[bool] = ..., reason: _Optional[str] = ..., ring_descriptors: _Optional[int] = ..., ring_lease_ms: _Optional[int] = ...) -> None: ...

class DeregisterRegionRequest(_message.Message):
    __slots__ = ("session_id", "region_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    region_id: int
    def __init__(self, session_id: _Optional[str] = ..., region_id: _Optional[int] = ...) -> None: ...

class DeregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescriptorGroup(_message.Message):
    __slots__ = ("region_id", "length_bytes", "block_hashes", "offsets_bytes")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    length_bytes: int
    block_hashes: bytes
    offsets_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, region_id: _Optional[int] = ..., length_bytes: _Optional[int] = ..., block_hashes: _Optional[bytes] = ..., offsets_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("session_id", "op", "groups", "prefix_only", "wait", "parent_hash", "token_ids", "extra_keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op: TransferOp
    groups: _containers.RepeatedCompositeFieldContainer[DescriptorGroup]
    prefix_only: bool
    wait: bool
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., op: _Optional[_Union[TransferOp, str]] = ..., groups: _Optional[_Iterable[_Union[DescriptorGroup, _Mapping]]] = ..., prefix_only: _Optional[bool] = ..., wait: _Optional[bool] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DescriptorFailure(_message.Message):
    __slots__ = ("index", "code", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: str
    reason: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TransferState(_message.Message):
    __slots__ = ("transfer_id", "done", "bytes_moved", "statuses", "failures", "block_hashes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    done: bool
    bytes_moved: int
    statuses: bytes
    failures: _containers.RepeatedCompositeFieldContainer[DescriptorFailure]
    block_hashes: bytes
    def __init__(self, transfer_id: _Optional[int] = ..., done: _Optional[bool] = ..., bytes_moved: _Optional[int] = ..., statuses: _Optional[bytes] = ..., failures: _Optional[_Iterable[_Union[DescriptorFailure, _Mapping]]] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class SubmitManyRequest(_message.Message):
    __slots__ = ("session_id", "batches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    batches: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    def __init__(self, session_id: _Optional[str] = ..., batches: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ...) -> None: ...

class SubmitManyResponse(_message.Message):
    __slots__ = ("transfer_ids",)
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("transfer_id", "state")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    state: TransferState
    def __init__(self, transfer_id: _Optional[int] = ..., state: _Optional[_Union[TransferState, _Mapping]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("session_id", "transfer_id", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transfer_id: int
    wait_ms: int
    def __init__(self, session_id: _Optional[str] = ..., transfer_id: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetTransfersRequest(_message.Message):
    __slots__ = ("session_id", "transfer_ids", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    wait_ms: int
    def __init__(self, session_id: _Optional[str] = ..., transfer_ids: _Optional[_Iterable[int]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetTransfersResponse(_message.Message):
    __slots__ = ("states", "omitted")
    STATES_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedCompositeFieldContainer[TransferState]
    omitted: int
    def __init__(self, states: _Optional[_Iterable[_Union[TransferState, _Mapping]]] = ..., omitted: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "block_hashes", "prefix_only")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    block_hashes: bytes
    prefix_only: bool
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("statuses", "data", "failures")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    statuses: bytes
    data: bytes
    failures: _containers.RepeatedCompositeFieldContainer[DescriptorFailure]
    def __init__(self, statuses: _Optional[bytes] = ..., data: _Optional[bytes] = ..., failures: _Optional[_Iterable[_Union[DescriptorFailure, _Mapping]]] = ...) -> None: ...

class OpenBulkRequest(_message.Message):
    __slots__ = ("session_id", "transport", "segment")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    transport: str
    segment: str
    def __init__(self, session_id: _Optional[str] = ..., transport: _Optional[str] = ..., segment: _Optional[str] = ...) -> None: ...

class OpenBulkReply(_message.Message):
    __slots__ = ("accepted", "reason", "max_blocks", "slots", "tcp_port", "tcp_token")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    max_blocks: int
    slots: int
    tcp_port: int
    tcp_token: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., max_blocks: _Optional[int] = ..., slots: _Optional[int] = ..., tcp_port: _Optional[int] = ..., tcp_token: _Optional[bytes] = ...) -> None: ...

class OpenPutRequest(_message.Message):
    __slots__ = ("geometry", "namespace")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class OpenPutReply(_message.Message):
    __slots__ = ("accepted", "reason", "tcp_port", "grant_id", "tcp_token", "max_frame_bytes")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    tcp_port: int
    grant_id: str
    tcp_token: bytes
    max_frame_bytes: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., tcp_port: _Optional[int] = ..., grant_id: _Optional[str] = ..., tcp_token: _Optional[bytes] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class BulkFetchRequest(_message.Message):
    __slots__ = ("session_id", "block_hashes", "address", "size_bytes", "offsets_bytes", "prefix_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    block_hashes: bytes
    address: int
    size_bytes: int
    offsets_bytes: _containers.RepeatedScalarFieldContainer[int]
    prefix_only: bool
    def __init__(self, session_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., offsets_bytes: _Optional[_Iterable[int]] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class BulkDrainRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class BulkDrainReply(_message.Message):
    __slots__ = ("writing",)
    WRITING_FIELD_NUMBER: _ClassVar[int]
    writing: int
    def __init__(self, writing: _Optional[int] = ...) -> None: ...

class TransferStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferStatsResponse(_message.Message):
    __slots__ = ("copy_loop", "copy_threads", "sessions", "regions", "mapped_bytes", "read_batches", "write_batches", "descriptors_done", "descriptors_missing", "descriptors_failed", "bytes_moved", "refresh_failures", "descriptors_in_flight", "rings", "ring_requests", "bulk_sessions", "bulk_fetches", "bulk_staged", "bulk_lanes")
    COPY_LOOP_FIELD_NUMBER: _ClassVar[int]
    COPY_THREADS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BATCHES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_DONE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_MISSING_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RINGS_FIELD_NUMBER: _ClassVar[int]
    RING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BULK_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BULK_FETCHES_FIELD_NUMBER: _ClassVar[int]
    BULK_STAGED_FIELD_NUMBER: _ClassVar[int]
    BULK_LANES_FIELD_NUMBER: _ClassVar[int]
    copy_loop: str
    copy_threads: int
    sessions: int
    regions: int
    mapped_bytes: int
    read_batches: int
    write_batches: int
    descriptors_done: int
    descriptors_missing: int
    descriptors_failed: int
    bytes_moved: int
    refresh_failures: int
    descriptors_in_flight: int
    rings: int
    ring_requests: int
    bulk_sessions: int
    bulk_fetches: int
    bulk_staged: int
    bulk_lanes: int
    def __init__(self, copy_loop: _Optional[str] = ..., copy_threads: _Optional[int] = ..., sessions: _Optional[int] = ..., regions: _Optional[int] = ..., mapped_bytes: _Optional[int] = ..., read_batches: _Optional[int] = ..., write_batches: _Optional[int] = ..., descriptors_done: _Optional[int] = ..., descriptors_missing: _Optional[int] = ..., descriptors_failed: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., refresh_failures: _Optional[int] = ..., descriptors_in_flight: _Optional[int] = ..., rings: _Optional[int] = ..., ring_requests: _Optional[int] = ..., bulk_sessions: _Optional[int] = ..., bulk_fetches: _Optional[int] = ..., bulk_staged: _Optional[int] = ..., bulk_lanes: _Optional[int] = ...) -> None: ...
