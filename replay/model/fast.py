"""The fast path of `ReferenceModel.extend` (batch_invariant=False, `fused=True`): few launches, no host syncs.

The same maths as replay.model.layers (allclose to it: tests/replay/model/test_fast.py),
arranged so that a short extend (a 128-token bounded replay over 40 layers) is not
bound by the host launching kernels and waiting on the GPU:

- no host sync inside the layer loop: every size comes from Python ints the step
  already knows (positions, row counts), never from a GPU value (`.item()`,
  `int(tensor)`, boolean indexing); the rows' NaN/Inf flags are collected on the
  device and checked once per step (the step's one sync);
- per layer, the projections of x (window KV, queries, compressor kv and gate,
  indexer query and weights) are one matmul against their concatenated weights,
  and the MLP's W1 and W3 one more (built once per weight version);
- RoPE is one complex multiply by a per-step table (ones on the channels without
  RoPE; the softmax scale folded into the query tables);
- window attention is a banded matmul against the window rows (no per-query
  gather), with a mask shared by every layer of the step; the selected compressed
  rows are gathered once per query chunk; one softmax spans sink, window and rows;
- rows written are appended to the state's float copies as they are encoded, so
  they are never decoded again, and the window rows are decoded once per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from kvstore.codec import rows as codec
from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from replay.model import ops
from replay.model.config import ModelConfig
from replay.model.layers import FAST_BUDGET, LayerWeights, new_compressor_inputs
from replay.model.state import CacheState
from replay.model.weights import ModelWeights

#: The codec's encoders, each returning (rows, flag) without checking the flag: the step checks
#: every flag at once (kvstore.codec.rows checks each with a host sync).
_ENCODERS = {"window": codec._swa, "kv": codec._compressed_kv, "index": codec._indexer_key}


@dataclass
class _Pack:
    """One layer's weights as the fused step uses them, and the (version, address) of the weights they came from.

    Held here so the layer loop reads plain attributes, not the module's parameters.
    """

    key: tuple[tuple[int, int], ...]
    w_in: Tensor  # [wkv; wq; (wc; wg); (wqi; ww); (a zero row to an even width)]
    w13: Tensor  # [w1; w3]
    attn_norm: Tensor
    ffn_norm: Tensor
    kv_norm: Tensor
    wo_t: Tensor
    w2_t: Tensor
    sink: Tensor  # [1, heads, 1]
    c_norm: Tensor | None = None  # source layers
    wik: Tensor | None = None
    ik_norm: Tensor | None = None


def _key(params: list[Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((p._version, p.data_ptr()) for p in params)


def _pack(w: LayerWeights) -> _Pack:
    """The layer's packed weights, rebuilt when any of its weights changed (load_weights, training, .to)."""
    pack: _Pack | None = w.__dict__.get("_fast_pack")
    source, index = hasattr(w, "wc"), hasattr(w, "wqi")
    names = ["wkv", "wq"] + (["wc", "wg"] if source else []) + (["wqi", "ww"] if index else [])
    rest = ["attn_norm", "ffn_norm", "kv_norm", "w1", "w3", "wo", "w2", "sink"]
    rest += ["c_norm", "wik", "ik_norm"] if source else []
    params = [getattr(w, n) for n in (*names, *rest)]
    key = _key(params)
    if pack is not None and pack.key == key:
        return pack
    with torch.no_grad():
        p = dict(zip((*names, *rest), params, strict=True))
        w_in = torch.cat([p[n] for n in names])
        if w_in.shape[0] % 2:  # even width: every slice of the output starts at an even column
            w_in = torch.cat((w_in, w_in.new_zeros((1, w_in.shape[1]))))
        pack = _Pack(key=key, w_in=w_in.contiguous(), w13=torch.cat((p["w1"], p["w3"])).contiguous(),
                     attn_norm=p["attn_norm"], ffn_norm=p["ffn_norm"], kv_norm=p["kv_norm"], wo_t=p["wo"].t(),
                     w2_t=p["w2"].t(), sink=p["sink"].view(1, -1, 1))
        if source:
            pack.c_norm, pack.wik, pack.ik_norm = p["c_norm"], p["wik"], p["ik_norm"]
    w.__dict__["_fast_pack"] = pack
    return pack


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return functional.rms_norm(x, (x.shape[-1],), weight, eps)


def rotation(positions: Tensor, freqs: Tensor, dims: int, rope_dims: int, scale: float = 1.0) -> Tensor:
    """complex64 `[n, dims/2]`: 1 on the pairs without RoPE, cos + i sin (ops.rope_tables) on the last rope_dims/2."""
    n = positions.shape[0]
    if rope_dims:
        cos, sin = ops.rope_tables(positions, freqs)
        rot = torch.complex(cos, sin)
        if dims > rope_dims:
            rot = torch.cat((rot.new_ones((n, (dims - rope_dims) // 2)), rot), dim=1)
    else:
        rot = torch.ones((n, dims // 2), dtype=torch.complex64, device=positions.device)
    return rot * scale if scale != 1.0 else rot


def rope(x: Tensor, rot: Tensor) -> Tensor:
    """x `[n, D]` or `[..., n, heads, D]` rotated pairwise by `rot` `[..., n, D/2]` (one complex multiply).

    A query `[1, n, heads, D]` against tables `[2, n, D/2]` gives both thetas' rotations `[2, n, heads, D]`.
    """
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * (rot.unsqueeze(-2) if z.dim() > rot.dim() else rot)).flatten(-2)



class _Step:
    """The per-step context: tables shared by every layer, the deferred row flags, the selections.

    `pos` may be given (a fixed buffer holding [start, start + m), as replay.model.graphs passes):
    the tables are then computed from it, so a captured graph recomputes them from its input.
    """

    def __init__(self, model: ModelWeights, state: CacheState, m: int, pos: Tensor | None = None) -> None:
        cfg, g = model.config, model.config.geometry
        self.model, self.cfg, self.g, self.state = model, cfg, g, state
        self.start, self.m = state.length, m
        self.end = self.start + self.m
        dev = model.device
        self.pos = torch.arange(self.start, self.end, device=dev) if pos is None else pos
        self.freq_c = model.freq_compress.to(dev)
        hd, rd = g.head_dim, g.rope_head_dim
        scale = 1.0 / math.sqrt(hd)
        self.rot_w = rotation(self.pos, model.freq_window.to(dev), hd, rd)
        # queries: [window theta; compress theta], both scaled by 1/sqrt(head_dim), rotated in one multiply
        self.rot_q = torch.stack((self.rot_w * scale, rotation(self.pos, self.freq_c, hd, rd, scale)))
        self.rot_qi = rotation(self.pos, self.freq_c, g.index_head_dim, rd)
        self.flags: list[Tensor] = []
        self.selected: dict[int, tuple[Tensor, Tensor]] = {}  # source -> (idx [m, used], additive mask [m, 1, used])
        self.bands: dict[tuple[int, int, int], Tensor] = {}  # (a, b, before) -> additive band mask [(b-a)*H, K]

    def encode(self, x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """(rows, exact values) of x; the NaN/Inf flag is kept for the step's one check."""
        rows, flag = _ENCODERS[kind](x)
        self.flags.append(flag.reshape(-1))
        return rows, ops.decode(rows, kind)

    def finite(self) -> Tensor:
        """A 0-dim bool on the device: every row the step wrote is finite (no host sync)."""
        if not self.flags:
            return torch.ones((), dtype=torch.bool, device=self.pos.device)
        return torch.isfinite(torch.cat(self.flags)).all()

    def check_flags(self) -> None:
        """The step's one host sync: refuse NaN or Inf in any row it wrote."""
        if self.flags and not bool(self.finite()):
            raise InvalidArgument("the model produced NaN or Inf; the cache cannot store it")

    def band(self, a: int, b: int, before: int, lo: int, hi: int) -> Tensor:
        """Additive mask `[(b-a)*heads, hi-lo]`: query i (key index i+before) sees keys j in (i+before-W, i+before]."""
        key = (a, b, before)
        mask = self.bands.get(key)
        if mask is None:
            dev = self.pos.device
            q = torch.arange(a + before, b + before, device=dev).unsqueeze(1)
            d = torch.arange(lo, hi, device=dev).unsqueeze(0) - q
            ok = (d <= 0) & (d > -self.g.window)
            zero = torch.zeros((), device=dev)
            c, nh = b - a, self.cfg.n_heads
            mask = torch.where(ok, zero, -math.inf).unsqueeze(1).expand(c, nh, hi - lo).reshape(c * nh, hi - lo)
            self.bands[key] = mask
        return mask


@dataclass
class LayerIn:
    """What a layer computes from its input before the index and the attention (`layer_in`)."""

    q: Tensor  # queries [m, heads, head_dim], not rotated
    both: Tensor  # window rows [before + m, row bytes]: the ones held, then the step's
    window_keys: Tensor  # their values
    before: int  # window rows held before the step
    kv: Tensor | None = None  # source layers: compressor kv and gate projections [m, head_dim]
    score: Tensor | None = None
    qi: Tensor | None = None  # index layers: indexer query projection and head weights
    weights: Tensor | None = None


@dataclass
class Chosen:
    """The compressed rows a layer attends to: the additive mask `[m, 1, used]` and either the
    selection's indices into the rows' values (gathered per query chunk) or the rows already gathered
    `[m, used, head_dim]` (replay.model.graphs gathers once per index layer: the same values)."""

    mask: Tensor
    idx: Tensor | None = None
    values: Tensor | None = None
    gathered: Tensor | None = None

    @property
    def used(self) -> int:
        """Slots per query."""
        return self.mask.shape[-1]

    def rows(self, a: int, b: int) -> Tensor:
        """`[b - a, used, head_dim]`: the selected rows of queries [a, b)."""
        if self.gathered is not None:
            return self.gathered[a:b]
        assert self.values is not None and self.idx is not None
        return self.values[self.idx[a:b]]


def layer_in(s: _Step, pack: _Pack, layer: int, h: Tensor, prev: Tensor) -> LayerIn:
    """The layer's projections of RMSNorm(h) (one matmul), its window rows (encoded, kept as flags)
    joined to the `prev` rows held, and their values."""
    cfg, g = s.cfg, s.g
    hd, nh, eps = g.head_dim, cfg.n_heads, cfg.norm_eps
    proj = functional.linear(_rms(h, pack.attn_norm, eps), pack.w_in)
    rows, _ = s.encode(rope(_rms(proj[:, :hd], pack.kv_norm, eps), s.rot_w), "window")
    q = proj[:, hd:hd + nh * hd].view(s.m, nh, hd)
    off = hd + nh * hd
    before = prev.shape[0]
    both = torch.cat((prev, rows)) if before else rows
    out = LayerIn(q=q, both=both, window_keys=ops.decode(both, "window"), before=before)  # [start - before, end)
    if layer in g.kv_source_layers:
        out.kv, out.score = proj[:, off:off + hd], proj[:, off + hd:off + 2 * hd]
        off += 2 * hd
    if layer in cfg.index_layers:
        width = cfg.index_heads * g.index_head_dim
        out.qi, out.weights = proj[:, off:off + width], proj[:, off + width:off + width + cfg.index_heads]
    return out


def layer_out(s: _Step, pack: _Pack, h: Tensor, attn: Tensor) -> Tensor:
    """h + W_o attn, then + SwiGLU(RMSNorm(h))."""
    h = torch.addmm(h, attn, pack.wo_t)
    gate, up = functional.linear(_rms(h, pack.ffn_norm, s.cfg.norm_eps), pack.w13).chunk(2, dim=-1)
    return torch.addmm(h, functional.silu(gate) * up, pack.w2_t)


def head(model: ModelWeights, h: Tensor) -> Tensor:
    """The logits of the last layer's output h."""
    return functional.linear(_rms(h, model.final_norm, model.config.norm_eps), model.head)


def step(model: ModelWeights, state: CacheState, toks: Tensor, *, top: int) -> Tensor | None:
    """Layers 0..top for positions [state.length, state.length + m); logits when top is the last layer."""
    s = _Step(model, state, toks.numel())
    cfg, g = s.cfg, s.g
    h = model.embed[toks]
    new_tail: dict[int, Tensor] = {}
    for layer in range(top + 1):
        pack = _pack(model.blocks[layer])  # type: ignore[arg-type]
        inp = layer_in(s, pack, layer, h, state.window_rows[layer])
        source = g.source_of(layer)
        if inp.kv is not None and inp.score is not None:
            tail = _compress(s, pack, layer, inp.kv, inp.score)
            if tail is not None:
                new_tail[layer] = tail
        if inp.qi is not None and inp.weights is not None:
            assert source is not None
            s.selected[source] = index_select(s.cfg, state, source, s.end, s.pos, index_query(s, inp.qi),
                                              inp.weights)
        chosen = None
        if source is not None:
            idx, mask = s.selected[source]
            chosen = Chosen(mask=mask, idx=idx, values=source_values(state, source, g.head_dim))
        attn = _attention(s, pack, layer, inp.q, inp.window_keys, inp.before, chosen)
        state.window_rows[layer] = inp.both[-g.window:]
        h = layer_out(s, pack, h, attn)
    s.check_flags()
    state.length = s.end
    state.tail = end_tail(g, state.length, new_tail, model.device)
    if top < cfg.num_layers - 1:
        return None
    return head(model, h)


def end_tail(g: ModelGeometry, length: int, new_tail: dict[int, Tensor], device: torch.device) -> Tensor | None:
    """The state's raw tail at `length`: the ratio-2 sources' open pairs at an odd length."""
    if length % 2 and g.ratio2_source_layers:
        return torch.stack([new_tail[src] for src in g.ratio2_source_layers])
    if length % 2:
        return torch.zeros((0, 2, g.head_dim), device=device)
    return None


def source_values(state: CacheState, source: int, head_dim: int) -> Tensor:
    """The float values of the source's rows; one zero row when it has none (every slot is masked
    then, but a gather needs a row)."""
    kv_values = state.kv_values(source)
    return kv_values if kv_values.shape[0] else kv_values.new_zeros((1, head_dim))


def _compress(s: _Step, pack: _Pack, layer: int, kv: Tensor, score: Tensor) -> Tensor | None:
    """replay.model.layers.compress on the step's kv and gate projections (rows appended with their values)."""
    g, state = s.g, s.state
    assert pack.c_norm is not None and pack.wik is not None and pack.ik_norm is not None
    eps = s.cfg.norm_eps
    ratio = g.compress_ratios[layer]
    start, end = s.start, s.end
    new = new_compressor_inputs(g, state, layer, kv, score, start, end)
    first, skip = new.first, new.skip
    pooled = new.kv if new.scores is None else (torch.softmax(new.scores, dim=1) * new.kv).sum(1)
    n = pooled.shape[0]
    if n:
        latent = _rms(pooled, pack.c_norm, eps)
        group_pos = torch.arange(first + skip, first + skip + n, device=kv.device) * ratio
        rot = rotation(group_pos, s.freq_c, g.head_dim, g.rope_head_dim)
        kv_rows, kv_values = s.encode(rope(latent, rot), "kv")
        key = _rms(functional.linear(latent, pack.wik), pack.ik_norm, eps)
        rot_i = rotation(group_pos, s.freq_c, g.index_head_dim, g.rope_head_dim)
        index_rows, index_values = s.encode(rope(key, rot_i), "index")
        state.append_rows(layer, kv_rows, kv_values, index_rows, index_values)
    return open_pair(g, layer, end, kv, score)


def open_pair(g: ModelGeometry, layer: int, end: int, kv: Tensor, score: Tensor) -> Tensor | None:
    """The raw tail `[2, head_dim]` of a ratio-2 source whose last pair stays open at `end`."""
    if g.compress_ratios[layer] == 2 and end % 2:
        return torch.stack((kv[-1], score[-1]))
    return None


def index_query(s: _Step, qi: Tensor) -> Tensor:
    """The indexer query `[m, heads, index_head_dim]`, rotated (compress theta)."""
    return rope(qi.reshape(s.m, s.cfg.index_heads, s.g.index_head_dim), s.rot_qi)


def index_select(cfg: ModelConfig, state: CacheState, source: int, end: int, pos: Tensor, q: Tensor,
                 weights: Tensor) -> tuple[Tensor, Tensor]:
    """The index layer's top-k (ops.select_topk, the rule both paths share), trimmed to the slots any query uses.

    Scores the queries at `pos` (ending at `end`) against the visible indexer keys of `source`:
    (idx `[m, used]`, additive mask `[m, 1, used]`), used = max(1, min(top-k, horizon)).
    """
    g = cfg.geometry
    m = pos.shape[0]
    ratio = g.compress_ratios[source]
    rows = state.kv_rows[source].shape[0]
    horizon = min(end // ratio, rows)  # the largest number of rows any query of the step sees
    visible = torch.clamp((pos + 1) // ratio, max=rows)
    keys = state.index_values(source)[:horizon]
    step = max(1, FAST_BUDGET // max(1, horizon * cfg.index_heads))
    idx, ok = [], []
    for a in range(0, m, step):
        b = min(a + step, m)
        dots = torch.relu(torch.matmul(q[a:b], keys.t()))  # [c, heads, rows]
        scores = torch.matmul(weights[a:b].unsqueeze(1), dots).squeeze(1)
        i, v = ops.select_topk(scores, visible[a:b], cfg.index_topk)
        idx.append(i)
        ok.append(v)
    # A query sees min(k, visible) valid slots, first: no query of the step uses a slot past min(k, horizon).
    used = used_slots(cfg, horizon)
    i_all = torch.cat(idx)[:, :used] if len(idx) > 1 else idx[0][:, :used]
    v_all = torch.cat(ok)[:, :used] if len(ok) > 1 else ok[0][:, :used]
    mask = torch.where(v_all, torch.zeros((), device=q.device), -math.inf).unsqueeze(1)
    return i_all.contiguous(), mask


def used_slots(cfg: ModelConfig, horizon: int) -> int:
    """Selection slots a step keeps when no query sees more than `horizon` rows."""
    return max(1, min(cfg.index_topk, horizon))


def _attention(s: _Step, pack: _Pack, layer: int, q: Tensor, window_keys: Tensor, before: int,
               chosen: Chosen | None) -> Tensor:
    """Sink + window keys of (p - W, p] + the selected compressed rows, one softmax: `[m, heads * head_dim]`."""
    cfg, g, m = s.cfg, s.g, s.m
    nh, hd, win = cfg.n_heads, g.head_dim, g.window
    source = g.source_of(layer)
    qc = None
    used = 0
    if source is None:
        qw = rope(q, s.rot_q[0])  # scaled by 1/sqrt(head_dim)
    else:
        qw, qc = rope(q.unsqueeze(0), s.rot_q)  # window and compress theta in one multiply
        assert chosen is not None
        used = chosen.used
    step = max(1, FAST_BUDGET // ((win + used) * hd))
    sink = pack.sink
    outs = []
    for a in range(0, m, step):
        b = min(a + step, m)
        c = b - a
        lo, hi = max(0, a + before - win + 1), b + before
        keys = window_keys[lo:hi]
        band = s.band(a, b, before, lo, hi)
        sw = torch.addmm(band, qw[a:b].reshape(c * nh, hd), keys.t()).view(c, nh, hi - lo)
        parts = [sink.expand(c, nh, 1), sw]
        sel = None
        if qc is not None and chosen is not None:
            sel = chosen.rows(a, b)  # [c, used, hd]
            parts.append(torch.baddbmm(chosen.mask[a:b], qc[a:b], sel.transpose(1, 2)))
        p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
        out = torch.matmul(p[:, :, 1:1 + hi - lo], keys)
        if sel is not None:
            out = torch.baddbmm(out, p[:, :, 1 + hi - lo:], sel)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(m, nh * hd)


__all__ = ["Chosen", "LayerIn", "end_tail", "head", "index_query", "index_select", "layer_in", "layer_out",
           "open_pair", "rope", "rotation", "source_values", "step", "used_slots"]
