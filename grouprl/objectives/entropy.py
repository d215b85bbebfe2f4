"""Entropy terms: per-token entropy from logits, the high-entropy token mask, the entropy bonus.

- `high_entropy_mask` follows "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL
  for LLM Reasoning" (arXiv 2506.01939): only the top `top_quantile` fraction of tokens by entropy
  (the "forking" tokens) receive a policy gradient; the paper keeps the top 20%.
  Deviation: the threshold is the quantile over the valid tokens of the tensor passed in (one
  micro-batch on one process). TRL gathers the entropies of all processes first, so its threshold
  is a global one. Quantiles use linear interpolation, as torch.quantile does.
- `entropy_bonus` is the aggregated entropy H; the objective subtracts coef * H from the loss, so a
  positive coefficient raises entropy (arXiv 2504.20571 convention, METHODS section 12).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grouprl.objectives.aggregation import aggregate


def token_entropy_from_logits(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last axis: logits [..., V] -> entropy [...].

    Uses log_softmax (stable for large logits), in float32 at least (float64 stays float64). Entries with p = 0 (logit -inf, e.g. masked
    vocabulary) contribute 0 and a finite gradient instead of 0 * -inf = NaN.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()  # [..., V] bf16/fp16 -> fp32
    logp = torch.log_softmax(x, dim=-1)  # [..., V]
    finite_logp = logp.masked_fill(torch.isinf(logp), 0.0)  # [..., V]  -inf -> 0 (p is 0 there)
    return -(logp.exp() * finite_logp).sum(-1)  # [...]


def _linear_quantile(sorted_vals: Tensor, q: float) -> Tensor:
    """Quantile q of an ascending 1-D tensor with linear interpolation (torch.quantile's default),
    written out because torch.quantile refuses inputs above 2**24 elements."""
    pos = q * (sorted_vals.numel() - 1)
    lo = int(pos)  # floor, pos >= 0
    hi = min(lo + 1, sorted_vals.numel() - 1)
    frac = pos - lo
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * frac  # scalar


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """Bool[n, T]: valid tokens whose entropy is >= the (1 - top_quantile) quantile of the valid
    tokens' entropies. top_quantile = 1 keeps every valid token; no valid token -> all False."""
    if not 0.0 < top_quantile <= 1.0:
        raise ValueError(f"top_quantile must be in (0, 1], got {top_quantile!r}")
    if entropy.shape != mask.shape:
        raise ValueError(
            f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape"
        )
    mask = mask.bool()  # [n, T]
    valid = entropy.detach()[mask].float()  # [K]
    if valid.numel() == 0:
        return torch.zeros_like(mask)  # [n, T] all False
    threshold = _linear_quantile(valid.sort().values, 1.0 - top_quantile)  # scalar
    return mask & (entropy.detach().float() >= threshold)  # [n, T]


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    **counts,
) -> Tensor:
    """Aggregated entropy (a scalar to *subtract*, times a coefficient, from the loss).

    `counts` are aggregate()'s keyword arguments: num_tokens, num_seqs, max_len.
    """
    return aggregate(entropy, mask.bool(), aggregation, **counts)  # scalar
