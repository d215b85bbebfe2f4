"""Train-vs-inference-engine mismatch correction: importance weights between trainer and engine log-probs.

The inference engine (vLLM, ...) samples with slightly different numerics than the trainer, so the
samples come from pi_engine while the loss assumes pi_old (the trainer's recompute of the same
weights). Truncated importance sampling (TIS, Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training") and masked importance sampling (MIS / IcePop) reweight each token
(or sequence) by w = pi_old / pi_engine. Formulas follow TRL's `vllm_importance_sampling_mode`:

  log w_it = old_logp - engine_logp, clamped to [-20, 20] before exp
  token_truncate     w_it clamped to [min, max]
  token_mask         w_it where min <= w_it <= max, else 0   (kept tokens keep their weight w, as TRL)
  sequence_truncate  W_i = exp(sum_t m_it log w_it) clamped to [min, max], broadcast over tokens
  sequence_mask      W_i where min <= W_i <= max, else 0, broadcast
  none               all ones

Choices: masked (padding) slots get weight 1.0 in every mode, so "none" is exactly all ones and the
weights never inject NaN/inf into padding; the loss mask removes those slots anyway. The summed
sequence log-weight is clamped to [-20, 20] too. TRL has no lower bound by default (clip_min None);
ours defaults to 0.0, which is the same for truncation (w > 0) and masking.

Metrics (python floats, over real tokens; sequence modes count sequences for the clipped fraction):
  engine_is/mean_weight      mean of the final weights
  engine_is/frac_clipped     fraction outside [min, max] (truncated or zeroed, per mode)
  engine_is/mean_abs_log_w   mean |old_logp - engine_logp|
  engine_is/kl_engine_trainer  k3 estimate of KL(pi_engine || pi_old) from engine samples:
                               mean(w - 1 - log w) >= 0
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grouprl.objectives.aggregation import masked_mean
from grouprl.objectives.registry import Registry

EngineCorrection = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]

CORRECTIONS = Registry("engine correction")
LOG_W_CLAMP = 20.0


def _keep(w: Tensor, lo: float, hi: float) -> Tensor:
    return (w >= lo) & (w <= hi)  # same shape as w


@CORRECTIONS.register("none")
def no_correction(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    ones = torch.ones_like(log_w)  # [N, T]
    return ones, torch.zeros_like(mask)  # weights [N, T], out-of-range flags [N, T]


@CORRECTIONS.register("token_truncate")
def token_truncate(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    w = log_w.exp()  # [N, T]
    return w.clamp(lo, hi), ~_keep(w, lo, hi) & mask  # [N, T], [N, T]


@CORRECTIONS.register("token_mask")
def token_mask(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    w = log_w.exp()  # [N, T]
    keep = _keep(w, lo, hi)  # [N, T]
    return torch.where(keep, w, torch.zeros_like(w)), ~keep & mask  # [N, T], [N, T]


def _sequence_w(log_w: Tensor) -> Tensor:
    return log_w.sum(-1, keepdim=True).clamp(-LOG_W_CLAMP, LOG_W_CLAMP).exp()  # [N, 1]


@CORRECTIONS.register("sequence_truncate")
def sequence_truncate(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    w = _sequence_w(log_w)  # [N, 1]
    return w.clamp(lo, hi).expand_as(log_w), ~_keep(w, lo, hi)[:, 0]  # [N, T], [N]


@CORRECTIONS.register("sequence_mask")
def sequence_mask(log_w: Tensor, mask: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    w = _sequence_w(log_w)  # [N, 1]
    keep = _keep(w, lo, hi)  # [N, 1]
    return torch.where(keep, w, torch.zeros_like(w)).expand_as(log_w), ~keep[:, 0]  # [N, T], [N]


def engine_is_weights(
    old_logp: Tensor,
    engine_logp: Tensor | None,
    mask: Tensor,
    mode: EngineCorrection,
    *,
    max_weight: float = 2.0,
    min_weight: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights pi_old / pi_engine, Float[N, T] detached, plus metrics (see module doc).

    Multiply them into the per-token loss. engine_logp may be None only with mode "none".
    """
    fn = CORRECTIONS[mode]
    if not 0.0 <= min_weight <= max_weight:
        raise ValueError(
            f"need 0 <= min_weight <= max_weight, got min {min_weight}, max {max_weight}"
        )
    mask = mask.bool()  # [N, T]
    if engine_logp is None:
        if mode != "none":
            raise ValueError(
                f"engine_correction {mode!r} needs engine_logp, but the rollout has none "
                "(the inference engine did not return log-probs)"
            )
        return torch.ones_like(old_logp).detach(), {}
    if not old_logp.shape == engine_logp.shape == mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, engine_logp {tuple(engine_logp.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape [N, T]"
        )
    with torch.no_grad():
        raw = torch.where(mask, old_logp - engine_logp, torch.zeros_like(old_logp))  # [N, T]
        log_w = raw.clamp(-LOG_W_CLAMP, LOG_W_CLAMP)  # [N, T]
        w, clipped = fn(log_w, mask, min_weight, max_weight)  # [N, T], [N, T] or [N]
        w = torch.where(mask, w, torch.ones_like(w))  # [N, T] padding -> 1
        tok_w = log_w.exp()  # [N, T]
        has_tokens = mask.any(-1)  # [N]
        per = mask if clipped.dim() == 2 else has_tokens  # [N, T] or [N]: token or sequence modes
        metrics = {
            "engine_is/mean_weight": masked_mean(w, mask),
            "engine_is/frac_clipped": masked_mean(clipped.float(), per),
            "engine_is/mean_abs_log_w": masked_mean(log_w.abs(), mask),
            "engine_is/kl_engine_trainer": masked_mean(tok_w - 1.0 - log_w, mask),
        }
        metrics = {k: float(v) for k, v in metrics.items()}
    return w.detach(), metrics
