"""Numeric primitives of the reference model, each in two modes.

`invariant=True` (the CPU default) makes every row's result independent of how
many rows are computed together, so a position's outputs are bit-identical however
the positions are chunked across `extend` calls. torch's CPU matmul is not: its
blocking depends on the batch size. What is:

- elementwise ops with correctly rounded IEEE results (+, -, *, /, sqrt, max);
- a sum along a contiguous, fixed-length last axis (`(x.unsqueeze(-2) * w).sum(-1)`):
  each output element is reduced by the same vectorised loop whatever the leading shape;
- transcendental functions (exp, sin, cos) computed in float64 and rounded to
  float32: a vectorised and a scalar float64 exp may differ in the last bit, which
  survives the rounding to float32 with probability ~2^-29 per element.

`invariant=False` uses matmul/bmm (fast on CUDA); results agree to float32 rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional

from kvstore.codec import rows as codec

#: Elements of the temporary a mul-sum builds at once (16 MiB of float32).
_MULSUM_ELEMENTS = 1 << 22


def linear(x: Tensor, w: Tensor, *, invariant: bool) -> Tensor:
    """x @ w.T for x `[n, in]`, w `[out, in]`; row-invariant when asked (in row chunks to bound memory)."""
    if not invariant:
        return functional.linear(x, w)
    n = x.shape[0]
    step = max(1, _MULSUM_ELEMENTS // max(1, w.numel()))
    parts = [(x[i:i + step].unsqueeze(-2) * w).sum(-1) for i in range(0, n, step)]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[0]))


def head_scores(q: Tensor, k: Tensor, *, invariant: bool) -> Tensor:
    """Dot products `[n, H, S]` of queries q `[n, H, D]` with per-query keys k `[n, S, D]`."""
    if not invariant:
        return torch.bmm(q, k.transpose(1, 2))
    return (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1)


def head_mix(p: Tensor, v: Tensor, *, invariant: bool) -> Tensor:
    """Weighted sums `[n, H, D]` of per-query values v `[n, S, D]` by weights p `[n, H, S]`."""
    if not invariant:
        return torch.bmm(p, v)
    # The slot axis goes last (contiguous) so it is the reduced axis of a plain sum(-1).
    vt = v.transpose(1, 2).contiguous()
    return (p.unsqueeze(2) * vt.unsqueeze(1)).sum(-1)


def exp(x: Tensor, *, invariant: bool) -> Tensor:
    """exp, through float64 when row invariance is wanted (see the module docstring)."""
    return torch.exp(x.double()).float() if invariant else torch.exp(x)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis (mean of squares as a last-axis sum: invariant in both modes)."""
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * weight


def silu(x: Tensor, *, invariant: bool) -> Tensor:
    """x * sigmoid(x), with the exp as `exp` computes it."""
    return x / (1.0 + exp(-x, invariant=invariant))


def inv_freq(rope_dims: int, theta: float, device: torch.device) -> Tensor:
    """float64 inverse frequencies of RoPE over `rope_dims` channels (pairs (2i, 2i+1))."""
    i = torch.arange(0, rope_dims, 2, dtype=torch.float64, device=device)
    return theta ** (-i / rope_dims)


def rope_tables(positions: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """float32 cos and sin `[n, rope_dims/2]` at integer `positions`, computed in float64 per element."""
    angle = positions.to(torch.float64).unsqueeze(-1) * freqs
    return torch.cos(angle).float(), torch.sin(angle).float()


def rope(x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int) -> Tensor:
    """RoPE on the last `rope_dims` channels of x `[n, ..., D]` (interleaved pairs); tables `[n, rope_dims/2]`.

    The tables broadcast over x's middle axes (heads)."""
    if rope_dims == 0:
        return x
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    head, tail = x[..., :-rope_dims], x[..., -rope_dims:]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((head, rot), dim=-1)


def fake_quant(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """The model's rows of x and their exact values: (`uint8 rows`, float32 values), no gradient.

    kind: "window" (E4M3 + UE8M0), "kv" (E2M1 + E4M3), "index" (E2M1 + UE8M0).
    """
    x = x.detach()
    if kind == "window":
        rows = codec.swa_rows(x)
        return rows, codec.decode_swa_rows(rows)
    if kind == "kv":
        rows = codec.compressed_kv_rows(x)
        return rows, codec.decode_compressed_kv_rows(rows)
    rows = codec.indexer_key_rows(x)
    return rows, codec.decode_indexer_key_rows(rows)


def decode(rows: Tensor, kind: str) -> Tensor:
    """float32 values of stored rows of `kind` (as `fake_quant` names them)."""
    if kind == "window":
        return codec.decode_swa_rows(rows)
    if kind == "kv":
        return codec.decode_compressed_kv_rows(rows)
    return codec.decode_indexer_key_rows(rows)


def straight_through(x: Tensor, kind: str) -> Tensor:
    """Fake quantization for training: the quantized values forward, the identity's gradient backward."""
    _, q = fake_quant(x, kind)
    return x + (q - x).detach()


def pool_pairs(kv: Tensor, score: Tensor, *, invariant: bool) -> Tensor:
    """Ratio-2 pooling: kv, score `[m, 2, D]` -> `[m, D]`, a per-channel softmax over the two gate scores."""
    top = torch.maximum(score[:, 0], score[:, 1]).unsqueeze(1)
    e = exp(score - top, invariant=invariant)
    return (e[:, 0] * kv[:, 0] + e[:, 1] * kv[:, 1]) / (e[:, 0] + e[:, 1])


def attend(parts: list[tuple[Tensor, Tensor, Tensor]], sink: Tensor, *, invariant: bool) -> Tensor:
    """Latent MQA over per-query key lists with a per-head sink logit (K = V = the latent).

    Args:
        parts: `(q [n, H, D], keys [n, S, D], valid bool [n, S])` for each kind of key
            (window, compressed), each query's keys in a canonical slot order; one
            softmax spans all parts. Masked slots weigh exactly 0.
        sink: `[H]` the sink logits (a key whose value is zero).

    Returns:
        `[n, H, D]`.
    """
    scale = 1.0 / math.sqrt(parts[0][0].shape[-1])
    scores = [(head_scores(q, k, invariant=invariant) * scale).masked_fill(~valid.unsqueeze(1), -math.inf)
              for q, k, valid in parts]
    n = parts[0][0].shape[0]
    full = torch.cat([sink.view(1, -1, 1).expand(n, -1, 1), *scores], dim=-1)
    e = exp(full - full.amax(-1, keepdim=True), invariant=invariant)
    p = e / e.sum(-1, keepdim=True)
    out: Tensor | None = None
    offset = 1
    for (_, keys, _), s in zip(parts, scores, strict=True):
        mixed = head_mix(p[..., offset:offset + s.shape[-1]].contiguous(), keys, invariant=invariant)
        out = mixed if out is None else out + mixed
        offset += s.shape[-1]
    assert out is not None
    return out


def index_scores(q: Tensor, w: Tensor, keys: Tensor, *, invariant: bool) -> Tensor:
    """Indexer scores `[n, R]`: sum_h w_h relu(q_h . k_j) for q `[n, h, d]`, w `[n, h]`, keys `[R, d]`."""
    if not invariant:
        dots = torch.einsum("nhd,rd->nhr", q, keys)
        return torch.einsum("nhr,nh->nr", torch.relu(dots), w)
    n, h, _ = q.shape
    step = max(1, _MULSUM_ELEMENTS // max(1, keys.numel() * h))
    out = []
    for i in range(0, n, step):
        dots = (q[i:i + step].unsqueeze(2) * keys.view(1, 1, *keys.shape)).sum(-1)  # [c, h, R]
        weighted = torch.relu(dots) * w[i:i + step].unsqueeze(-1)
        out.append(weighted.transpose(1, 2).contiguous().sum(-1))  # heads last: a last-axis sum
    return torch.cat(out) if out else keys.new_zeros((0, keys.shape[0]))


def select_topk(scores: Tensor, visible: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-k visible rows of each query, canonical: indices ascending, unused slots last.

    Args:
        scores: `[n, R]` indexer scores over rows [0, R).
        visible: int64 `[n]`: rows [0, visible) are visible to each query.
        k: slots per query.

    Returns:
        (`idx` int64 `[n, k]`, `valid` bool `[n, k]`); invalid slots hold index 0.
        Rows scoring above the k-th largest visible score are in; ties at it go to
        the lower row indices (exact 0 scores from the relu tie often). The choice
        depends only on the visible scores, never on rows beyond a query's horizon
        nor on how torch.topk breaks ties (only its k-th value, exact, is used), so
        the fast and the invariant paths choose alike.
    """
    n, r = scores.shape
    cols = torch.arange(r, device=scores.device)
    if r <= k:
        idx = cols.unsqueeze(0).expand(n, r)
    else:
        masked = scores.masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), -math.inf)
        kth = torch.topk(masked, k, dim=-1).values[:, -1:]
        above = masked > kth
        tied = masked == kth
        need = k - above.sum(-1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(-1) <= need))
        # exactly k chosen per row: a topk over descending keys r - col lists them by ascending column
        idx = torch.topk(torch.where(chosen, r - cols, 0), k, dim=-1).values.neg().add(r)
    # idx is ascending, so the rows beyond the horizon (unused slots) are already last
    ok = idx < visible.unsqueeze(1)
    idx = torch.where(ok, idx, 0)
    if idx.shape[1] < k:
        pad = k - idx.shape[1]
        idx = functional.pad(idx, (0, pad))
        ok = functional.pad(ok, (0, pad))
    return idx, ok
