from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SwaStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWA_STATUS_UNSPECIFIED: _ClassVar[SwaStatus]
    SWA_STATUS_FOUND: _ClassVar[SwaStatus]
    SWA_STATUS_MISSING: _ClassVar[SwaStatus]

class SwaShmOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWA_SHM_OP_UNSPECIFIED: _ClassVar[SwaShmOp]
    SWA_SHM_OP_HELLO: _ClassVar[SwaShmOp]
    SWA_SHM_OP_BEGIN: _ClassVar[SwaShmOp]
    SWA_SHM_OP_COMMIT: _ClassVar[SwaShmOp]
    SWA_SHM_OP_ABORT: _ClassVar[SwaShmOp]
    SWA_SHM_OP_GET: _ClassVar[SwaShmOp]
    SWA_SHM_OP_WRITTEN: _ClassVar[SwaShmOp]
SWA_STATUS_UNSPECIFIED: SwaStatus
SWA_STATUS_FOUND: SwaStatus
SWA_STATUS_MISSING: SwaStatus
SWA_SHM_OP_UNSPECIFIED: SwaShmOp
SWA_SHM_OP_HELLO: SwaShmOp
SWA_SHM_OP_BEGIN: SwaShmOp
SWA_SHM_OP_COMMIT: SwaShmOp
SWA_SHM_OP_ABORT: SwaShmOp
SWA_SHM_OP_GET: SwaShmOp
SWA_SHM_OP_WRITTEN: SwaShmOp

class SwaSnapshot(_message.Message):
    __slots__ = ("key", "data", "checksum", "position")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    checksum: int
    position: int
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class SwaPutRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "snapshots", "ttl_ms")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    snapshots: _containers.RepeatedCompositeFieldContainer[SwaSnapshot]
    ttl_ms: int
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., snapshots: _Optional[_Iterable[_Union[SwaSnapshot, _Mapping]]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class SwaPutResponse(_message.Message):
    __slots__ = ("stored", "failed", "ttl_ms")
    STORED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    failed: int
    ttl_ms: int
    def __init__(self, stored: _Optional[int] = ..., failed: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class SwaGetRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "keys")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SwaResult(_message.Message):
    __slots__ = ("status", "data", "checksum", "position")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    status: SwaStatus
    data: bytes
    checksum: int
    position: int
    def __init__(self, status: _Optional[_Union[SwaStatus, str]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class SwaGetResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SwaResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SwaResult, _Mapping]]] = ...) -> None: ...

class SwaDeleteRequest(_message.Message):
    __slots__ = ("geometry", "namespace", "keys")
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, geometry: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SwaDeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class SwaStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwaStatsResponse(_message.Message):
    __slots__ = ("backend", "backend_up", "ttl_s", "puts", "snapshots_put", "bytes_put", "failed_puts", "gets", "snapshots_asked", "hits", "corrupt", "backend_errors", "expirations", "evictions", "items", "bytes_used", "cap_bytes", "max_batch_snapshots")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_UP_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_PUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUT_FIELD_NUMBER: _ClassVar[int]
    FAILED_PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_ASKED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    backend_up: bool
    ttl_s: float
    puts: int
    snapshots_put: int
    bytes_put: int
    failed_puts: int
    gets: int
    snapshots_asked: int
    hits: int
    corrupt: int
    backend_errors: int
    expirations: int
    evictions: int
    items: int
    bytes_used: int
    cap_bytes: int
    max_batch_snapshots: int
    def __init__(self, backend: _Optional[str] = ..., backend_up: _Optional[bool] = ..., ttl_s: _Optional[float] = ..., puts: _Optional[int] = ..., snapshots_put: _Optional[int] = ..., bytes_put: _Optional[int] = ..., failed_puts: _Optional[int] = ..., gets: _Optional[int] = ..., snapshots_asked: _Optional[int] = ..., hits: _Optional[int] = ..., corrupt: _Optional[int] = ..., backend_errors: _Optional[int] = ..., expirations: _Optional[int] = ..., evictions: _Optional[int] = ..., items: _Optional[int] = ..., bytes_used: _Optional[int] = ..., cap_bytes: _Optional[int] = ..., max_batch_snapshots: _Optional[int] = ...) -> None: ...

class SwaOpenDirectRequest(_message.Message):
    __slots__ = ("geometry",)
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    geometry: str
    def __init__(self, geometry: _Optional[str] = ...) -> None: ...

class SwaOpenDirectResponse(_message.Message):
    __slots__ = ("offered", "reason", "redis_url", "username", "password", "key_prefix", "ttl_ms", "writable", "max_record_bytes", "expires_in_ms", "renew_after_ms", "tenant", "cluster_nodes", "shm_socket", "shm_ticket", "shm_host", "trace_calls")
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REDIS_URL_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    RENEW_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NODES_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHM_TICKET_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CALLS_FIELD_NUMBER: _ClassVar[int]
    offered: bool
    reason: str
    redis_url: str
    username: str
    password: str
    key_prefix: bytes
    ttl_ms: int
    writable: bool
    max_record_bytes: int
    expires_in_ms: int
    renew_after_ms: int
    tenant: str
    cluster_nodes: str
    shm_socket: str
    shm_ticket: bytes
    shm_host: str
    trace_calls: bool
    def __init__(self, offered: _Optional[bool] = ..., reason: _Optional[str] = ..., redis_url: _Optional[str] = ..., username: _Optional[str] = ..., password: _Optional[str] = ..., key_prefix: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., writable: _Optional[bool] = ..., max_record_bytes: _Optional[int] = ..., expires_in_ms: _Optional[int] = ..., renew_after_ms: _Optional[int] = ..., tenant: _Optional[str] = ..., cluster_nodes: _Optional[str] = ..., shm_socket: _Optional[str] = ..., shm_ticket: _Optional[bytes] = ..., shm_host: _Optional[str] = ..., trace_calls: _Optional[bool] = ...) -> None: ...

class SwaDirectGet(_message.Message):
    __slots__ = ("asked", "found", "corrupt")
    ASKED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    asked: int
    found: int
    corrupt: int
    def __init__(self, asked: _Optional[int] = ..., found: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class SwaReportDirectRequest(_message.Message):
    __slots__ = ("gets", "puts", "snapshots_put", "bytes_put", "report_id", "calls", "calls_dropped", "geometry")
    GETS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_PUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUT_FIELD_NUMBER: _ClassVar[int]
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    gets: _containers.RepeatedCompositeFieldContainer[SwaDirectGet]
    puts: int
    snapshots_put: int
    bytes_put: int
    report_id: bytes
    calls: _containers.RepeatedCompositeFieldContainer[SwaDirectCall]
    calls_dropped: int
    geometry: str
    def __init__(self, gets: _Optional[_Iterable[_Union[SwaDirectGet, _Mapping]]] = ..., puts: _Optional[int] = ..., snapshots_put: _Optional[int] = ..., bytes_put: _Optional[int] = ..., report_id: _Optional[bytes] = ..., calls: _Optional[_Iterable[_Union[SwaDirectCall, _Mapping]]] = ..., calls_dropped: _Optional[int] = ..., geometry: _Optional[str] = ...) -> None: ...

class SwaDirectCall(_message.Message):
    __slots__ = ("time_s", "put", "keys", "snapshots", "found")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    put: bool
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    snapshots: int
    found: int
    def __init__(self, time_s: _Optional[float] = ..., put: _Optional[bool] = ..., keys: _Optional[_Iterable[bytes]] = ..., snapshots: _Optional[int] = ..., found: _Optional[int] = ...) -> None: ...

class SwaReportDirectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwaShmRequest(_message.Message):
    __slots__ = ("op", "ticket", "keys", "positions", "ttl_ms", "corrupt", "index", "written")
    OP_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    op: SwaShmOp
    ticket: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    positions: _containers.RepeatedScalarFieldContainer[int]
    ttl_ms: int
    corrupt: int
    index: int
    written: int
    def __init__(self, op: _Optional[_Union[SwaShmOp, str]] = ..., ticket: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., positions: _Optional[_Iterable[int]] = ..., ttl_ms: _Optional[int] = ..., corrupt: _Optional[int] = ..., index: _Optional[int] = ..., written: _Optional[int] = ...) -> None: ...

class SwaShmReply(_message.Message):
    __slots__ = ("code", "message", "arena_bytes", "writable", "ttl_ms", "lifetime_s", "max_batch", "offsets", "positions", "checksums")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    arena_bytes: int
    writable: bool
    ttl_ms: int
    lifetime_s: float
    max_batch: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., writable: _Optional[bool] = ..., ttl_ms: _Optional[int] = ..., lifetime_s: _Optional[float] = ..., max_batch: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...
