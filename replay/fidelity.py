"""How far an approximate cache state (bounded replay, tail prefill) is from the exact one.

Every comparison is between two states at the same length, or two logit streams
over the same tokens, with the exact side as the reference:

- window KV error per layer: ||a - e|| / ||e|| over the dequantized window rows
  (the rows the next tokens attend to; compressed and indexer rows are loaded,
  so they are equal on both sides by construction);
- next-token logits: cosine, max |a - e| relative to the exact logits' range
  (max - min; the fastllm fixture's pass criteria are cosine >= 0.9975 and
  max |diff| <= 4% of the range), and whether the top-1 token agrees;
- a continuation: the exact state decodes `steps` greedy tokens; both states are
  then fed that same token stream (teacher forcing, so they never drift onto
  different text) and KL(exact || approx) of each step's next-token distribution
  is averaged, in nats, with the top-1 agreement over the steps.

Exact against exact gives cosine 1, diff 0, KL 0 and full agreement: the tests
check that, so a comparison wired to the wrong states fails.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.codec.rows import decode_swa_rows

if TYPE_CHECKING:
    from replay.model.model import ReferenceModel
    from replay.model.state import CacheState


@dataclass(frozen=True, kw_only=True)
class LogitsAgreement:
    """Next-token logits of an approximate state against the exact state's."""

    cosine: float
    max_diff_of_range: float
    top1: bool


@dataclass(frozen=True, kw_only=True)
class Continuation:
    """A teacher-forced continuation of both states over the exact state's greedy tokens."""

    steps: int
    kl_mean: float
    kl_max: float
    top1_agreement: float


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One resume point measured: window errors at the resume and after the prompt, logits, continuation."""

    window_errors: list[float]        # per layer, at the resume point
    window_errors_after: list[float]  # per layer, at the prompt's end
    logits: LogitsAgreement
    continuation: Continuation | None


def compare_logits(approx: torch.Tensor, exact: torch.Tensor) -> LogitsAgreement:
    """Compare one next-token logits vector (float [vocab]) against the exact one."""
    a = approx.detach().double().flatten().cpu()
    e = exact.detach().double().flatten().cpu()
    # Equal vectors are cosine 1 by definition; the quotient of rounded norms can land an ulp below
    # (0.9999999999999999 with some CPU kernels), which would read as a replay error that is not there.
    cosine = 1.0 if torch.equal(a, e) else float(torch.nn.functional.cosine_similarity(a, e, dim=0))
    spread = float(e.max() - e.min())
    diff = float((a - e).abs().max())
    return LogitsAgreement(cosine=min(cosine, 1.0), max_diff_of_range=diff / spread if spread > 0 else diff,
                           top1=bool(a.argmax() == e.argmax()))


def kl_divergence(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """KL(exact || approx) in nats for each row of two [n, vocab] logits tensors, float64 [n]."""
    log_e = torch.log_softmax(exact.detach().double().cpu(), dim=-1)
    log_a = torch.log_softmax(approx.detach().double().cpu(), dim=-1)
    return (log_e.exp() * (log_e - log_a)).sum(-1).clamp_min(0.0)


def window_errors(approx: Sequence[torch.Tensor], exact: Sequence[torch.Tensor]) -> list[float]:
    """Relative error ||a - e|| / ||e|| of each layer's dequantized window rows (CacheState.window_rows).

    Raises:
        ValueError: when the two states hold different layers or rows.
    """
    if len(approx) != len(exact):
        raise ValueError(f"window rows of {len(approx)} and {len(exact)} layers")
    errors = []
    for layer, (a_rows, e_rows) in enumerate(zip(approx, exact, strict=True)):
        if a_rows.shape != e_rows.shape:
            raise ValueError(f"layer {layer}: window rows {tuple(a_rows.shape)} against {tuple(e_rows.shape)}")
        if a_rows.shape[0] == 0:
            errors.append(0.0)
            continue
        a = decode_swa_rows(a_rows).double().cpu()
        e = decode_swa_rows(e_rows).double().cpu()
        diff = float((a - e).norm())
        norm = float(e.norm())
        errors.append(diff / norm if norm > 0 else diff)
    return errors


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The exact side of a resume point, computed once and compared against every approximation."""

    length: int
    window_rows: list[torch.Tensor] = field(repr=False)        # at the resume point H
    window_rows_after: list[torch.Tensor] = field(repr=False)  # at the prompt's end
    logits: torch.Tensor = field(repr=False)                   # next-token logits at the prompt's end
    tokens: list[int]                                          # the exact state's greedy continuation
    step_logits: torch.Tensor = field(repr=False)              # [steps, vocab]: logits each token was chosen from


def _rows(state: CacheState) -> list[torch.Tensor]:
    return [r.detach().clone() for r in state.window_rows]


def reference(model: ReferenceModel, exact: CacheState, prompt_rest: Sequence[int], *, steps: int = 32) -> Reference:
    """Run the exact state through the rest of the prompt and `steps` greedy tokens; mutates `exact`.

    Args:
        model: the model the state belongs to.
        exact: the exact state at the resume point H.
        prompt_rest: tokens [H, len) of the prompt (at least the last one: its logits are compared).
        steps: greedy tokens to continue (0: none).
    """
    if not prompt_rest:
        raise ValueError("the rest of the prompt must hold at least its last token")
    at_resume = _rows(exact)
    length = exact.length
    logits = model.extend(exact, list(prompt_rest), tail_prefill=False)[-1].float().cpu()
    after = _rows(exact)
    tokens: list[int] = []
    step_logits = logits.reshape(1, -1)
    if steps > 0:
        tokens = [int(t) for t in model.greedy(copy.deepcopy(exact), logits, steps)[0]]
        if len(tokens) > 1:
            fed = model.extend(exact, tokens[:-1], tail_prefill=False).float().cpu()
            step_logits = torch.cat([step_logits, fed])
    return Reference(length=length, window_rows=at_resume, window_rows_after=after, logits=logits,
                     tokens=tokens, step_logits=step_logits[: max(len(tokens), 1)])


def measure(model: ReferenceModel, approx: CacheState, ref: Reference, prompt_rest: Sequence[int], *,
            tail_prefill: bool = False) -> Sample:
    """Compare an approximate state at H against the exact one's `ref`; mutates `approx`.

    The approximate state is fed the same prompt rest (with the decoder-side tail
    prefill when `tail_prefill`) and then the exact state's greedy tokens.
    """
    if approx.length != ref.length:
        raise ValueError(f"the approximate state is at {approx.length}, the reference at {ref.length}")
    errors = window_errors(approx.window_rows, ref.window_rows)
    logits = model.extend(approx, list(prompt_rest), tail_prefill=tail_prefill)[-1].float().cpu()
    after = window_errors(approx.window_rows, ref.window_rows_after)
    cont = None
    if ref.tokens:
        steps = [logits.reshape(1, -1)]
        if len(ref.tokens) > 1:
            steps.append(model.extend(approx, ref.tokens[:-1], tail_prefill=False).float().cpu())
        a_all = torch.cat(steps)
        kl = kl_divergence(a_all, ref.step_logits)
        agree = (a_all.argmax(-1) == torch.as_tensor(ref.tokens)).double().mean()
        cont = Continuation(steps=len(ref.tokens), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                            top1_agreement=float(agree))
    return Sample(window_errors=errors, window_errors_after=after, logits=compare_logits(logits, ref.logits),
                  continuation=cont)


@dataclass(kw_only=True)
class Summary:
    """Samples of one setting (a replay span, a boundary case) aggregated: means and worst cases."""

    name: str
    samples: list[Sample] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        """Append one measured sample."""
        self.samples.append(sample)

    def layer_errors(self, after: bool = False) -> list[float]:
        """Mean window error of each layer over the samples, at the resume point or after the prompt."""
        if not self.samples:
            return []
        rows = [s.window_errors_after if after else s.window_errors for s in self.samples]
        return [float(x) for x in torch.tensor(rows, dtype=torch.float64).mean(0)]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready means and worst cases (NaN-free: an empty summary gives zeros)."""
        s = self.samples
        conts = [x.continuation for x in s if x.continuation is not None]
        layers, after = self.layer_errors(), self.layer_errors(after=True)
        return {
            "name": self.name,
            "samples": len(s),
            "window_error_mean": _mean(layers),
            "window_error_max": max((max(x.window_errors, default=0.0) for x in s), default=0.0),
            "window_error_per_layer": layers,
            "window_error_after_mean": _mean(after),
            "window_error_after_per_layer": after,
            "cosine_mean": _mean(x.logits.cosine for x in s),
            "cosine_min": min((x.logits.cosine for x in s), default=0.0),
            "max_diff_of_range_mean": _mean(x.logits.max_diff_of_range for x in s),
            "max_diff_of_range_max": max((x.logits.max_diff_of_range for x in s), default=0.0),
            "top1_agreement": _mean(float(x.logits.top1) for x in s),
            "kl_mean": _mean(c.kl_mean for c in conts),
            "kl_max": max((c.kl_max for c in conts), default=0.0),
            "continued_top1_agreement": _mean(c.top1_agreement for c in conts),
            "pass_fastllm": _mean(float(x.logits.cosine >= 0.9975 and x.logits.max_diff_of_range <= 0.04)
                                  for x in s),
        }


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return math.fsum(vals) / len(vals) if vals else 0.0
