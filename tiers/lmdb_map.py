"""The LMDB tier's map of data.mdb, for the paths that read blocks straight out of it.

The transfer paths on the same host (the request ring's native server, the bulk
transport's map source) find and verify blocks in LMDB's map natively, under a
read transaction of their own. They hold no other handle on the environment:
`LmdbMap` is what the tier lends them (`LmdbBlockTier.map`, the `MappedReads`
capability of `tiers.store`), so no gateway module opens LMDB itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from tiers.ring import Mapping


class LmdbMap:
    """Read transactions and the map's figures of one LMDB environment.

    Args:
        env: the tier's environment (it outlives every transaction begun here).
        records: the handle of its `records` database.
    """

    def __init__(self, env: lmdb.Environment, records: Any) -> None:
        self._env = env
        #: The `records` database (data, meta and child entries of each block: `kvstore.native.records`).
        self.records = records
        #: data.mdb, the file the map is of.
        self.data_path = Path(env.path()) / "data.mdb"

    def begin(self) -> lmdb.Transaction[bytes]:
        """A read transaction of the newest snapshot; the caller aborts it.

        While it is open LMDB reuses none of its snapshot's pages, so an address
        found in the map under it stays valid until it is aborted.
        """
        return self._env.begin()

    def begin_buffers(self) -> lmdb.Transaction[memoryview]:
        """`begin`, whose gets hand out buffers into the map: valid until the transaction ends."""
        return self._env.begin(buffers=True)

    def mapping(self) -> Mapping:
        """Where this process maps data.mdb (`tiers.ring.Mapping`; LookupError when it is not found)."""
        return Mapping(self._env)

    def map_size(self) -> int:
        """The environment's map size in bytes (it changes only if LMDB mapped the file again)."""
        return int(self._env.info()["map_size"])

    def last_page(self) -> int:
        """The newest snapshot's last page number: nothing past it may be read from the map."""
        return int(self._env.info()["last_pgno"])
