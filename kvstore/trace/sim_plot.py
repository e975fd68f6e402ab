"""The sweep's curves as a PNG (matplotlib, an optional extra: `pip install kvstore[plots]`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvstore.errors import FailedPrecondition
from kvstore.trace.simulate import SimResult


def plot(results: Sequence[tuple[str, SimResult]], path: Path) -> None:
    """Usable and lookup hit rate per run of a sweep, and each run's stored bytes over time.

    Raises:
        FailedPrecondition: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FailedPrecondition("--png needs matplotlib", hint="pip install matplotlib (or kvstore[plots])") from None
    fig, (rates, stored) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [label for label, _ in results]
    rates.plot(range(len(results)), [r.total.usable_hit_rate for _, r in results], "o-", label="usable")
    rates.plot(range(len(results)), [r.total.lookup_hit_rate for _, r in results], "s--", label="lookup")
    rates.set_xticks(range(len(results)), labels, rotation=30, ha="right", fontsize=7)
    rates.set_ylabel("hit rate (tokens)")
    rates.legend()
    for label, r in results:
        stored.plot([b.start_s / 3600 for b in r.buckets], [b.stored_bytes / 1e12 for b in r.buckets], label=label)
    stored.set_xlabel("hours")
    stored.set_ylabel("stored TB")
    stored.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
