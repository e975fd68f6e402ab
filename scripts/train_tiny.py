#!/usr/bin/env python3
"""Train a reference model (the tiny one by default) on the standard library's sources, byte by byte.

Random weights make attention close to uniform, so a bounded replay's error
on them says little about a trained model's. This trains replay.model's tiny
configuration (docs/FORMAT.md's tiny fixture: vocab 128, dim 128, 5 layers, window 8)
for a few minutes on one GPU on the ASCII bytes of the Python standard
library's sources (replay/corpus.py: files split by a hash of their path, so
`kvstore bench replay` measures on files the model never saw).

The run is fixed by its arguments and the seed: same arguments, same Python
(the corpus is this interpreter's library) and same torch give the same
weights up to GPU nondeterminism. What ships is this script and the seed, not
the weights:

    python scripts/train_tiny.py --out tiny.pt --steps 1500 --seed 0
    kvstore bench replay --weights tiny.pt

`--config reduced_v41-d256` trains the V4.1-shaped model instead (replay.model.config.NAMED_CONFIGS:
40 layers, V4.1-Flash's layer pattern and 128-token window at hidden width 256), for its fidelity
table (scripts/device_fidelity_v41.sh, docs/REPLAY.md). `--time-schedule` makes the learning rate's
cosine end at the --max-minutes cap when that comes before --steps, so a run cut by time still ends
annealed; `--matmul-precision high` lets CUDA matmuls use TF32 (training only: measurement runs
at the default precision).

It writes the weights (model.save_weights) and, beside them, NAME.json with the
arguments, the loss curve, the held-out loss and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay.corpus import corpus  # noqa: E402


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="weights file to write (a JSON log goes beside it)")
    p.add_argument("--config", default="tiny",
                   help="model configuration (replay.model.config.NAMED_CONFIGS: tiny, reduced_v41-d256)")
    p.add_argument("--time-schedule", action="store_true",
                   help="the cosine decay ends at --max-minutes when that comes before --steps")
    p.add_argument("--matmul-precision", choices=("highest", "high"), default="highest",
                   help="torch.set_float32_matmul_precision for training (high: TF32 on CUDA)")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (the schedule spans them)")
    p.add_argument("--max-minutes", type=float, default=4.0, help="stop early after this long (default 4)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (> 64 top-k rows: the indexer selects)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warmup then cosine)")
    p.add_argument("--warmup", type=int, default=100, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


def batches(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of seq + 1 tokens at random offsets of `data` (uint8 [n]), int64 [batch, seq + 1]."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    index = starts[:, None] + torch.arange(seq + 1)[None, :]
    return data[index].long()


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of a [batch, seq + 1] token tensor."""
    logits = model.forward_train(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             tokens[:, 1:].reshape(-1))


def learning_rate(step: int, args: argparse.Namespace, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak over `args.steps` (with --time-schedule,
    over whichever ends first: the steps or the --max-minutes cap, by the elapsed time)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
    if getattr(args, "time_schedule", False):
        done = max(done, min(elapsed_s / max(args.max_minutes * 60, 1e-9), 1.0))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def train(args: argparse.Namespace) -> dict[str, object]:
    """Train and save; returns the log written beside the weights."""
    from replay.model import ReferenceModel
    from replay.model.config import named_config

    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision(args.matmul_precision)
    config = dataclasses.replace(named_config(args.config), seed=args.seed)
    model = ReferenceModel(config, device=args.device)
    model.train()
    device = torch.device(args.device)
    train_data = torch.frombuffer(bytearray(corpus("train")), dtype=torch.uint8).to(device)
    eval_data = torch.frombuffer(bytearray(corpus("eval")), dtype=torch.uint8).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    curve: list[tuple[int, float]] = []
    start = time.perf_counter()
    step = steps_done = 0
    for step in range(args.steps):
        if time.perf_counter() - start > args.max_minutes * 60:
            break
        lr = learning_rate(step, args, time.perf_counter() - start)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = loss_of(model, batches(train_data, args.batch, args.seq, gen).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done += 1  # counted, not step + 1: a time cut breaks before the step it names
        if step % args.log_every == 0 or step == args.steps - 1:
            curve.append((step, loss.item()))
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                  f"{time.perf_counter() - start:6.1f} s", flush=True)
    print(f"stopped after {steps_done} of {args.steps} steps, {time.perf_counter() - start:.1f} s", flush=True)
    model.eval()
    torch.set_float32_matmul_precision("highest")
    with torch.no_grad():
        held_out = [float(loss_of(model, batches(eval_data, args.batch, args.seq, eval_gen).to(device)))
                    for _ in range(8)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save_weights(args.out)
    log: dict[str, object] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": args.config, "steps_done": steps_done, "cut_by_time": steps_done < args.steps,
        "wall_s": time.perf_counter() - start, "curve": curve,
        "held_out_loss": sum(held_out) / len(held_out),
        "held_out_bits_per_byte": sum(held_out) / len(held_out) / math.log(2),
        "train_bytes": train_data.numel(), "eval_bytes": eval_data.numel(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    args.out.with_suffix(".json").write_text(json.dumps(log, indent=1))
    print(f"held-out loss {log['held_out_loss']:.4f} nats/byte; weights in {args.out}", flush=True)
    return log


if __name__ == "__main__":
    train(arguments())
