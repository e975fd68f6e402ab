"""The planner's cost model: seconds to fetch bytes against seconds to recompute tokens.

Both rates are settings. The defaults come from the benchmarks (docs/BENCHMARKS.md):

- `fetch_gbps` = 6 GB/s: `kvstore bench transfer` fetched a 1M-token prompt's
  blocks into a registered region over shared memory at 12.9 GB/s (batch 512)
  on the development host and 0.44-0.83x of memcpy on the H200 host; 6 GB/s is
  about half of that, for smaller batches and the copy on into GPU memory (55
  GB/s on the H200: not the bottleneck). A worker on another host fetches over
  gRPC: give it its own measured figure.
- `recompute_tokens_per_s` = 10,000 tokens/s: a conservative prefill rate for a
  V4.1-Flash-sized model on one GPU. The reference worker reports its own
  measured rate (Worker.GetInfo); pass it here when planning for that worker
  (`kvstore plan --recompute-tps`).

Fidelity is a per-tenant setting of the same object: `replay_windows` is how
many windows a bounded replay recomputes before the hit (1, as DeepSeek does;
2 or 4 trade GPU time for a closer window state), or None for exact replays
only (layers x window tokens, bit-exact window state, never approximate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

#: GB/s of block fetch (see the module docstring for where it comes from).
DEFAULT_FETCH_GBPS = 6.0
#: Tokens per second the worker recomputes (see the module docstring).
DEFAULT_RECOMPUTE_TOKENS_PER_S = 10_000.0
#: Replay length in windows by default: one window before the hit, as DeepSeek does.
DEFAULT_REPLAY_WINDOWS = 1


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """What fetching and recomputing cost, and how faithful a replay must be.

    Attributes:
        fetch_gbps: GB/s (1e9 bytes) at which the worker fetches blocks and snapshots.
        recompute_tokens_per_s: tokens per second the worker computes (prefill or replay).
        replay_windows: windows a bounded replay recomputes before the hit (1, 2, 4, ...);
            None: exact replay only (layers x window tokens). A value of layers or more is
            an exact replay too.
    """

    fetch_gbps: float = DEFAULT_FETCH_GBPS
    recompute_tokens_per_s: float = DEFAULT_RECOMPUTE_TOKENS_PER_S
    replay_windows: int | None = DEFAULT_REPLAY_WINDOWS

    def __post_init__(self) -> None:
        _positive(self.fetch_gbps, "fetch_gbps")
        _positive(self.recompute_tokens_per_s, "recompute_tokens_per_s")
        w = self.replay_windows
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidArgument(f"replay_windows must be a positive integer or None (exact only), got {w!r}")

    def fetch_s(self, size_bytes: int) -> float:
        """Seconds to fetch `size_bytes`."""
        return size_bytes / (self.fetch_gbps * 1e9)

    def compute_s(self, tokens: int) -> float:
        """Seconds to compute `tokens` positions."""
        return tokens / self.recompute_tokens_per_s

    def replay_tokens(self, *, window: int, num_layers: int) -> tuple[int, bool]:
        """(S, exact): the tokens a replay recomputes before the hit, and whether its window
        state is exact (S = layers x window: information moves one window per layer)."""
        exact_span = num_layers * window
        if self.replay_windows is None or self.replay_windows * window >= exact_span:
            return exact_span, True
        return self.replay_windows * window, False

    @property
    def fidelity(self) -> str:
        """The fidelity setting in words: "exact" or "N x window"."""
        return "exact" if self.replay_windows is None else f"{self.replay_windows} x window"


def parse_replay_windows(text: str) -> int | None:
    """A `--replay-windows` value: a positive integer, or "exact" (None).

    Raises:
        InvalidArgument: anything else.
    """
    if text.strip().lower() == "exact":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"replay windows must be a positive integer or 'exact', got {text!r}")
    return value
