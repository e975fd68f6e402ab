from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_ACTION_UNSPECIFIED: _ClassVar[RunAction]
    RUN_ACTION_FULL_PREFILL: _ClassVar[RunAction]
    RUN_ACTION_FETCH_SNAPSHOT: _ClassVar[RunAction]
    RUN_ACTION_BOUNDED_REPLAY: _ClassVar[RunAction]
    RUN_ACTION_EXACT_REPLAY: _ClassVar[RunAction]
RUN_ACTION_UNSPECIFIED: RunAction
RUN_ACTION_FULL_PREFILL: RunAction
RUN_ACTION_FETCH_SNAPSHOT: RunAction
RUN_ACTION_BOUNDED_REPLAY: RunAction
RUN_ACTION_EXACT_REPLAY: RunAction

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("model_config_json", "geometry", "geometry_fingerprint", "device", "block_tokens", "tokens_per_s", "store_target", "max_prompt_tokens", "max_new_tokens", "vocab_size", "window", "batch_invariant")
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STORE_TARGET_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    model_config_json: str
    geometry: str
    geometry_fingerprint: bytes
    device: str
    block_tokens: int
    tokens_per_s: float
    store_target: str
    max_prompt_tokens: int
    max_new_tokens: int
    vocab_size: int
    window: int
    batch_invariant: bool
    def __init__(self, model_config_json: _Optional[str] = ..., geometry: _Optional[str] = ..., geometry_fingerprint: _Optional[bytes] = ..., device: _Optional[str] = ..., block_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., store_target: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., window: _Optional[int] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("tokens", "extra_keys", "namespace", "action", "fetch_tokens", "snapshot_position", "resume_tokens", "replay_start", "max_new_tokens", "store", "snapshot_every", "tail_prefill", "lease_id", "keep_until_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    FETCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_POSITION_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_START_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_FIELD_NUMBER: _ClassVar[int]
    TAIL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: str
    action: RunAction
    fetch_tokens: int
    snapshot_position: int
    resume_tokens: int
    replay_start: int
    max_new_tokens: int
    store: bool
    snapshot_every: int
    tail_prefill: bool
    lease_id: str
    keep_until_s: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[str] = ..., action: _Optional[_Union[RunAction, str]] = ..., fetch_tokens: _Optional[int] = ..., snapshot_position: _Optional[int] = ..., resume_tokens: _Optional[int] = ..., replay_start: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., store: _Optional[bool] = ..., snapshot_every: _Optional[int] = ..., tail_prefill: _Optional[bool] = ..., lease_id: _Optional[str] = ..., keep_until_s: _Optional[float] = ...) -> None: ...

class RunTimings(_message.Message):
    __slots__ = ("fetch_s", "replay_s", "prefill_s", "decode_s", "store_s", "total_s", "queued_s")
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    REPLAY_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    STORE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    fetch_s: float
    replay_s: float
    prefill_s: float
    decode_s: float
    store_s: float
    total_s: float
    queued_s: float
    def __init__(self, fetch_s: _Optional[float] = ..., replay_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., store_s: _Optional[float] = ..., total_s: _Optional[float] = ..., queued_s: _Optional[float] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("logits", "output_tokens", "tokens_computed", "tokens_replayed", "blocks_fetched", "blocks_stored", "snapshot_positions", "snapshot_loaded", "resume_tokens", "timings", "vocab_size", "store_error", "kept_in_put", "kept_until_s", "keep_note")
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_LOADED_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    KEPT_IN_PUT_FIELD_NUMBER: _ClassVar[int]
    KEPT_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_NOTE_FIELD_NUMBER: _ClassVar[int]
    logits: bytes
    output_tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens_computed: int
    tokens_replayed: int
    blocks_fetched: int
    blocks_stored: int
    snapshot_positions: _containers.RepeatedScalarFieldContainer[int]
    snapshot_loaded: bool
    resume_tokens: int
    timings: RunTimings
    vocab_size: int
    store_error: str
    kept_in_put: bool
    kept_until_s: float
    keep_note: str
    def __init__(self, logits: _Optional[bytes] = ..., output_tokens: _Optional[_Iterable[int]] = ..., tokens_computed: _Optional[int] = ..., tokens_replayed: _Optional[int] = ..., blocks_fetched: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., snapshot_positions: _Optional[_Iterable[int]] = ..., snapshot_loaded: _Optional[bool] = ..., resume_tokens: _Optional[int] = ..., timings: _Optional[_Union[RunTimings, _Mapping]] = ..., vocab_size: _Optional[int] = ..., store_error: _Optional[str] = ..., kept_in_put: _Optional[bool] = ..., kept_until_s: _Optional[float] = ..., keep_note: _Optional[str] = ...) -> None: ...
