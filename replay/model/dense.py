"""The full-sequence, batched, differentiable forward (`ReferenceModel.forward_train`).

Same maths as `extend`, written with dense masks for a batch of whole sequences:
window attention as a band mask, compressed rows as a selection mask from the same
canonical top-k (replay.model.ops.select_topk). Quantization is straight-through:
the forward sees the rows' values, the backward the identity. The indexer's choice
is not differentiable (its weights get no gradient), as in the model's own
training, where the indexer learns from a separate loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from replay.model import ops
from replay.model.layers import LayerWeights
from replay.model.weights import ModelWeights


def _rope(x: Tensor, tables: tuple[Tensor, Tensor], rope_dims: int) -> Tensor:
    """RoPE on `[B, T, ..., D]` with tables `[T, rope_dims/2]` (positions along axis 1)."""
    b, t = x.shape[:2]
    flat = x.transpose(0, 1).reshape(t, b, *x.shape[2:])  # positions first, as ops.rope expects
    return ops.rope(flat, *tables, rope_dims).reshape(t, b, *x.shape[2:]).transpose(0, 1)


def _compress(model: ModelWeights, w: LayerWeights, layer: int, x: Tensor, freq: Tensor) -> tuple[Tensor, Tensor]:
    """A source layer's compressed KV `[B, R, D]` and indexer keys `[B, R, d_I]` for full sequences."""
    cfg = model.config
    g = cfg.geometry
    ratio = g.compress_ratios[layer]
    b, t, _ = x.shape
    kv, score = x @ w.wc.T, x @ w.wg.T
    if ratio == 2:
        rows = t // 2
        pk = kv[:, :2 * rows].reshape(b, rows, 2, -1)
        ps = score[:, :2 * rows].reshape(b, rows, 2, -1)
        pooled = (torch.softmax(ps, dim=2) * pk).sum(2)
    else:
        rows, pooled = t, kv
    latent = ops.rms_norm(pooled, w.c_norm, cfg.norm_eps)
    tables = ops.rope_tables(torch.arange(rows, device=x.device) * ratio, freq)
    values = ops.straight_through(_rope(latent, tables, g.rope_head_dim), "kv")
    key = ops.rms_norm(latent @ w.wik.T, w.ik_norm, cfg.norm_eps)
    keys = ops.straight_through(_rope(key, tables, g.rope_head_dim), "index")
    return values, keys


def _select(model: ModelWeights, w: LayerWeights, x: Tensor, keys: Tensor, ratio: int,
            tables: tuple[Tensor, Tensor]) -> Tensor:
    """The index layer's choice as a bool mask `[B, T, R]` (no gradient)."""
    cfg = model.config
    b, t, _ = x.shape
    rows = keys.shape[1]
    with torch.no_grad():
        q = _rope((x @ w.wqi.T).view(b, t, cfg.index_heads, -1), tables, cfg.geometry.rope_head_dim)
        weights = x @ w.ww.T
        scores = torch.einsum("bthd,brd->bthr", q, keys).relu().mul(weights.unsqueeze(-1)).sum(2)
        visible = ((torch.arange(t, device=x.device) + 1) // ratio).clamp(max=rows).repeat(b)
        idx, ok = ops.select_topk(scores.reshape(b * t, rows), visible, cfg.index_topk)
        # unused slots point at a spare column, so no slot clears another's True
        mask = torch.zeros(b * t, rows + 1, dtype=torch.bool, device=x.device)
        mask.scatter_(1, torch.where(ok, idx, rows), True)
    return mask[:, :rows].view(b, t, rows)


def _attention(model: ModelWeights, w: LayerWeights, x: Tensor, window_kv: Tensor,
               tables: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
               compressed: tuple[Tensor, Tensor] | None) -> Tensor:
    """[sink] + band-masked window keys + selected compressed rows, one softmax; `[B, T, H * D]`."""
    cfg = model.config
    g = cfg.geometry
    b, t, _ = x.shape
    q = (x @ w.wq.T).view(b, t, cfg.n_heads, g.head_dim)
    scale = 1.0 / math.sqrt(g.head_dim)
    pos = torch.arange(t, device=x.device)
    band = (pos.view(1, -1) <= pos.view(-1, 1)) & (pos.view(1, -1) > pos.view(-1, 1) - g.window)
    qw = _rope(q, tables[0], g.rope_head_dim)
    s_win = torch.einsum("bthd,bsd->bhts", qw, window_kv) * scale
    parts = [w.sink.view(1, -1, 1, 1).expand(b, -1, t, 1), s_win.masked_fill(~band, -math.inf)]
    if compressed is not None:
        values, mask = compressed
        qc = _rope(q, tables[1], g.rope_head_dim)
        s_c = torch.einsum("bthd,brd->bhtr", qc, values) * scale
        parts.append(s_c.masked_fill(~mask.unsqueeze(1), -math.inf))
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = torch.einsum("bhts,bsd->bthd", p[..., 1:1 + t], window_kv)
    if compressed is not None:
        out = out + torch.einsum("bhtr,brd->bthd", p[..., 1 + t:], compressed[0])
    return out.reshape(b, t, -1)


def forward_dense(model: ModelWeights, tokens: Tensor) -> Tensor:
    """Logits `[B, T, vocab]` of whole sequences `[B, T]` (positions from 0), differentiable."""
    cfg = model.config
    g = cfg.geometry
    tokens = tokens.to(model.device)
    t = tokens.shape[1]
    pos = torch.arange(t, device=model.device)
    freq_c = model.freq_compress.to(model.device)
    tables = (ops.rope_tables(pos, model.freq_window.to(model.device)), ops.rope_tables(pos, freq_c))
    h = model.embed[tokens]
    sources: dict[int, tuple[Tensor, Tensor]] = {}
    chosen: dict[int, Tensor] = {}
    for layer in range(g.num_layers):
        w: LayerWeights = model.blocks[layer]  # type: ignore[assignment]
        x = ops.rms_norm(h, w.attn_norm, cfg.norm_eps)
        latent = ops.rms_norm(x @ w.wkv.T, w.kv_norm, cfg.norm_eps)
        window_kv = ops.straight_through(_rope(latent, tables[0], g.rope_head_dim), "window")
        source = g.source_of(layer)
        if layer in g.kv_source_layers:
            sources[layer] = _compress(model, w, layer, x, freq_c)
        if layer in cfg.index_layers and source is not None:
            chosen[source] = _select(model, w, x, sources[source][1], g.compress_ratios[source], tables[1])
        compressed = (sources[source][0], chosen[source]) if source is not None else None
        h = h + _attention(model, w, x, window_kv, tables, compressed) @ w.wo.T
        y = ops.rms_norm(h, w.ffn_norm, cfg.norm_eps)
        h = h + (torch.nn.functional.silu(y @ w.w1.T) * (y @ w.w3.T)) @ w.w2.T
    return ops.rms_norm(h, model.final_norm, cfg.norm_eps) @ model.head.T
