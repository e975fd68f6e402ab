"""Summarize a `lookup_tail_probe` file (sitecustomize.py beside this one says how to take it)."""

from __future__ import annotations

import glob
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
    _end_to_end(path, probe)


def _end_to_end(path: str, probe: dict[str, object]) -> None:
    """Each Lookup the clients timed, joined with the server's record of it (by its last hash, one clock): where the
    slowest 1% spent their time against the median call."""
    calls = {c["key"]: c for c in probe.get("calls", [])}  # type: ignore[attr-defined]
    handlers = {r["key"]: r for r in probe["lookups"] if "began" in r}  # type: ignore[attr-defined]
    joined = []
    for name in glob.glob(path + ".client-*"):
        with open(name) as f:
            for key, sent, answered in json.load(f):
                c, h = calls.get(key), handlers.get(key)
                if c is None or h is None or not c["arrived"] >= sent:
                    continue
                handler_end = h["began"] + h["wall_s"]
                joined.append((answered - sent, c["arrived"] - sent, c["began"] - c["arrived"],
                               h["began"] - c["began"], h["wall_s"], c["ended"] - handler_end, answered - c["ended"]))
    if not joined:
        print("no client records joined (run the bench with the probe on PYTHONPATH)")
        return
    a = np.array(joined) * 1e3
    order = np.argsort(a[:, 0])
    slow, mid = a[order[-max(1, len(a) // 100):]], a[order[len(a) * 45 // 100:len(a) * 55 // 100]]
    names = ("client's whole call", "sent -> the call's headers seen (wire, grpc's C-core, the loop's queue)",
             "headers -> the message read and the handler called", "interceptors before the servicer",
             "the servicer's Lookup", "after the servicer (interceptors)", "returned -> the client has the answer")
    print(f"Lookups joined client to server: {len(a)}; ms, the slowest 1% against the middle 10% (means):")
    for i, name in enumerate(names):
        print(f"  {name}: {slow[:, i].mean():.2f} vs {mid[:, i].mean():.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
