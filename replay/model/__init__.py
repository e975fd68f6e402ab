"""The torch reference model of the DeepSeek-V4.1 structure (docs/MODEL.md).

`ReferenceModel` computes the cache in the model's own bytes (kvstore.codec rows);
`CacheState` holds one sequence's rows; `cache_io` moves a state to and from the
store's blocks and snapshots.
"""

from replay.model.cache_io import restore_state, state_blocks, state_snapshot
from replay.model.config import TINY_MODEL, ModelConfig, from_config, reduced_v41
from replay.model.model import ReferenceModel
from replay.model.state import CacheState

__all__ = ["TINY_MODEL", "CacheState", "ModelConfig", "ReferenceModel", "from_config", "reduced_v41",
           "restore_state", "state_blocks", "state_snapshot"]
