"""Trace simulation speed: the shipped traces simulated on one core, beside reading them alone.

For each trace (the weka sessions and the Mooncake conversation trace in
../shared/traces/), the figure is the seconds the simulation takes (store rules,
planner, SWA, on virtual time; `kvstore trace simulate` with its defaults) and the
baseline the seconds reading and ordering the same trace takes (`load_trace`). The
ratio (read / simulate) says how much the simulation costs beyond parsing. CPU
seconds of the process are a figure too (a loaded machine stretches wall time
more than those; run it under `taskset -c 1` to hold it to one core). Targets
(issue 24): 600 weka sessions under 120 s, the Mooncake conversation trace under
10 s, on one core, read and simulated (`target_met_by_cpu` in the notes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvstore.bench.report import Figure, Progress, Report

SHIPPED = Path(__file__).resolve().parents[3] / "shared" / "traces"
TARGETS_S = {"weka": 120.0, "mooncake": 10.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's arguments."""
    parser.add_argument("--weka", type=Path, default=SHIPPED / "weka" / "sessions.tar.zst",
                        help="the weka sessions (default: the shipped archive)")
    parser.add_argument("--mooncake", type=Path, default=SHIPPED / "mooncake" / "conversation_trace.jsonl.zst",
                        help="the Mooncake trace (default: the shipped conversation trace)")
    parser.add_argument("--sessions", type=int, default=None, help="weka sessions to read (default: all)")
    parser.add_argument("--only", choices=("weka", "mooncake"), help="run one trace only")


def _timed(fn: object) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()  # type: ignore[operator]
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Measure each trace's read and simulation."""
    from kvstore.trace.load import load_trace
    from kvstore.trace.simulate import SimSettings, Simulation

    report = Report(bench="trace")
    for kind, path in (("weka", args.weka), ("mooncake", args.mooncake)):
        if args.only and kind != args.only:
            continue
        sessions = args.sessions if kind == "weka" else None
        trace, read_s, read_cpu = _timed(lambda p=path, n=sessions: load_trace(p, sessions=n))
        result, sim_s, sim_cpu = _timed(lambda t=trace: Simulation(SimSettings()).run(t))
        n = len(trace.requests)  # type: ignore[attr-defined]
        report.add(Figure.against(f"{kind}: simulate {n:,} requests", sim_s, "s", "read the trace alone", read_s))
        report.add(Figure.against(f"{kind}: requests simulated per s", n / sim_s, "req/s",
                                  "requests read per s", n / read_s))
        # CPU seconds: what a loaded machine stretches least (other people's work adds wall time)
        report.add(Figure.against(f"{kind}: simulate, CPU", sim_cpu, "s", "read the trace alone, CPU", read_cpu))
        report.notes[f"{kind}_cpu_s"] = {"read": round(read_cpu, 2), "simulate": round(sim_cpu, 2),
                                         "target_simulate_s": TARGETS_S[kind],
                                         "target_met_by_cpu": read_cpu + sim_cpu < TARGETS_S[kind]}
        report.notes[f"{kind}_usable_hit_rate"] = round(result.total.usable_hit_rate, 4)  # type: ignore[attr-defined]
    return report
