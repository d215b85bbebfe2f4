"""The one composed loss train.py uses for every modality (text tokens, denoising steps, agent turns).

    loss = pg_coef * policy_loss(weighted by engine-IS weights, the high-entropy mask, token_scales)
         + kl_coef * aggregate(KL)            when kl_mode == "loss" and kl_coef > 0
                                              (KL x pi_theta/pi_old with kl_weighting "importance")
         - entropy_coef * aggregate(H)        when entropy_coef != 0
         + distill.coef * aggregate(KL(pi_theta || pi_teacher))   when algo.distill is set
                                              (distill.py: k1 / k3 from teacher_logp, full from
                                              the policy's exact per-position KL `distill_kl`)

Pieces and sources: surrogates in losses.py; KL estimators in kl.py (Schulman's k1/k2/k3, as in
DeepSeekMath GRPO arXiv 2402.03300); engine mismatch weights in correction.py; the high-entropy token
mask of arXiv 2506.01939 and the entropy sign of arXiv 2504.20571 ("loss - coef * H": a positive coef
raises entropy, METHODS section 12) in entropy.py.

Choices:
- The KL and entropy terms use the configured `aggregation` with the same global counts as the policy
  term (as verl's agg_loss does), so the whole loss stays invariant to the micro-batch split. With
  ratio_level "geometric" the policy term ignores `aggregation` (GMPO), the KL and entropy terms don't.
- The high-entropy mask and the engine weights multiply the per-token policy loss only; the counts
  (normalisers) are unchanged, as in TRL: masked-out tokens count as zero-loss tokens.
- No silent fallbacks: a configured engine correction without engine log-probs, a KL in the loss
  without reference log-probs, an entropy mask or bonus without entropies, or an entropy bonus on a
  non-differentiable entropy all raise.
- A policy may replace the token KL estimators (flow models: Gaussian mean-space KL) via `kl_out`;
  `kl_loss_term` is the KL term alone, for a loss that composes its own policy term (GRPO-Guard).
- pg_coef (default 1.0; 0 = entropy-only training, arXiv 2504.20571, METHODS section 12) scales the
  policy term only. `pg_loss` is logged before the coefficient, `loss` after.
- token_scales [n, T] (detached; lambda-GRPO scales x EGSW weights, token_scales.py) multiply the
  per-token policy loss like the engine weights: normalisers unchanged, KL and entropy untouched.
- seq_weights [n] (delta_l): they weight the policy term only. The KL and entropy terms are
  aggregated with the same mode and counts but unit weights, because the official Delta-L code
  scales the advantages by w_i, which the KL and entropy terms never see.
- group_ids [n] and counts["num_groups"] (count_tokens(..., group_ids=...)) serve surrogate "tpo";
  `algo.surrogate` is passed to policy_loss as it is (the surrogate's config: type and knobs);
  pg_coef is read with getattr and its default 1.0, so config objects without it still work.

Metrics: `loss`, `pg_loss` (and `kl_loss`, `entropy_loss`, `distill_loss` when active) are this micro-batch's share of
the step's loss: sum them over micro-batches. `kl` and `entropy` are means over this micro-batch's
valid slots, like the other policy_loss and correction metrics: average them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.objectives.aggregation import AGG_COUNTS, aggregate, local_counts, masked_mean
from grouprl.objectives.correction import engine_is_weights
from grouprl.objectives.distill import distill_loss_term
from grouprl.objectives.entropy import entropy_bonus, high_entropy_mask
from grouprl.objectives.kl import importance_weighted_kl, kl_penalty
from grouprl.objectives.losses import policy_loss
from grouprl.types import LossOutput, PolicyOutput

_KL_MODES = ("loss", "reward")


def count_tokens(
    mask: Tensor, max_len: int | None = None, group_ids: Tensor | None = None
) -> dict[str, int]:
    """Counts of a full optimizer-step batch mask [N, T], for aggregate()/total_loss(`counts`).

    max_len should be the configured maximum completion length (the Dr. GRPO constant); it
    defaults to the padded width T. With group_ids [N], also num_groups = distinct groups with at
    least one non-empty row (TPO's divisor). Under data parallelism, sum the counts over processes.
    """
    mask = mask.bool()
    tokens, seqs = local_counts(mask)
    counts = {
        "num_tokens": tokens,
        "num_seqs": seqs,
        "max_len": int(mask.shape[-1] if max_len is None else max_len),
    }
    if group_ids is not None:
        if group_ids.shape != mask.shape[:1]:
            raise ValueError(
                f"group_ids must be [N] = {tuple(mask.shape[:1])}, got {tuple(group_ids.shape)}"
            )
        counts["num_groups"] = int(torch.unique(group_ids[mask.any(-1)]).numel())
    return counts


def _metric(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x.detach(), mask))  # a logged mean over the valid slots


def _token_weights(policy_out, old_logp, mask, algo, engine_logp, token_scales, metrics) -> Tensor:
    """Engine-IS weights [n, T] (ones for "none") x the high-entropy selection mask x token_scales."""
    weights, corr_metrics = engine_is_weights(
        old_logp,
        engine_logp,
        mask,
        algo.engine_correction,
        max_weight=algo.engine_correction_max,
        min_weight=algo.engine_correction_min,
    )  # [n, T] detached; raises when a correction is configured but engine_logp is None
    metrics.update(corr_metrics)
    if algo.top_entropy_quantile < 1:
        if policy_out.entropy is None:
            raise ValueError(
                f"top_entropy_quantile={algo.top_entropy_quantile} needs per-token entropies, but the "
                "policy returned entropy=None"
            )
        keep = high_entropy_mask(policy_out.entropy, mask, algo.top_entropy_quantile)  # [n, T]
        weights = weights * keep  # [n, T]
        metrics["entropy_mask_frac"] = _metric(keep.float(), mask)
    if token_scales is not None:
        if token_scales.shape != mask.shape:
            raise ValueError(
                f"token_scales must be [n, T] = {tuple(mask.shape)}, got {tuple(token_scales.shape)}"
            )
        scales = token_scales.detach().to(weights.dtype).masked_fill(~mask, 0.0)  # [n, T]
        weights = weights * scales  # [n, T]
        metrics["token_scale_mean"] = _metric(scales, mask)
    return weights.to(policy_out.logp.dtype)  # [n, T]


def _kl_in_loss(algo: Any) -> bool:
    """True when the KL is a loss term (kl_mode "loss" and kl_coef > 0); checks kl_mode."""
    if algo.kl_mode not in _KL_MODES:
        raise ValueError(f"kl_mode must be one of {_KL_MODES}, got {algo.kl_mode!r}")
    return algo.kl_mode == "loss" and algo.kl_coef > 0


def kl_loss_term(
    kl: Tensor, mask: Tensor, algo: Any, counts: dict, seq_weights: Tensor | None = None
) -> tuple[Tensor | None, dict[str, float]]:
    """The KL term of the loss from a per-token KL [n, T] over mask Bool[n, T], whichever KL it is
    (a token estimator's, or a policy's own such as the flow models' mean-space Gaussian KL).

    Returns (kl_coef * aggregate(kl) with the configured aggregation and the step's global counts,
    or None when the KL is not a loss term) and the metrics: `kl` (the mean over the valid slots,
    always) and `kl_loss` (the term, when there is one). counts: the step's counts (keys other than
    AGG_COUNTS are ignored); seq_weights [n]: passed to aggregate() (delta_l needs them)."""
    in_loss = _kl_in_loss(algo)
    metrics = {"kl": _metric(kl, mask)}
    if not in_loss:
        return None, metrics
    agg_counts = {k: v for k, v in counts.items() if k in AGG_COUNTS}
    term = algo.kl_coef * aggregate(  # scalar
        kl, mask, algo.aggregation, **agg_counts, seq_weights=seq_weights
    )
    metrics["kl_loss"] = float(term.detach())
    return term, metrics


def _kl_term(
    logp, old_logp, mask, algo, counts, ref_logp, kl_out, metrics, seq_weights
) -> Tensor | None:
    """coef * aggregated KL (scalar) when the KL is a loss term, else None; logs the KL either way.
    kl_weighting "importance": the per-token KL times the ratio pi_theta / pi_old (kl.py)."""
    in_loss = _kl_in_loss(algo)
    weighting = getattr(algo, "kl_weighting", "none")
    if weighting not in ("none", "importance"):
        raise ValueError(f"kl_weighting must be 'none' or 'importance', got {weighting!r}")
    if weighting == "importance" and not in_loss:
        raise ValueError(
            "kl_weighting='importance' weights the KL loss term; it needs kl_mode='loss' and "
            f"kl_coef > 0 (got kl_mode={algo.kl_mode!r}, kl_coef={algo.kl_coef})"
        )
    if kl_out is None and ref_logp is None:
        if in_loss:
            raise ValueError(
                f"kl_mode='loss' with kl_coef={algo.kl_coef} needs ref_logp (reference log-probs) "
                "or a policy-specific kl_out, got neither"
            )
        return None
    if kl_out is None:
        kl = kl_penalty(logp, ref_logp, algo.kl_estimator)  # [n, T]
    else:
        kl = kl_out  # [n, T]
    if kl.shape != mask.shape:
        raise ValueError(f"KL must be [n, T] = {tuple(mask.shape)}, got {tuple(kl.shape)}")
    if weighting == "importance":
        kl = importance_weighted_kl(kl, logp, old_logp, mask, algo.ratio_level)  # [n, T]
    term, kl_metrics = kl_loss_term(kl, mask, algo, counts, seq_weights)
    metrics.update(kl_metrics)
    return term


def _entropy_term(entropy, logp, mask, algo, counts, metrics) -> Tensor | None:
    """-coef * aggregated entropy (scalar) when entropy_coef != 0, else None."""
    if entropy is not None:
        metrics["entropy"] = _metric(entropy, mask)
    if algo.entropy_coef == 0:
        return None
    if entropy is None:
        raise ValueError(
            f"entropy_coef={algo.entropy_coef} needs per-token entropies, but the policy returned None"
        )
    if logp.requires_grad and not entropy.requires_grad:
        raise ValueError(
            f"entropy_coef={algo.entropy_coef} needs a differentiable entropy, but the policy's entropy "
            "is detached: the bonus would be a constant with no effect"
        )
    term = -algo.entropy_coef * entropy_bonus(entropy, mask, algo.aggregation, **counts)  # scalar
    metrics["entropy_loss"] = float(term.detach())
    return term


def total_loss(
    policy_out: PolicyOutput,
    *,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    algo: Any,
    counts: dict,
    ref_logp: Tensor | None = None,
    engine_logp: Tensor | None = None,
    kl_out: Tensor | None = None,
    generator: torch.Generator | None = None,
    group_ids: Tensor | None = None,
    token_scales: Tensor | None = None,
    seq_weights: Tensor | None = None,
    teacher_logp: Tensor | None = None,
    distill_kl: Tensor | None = None,
) -> LossOutput:
    """The training loss of one micro-batch (see module docstring).

    policy_out: logp [n, T] (differentiable), optional entropy [n, T]. old_logp / ref_logp /
    engine_logp / kl_out: [n, T]. advantages: [n] or [n, T]. mask: Bool[n, T].
    algo: anything with the `algorithm:` config fields (attribute access). counts: global
    {num_tokens, num_seqs, max_len[, num_groups]} of the optimizer step (count_tokens). generator:
    for clip_cov. group_ids [n]: for TPO. token_scales [n, T], seq_weights [n]: see module doc.
    teacher_logp [n, T] (k1 / k3) or distill_kl [n, T] (full): the distillation term's inputs,
    read when `algo.distill` (getattr, default None) is set.
    """
    mask = mask.bool()  # [n, T]
    logp = policy_out.logp  # [n, T]
    metrics: dict[str, float] = {}
    weights = _token_weights(
        policy_out, old_logp, mask, algo, engine_logp, token_scales, metrics
    )  # [n, T]
    agg_counts = {k: v for k, v in counts.items() if k in AGG_COUNTS}
    unit = None if seq_weights is None else torch.ones_like(seq_weights)  # [n] for KL / entropy
    pg = policy_loss(
        logp, old_logp, advantages, mask,
        surrogate=algo.surrogate, ratio_level=algo.ratio_level,
        aggregation=algo.aggregation, token_weights=weights, group_ids=group_ids,
        num_groups=counts.get("num_groups"), seq_weights=seq_weights,
        generator=generator, **agg_counts,
    )  # fmt: skip
    metrics.update(pg.metrics)
    loss = getattr(algo, "pg_coef", 1.0) * pg.loss  # scalar
    for term in (
        _kl_term(logp, old_logp, mask, algo, agg_counts, ref_logp, kl_out, metrics, unit),
        _entropy_term(
            policy_out.entropy, logp, mask, algo, {**agg_counts, "seq_weights": unit}, metrics
        ),
    ):
        if term is not None:
            loss = loss + term  # scalar
    distill = getattr(algo, "distill", None)
    if distill is not None:
        term, distill_metrics = distill_loss_term(
            logp, mask, distill, algo.aggregation, agg_counts,
            teacher_logp=teacher_logp, full_kl=distill_kl,
        )  # fmt: skip
        metrics.update(distill_metrics)
        loss = loss + term  # scalar
    metrics["loss"] = float(loss.detach())
    return LossOutput(loss=loss, metrics=metrics)
