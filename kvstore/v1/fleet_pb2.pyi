from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunDigestsRequest(_message.Message):
    __slots__ = ("run_roots",)
    RUN_ROOTS_FIELD_NUMBER: _ClassVar[int]
    run_roots: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, run_roots: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RunDigest(_message.Message):
    __slots__ = ("blocks", "size_bytes", "digest", "pins")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    size_bytes: int
    digest: bytes
    pins: _containers.RepeatedCompositeFieldContainer[RunPin]
    def __init__(self, blocks: _Optional[int] = ..., size_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., pins: _Optional[_Iterable[_Union[RunPin, _Mapping]]] = ...) -> None: ...

class RunPin(_message.Message):
    __slots__ = ("hash", "until_s")
    HASH_FIELD_NUMBER: _ClassVar[int]
    UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    until_s: float
    def __init__(self, hash: _Optional[bytes] = ..., until_s: _Optional[float] = ...) -> None: ...

class RunDigestsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunDigest]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunDigest, _Mapping]]] = ...) -> None: ...

class HeldBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HeldBlocksResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, held: _Optional[_Iterable[bool]] = ...) -> None: ...

class CopiedBlock(_message.Message):
    __slots__ = ("key", "namespace", "parent_hash", "depth", "data", "checksum", "last_use_s", "source_address", "pin_until_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_USE_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PIN_UNTIL_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace: str
    parent_hash: bytes
    depth: int
    data: bytes
    checksum: int
    last_use_s: float
    source_address: int
    pin_until_s: float
    def __init__(self, key: _Optional[bytes] = ..., namespace: _Optional[str] = ..., parent_hash: _Optional[bytes] = ..., depth: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., last_use_s: _Optional[float] = ..., source_address: _Optional[int] = ..., pin_until_s: _Optional[float] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("blocks", "bulk_segment")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BULK_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[CopiedBlock]
    bulk_segment: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[CopiedBlock, _Mapping]]] = ..., bulk_segment: _Optional[str] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("written_blocks", "existing_blocks", "written_bytes", "bulk_refused", "pins_granted", "pins_short", "pin_note")
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    BULK_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PINS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    PINS_SHORT_FIELD_NUMBER: _ClassVar[int]
    PIN_NOTE_FIELD_NUMBER: _ClassVar[int]
    written_blocks: int
    existing_blocks: int
    written_bytes: int
    bulk_refused: str
    pins_granted: int
    pins_short: int
    pin_note: str
    def __init__(self, written_blocks: _Optional[int] = ..., existing_blocks: _Optional[int] = ..., written_bytes: _Optional[int] = ..., bulk_refused: _Optional[str] = ..., pins_granted: _Optional[int] = ..., pins_short: _Optional[int] = ..., pin_note: _Optional[str] = ...) -> None: ...

class BlockUse(_message.Message):
    __slots__ = ("key", "last_use_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAST_USE_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    last_use_s: float
    def __init__(self, key: _Optional[bytes] = ..., last_use_s: _Optional[float] = ...) -> None: ...

class RaiseUsesRequest(_message.Message):
    __slots__ = ("uses",)
    USES_FIELD_NUMBER: _ClassVar[int]
    uses: _containers.RepeatedCompositeFieldContainer[BlockUse]
    def __init__(self, uses: _Optional[_Iterable[_Union[BlockUse, _Mapping]]] = ...) -> None: ...

class RaiseUsesResponse(_message.Message):
    __slots__ = ("at_least",)
    AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    at_least: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, at_least: _Optional[_Iterable[bool]] = ...) -> None: ...
