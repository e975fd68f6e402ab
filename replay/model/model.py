"""The torch reference model of the DeepSeek-V4.1 structure, computing its cache in the model's own bytes.

Per layer l, at position p (docs/MODEL.md has the equations):

- x = RMSNorm(h); window KV = FP8(RoPE(RMSNorm(W_kv x), p)) (kvstore.codec.rows.swa_rows);
- kv source layers also compress: ratio 2 pools pairs (2j, 2j+1) by a per-channel
  softmax over gate scores, ratio 1 takes each token; RMSNorm, RoPE at the group's
  first position (compress theta), FP4 (compressed_kv_rows); indexer key =
  FP4(RoPE(RMSNorm(W_ik latent))) (indexer_key_rows);
- index layers score the visible compressed rows (sum_h w_h relu(q_h . k_j)) and keep the top-k;
- attention over [sink] + window keys of (p - window, p] + the selected compressed rows;
- h += W_o attn; h += SwiGLU(RMSNorm(h)).

`extend` is the one incremental path (prefill, decode, resume and replay all use it);
`replay` and `greedy` are built on it. With `batch_invariant=True` (CPU default)
every position's outputs are bit-identical however positions are chunked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from kvstore.errors import InvalidArgument
from replay.model import fast, ops
from replay.model.config import ModelConfig
from replay.model.graphs import StepGraphs
from replay.model.layers import LayerWeights, attention, compress, index_topk, mlp
from replay.model.state import CacheState


class ReferenceModel(nn.Module):
    """Seeded, deterministic reference weights plus the incremental forward.

    Args:
        config: the model's shape.
        device: where the weights and every state live.
        batch_invariant: row-invariant arithmetic (see replay.model.layers); by
            default True on CPU and False on CUDA (matmul path, TF32 off).

    Attributes:
        fused: without batch invariance, run the fused, sync-free step
            (replay.model.fast; True by default); False runs the per-layer functions of
            replay.model.layers, as before it existed (the speed bench's baseline).
        graphs: with the fused step, take the steps that fit (a bounded replay over loaded
            rows, at most replay.model.graphs.MAX_TOKENS tokens) through fixed buffers,
            captured in CUDA graphs on CUDA (replay.model.graphs; logits and rows equal to
            the fused step's). True by default on CUDA; on the CPU the same buffers run
            eagerly when set (what the CPU tests check). The worker's `--cuda-graphs off`
            clears it.
    """

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu",
                 batch_invariant: bool | None = None) -> None:
        super().__init__()
        self.config = config
        dev = torch.device(device)
        self.batch_invariant = dev.type == "cpu" if batch_invariant is None else batch_invariant
        self.fused = True
        self.graphs = dev.type == "cuda"
        self._step_graphs: StepGraphs | None = None
        if dev.type == "cuda":
            # float32 throughout: TF32 would change the rows the model writes.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        gen = torch.Generator().manual_seed(config.seed)
        g = config.geometry
        self.embed = nn.Parameter(torch.randn(config.vocab_size, config.dim, generator=gen))
        self.blocks = nn.ModuleList(
            LayerWeights(config, layer, gen, source=layer in g.kv_source_layers,
                         index=layer in config.index_layers) for layer in range(g.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.dim))
        self.head = nn.Parameter(torch.randn(config.vocab_size, config.dim, generator=gen) / config.dim**0.5)
        self.to(dev)
        rd = g.rope_head_dim
        # float64 RoPE frequencies: plain attributes (not buffers), so state_dict holds weights only.
        self.freq_window: Tensor = ops.inv_freq(rd, config.rope_theta, dev)
        self.freq_compress: Tensor = ops.inv_freq(rd, config.compress_rope_theta, dev)

    @property
    def device(self) -> torch.device:
        """The device of the weights."""
        return self.embed.device

    # -- states ----------------------------------------------------------------------

    def new_state(self) -> CacheState:
        """An empty cache (length 0) on the model's device."""
        g = self.config.geometry
        dev = self.device
        return CacheState(
            length=0,
            window_rows=[torch.empty((0, g.window_row_bytes), dtype=torch.uint8, device=dev)
                         for _ in range(g.num_layers)],
            kv_rows={s: torch.empty((0, g.compressed_kv_row_bytes), dtype=torch.uint8, device=dev)
                     for s in g.kv_source_layers},
            index_rows={s: torch.empty((0, g.indexer_row_bytes), dtype=torch.uint8, device=dev)
                        for s in g.kv_source_layers})

    def _tokens(self, tokens: Tensor | Sequence[int]) -> Tensor:
        # Checked where the ids are: a host list on the host (no device sync), a tensor where it lives.
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if t.numel():
            lo, hi = (int(t.min()), int(t.max())) if isinstance(tokens, Tensor) else (min(t.tolist()), max(t.tolist()))
            if lo < 0 or hi >= self.config.vocab_size:
                raise InvalidArgument(f"token ids must be in [0, {self.config.vocab_size}), got [{lo}, {hi}]")
        return t.to(self.device)

    # -- the incremental forward --------------------------------------------------------

    @torch.no_grad()
    def extend(self, state: CacheState, tokens: Tensor | Sequence[int], *, tail_prefill: bool | None = None,
               chunk: int = 4096) -> Tensor:
        """Process `tokens` at positions [state.length, state.length + n), mutating `state`.

        Writes each layer's window rows, the compressed and indexer rows of groups
        completed here (never rewriting a row the state already holds), and the raw
        tail at an odd length.

        Args:
            state: the cache to extend (its device must be the model's).
            tokens: n token ids.
            tail_prefill: decoder-side tail prefill (default: the config's). The
                layers above the last kv source compute only the last min(n, window)
                positions; when that cuts positions, their window attention sees
                only the positions they computed in this call.
            chunk: positions per internal step (bounds memory; never changes results
                in batch-invariant mode).

        Returns:
            float32 logits `[n, vocab]`, or `[min(n, window), vocab]` (the last
            positions) with tail prefill.

        Raises:
            InvalidArgument: bad token ids or chunk; an odd-length state without its
                raw tail whose open pair has no row.
        """
        if chunk <= 0:
            raise InvalidArgument(f"chunk must be positive, got {chunk}")
        toks = self._tokens(tokens)
        n = toks.numel()
        self._check_open_pair(state)
        use_tail = self.config.tail_prefill if tail_prefill is None else tail_prefill
        cut = n - min(n, self.config.geometry.window) if use_tail else 0
        outs: list[Tensor] = []
        for c0 in range(0, cut, chunk):  # positions only the layers up to the last source compute
            self._step(state, toks[c0:min(c0 + chunk, cut)], top=self.config.last_source)
        if cut:
            # The upper layers skipped [start, cut): their window restarts empty (it holds
            # only positions they computed in this call).
            for layer in range(self.config.last_source + 1, self.config.num_layers):
                state.window_rows[layer] = state.window_rows[layer][:0]
        for c0 in range(cut, n, chunk):
            logits = self._step(state, toks[c0:min(c0 + chunk, n)], top=self.config.num_layers - 1)
            assert logits is not None
            outs.append(logits)
        if not outs:
            return torch.empty((0, self.config.vocab_size), device=self.device)
        return torch.cat(outs)

    def _check_open_pair(self, state: CacheState) -> None:
        """Refuse, before touching the state, an odd length whose open pair has neither tail nor row."""
        g = self.config.geometry
        if state.length % 2 == 0 or state.tail is not None:
            return
        for s in g.ratio2_source_layers:
            if state.kv_rows[s].shape[0] <= (state.length - 1) // 2:
                raise InvalidArgument(f"layer {s}: the state is at odd length {state.length} with neither its raw "
                                      f"tail nor the row of pair ({state.length - 1}, {state.length}): restore "
                                      f"the tail (a snapshot at {state.length}) or the blocks holding that pair")

    def _step(self, state: CacheState, toks: Tensor, *, top: int) -> Tensor | None:
        """Layers 0..top for positions [state.length, state.length + m); logits when top is the last layer."""
        if not self.batch_invariant and self.fused:
            if self.graphs:
                taken, logits = self.step_graphs().step(state, toks, top=top)
                if taken:
                    return logits
            return fast.step(self, state, toks, top=top)
        cfg, g = self.config, self.config.geometry
        inv = self.batch_invariant
        start, m = state.length, toks.numel()
        pos = torch.arange(start, start + m, device=self.device)
        freq_c = self.freq_compress.to(self.device)  # no-op unless the module was moved after __init__
        tables = (ops.rope_tables(pos, self.freq_window.to(self.device)), ops.rope_tables(pos, freq_c))
        h = self.embed[toks]
        selected: dict[int, tuple[Tensor, Tensor]] = {}  # kv source -> the last index layer's top-k
        new_tail: dict[int, Tensor] = {}
        for layer in range(top + 1):
            w: LayerWeights = self.blocks[layer]  # type: ignore[assignment]
            x = ops.rms_norm(h, w.attn_norm, cfg.norm_eps)
            lat = ops.rms_norm(ops.linear(x, w.wkv, invariant=inv), w.kv_norm, cfg.norm_eps)
            rows, vals = ops.fake_quant(ops.rope(lat, *tables[0], g.rope_head_dim), "window")
            prev = state.window_rows[layer]
            window_keys = torch.cat((ops.decode(prev, "window"), vals))  # positions [start - len(prev), start + m)
            source = g.source_of(layer)
            if layer in g.kv_source_layers:
                tail = compress(cfg, w, state, layer, x, pos, freq_c, inv)
                if tail is not None:
                    new_tail[layer] = tail
            if layer in cfg.index_layers:
                assert source is not None
                selected[source] = index_topk(cfg, w, state, source, x, pos, tables[1], inv)
            chosen = selected.get(source) if source is not None else None
            attn = attention(cfg, w, state, layer, x, pos, tables, window_keys, chosen, inv)
            state.window_rows[layer] = torch.cat((prev, rows))[-g.window:]
            h = h + ops.linear(attn, w.wo, invariant=inv)
            h = h + mlp(cfg, w, h, inv)
        state.length = start + m
        if state.length % 2 and g.ratio2_source_layers:
            state.tail = torch.stack([new_tail[s] for s in g.ratio2_source_layers])
        elif state.length % 2:
            state.tail = torch.zeros((0, 2, g.head_dim), device=self.device)
        else:
            state.tail = None
        if top < cfg.num_layers - 1:
            return None
        return ops.linear(ops.rms_norm(h, self.final_norm, cfg.norm_eps), self.head, invariant=inv)

    def step_graphs(self) -> StepGraphs:
        """The model's captured steps (replay.model.graphs), made on first use and again after a move."""
        steps = self._step_graphs
        if steps is None or steps.device != self.device:
            steps = self._step_graphs = StepGraphs(self)
        return steps

    # -- replay and decode ------------------------------------------------------------------

    @torch.no_grad()
    def replay(self, tokens: Sequence[int] | Tensor, rows: CacheState, *, span: int) -> CacheState:
        """Recompute positions [H - span, H) over loaded rows, with an empty window at H - span.

        Args:
            tokens: the sequence (at least its first H = rows.length tokens).
            rows: a state holding the rows of [0, H) (e.g. `restore_state` without a
                snapshot); its window is ignored. It is not modified.
            span: positions to recompute; span >= H recomputes everything (the rows
                are still kept: loaded rows are authoritative).

        Returns:
            A new state at H: the loaded rows (plus a ratio-2 row straddling H if one
            was missing), window rows of the recomputed positions, the tail at odd H.
            Window attention of the recomputed positions sees nothing below H - span.

        Raises:
            InvalidArgument: span < 1 or fewer than H tokens.
        """
        return self.replay_logits(tokens, rows, span=span)[0]

    @torch.no_grad()
    def replay_logits(self, tokens: Sequence[int] | Tensor, rows: CacheState, *,
                      span: int) -> tuple[CacheState, Tensor]:
        """`replay`, with the logits of the recomputed positions `[min(span, H), vocab]` (what the
        graph tests compare)."""
        h_len = rows.length
        if span < 1 or len(tokens) < h_len:
            raise InvalidArgument(f"replay needs span >= 1 and the {h_len} tokens the rows cover; "
                                  f"got span {span} and {len(tokens)} tokens")
        start = max(0, h_len - span)
        toks = tokens[start:h_len]  # only the span: a 1M-token list is never converted whole (extend checks it)
        empty = self.new_state()
        state = CacheState(length=start, window_rows=empty.window_rows, kv_rows=dict(rows.kv_rows),
                           index_rows=dict(rows.index_rows), tail=None, rows_floor=rows.rows_floor)
        logits = self.extend(state, toks, tail_prefill=False)
        return state, logits

    @torch.no_grad()
    def greedy(self, state: CacheState, first_logits: Tensor, n: int) -> tuple[list[int], Tensor]:
        """n greedy tokens, extending `state` with each.

        Token i is the argmax of logits i, where logits 0 = `first_logits` (the
        next-token logits after the prompt) and logits i = the model's output after
        token i - 1. All n tokens are fed, so the state ends after the last one.

        Returns:
            (tokens, logits `[n, vocab]`: the distributions the tokens were chosen from).
        """
        logits = first_logits.reshape(-1).float().to(self.device)
        out: list[int] = []
        rows: list[Tensor] = []
        for _ in range(n):
            rows.append(logits)
            tok = int(torch.argmax(logits))
            out.append(tok)
            logits = self.extend(state, [tok], tail_prefill=False)[-1]
        stacked = torch.stack(rows) if rows else torch.empty((0, self.config.vocab_size), device=self.device)
        return out, stacked

    # -- training and weights -----------------------------------------------------------------

    def forward_train(self, tokens: Tensor) -> Tensor:
        """Batched, differentiable full-sequence forward `[B, T] -> [B, T, vocab]` (same maths as extend).

        Quantization is straight-through (forward: the rows' values; backward: identity).
        """
        from replay.model.dense import forward_dense

        return forward_dense(self, tokens)

    def save_weights(self, path: str | Path) -> None:
        """Write the config and the weights (torch.save of plain tensors)."""
        torch.save({"config": self.config.to_dict(),
                    "weights": {k: v.detach().cpu() for k, v in self.state_dict().items()}}, str(path))

    def load_weights(self, path: str | Path) -> None:
        """Read weights `save_weights` wrote for the same config (seed aside).

        Raises:
            InvalidArgument: the file is for another model shape.
        """
        data = torch.load(str(path), map_location=self.device, weights_only=True)
        theirs = dict(data.get("config", {}))
        mine = self.config.to_dict()
        for key in ("seed", "tail_prefill"):
            theirs.pop(key, None)
            mine.pop(key, None)
        if theirs != mine:
            raise InvalidArgument(f"weights at {path} are for another model: {theirs} (this one: {mine})")
        self.load_state_dict(data["weights"])


__all__ = ["ReferenceModel"]
