"""Replay: planner overhead at 1M tokens, bounded-replay fidelity, replay and resume speed.

Three parts, chosen with --parts (default: all; speed only where CUDA is):

- overhead: a `kvstore serve` process holds a 1M-token prompt's blocks (V4.1
  geometry, 15,625 blocks of 64 tokens, 890 MB); the planner's `plan` of that
  prompt is timed against the client's own Lookup of it (hash + RPC) in the
  same run: the difference is what planning costs beyond the store's lookup.
- fidelity (replay/fidelity.py; kvstore/bench/replay_fidelity.py): bounded
  replay at 1x, 2x and 4x the window against exact replay (num_layers x
  window), over many prompts of held-out standard-library text and resume
  points, with the boundary cases; the decoder-side tail prefill against a full
  prefill. Tiny configuration, random weights unless --weights is given.
- speed (kvstore/bench/replay_speed.py, CUDA): bounded against exact replay at
  W = 128 on V4.1's layer pattern at reduced width; the resume of a 1M-token
  conversation (blocks over shared memory into GPU memory, then bounded replay)
  against a full prefill, measured at sizes that fit and extrapolated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import V4_1_FLASH

PARTS = ("overhead", "fidelity", "speed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench replay`."""
    parser.add_argument("--parts", default="auto",
                        help="comma-separated parts: overhead,fidelity,speed (default auto: all; speed with CUDA)")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized: 4,096-token overhead prompt, 2 prompts per case of at most 8 windows, "
                             "2 continued tokens, small speed sizes")
    parser.add_argument("--overhead-tokens", type=int, default=1_000_000, help="prompt length of the overhead part")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed runs per figure, the best kept (default 5); the overhead part pairs 4x as many")
    parser.add_argument("--prompts", type=int, default=48, help="resume points per fidelity case (default 48)")
    parser.add_argument("--steps", type=int, default=32, help="greedy tokens continued for the KL (default 32)")
    parser.add_argument("--spans", default="1,2,4", help="bounded replay spans in windows (default 1,2,4)")
    parser.add_argument("--cases", default="all",
                        help="fidelity cases, comma-separated (default all, none for only the tail prefill; "
                             "docs/REPLAY.md lists them)")
    parser.add_argument("--tail-prompts", type=int, default=-1,
                        help="prompts of the tail-prefill study (default: --prompts; 0 skips it)")
    parser.add_argument("--model", choices=("tiny", "reduced", "reduced_v41-d256"), default="tiny",
                        help="fidelity model: the tiny fixture, reduced_v41(--speed-dim) (W = 128, 40 layers), or "
                             "a named config (replay.model.config.NAMED_CONFIGS: reduced_v41-d256, the trained "
                             "V4.1-shaped model)")
    parser.add_argument("--batch-invariant", choices=("on", "off"), default="on",
                        help="fidelity model arithmetic: on (default) makes exact replay equal the full prefill "
                             "bit for bit, so every error measured is the approximation's; off: fast CUDA matmuls")
    parser.add_argument("--max-windows", type=int, default=48,
                        help="longest stored prefix of the fidelity cases, in windows (default 48)")
    parser.add_argument("--weights", default="",
                        help="tiny-model weights from scripts/train_tiny.py, comma-separated: one model per "
                             "training seed (default: seeded random weights)")
    parser.add_argument("--train-seed", default="",
                        help="train the tiny model with scripts/train_tiny.py at these seeds (comma-separated, "
                             "in parallel) and measure each; weights already trained with the same arguments "
                             "are reused")
    parser.add_argument("--train-steps", type=int, default=3000, help="steps of --train-seed's training (3000)")
    parser.add_argument("--train-minutes", type=float, default=3.5,
                        help="longest each --train-seed training runs, minutes (default 3.5)")
    parser.add_argument("--train-dir", type=Path, default=Path(".replay-weights"),
                        help="where --train-seed writes its weights (default .replay-weights)")
    parser.add_argument("--seeds", default="",
                        help="prompt seeds, comma-separated (default: --seed); every model sees the same prompts")
    parser.add_argument("--fidelity-minutes", type=float, default=0.0,
                        help="stop adding resumes after this long (0: none); resumes go round-robin over "
                             "models, seeds and cases, so a cut keeps every one of them")
    parser.add_argument("--write-table", type=Path, default=None,
                        help="write the span table the planner reads (e.g. replay/fidelity/tiny.json)")
    parser.add_argument("--write-resumes", type=Path, default=None,
                        help="write every resume's figures (for merging shards: scripts/merge_fidelity.py)")
    parser.add_argument("--block-tokens", type=int, default=0,
                        help="block size of the fidelity study (default: half the window, V4.1's 64/128)")
    parser.add_argument("--device", default="auto", help="torch device of the fidelity part (auto: cuda if any)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and resume points")
    parser.add_argument("--speed-dim", type=int, default=512, help="hidden width of the reduced V4.1 config")
    parser.add_argument("--prefill-sizes", default="4096,16384,65536",
                        help="prefill lengths timed for the throughput fit (default 4096,16384,65536)")
    parser.add_argument("--replay-at", type=int, default=8192, help="H of the bounded/exact replay timing")
    parser.add_argument("--resume-tokens", type=int, default=1_000_000, help="conversation length resumed")
    parser.add_argument("--speed-device", default="cuda", help="device of the speed part (cpu: a dry run)")
    parser.add_argument("--resume-path", choices=("shm", "pinned"), default="shm",
                        help="rows into host memory over a kvstore serve's shm path, or from a pinned buffer")


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the chosen parts; see the module docstring."""
    if args.quick:
        args.overhead_tokens = min(args.overhead_tokens, 4096)
        args.prompts = min(args.prompts, 2)
        args.steps = min(args.steps, 2)
        args.max_windows = min(args.max_windows, 8)
        args.replay_at = min(args.replay_at, 4096)
        args.prefill_sizes = "1024,2048,4096"
        args.resume_tokens = min(args.resume_tokens, 65536)
        args.repeat = min(args.repeat, 2)
    parts = _parts(args.parts)
    report = ReplayReport(bench="replay")
    report.notes.update(parts=",".join(parts), cpus=os.cpu_count())
    if "overhead" in parts:
        overhead(report, args, progress)
    if "fidelity" in parts:
        from kvstore.bench.replay_fidelity import fidelity

        fidelity(report, args, progress)
    if "speed" in parts:
        from kvstore.bench.replay_speed import speed

        speed(report, args, progress)
    return report


def _parts(text: str) -> list[str]:
    if text == "auto":
        from kvstore.bench.transfer import _cuda

        return [p for p in PARTS if p != "speed" or _cuda()]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return parts


class ReplayReport(Report):
    """A report whose table also prints the fidelity tables (kept as `notes["tables"]`).

    The per-setting summaries (`notes["fidelity"]`, `notes["tail_prefill"]`) go to --json only.
    """

    #: Notes the tables already show (or too long for a line): kept for --json only.
    TABLE_ONLY = ("tables", "fidelity", "tail_prefill")

    def to_table(self) -> str:
        """The figures, the short notes and the markdown tables."""
        kept = {k: self.notes.pop(k) for k in self.TABLE_ONLY if k in self.notes}
        try:
            text = super().to_table()
        finally:
            self.notes.update(kept)
        tables = kept.get("tables") or {}
        return text + "".join(f"\n\n{t}" for t in tables.values())  # type: ignore[attr-defined]


def overhead(report: Report, args: argparse.Namespace, progress: Progress) -> None:
    """Planner.plan of a long prompt against the client's own Lookup of it, same server, same run."""
    from kvstore.client import Client
    from replay.planner import Planner

    block_tokens = 64
    block_bytes = V4_1_FLASH.block_bytes(block_tokens)
    n_blocks = max(args.overhead_tokens // block_tokens, 1)
    total = n_blocks * block_bytes
    rng = np.random.default_rng(args.seed)
    tokens = [int(t) for t in rng.integers(0, 128, size=n_blocks * block_tokens)]
    with scratch() as folder, serve_process(folder / "store", total, block_tokens) as target, \
            Client(target) as client:
        _put_random(client, tokens, n_blocks, block_bytes, rng, progress)
        with Planner(client) as planner:
            lookup_s, plan_s, diff_s, decide_s, plan = _time_pair(client, planner, tokens, 4 * args.repeat,
                                                                   progress)
        plain_s, hosts_s = _time_hosts(client, tokens, 4 * args.repeat)
    label = f"{len(tokens):,} tokens"
    report.add(Figure.against(f"plan {label}", plan_s * 1e3, "ms", "client lookup, hash + RPC", lookup_s * 1e3))
    # A difference has no meaningful ratio: the baseline is shown for scale only.
    report.add(Figure(name=f"planner overhead beyond the lookup (median of paired runs), {label}", value=diff_s * 1e3,
                      unit="ms", baseline="client lookup, hash + RPC", baseline_value=lookup_s * 1e3))
    report.add(Figure(name=f"planner decision alone (plan_from_lookup), {label}", value=decide_s * 1e3, unit="ms"))
    # Where a prefix lives (docs/PLANNER.md): the hosts answer and one more decision per host, against the same plan.
    report.add(Figure.against(f"plan with hosts {label}", hosts_s * 1e3, "ms", "the same plan without hosts",
                              plain_s * 1e3))
    report.notes.update(overhead_blocks=n_blocks, overhead_bytes=total,
                        overhead_plan={k: v for k, v in plan.to_dict().items() if k != "block_hashes"})


def _time_hosts(client: Any, tokens: list[int], rounds: int) -> tuple[float, float]:
    """Median seconds of Planner.plan without and with hosts (`Planner(hosts=PathRates())`), alternated
    `rounds` times after one warm-up round each (no lease, no report: only the plan's own work)."""
    from replay.hosts import PathRates
    from replay.planner import Planner

    plain, with_hosts = Planner(client, lease_ms=0, report=False), Planner(client, lease_ms=0, report=False,
                                                                          hosts=PathRates())
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds + 1):
        for which, planner in ((0, plain), (1, with_hosts)) if i % 2 else ((1, with_hosts), (0, plain)):
            start = time.perf_counter()
            planner.plan(tokens)
            if i:
                times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _put_random(client: Any, tokens: list[int], n_blocks: int, block_bytes: int, rng: np.random.Generator,
                progress: Progress) -> None:
    """Store the prompt's blocks (random bytes: the store never decodes them)."""
    pool = rng.integers(0, 256, size=64 * block_bytes, dtype=np.uint8).tobytes()
    step = 1024
    with progress.bar("put blocks", n_blocks * block_bytes) as bar:
        parent = None
        for lo in range(0, n_blocks, step):
            hi = min(lo + step, n_blocks)
            blocks = [pool[(i % 64) * block_bytes:(i % 64 + 1) * block_bytes] for i in range(lo, hi)]
            result = client.put(tokens[: hi * client.block_tokens], blocks, first_block=lo, parent=parent)
            parent = result.block_hashes[-1]
            bar.update((hi - lo) * block_bytes)


def _time_pair(client: Any, planner: Any, tokens: list[int], pairs: int,
               progress: Progress) -> tuple[float, float, float, float, Any]:
    """Client Lookup and Planner.plan alternated `pairs` times (drift hits both alike).

    Returns the best Lookup, the best plan, the median of the paired differences
    (plan - lookup of the same round), the best decision alone (the plan's own
    `plan_s`: deciding and reporting, after the lookup), in seconds, and the last plan.
    """
    lookups: list[float] = []
    plans: list[float] = []
    decides: list[float] = []
    plan = None
    with progress.bar("lookup and plan", 2 * (pairs + 1), unit="call") as bar:
        for i in range(pairs + 1):  # the first round warms the server's chain memo and is not kept
            start = time.perf_counter()
            found = client.lookup(tokens, lease_ms=planner.lease_ms)
            lookup_s = time.perf_counter() - start
            if found.found_tokens != len(tokens) - len(tokens) % client.block_tokens:
                raise RuntimeError(f"lookup found {found.found_tokens} of {len(tokens)} tokens")
            if found.lease_id:
                client.release(found.lease_id)
            bar.update(1)
            start = time.perf_counter()
            plan = planner.plan(tokens)
            plan_s = time.perf_counter() - start
            if plan.lease_id:
                client.release(plan.lease_id)
            bar.update(1)
            if i:
                lookups.append(lookup_s)
                plans.append(plan_s)
                decides.append(plan.plan_s)
    diffs = sorted(p - q for p, q in zip(plans, lookups, strict=True))
    return min(lookups), min(plans), diffs[len(diffs) // 2], min(decides), plan
