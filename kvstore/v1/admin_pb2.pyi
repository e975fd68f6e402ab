from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(_message.Message):
    __slots__ = ("retention_hours", "swa_ttl_s", "nvme_quota_bytes", "swa_quota_bytes", "requests_per_s", "pin_max_hours", "pin_budget_bytes", "replication", "replay_fidelity")
    RETENTION_HOURS_FIELD_NUMBER: _ClassVar[int]
    SWA_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NVME_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWA_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PIN_MAX_HOURS_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIDELITY_FIELD_NUMBER: _ClassVar[int]
    retention_hours: float
    swa_ttl_s: float
    nvme_quota_bytes: int
    swa_quota_bytes: int
    requests_per_s: float
    pin_max_hours: float
    pin_budget_bytes: int
    replication: int
    replay_fidelity: str
    def __init__(self, retention_hours: _Optional[float] = ..., swa_ttl_s: _Optional[float] = ..., nvme_quota_bytes: _Optional[int] = ..., swa_quota_bytes: _Optional[int] = ..., requests_per_s: _Optional[float] = ..., pin_max_hours: _Optional[float] = ..., pin_budget_bytes: _Optional[int] = ..., replication: _Optional[int] = ..., replay_fidelity: _Optional[str] = ...) -> None: ...

class TenantPolicy(_message.Message):
    __slots__ = ("tenant", "policy", "is_default")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    policy: Policy
    is_default: bool
    def __init__(self, tenant: _Optional[str] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., is_default: _Optional[bool] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class GetPolicyResponse(_message.Message):
    __slots__ = ("policy", "usage")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    policy: TenantPolicy
    usage: TenantUsage
    def __init__(self, policy: _Optional[_Union[TenantPolicy, _Mapping]] = ..., usage: _Optional[_Union[TenantUsage, _Mapping]] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("nvme_bytes", "nvme_blocks", "token_hours", "swa_bytes")
    NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HOURS_FIELD_NUMBER: _ClassVar[int]
    SWA_BYTES_FIELD_NUMBER: _ClassVar[int]
    nvme_bytes: int
    nvme_blocks: int
    token_hours: float
    swa_bytes: int
    def __init__(self, nvme_bytes: _Optional[int] = ..., nvme_blocks: _Optional[int] = ..., token_hours: _Optional[float] = ..., swa_bytes: _Optional[int] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("tenant", "retention_hours", "swa_ttl_s", "nvme_quota_bytes", "swa_quota_bytes", "requests_per_s", "pin_max_hours", "pin_budget_bytes", "replication", "replay_fidelity")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HOURS_FIELD_NUMBER: _ClassVar[int]
    SWA_TTL_S_FIELD_NUMBER: _ClassVar[int]
    NVME_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWA_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PIN_MAX_HOURS_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIDELITY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    retention_hours: float
    swa_ttl_s: float
    nvme_quota_bytes: int
    swa_quota_bytes: int
    requests_per_s: float
    pin_max_hours: float
    pin_budget_bytes: int
    replication: int
    replay_fidelity: str
    def __init__(self, tenant: _Optional[str] = ..., retention_hours: _Optional[float] = ..., swa_ttl_s: _Optional[float] = ..., nvme_quota_bytes: _Optional[int] = ..., swa_quota_bytes: _Optional[int] = ..., requests_per_s: _Optional[float] = ..., pin_max_hours: _Optional[float] = ..., pin_budget_bytes: _Optional[int] = ..., replication: _Optional[int] = ..., replay_fidelity: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("before", "after", "note")
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    before: TenantPolicy
    after: TenantPolicy
    note: str
    def __init__(self, before: _Optional[_Union[TenantPolicy, _Mapping]] = ..., after: _Optional[_Union[TenantPolicy, _Mapping]] = ..., note: _Optional[str] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("policies", "defaults")
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[TenantPolicy]
    defaults: Policy
    def __init__(self, policies: _Optional[_Iterable[_Union[TenantPolicy, _Mapping]]] = ..., defaults: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class PolicyLogRequest(_message.Message):
    __slots__ = ("tenant", "limit")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    limit: int
    def __init__(self, tenant: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("time_s", "actor", "action", "tenant", "old_json", "new_json")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OLD_JSON_FIELD_NUMBER: _ClassVar[int]
    NEW_JSON_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    actor: str
    action: str
    tenant: str
    old_json: str
    new_json: str
    def __init__(self, time_s: _Optional[float] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., tenant: _Optional[str] = ..., old_json: _Optional[str] = ..., new_json: _Optional[str] = ...) -> None: ...

class PolicyLogResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("tenant", "geometry", "all", "token_ids", "extra_keys", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    geometry: str
    all: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., geometry: _Optional[str] = ..., all: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("purged_blocks",)
    PURGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    purged_blocks: int
    def __init__(self, purged_blocks: _Optional[int] = ...) -> None: ...

class DropPinsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class DropPinsResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class ExportTenantRequest(_message.Message):
    __slots__ = ("tenant", "path")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    path: str
    def __init__(self, tenant: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ExportTenantResponse(_message.Message):
    __slots__ = ("records", "bytes", "data_bytes", "skipped")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    records: int
    bytes: int
    data_bytes: int
    skipped: int
    def __init__(self, records: _Optional[int] = ..., bytes: _Optional[int] = ..., data_bytes: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class ImportTenantRequest(_message.Message):
    __slots__ = ("tenant", "path")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    path: str
    def __init__(self, tenant: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ImportTenantResponse(_message.Message):
    __slots__ = ("records", "written", "skipped", "tenant")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    records: int
    written: int
    skipped: int
    tenant: str
    def __init__(self, records: _Optional[int] = ..., written: _Optional[int] = ..., skipped: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...
