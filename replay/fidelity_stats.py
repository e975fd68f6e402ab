"""Fidelity figures with their uncertainty: a mean, its 95% bootstrap interval over resumes, the worst case.

One resume (a `replay.fidelity.Sample`) gives four per-resume values
(`resume_values`):

- `one_minus_cosine`: 1 - cosine of the next-token logits at the prompt's end;
- `kl_per_token`: KL(exact || approx) per continued token, averaged over the
  teacher-forced continuation (nats);
- `top1_agreement`: the share of continued tokens whose top-1 agrees;
- `fastllm_pass`: 1 when the resume meets the fastllm fixture's criteria
  (cosine >= 0.9975 and max |diff| <= 4% of the logit range), else 0.

`interval` summarises one figure over the resumes of one case and span: the
mean, a percentile bootstrap interval (resumes drawn with replacement, a fixed
generator so a table regenerates the same), the worst case, the number of
resumes and the seeds they came from. "Worst" is the worst resume for the
per-resume figures (the largest 1 - cosine or KL, the lowest top-1 agreement);
for the pass rate, a 0-or-1 value per resume whose worst resume says nothing,
it is the lowest pass rate of any one (training seed, prompt seed) group, so a
seed that fails more shows there. torch is never imported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Figures per resume, and whether a larger value is worse.
FIGURES: dict[str, bool] = {"one_minus_cosine": True, "kl_per_token": True, "top1_agreement": False,
                            "fastllm_pass": False}
#: The fastllm fixture's pass criteria (replay/fidelity.py).
FASTLLM_COSINE = 0.9975
FASTLLM_MAX_DIFF = 0.04
#: Bootstrap resamples: the 2.5th and 97.5th percentiles of 2,000 means move by well under a tenth of the
#: interval's width between generators, which a table printed to 3 digits does not show.
RESAMPLES = 2000
#: The interval's level.
LEVEL = 0.95


def resume_values(sample: Any) -> dict[str, float]:
    """The four figures of one `replay.fidelity.Sample` (a resume without a continuation counts KL 0 and
    the top-1 at the prompt's end as its agreement)."""
    cont = sample.continuation
    logits = sample.logits
    return {"one_minus_cosine": max(0.0, 1.0 - logits.cosine),
            "kl_per_token": cont.kl_mean if cont is not None else 0.0,
            "top1_agreement": cont.top1_agreement if cont is not None else float(logits.top1),
            "fastllm_pass": float(logits.cosine >= FASTLLM_COSINE and logits.max_diff_of_range <= FASTLLM_MAX_DIFF)}


def bootstrap(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` and its percentile bootstrap interval at LEVEL.

    An empty sequence gives zeros; a single value gives that value three times.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0, 0.0
    mean = math.fsum(x.tolist()) / x.size
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1.0 - LEVEL) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    # The mean lies inside by construction; rounding in the percentile interpolation must not say otherwise.
    return mean, min(float(low), mean), max(float(high), mean)


def interval(figure: str, values: Sequence[float], groups: Sequence[tuple[str, int]], *,
             seed: int = 0) -> dict[str, Any]:
    """One figure over the resumes of one case and span: mean, ci_low, ci_high, worst, resumes, seeds.

    Args:
        figure: a name of FIGURES.
        values: one value per resume.
        groups: the (training seed or weights, prompt seed) of each resume, in the same order.
        seed: the bootstrap generator's seed.

    Raises:
        ValueError: an unknown figure, or values and groups of different lengths.
    """
    if figure not in FIGURES:
        raise ValueError(f"unknown fidelity figure {figure!r}; the figures are {list(FIGURES)}")
    if len(values) != len(groups):
        raise ValueError(f"{len(values)} values but {len(groups)} groups")
    mean, low, high = bootstrap(values, seed=seed)
    worse_high = FIGURES[figure]
    if figure == "fastllm_pass":
        by_group: dict[tuple[str, int], list[float]] = {}
        for v, g in zip(values, groups, strict=True):
            by_group.setdefault(g, []).append(v)
        worst = min((sum(v) / len(v) for v in by_group.values()), default=0.0)
    elif worse_high:
        worst = max(values, default=0.0)
    else:
        worst = min(values, default=0.0)
    return {"mean": mean, "ci_low": low, "ci_high": high, "worst": float(worst), "resumes": len(values),
            "seeds": seeds_of(groups)}


def seeds_of(groups: Sequence[tuple[str, int]]) -> dict[str, list[Any]]:
    """The training seeds (weights) and prompt seeds the resumes came from, in first-seen order."""
    return {"training": list(dict.fromkeys(g[0] for g in groups)),
            "prompt": list(dict.fromkeys(g[1] for g in groups))}


def intervals(samples: Sequence[Any], groups: Sequence[tuple[str, int]], *, seed: int = 0) -> dict[str, Any]:
    """Every figure of FIGURES over `samples` (replay.fidelity.Sample), each an `interval`."""
    rows = [resume_values(s) for s in samples]
    return {name: interval(name, [r[name] for r in rows], groups, seed=seed) for name in FIGURES}
