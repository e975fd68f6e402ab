"""The planner's cost model: seconds to fetch bytes against seconds to recompute tokens.

Both rates are settings. The defaults come from the benchmarks (docs/BENCHMARKS.md):

- `fetch_gbps` = 6 GB/s: `kvstore bench transfer` fetched a 1M-token prompt's
  blocks into a registered region over shared memory at 12.9 GB/s (batch 512)
  on the development host and 0.44-0.83x of memcpy on the H200 host; 6 GB/s is
  about half of that, for smaller batches and the copy on into GPU memory (55
  GB/s on the H200: not the bottleneck). A worker on another host fetches over
  gRPC: give it its own measured figure.
- `recompute_tokens_per_s` = 8,000 tokens/s: the reference model's full prefill
  on V4.1's layer pattern at reduced width (`reduced_v41`, 40 layers, window
  128) on one H200 measured 6.9K-9.0K tokens/s over 8K-64K-token prompts
  (docs/REPLAY.md, "Speed"). The reference worker reports its own measured
  rate (Worker.GetInfo); pass it here when planning for that worker
  (`kvstore plan --recompute-tps`), and an engine's own rate for an engine.
- `replay_overhead_s` = 1.4 ms: the fixed cost of one replay call that the
  per-token rate misses (every layer runs once however few tokens it replays,
  and the loaded rows are decoded). On the H200 the reference model's replay of
  `reduced_v41` at H = 8,192 kept the GPU busy 13.0 ms for 128 tokens and
  465.9 ms for 5,120 (docs/REPLAY.md, "Speed"): 11,000 tokens/s plus 1.4 ms per
  call. That is what an engine pays that launches its replay without host
  stalls (a captured CUDA graph). The eager reference worker pays its host
  launches too: 45 ms of wall time for the 128 tokens, about 30 ms more than the
  tokens at the recompute rate; give `replay_overhead_s=0.03` when planning for
  it. The planner adds the overhead to every replay option's estimate, so a
  replay that saves less compute than the overhead loses to a plain prefill.

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
DEFAULT_RECOMPUTE_TOKENS_PER_S = 8_000.0
#: Seconds one replay call costs beyond its tokens at the recompute rate (see the module docstring).
DEFAULT_REPLAY_OVERHEAD_S = 0.0014
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
        replay_overhead_s: seconds one replay call costs beyond its tokens (>= 0).
    """

    fetch_gbps: float = DEFAULT_FETCH_GBPS
    recompute_tokens_per_s: float = DEFAULT_RECOMPUTE_TOKENS_PER_S
    replay_windows: int | None = DEFAULT_REPLAY_WINDOWS
    replay_overhead_s: float = DEFAULT_REPLAY_OVERHEAD_S

    def __post_init__(self) -> None:
        _positive(self.fetch_gbps, "fetch_gbps")
        _positive(self.recompute_tokens_per_s, "recompute_tokens_per_s")
        o = self.replay_overhead_s
        if isinstance(o, bool) or not isinstance(o, int | float) or not math.isfinite(o) or o < 0:
            raise InvalidArgument(f"replay_overhead_s must be a finite number >= 0, got {o!r}")
        w = self.replay_windows
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidArgument(f"replay_windows must be a positive integer or None (exact only), got {w!r}")

    def fetch_s(self, size_bytes: int) -> float:
        """Seconds to fetch `size_bytes`."""
        return size_bytes / (self.fetch_gbps * 1e9)

    def compute_s(self, tokens: int) -> float:
        """Seconds to compute `tokens` positions."""
        return tokens / self.recompute_tokens_per_s

    def replay_s(self, tokens: int) -> float:
        """Seconds of one replay call recomputing `tokens` positions: the per-call overhead plus the tokens."""
        return self.replay_overhead_s + self.compute_s(tokens)

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
