"""On-policy distillation: per-token reverse KL(pi_s || pi_t) of the student pi_s against a frozen
teacher pi_t, on completions the STUDENT sampled.

Sources: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv 2306.13649), the on-policy reverse-KL case (student data fraction 1,
beta = 1); Thinking Machines, "On-Policy Distillation" (blog, 2025): the per-token reverse KL of
the sampled tokens used as a negative advantage. Three forms, with ls = log pi_s(y_t | ...) and
lt = log pi_t(y_t | ...) at the sampled token y_t:

  k1    value ls - lt. As a loss: the unbiased score-function gradient of
        KL(pi_s || pi_t) = E_{y~pi_s}[ls - lt], which is E_{y~pi_s}[(ls - lt) grad ls] (the
        E[grad ls] = 0 term drops out). The per-token term is built as
            sg(d) * (ls - sg(ls)) + sg(d),   d = ls - lt,
        whose VALUE is the k1 estimate d and whose GRADIENT is d * grad ls: the same gradient as
        the usual loss sg(ls - lt) * ls, i.e. a policy-gradient term with the per-token advantage
        -(ls - lt) (the blog's form), while the logged value stays a KL estimate.
  k3    exp(lt - ls) - (lt - ls) - 1, differentiated directly, as GRPO's KL term (objectives/kl.py
        k3, with its clamps). Its gradient 1 - pi_t/pi_s per sampled token is, in expectation
        over pi_s, sum_v (pi_s(v) - pi_t(v)) grad log pi_s(v): not the reverse-KL gradient (the
        k3 value is unbiased, its direct derivative is not); it is offered because GRPO uses it.
  full  sum_v pi_s(v) (log pi_s(v) - log pi_t(v)) over the whole vocabulary at each position,
        exact and differentiable in the student. `full_reverse_kl` works on one chunk of
        positions' logits [c, V]; the text policy calls it chunk by chunk
        (policies/text/logprobs.py `chunked_pair_head`), so only [chunk, V] logits live at once.

Deviations / choices:
- Both distributions are softmax(logits / temperature) at the rollout temperature (the policy's
  log-probs in the loss use it too); at temperature 1 this is the plain model distribution.
- No importance correction for epochs > 1: the KL is estimated on tokens drawn from the sampling
  weights (exact at the first update of a batch, as in both sources, which do one update per
  batch).
- The term is aggregated like the KL term (the run's `aggregation` over the loss mask with the
  step's global counts, unit sequence weights), so it is invariant to the micro-batch split.

Shapes: logp, teacher_logp, mask: [n, T]; full_reverse_kl: [c, V] -> [c].
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from grouprl.objectives.aggregation import AGG_COUNTS, aggregate, masked_mean
from grouprl.objectives.kl import KL_ESTIMATORS

DistillEstimator = Literal["k1", "k3", "full"]
SAMPLED_ESTIMATORS = ("k1", "k3")  # need only the teacher's log-prob of the sampled token


def k1_distill(logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Value ls - lt, gradient (ls - lt) * grad ls (see the module docstring). [n, T] -> [n, T]."""
    d = (logp - teacher_logp).detach()  # [n, T]
    return d * (logp - logp.detach()) + d  # [n, T]


def k3_distill(logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """exp(lt - ls) - (lt - ls) - 1, differentiated directly (kl.py's k3). [n, T] -> [n, T]."""
    return KL_ESTIMATORS["k3"](logp, teacher_logp.detach())  # [n, T]


SAMPLED_FORMS = {"k1": k1_distill, "k3": k3_distill}


def full_reverse_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Exact sum_v p_s(v) (log p_s(v) - log p_t(v)) per row; logits [c, V] (already divided by
    the temperature) -> [c], in float32, differentiable in the student's logits only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: the vocabularies must match"
        )
    ls = torch.log_softmax(student_logits.float(), dim=-1)  # [c, V]
    lt = torch.log_softmax(teacher_logits.detach().float(), dim=-1)  # [c, V]
    return (ls.exp() * (ls - lt)).sum(-1)  # [c]


def per_token_distill(
    estimator: DistillEstimator,
    logp: Tensor,
    mask: Tensor,
    *,
    teacher_logp: Tensor | None = None,
    full_kl: Tensor | None = None,
) -> Tensor:
    """The per-token distillation loss [n, T] of `estimator`, zero on masked slots.

    k1 / k3 read teacher_logp [n, T] (the teacher's log-prob of each sampled token); full reads
    full_kl [n, T] (the exact per-position KL, computed by the policy with both models' logits)."""
    if estimator == "full":
        if full_kl is None:
            raise ValueError(
                "algorithm.distill.estimator='full' needs the exact per-position KL (full_kl), "
                "computed by the policy from both models' logits; got None"
            )
        values = full_kl  # [n, T]
    elif estimator in SAMPLED_FORMS:
        if teacher_logp is None:
            raise ValueError(
                f"algorithm.distill.estimator={estimator!r} needs the teacher's log-probs of the "
                "sampled tokens (rollout.teacher_logp), got None"
            )
        if teacher_logp.shape != logp.shape:
            raise ValueError(
                f"teacher_logp {tuple(teacher_logp.shape)} and logp {tuple(logp.shape)} differ"
            )
        # masked slots may hold anything (padding): keep them out of exp and the graph's values
        safe_t = torch.where(mask, teacher_logp, logp.detach())  # [n, T]
        values = SAMPLED_FORMS[estimator](logp, safe_t)  # [n, T]
    else:
        raise ValueError(
            f"algorithm.distill.estimator must be one of k1, k3, full; got {estimator!r}"
        )
    if values.shape != mask.shape:
        raise ValueError(f"distill KL must be [n, T] = {tuple(mask.shape)}, got {values.shape}")
    return values.masked_fill(~mask, 0.0)  # [n, T]


def distill_loss_term(
    logp: Tensor,
    mask: Tensor,
    distill: Any,
    aggregation: str,
    counts: dict,
    *,
    teacher_logp: Tensor | None = None,
    full_kl: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """coef * aggregate(per-token distillation loss) (scalar) and its metrics.

    distill: anything with `estimator` and `coef` (the algorithm.distill config). counts: the
    step's global counts (keys other than AGG_COUNTS ignored). Metrics: `distill_kl` (mean of the
    per-token KL value over this micro-batch's valid slots: average over micro-batches) and
    `distill_loss` (this micro-batch's share of the term: sum over micro-batches)."""
    mask = mask.bool()  # [n, T]
    values = per_token_distill(
        distill.estimator, logp, mask, teacher_logp=teacher_logp, full_kl=full_kl
    )  # [n, T]
    agg_counts = {k: v for k, v in counts.items() if k in AGG_COUNTS}
    unit = torch.ones(mask.shape[0], dtype=values.dtype, device=values.device)  # [n]
    term = distill.coef * aggregate(values, mask, aggregation, **agg_counts, seq_weights=unit)
    metrics = {
        "distill_kl": float(masked_mean(values.detach(), mask)),
        "distill_loss": float(term.detach()),
    }
    return term, metrics
