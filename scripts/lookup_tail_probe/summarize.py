"""Summarize a `lookup_tail_probe` file (sitecustomize.py beside this one says how to take it)."""

from __future__ import annotations

import json
import sys

import numpy as np


def _ms(values: list[float]) -> str:
    a = np.array(values) * 1e3
    return f"p50 {np.percentile(a, 50):.2f} p99 {np.percentile(a, 99):.2f} max {a.max():.1f} ms (n={len(a)})"


def main(path: str) -> None:
    """Print the Lookups' server-side split, the loop's lag and the commits'."""
    with open(path) as f:
        probe = json.load(f)
    lookups = probe["lookups"]
    print("Lookup handler wall:", _ms([r["wall_s"] for r in lookups]))
    print("  that called the executor:", sum(r["executor"] > 0 for r in lookups),
          "awaited a refresh:", sum(r["refresh"] > 0 for r in lookups))
    during = [r["wall_s"] for r in lookups if r["committing"]]
    idle = [r["wall_s"] for r in lookups if not r["committing"]]
    for name, part in (("began during a commit", during), ("began without one", idle)):
        if part:
            print(f"  {name}:", _ms(part))
    reads = [r for r in lookups if "read_s" in r]
    if reads:
        wall = np.array([r["read_s"] for r in reads])
        cpu = np.array([r["read_cpu_s"] for r in reads])
        queued = np.array([r["read_runqueue_s"] for r in reads])
        slow = np.argsort(wall)[-max(1, len(wall) // 50):]
        print("index read wall:", _ms(list(wall)))
        print(f"  slowest 2%: wall {wall[slow].mean() * 1e3:.2f} = CPU {cpu[slow].mean() * 1e3:.2f} + run queue "
              f"{queued[slow].mean() * 1e3:.2f} + asleep {(wall - cpu - queued)[slow].mean() * 1e3:.2f} ms")
    print("event loop lag (1 ms sleep):", _ms(probe["lags_s"]))
    commits = probe["commits"]
    if commits:
        print("group commits:", _ms([c[0] for c in commits]), f"mean size {np.mean([c[1] for c in commits]):.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
