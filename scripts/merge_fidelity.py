#!/usr/bin/env python3
"""Merge `kvstore bench replay --write-resumes` shards of one model into the span table the planner reads.

    python scripts/merge_fidelity.py --out replay/fidelity/reduced_v41-d256.json shard-*.json \
        --label /dev/path/v41-seed0.pt="train_tiny --config reduced_v41-d256 seed 0"

Every resume of every shard is pooled per case and span and each figure's 95% bootstrap interval is
recomputed over the pool (kvstore.bench.replay_fidelity.merge_resumes); the table is the format
`--write-table` writes (replay/fidelity_budget.py). It prints the pooled table in markdown, and
exits 1 when a case and span has fewer resumes than --min-resumes (the table is written anyway).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.bench.replay_fidelity import interval_table, merge_resumes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Merge, write, print; 1 when some case and span has fewer resumes than asked."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", nargs="+", type=Path, help="--write-resumes files of one model")
    p.add_argument("--out", type=Path, required=True, help="the table to write")
    p.add_argument("--label", action="append", default=[],
                   help="OLD=NEW: name a weights label (a device path) as the table should show it")
    p.add_argument("--min-resumes", type=int, default=100, help="resumes each case and span should have")
    args = p.parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)
    table = merge_resumes(list(args.shards), labels=labels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    span_labels: list[str] = []  # the table keeps spans by windows: the bench's labels, rebuilt
    window = int(table["window"])
    found: dict[str, dict[str, dict[str, object]]] = {}
    for k, cases in table["spans"].items():
        label = f"{k}x window ({int(k) * window} tokens)"
        span_labels.append(label)
        for case, figures in cases.items():
            found.setdefault(case, {})[label] = figures
    print(interval_table(found, span_labels, table["prompt_seeds"], ", ".join(table["training"])))
    fewest = min(int(f["kl_per_token"]["resumes"]) for cases in table["spans"].values() for f in cases.values())
    logs = table.get("training_logs", {})
    for label, log in logs.items():
        print(f"{label}: {log}")
    print(f"wrote {args.out}: {table['shards']} shards, >= {fewest} resumes a case and span, "
          f"cut by deadline: {table['cut_by_deadline']}")
    return 0 if fewest >= args.min_resumes else 1


if __name__ == "__main__":
    sys.exit(main())
