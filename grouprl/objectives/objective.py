"""The one composed loss train.py uses for every modality (text tokens, denoising steps, agent turns).

    loss = policy_loss(weighted by engine-IS weights and the high-entropy mask)
         + kl_coef * aggregate(KL)            when kl_mode == "loss" and kl_coef > 0
         - entropy_coef * aggregate(H)        when entropy_coef != 0

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
- A policy may replace the token KL estimators (flow models: Gaussian mean-space KL) via `kl_out`.

Metrics: `loss`, `pg_loss` (and `kl_loss`, `entropy_loss` when active) are this micro-batch's share of
the step's loss: sum them over micro-batches. `kl` and `entropy` are means over this micro-batch's
valid slots, like the other policy_loss and correction metrics: average them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.objectives.aggregation import aggregate, local_counts
from grouprl.objectives.correction import engine_is_weights
from grouprl.objectives.entropy import entropy_bonus, high_entropy_mask
from grouprl.objectives.kl import kl_penalty
from grouprl.objectives.losses import policy_loss
from grouprl.types import LossOutput, PolicyOutput

_KL_MODES = ("loss", "reward")


def count_tokens(mask: Tensor, max_len: int | None = None) -> dict[str, int]:
    """Counts of a full optimizer-step batch mask [N, T], for aggregate()/total_loss(`counts`).

    max_len should be the configured maximum completion length (the Dr. GRPO constant); it
    defaults to the padded width T. Under data parallelism, sum num_tokens / num_seqs over processes.
    """
    tokens, seqs = local_counts(mask.bool())
    return {
        "num_tokens": tokens,
        "num_seqs": seqs,
        "max_len": int(mask.shape[-1] if max_len is None else max_len),
    }


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float(x.detach().masked_fill(~mask, 0.0).sum() / mask.sum().clamp(min=1))


def _token_weights(policy_out, old_logp, mask, algo, engine_logp, metrics) -> Tensor:
    """Engine-IS weights [n, T] (ones for "none") times the high-entropy selection mask."""
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
        metrics["entropy_mask_frac"] = _masked_mean(keep.float(), mask)
    return weights.to(policy_out.logp.dtype)  # [n, T]


def _kl_term(logp, mask, algo, counts, ref_logp, kl_out, metrics) -> Tensor | None:
    """coef * aggregated KL (scalar) when the KL is a loss term, else None; logs the KL either way."""
    if algo.kl_mode not in _KL_MODES:
        raise ValueError(f"kl_mode must be one of {_KL_MODES}, got {algo.kl_mode!r}")
    in_loss = algo.kl_mode == "loss" and algo.kl_coef > 0
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
    metrics["kl"] = _masked_mean(kl, mask)
    if not in_loss:
        return None
    term = algo.kl_coef * aggregate(kl, mask, algo.aggregation, **counts)  # scalar
    metrics["kl_loss"] = float(term.detach())
    return term


def _entropy_term(entropy, logp, mask, algo, counts, metrics) -> Tensor | None:
    """-coef * aggregated entropy (scalar) when entropy_coef != 0, else None."""
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy, mask)
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
) -> LossOutput:
    """The training loss of one micro-batch (see module docstring).

    policy_out: logp [n, T] (differentiable), optional entropy [n, T]. old_logp / ref_logp /
    engine_logp / kl_out: [n, T]. advantages: [n] or [n, T]. mask: Bool[n, T].
    algo: anything with the `algorithm:` config fields (attribute access). counts: global
    {num_tokens, num_seqs, max_len} of the optimizer step (count_tokens). generator: for clip_cov.
    """
    mask = mask.bool()  # [n, T]
    logp = policy_out.logp  # [n, T]
    metrics: dict[str, float] = {}
    weights = _token_weights(policy_out, old_logp, mask, algo, engine_logp, metrics)  # [n, T]
    pg = policy_loss(
        logp, old_logp, advantages, mask,
        ratio_level=algo.ratio_level, surrogate=algo.surrogate,
        eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip_c=algo.dual_clip_c,
        aggregation=algo.aggregation, token_weights=weights,
        sapo_tau_pos=algo.sapo_tau_pos, sapo_tau_neg=algo.sapo_tau_neg,
        clip_cov_ratio=algo.clip_cov_ratio, clip_cov_lb=algo.clip_cov_lb, clip_cov_ub=algo.clip_cov_ub,
        kl_cov_ratio=algo.kl_cov_ratio, kl_cov_coef=algo.kl_cov_coef,
        generator=generator, **counts,
    )  # fmt: skip
    metrics.update(pg.metrics)
    loss = pg.loss  # scalar
    for term in (
        _kl_term(logp, mask, algo, counts, ref_logp, kl_out, metrics),
        _entropy_term(policy_out.entropy, logp, mask, algo, counts, metrics),
    ):
        if term is not None:
            loss = loss + term  # scalar
    metrics["loss"] = float(loss.detach())
    return LossOutput(loss=loss, metrics=metrics)
