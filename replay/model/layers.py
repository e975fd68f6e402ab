"""One layer of the reference model: its weights and the four things it computes.

- `compress`: a kv source layer's compressed-KV and indexer rows (ratio 1 or 2) and raw tail;
- `index_topk`: an index layer's top-k of the visible compressed rows;
- `attention`: sink + window keys + selected compressed rows;
- `mlp`: the dense SwiGLU standing in for the MoE.

Every function takes `inv` (batch invariance, replay.model.ops) and writes rows only
through the state, never rewriting one it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from replay.model import ops
from replay.model.config import ModelConfig
from replay.model.state import CacheState

#: Elements of the per-query temporaries one attention or indexer step may build (fast path: 256 MiB).
FAST_BUDGET = 1 << 26
#: The same for the mul-sum (batch-invariant) path, whose temporaries are a factor D larger.
INVARIANT_BUDGET = 1 << 22


def _param(gen: torch.Generator, *shape: int, scale: float | None = None) -> nn.Parameter:
    """A seeded normal weight scaled by 1/sqrt(fan_in) (or `scale`)."""
    std = scale if scale is not None else shape[-1] ** -0.5
    return nn.Parameter(torch.randn(*shape, generator=gen) * std)


class LayerWeights(nn.Module):
    """The weights of one layer, created in a fixed order from `gen` (same seed, same bits)."""

    def __init__(self, cfg: ModelConfig, layer: int, gen: torch.Generator, *, source: bool, index: bool) -> None:
        super().__init__()
        d, hd, di = cfg.dim, cfg.head_dim, cfg.geometry.index_head_dim
        out_scale = (cfg.n_heads * hd) ** -0.5 / (2 * cfg.num_layers) ** 0.5
        self.layer = layer
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.wkv = _param(gen, hd, d)
        self.kv_norm = nn.Parameter(torch.ones(hd))
        self.wq = _param(gen, cfg.n_heads * hd, d)
        self.sink = _param(gen, cfg.n_heads, scale=1.0)
        self.wo = _param(gen, d, cfg.n_heads * hd, scale=out_scale)
        if source:
            self.wc = _param(gen, hd, d)
            self.wg = _param(gen, hd, d)
            self.c_norm = nn.Parameter(torch.ones(hd))
            self.wik = _param(gen, di, hd)
            self.ik_norm = nn.Parameter(torch.ones(di))
        if index:
            self.wqi = _param(gen, cfg.index_heads * di, d)
            self.ww = _param(gen, cfg.index_heads, d)
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.w1 = _param(gen, cfg.mlp_hidden, d)
        self.w3 = _param(gen, cfg.mlp_hidden, d)
        self.w2 = _param(gen, d, cfg.mlp_hidden, scale=cfg.mlp_hidden ** -0.5 / (2 * cfg.num_layers) ** 0.5)


def mlp(cfg: ModelConfig, w: LayerWeights, h: Tensor, inv: bool) -> Tensor:
    """SwiGLU: W2 (silu(W1 x) * W3 x), x = RMSNorm(h)."""
    x = ops.rms_norm(h, w.ffn_norm, cfg.norm_eps)
    gate = ops.silu(ops.linear(x, w.w1, invariant=inv), invariant=inv)
    return ops.linear(gate * ops.linear(x, w.w3, invariant=inv), w.w2, invariant=inv)


@dataclass(frozen=True)
class CompressorInputs:
    """What a source layer compresses in one step: only rows it does not hold yet.

    Attributes:
        kv: ratio 1: the kv projections `[n, head_dim]` of the new rows' positions;
            ratio 2: the pairs' kv projections `[pairs, 2, head_dim]`.
        scores: ratio 2: the pairs' gate scores `[pairs, 2, head_dim]`; ratio 1: None.
        first: the row of the step's first whole group (before `skip`).
        skip: groups at the start whose rows the state already holds (loaded rows are
            never rewritten).
    """

    kv: Tensor
    scores: Tensor | None
    first: int
    skip: int


def new_compressor_inputs(g: ModelGeometry, state: CacheState, layer: int, kv: Tensor, score: Tensor, start: int,
                          end: int) -> CompressorInputs:
    """The groups of positions [start, end) whose rows `layer` must compute, given what `state` holds.

    Ratio 2 at an odd `start` completes the open pair (start - 1, start) with the raw tail,
    unless the pair's row is already held (a resume at T - 1, a replay): then it stays.
    The one place both model paths (layers.compress and fast._compress) decide it.

    Raises:
        InvalidArgument: an odd start with neither the tail nor the open pair's row, or rows
            missing below the first one to compute.
    """
    have = state.kv_rows[layer].shape[0]
    if g.compress_ratios[layer] == 1:
        skip = max(0, have - start)
        return _held_below(CompressorInputs(kv=kv[skip:], scores=None, first=start, skip=skip), layer, have, start)
    seq_kv, seq_score, seq_start = kv, score, start
    if start % 2:
        if have > (start - 1) // 2:  # the open pair's row is held: it stays as it is
            seq_kv, seq_score, seq_start = kv[1:], score[1:], start + 1
        elif state.tail is not None:
            tail = state.tail[g.ratio2_source_layers.index(layer)]
            seq_kv, seq_score, seq_start = torch.cat((tail[:1], kv)), torch.cat((tail[1:], score)), start - 1
        else:
            raise InvalidArgument(f"layer {layer}: the state is at odd length {start} with neither its raw "
                                  f"tail nor the row of pair ({start - 1}, {start}): restore the tail")
    pairs = (end - seq_start) // 2
    first = seq_start // 2
    skip = min(pairs, max(0, have - first))
    width = kv.shape[-1]
    return _held_below(CompressorInputs(kv=seq_kv[:2 * pairs].reshape(pairs, 2, width)[skip:],
                                        scores=seq_score[:2 * pairs].reshape(pairs, 2, width)[skip:],
                                        first=first, skip=skip), layer, have, start)


def groups_to_compute(g: ModelGeometry, state: CacheState, layer: int, start: int, end: int) -> int | None:
    """How many rows `new_compressor_inputs` would compute for positions [start, end), from host ints only.

    None where it would raise (an odd start with neither tail nor the open pair's row): the caller
    then runs the step that raises. replay.model.graphs takes a step only when this is 0 for every
    source (a bounded replay over loaded rows), so a captured step never appends rows.
    """
    have = state.kv_rows[layer].shape[0]
    if g.compress_ratios[layer] == 1:
        return max(0, (end - start) - max(0, have - start))
    seq_start = start
    if start % 2:
        if have > (start - 1) // 2:
            seq_start = start + 1
        elif state.tail is not None:
            seq_start = start - 1
        else:
            return None
    pairs = max(0, (end - seq_start) // 2)
    return pairs - min(pairs, max(0, have - seq_start // 2))


def _held_below(new: CompressorInputs, layer: int, have: int, start: int) -> CompressorInputs:
    """`new`, once checked that the state holds every row below the first one it computes."""
    if new.first + new.skip > have and new.kv.shape[0]:
        raise InvalidArgument(f"layer {layer}: rows [{have}, {new.first + new.skip}) are missing below position "
                              f"{start}")
    return new


def compress(cfg: ModelConfig, w: LayerWeights, state: CacheState, layer: int, x: Tensor, pos: Tensor,
             freq: Tensor, inv: bool) -> Tensor | None:
    """Append the rows of the groups completed at `pos` to the state's rows of source `layer`.

    A row the state already holds (loaded, or computed earlier) is not rewritten.

    Returns:
        The raw tail `[2, head_dim]` (kv, gate score of the last position) when a
        ratio-2 pair stays open at the end of `pos`; None otherwise.

    Raises:
        InvalidArgument: the state starts at an odd length without its tail and the
            open pair has no row; or rows are missing below `pos`.
    """
    g = cfg.geometry
    ratio = g.compress_ratios[layer]
    start, end = int(pos[0]), int(pos[-1]) + 1
    kv = ops.linear(x, w.wc, invariant=inv)
    score = ops.linear(x, w.wg, invariant=inv)
    new = new_compressor_inputs(g, state, layer, kv, score, start, end)
    first, skip = new.first, new.skip
    if new.scores is None:
        latent = ops.rms_norm(new.kv, w.c_norm, cfg.norm_eps)
    else:
        latent = ops.rms_norm(ops.pool_pairs(new.kv, new.scores, invariant=inv), w.c_norm, cfg.norm_eps)
    if latent.shape[0]:
        group_pos = (torch.arange(latent.shape[0], device=x.device) + first + skip) * ratio
        cos, sin = ops.rope_tables(group_pos, freq)
        kv_rows, _ = ops.fake_quant(ops.rope(latent, cos, sin, g.rope_head_dim), "kv")
        key = ops.rms_norm(ops.linear(latent, w.wik, invariant=inv), w.ik_norm, cfg.norm_eps)
        index_rows, _ = ops.fake_quant(ops.rope(key, cos, sin, g.rope_head_dim), "index")
        state.kv_rows[layer] = torch.cat((state.kv_rows[layer], kv_rows))
        state.index_rows[layer] = torch.cat((state.index_rows[layer], index_rows))
    if ratio == 2 and end % 2:
        return torch.stack((kv[-1], score[-1]))
    return None


def visible_rows(cfg: ModelConfig, state: CacheState, source: int, pos: Tensor) -> Tensor:
    """Rows of `source` each position may see: those whose last position is <= p (and that exist)."""
    ratio = cfg.geometry.compress_ratios[source]
    return torch.clamp((pos + 1) // ratio, max=state.kv_rows[source].shape[0])


def index_topk(cfg: ModelConfig, w: LayerWeights, state: CacheState, source: int, x: Tensor, pos: Tensor,
               tables: tuple[Tensor, Tensor], inv: bool) -> tuple[Tensor, Tensor]:
    """The index layer's selection: (`idx [m, index_topk]`, `valid [m, index_topk]`), canonical.

    Scores are sum_h w_h relu(q_h . k_j) over the visible rows, queries in chunks
    so the `[chunk, heads, rows]` temporary stays bounded at a million rows.
    """
    g = cfg.geometry
    m = x.shape[0]
    visible = visible_rows(cfg, state, source, pos)
    horizon = int(visible.max()) if m else 0
    keys = state.index_values(source)[:horizon]
    q = ops.linear(x, w.wqi, invariant=inv).view(m, cfg.index_heads, g.index_head_dim)
    q = ops.rope(q, *tables, g.rope_head_dim)
    weights = ops.linear(x, w.ww, invariant=inv)
    budget = INVARIANT_BUDGET if inv else FAST_BUDGET
    step = max(1, budget // max(1, horizon * cfg.index_heads))
    idx, ok = [], []
    for a in range(0, m, step):
        scores = ops.index_scores(q[a:a + step], weights[a:a + step], keys, invariant=inv)
        i, v = ops.select_topk(scores, visible[a:a + step], cfg.index_topk)
        idx.append(i)
        ok.append(v)
    return torch.cat(idx), torch.cat(ok)


def attention(cfg: ModelConfig, w: LayerWeights, state: CacheState, layer: int, x: Tensor, pos: Tensor,
              tables: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]], window_keys: Tensor,
              selected: tuple[Tensor, Tensor] | None, inv: bool) -> Tensor:
    """Attention `[m, n_heads * head_dim]` of positions `pos` (contiguous).

    Each query's key list is canonical: `window` slots for positions (p - window, p]
    in position order (positions missing from `window_keys`, which covers
    [pos[0] - len(prev), pos[-1]] and ends at p, are masked), then `index_topk`
    slots of selected compressed rows in row order. Window slots meet a query
    rotated at p with the window theta, compressed slots one rotated with the
    compress theta (the theta of their keys).
    """
    g = cfg.geometry
    m, win, hd = x.shape[0], g.window, g.head_dim
    before = window_keys.shape[0] - m
    q = ops.linear(x, w.wq, invariant=inv).view(m, cfg.n_heads, hd)
    q_window = ops.rope(q, *tables[0], g.rope_head_dim)
    slots = torch.arange(m, device=x.device).unsqueeze(1) + (before - win + 1) + torch.arange(win, device=x.device)
    slot_ok = slots >= 0
    slots = slots.clamp(min=0)
    source = g.source_of(layer)
    q_comp = kv_values = None
    if source is not None:
        assert selected is not None
        q_comp = ops.rope(q, *tables[1], g.rope_head_dim)
        kv_values = state.kv_values(source)
        if kv_values.shape[0] == 0:  # nothing visible yet: every slot is masked, but gathers need a row
            kv_values = kv_values.new_zeros((1, hd))
        if not inv:
            # The fast path needs no fixed-length key list: drop the slots no query of this call uses
            # (valid slots come first), which early in a sequence is most of index_topk.
            used = max(1, int(selected[1].sum(-1).max()))
            selected = (selected[0][:, :used], selected[1][:, :used])
    keys_per_query = win + (selected[0].shape[1] if selected is not None and source is not None else 0)
    budget = INVARIANT_BUDGET // cfg.n_heads if inv else FAST_BUDGET
    step = max(1, budget // (keys_per_query * hd))
    out = []
    for a in range(0, m, step):
        b = min(a + step, m)
        parts = [(q_window[a:b], window_keys[slots[a:b]], slot_ok[a:b])]
        if q_comp is not None and kv_values is not None and selected is not None:
            parts.append((q_comp[a:b], kv_values[selected[0][a:b]], selected[1][a:b]))
        out.append(ops.attend(parts, w.sink, invariant=inv))
    return torch.cat(out).reshape(m, cfg.n_heads * hd)
