"""One sequence's cache: the model's own row bytes, plus float copies kept for speed.

The uint8 rows are the truth (they are what the store keeps: kvstore.codec.rows
formats). Decoding is exact, so the float copies `FloatRows` keeps are the rows'
values bit for bit; they are rebuilt from the rows whenever they fall behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from replay.model import ops


class FloatRows:
    """Decoded values of an append-only row tensor, grown by doubling (no full copy per append).

    Valid as long as the rows it mirrors are only appended to: loaded rows are never
    rewritten (the state's rule), so a decoded prefix stays right.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.buf: Tensor | None = None
        self.count = 0

    def values(self, rows: Tensor) -> Tensor:
        """float32 `[len(rows), D]`: the values of `rows`, decoding only rows not seen yet."""
        n = rows.shape[0]
        if n < self.count:  # the rows were replaced by a shorter tensor: start again
            self.buf, self.count = None, 0
        if n > self.count:
            self._put(ops.decode(rows[self.count:n], self.kind))
        if self.buf is None:
            return ops.decode(rows[:0], self.kind)
        return self.buf[:n]

    def append(self, had: int, new: Tensor) -> None:
        """Record the values `new` of rows appended after `had` rows (when the copy holds exactly those)."""
        if self.count == had and new.shape[0]:
            self._put(new)

    def _put(self, new: Tensor) -> None:
        n = self.count + new.shape[0]
        if self.buf is None or self.buf.shape[0] < n:
            grown = new.new_empty((max(n, 2 * (self.buf.shape[0] if self.buf is not None else 0)), new.shape[1]))
            if self.buf is not None and self.count:
                grown[:self.count] = self.buf[:self.count]
            self.buf = grown
        self.buf[self.count:n] = new
        self.count = n


@dataclass
class CacheState:
    """One sequence's cache after `length` positions, on the model's device.

    Attributes:
        length: positions computed (or restored) so far.
        window_rows: per layer, uint8 `[n, window_row_bytes]`: the window rows of
            positions [length - n, length), n <= window.
        kv_rows: kv source layer -> uint8 `[rows, compressed_kv_row_bytes]`, in position order.
        index_rows: kv source layer -> uint8 `[rows, indexer_row_bytes]`.
        tail: float32 `[ratio-2 source layers, 2, head_dim]` (kv, gate score of position
            length - 1) when length is odd and that position was computed here; None otherwise.
        rows_floor: rows covering positions below it were loaded; recomputation never
            rewrites any existing row (loaded rows are authoritative).
    """

    length: int
    window_rows: list[Tensor]
    kv_rows: dict[int, Tensor]
    index_rows: dict[int, Tensor]
    tail: Tensor | None = None
    rows_floor: int = 0
    kv_float: dict[int, FloatRows] = field(default_factory=dict, repr=False, compare=False)
    index_float: dict[int, FloatRows] = field(default_factory=dict, repr=False, compare=False)

    def kv_values(self, source: int) -> Tensor:
        """float32 values of `kv_rows[source]` (decoded once, cached)."""
        cache = self.kv_float.setdefault(source, FloatRows("kv"))
        return cache.values(self.kv_rows[source])

    def index_values(self, source: int) -> Tensor:
        """float32 values of `index_rows[source]` (decoded once, cached)."""
        cache = self.index_float.setdefault(source, FloatRows("index"))
        return cache.values(self.index_rows[source])

    def append_rows(self, source: int, kv: Tensor, kv_values: Tensor, index: Tensor, index_values: Tensor) -> None:
        """Append rows of `source` with their exact values (kept as the float copies: never decoded again)."""
        self.kv_values(source)  # the copies first catch up with the rows held, so the new values follow them
        self.index_values(source)
        self.kv_float[source].append(self.kv_rows[source].shape[0], kv_values)
        self.index_float[source].append(self.index_rows[source].shape[0], index_values)
        self.kv_rows[source] = torch.cat((self.kv_rows[source], kv))
        self.index_rows[source] = torch.cat((self.index_rows[source], index))

    def rows_coverage(self, ratios: dict[int, int]) -> int:
        """Tokens whose rows every source holds: min over sources of rows x ratio."""
        if not self.kv_rows:
            return 0
        return min(self.kv_rows[s].shape[0] * ratios[s] for s in self.kv_rows)

    @property
    def device(self) -> torch.device:
        """Where the rows live."""
        return self.window_rows[0].device

    def clone(self) -> CacheState:
        """An independent copy (rows copied; float caches start empty)."""
        return CacheState(length=self.length, window_rows=[w.clone() for w in self.window_rows],
                          kv_rows={s: r.clone() for s, r in self.kv_rows.items()},
                          index_rows={s: r.clone() for s, r in self.index_rows.items()},
                          tail=None if self.tail is None else self.tail.clone(), rows_floor=self.rows_floor)


__all__ = ["CacheState", "FloatRows"]
