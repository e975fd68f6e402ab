"""Summarize a `put_timeline_probe` folder (sitecustomize.py beside this one says how to take it): per TCP round of
`bench store`, where the server's time went, and the rounds' totals."""

from __future__ import annotations

import collections
import glob
import os
import sys

Event = tuple[str, int, float, float, float]


def _events(folder: str) -> tuple[list[Event], list[tuple[float, float]]]:
    events: list[Event] = []
    for name in glob.glob(os.path.join(folder, "serve-*.txt")):
        with open(name) as f:
            for line in f:
                kind, thread, t0, t1, cpu = line.split()[:5]
                events.append((kind, int(thread), float(t0), float(t1), float(cpu)))
    rounds: list[tuple[float, float]] = []
    for name in glob.glob(os.path.join(folder, "bench-*.txt")):
        with open(name) as f:
            for line in f:
                path, start, end = line.split()
                if path == "tcp":
                    rounds.append((float(start), float(end)))
    return sorted(events, key=lambda e: e[2]), sorted(rounds)


def _round(events: list[Event], start: float, end: float) -> dict[str, float]:
    inside = [e for e in events if start <= e[2] <= end]

    def of(kind: str) -> list[Event]:
        return [e for e in inside if e[0] == kind]

    def wall(kind: str) -> float:
        return sum(e[3] - e[2] for e in of(kind))

    def cpu(kind: str) -> float:
        return sum(e[4] for e in of(kind))

    writes = of("put_many")
    commit = sum(c[2] - s[3] for s, c in zip(of("save_state"), of("committed"), strict=False))
    busy = wall("put_many")
    return {
        "round": end - start,
        "writer busy": busy, "writer CPU": cpu("put_many"),
        "commits (the wait for the flush before, the write-out)": commit,
        "of it, waiting for the flush before (R35)": wall("wait_flush"),
        "flusher busy (fdatasync and marker)": wall("flush"), "of it, the marker": wall("marker"),
        "body (put_all less commit)": wall("put_all") - commit,
        "_put_in": wall("put_in"), "_put_in CPU": cpu("put_in"),
        "writer idle before the first commit": (writes[0][2] if writes else end) - start,
        "writer idle between commits": (writes[-1][3] - writes[0][2]) - busy if writes else 0.0,
        "after the last commit": end - writes[-1][3] if writes else 0.0,
        "frames read (wall)": wall("frame"), "frames read CPU": cpu("frame"),
        "plans (wall)": wall("plan"), "plans CPU": cpu("plan"),
        "commits #": float(len(writes)), "flushes #": float(len(of("flush"))), "batches #": float(len(of("plan"))),
    }


def main(folder: str) -> None:
    """Print each TCP round's split and the totals, in ms."""
    events, rounds = _events(folder)
    total: collections.Counter[str] = collections.Counter()
    for start, end in rounds:
        split = _round(events, start, end)
        total.update(split)
        print(" ".join(f"{k.split(' (')[0].replace(' ', '_')}={v if k.endswith('#') else v * 1e3:.0f}"
                       for k, v in split.items()))
    print(f"{len(rounds)} TCP rounds, ms (share of the rounds' time):")
    for key, value in total.items():
        share = "" if key.endswith("#") else f" ({value / total['round']:.0%})"
        print(f"  {key}: {value if key.endswith('#') else value * 1e3:.0f}{share}")


if __name__ == "__main__":
    main(sys.argv[1])
