"""Policy-gradient surrogates at three ratio levels, for every modality (tokens, denoising steps, turns).

Notation: log rho = logp - old_logp per action slot, A = advantage, m = mask, sg = stop-gradient.
Log-ratios are clamped to [-20, 20] before exp (as verl / OpenRLHF do).

Ratio levels (`ratio_level`):
- token      PPO (arXiv 1707.06347) / GRPO (arXiv 2402.03300): one ratio per slot.
- sequence   GSPO (arXiv 2507.18071): log s_i = sum_t m log rho / |o_i|, used in the token form
             log s_it = sg(log s_i) + (logp - sg(logp)): the value is the sequence ratio, bit for bit
             the same on every token of the sequence (so a sequence is clipped whole or not at all),
             the gradient is per token (GSPO-token, as in verl).
- geometric  GMPO (arXiv 2507.20673, METHODS section 14): token log-ratios are clipped in log space,
             sign(A)-aware, R_i = exp(masked mean), L = -(1/num_seqs) sum_i A_i R_i with A_i the mean
             token advantage. The `aggregation` argument is IGNORED here (GMPO defines its own mean
             over sequences); only the `clip` surrogate applies. token_weights become one weight per
             sequence, their geometric mean over the valid slots (as verl does), so a 0 weight on any
             token drops the whole sequence.

Surrogates (`surrogate`: its config object, `type` plus the family's knobs, grouprl/config/
surrogates.py; knob names below are its fields), per-slot losses l (to minimise), then token_weights, then aggregate():
- clip       PPO clip: max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high)); eps_high > eps_low is DAPO's
             clip-higher (arXiv 2503.14476). Dual clip (arXiv 1912.09729) when dual_clip_c = c > 1:
             for A < 0, l = min(l, -A c).
- cispo      MiniMax-M1 (arXiv 2506.13585, METHODS 15a): -sg(clip(rho, 1-eps_low, 1+eps_high)) A logp.
             Two-sided as in verl; TRL caps only the top (use a large eps_low for that).
- sapo       Qwen SAPO (arXiv 2511.20347, METHODS 15b): -(4/tau) sigmoid(tau (rho - 1)) A, tau =
             tau_pos if A > 0 else tau_neg. verl forces seq_mean_token_mean; here the
             configured aggregation is used (presets choose it).
- reinforce  GPG (arXiv 2504.02546): -A logp, no ratio.
- clip_cov   Entropy Mechanism (arXiv 2505.22617), rule read from verl: cov = (A - mean A)(logp - mean
             logp) over the valid slots of this call; candidates are valid slots with lb < cov
             < ub that PPO does not already clip; a uniformly random subset of
             min(#candidates, max(1, int(ratio * n_valid))) of them is chosen (`generator`)
             and their PPO loss is detached. Deviation: verl multiplies those losses by 0, which also
             drops their value; detaching gives the same gradient and keeps the logged loss honest.
- kl_cov     same paper: l = -A rho (no clip) and, for the top max(1, int(ratio * n_valid))
             valid slots by cov, l += coef * |log rho|.
- pmd        PMD-mean (arXiv 2602.05933, METHODS section 2), group_losses.py: (tau/2)(A/tau - Delta_i)^2
             / |o_i| on each slot, Delta_i = summed token log-ratio; no clip. ratio_level "token" only.
- tpo        TPO (arXiv 2604.06159, METHODS section 9), group_losses.py: cross-entropy to a target over
             each group's candidates; it needs group_ids, reduces by itself (aggregation IGNORED,
             divided by num_groups = the global number of groups, default the groups here), and
             refuses token weights other than 1 and seq_weights. ratio_level "token" only.
clip_cov / kl_cov select slots within one call, so unlike the others they are not exactly invariant
to splitting a batch into micro-batches (true of the reference implementation as well).

seq_weights (Float[n], optional): per-row loss weights passed to aggregate() (delta_l needs them); at
ratio_level "geometric" they multiply each sequence's term.

Metrics (floats over valid slots; 0 when there are none): clip_frac_low (A < 0 and rho < 1-eps_low),
clip_frac_high (A > 0 and rho > 1+eps_high) (both 0 for a surrogate without a clip range), dual_clip_frac (A < 0 and rho > c), ratio_mean/min/max
(of the ratio the surrogate uses: per slot; for geometric per non-empty sequence, R_i), approx_kl =
mean k3 estimate of KL(old || new) from the token log-ratios: (rho - 1) - log rho; pg_loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from grouprl.objectives.aggregation import aggregate, local_counts, masked_mean, safe_count
from grouprl.objectives.group_losses import (
    GROUP_SURROGATES,
    check_group_options,
    pmd_surrogate,
    tpo_surrogate,
)
from grouprl.objectives.registry import Registry
from grouprl.types import LossOutput

# ---- the input record, its checks and the logged metrics ---------------------------------------


@dataclass(frozen=True)
class SurrogateBatch:
    """Everything a ratio level / surrogate needs; tensors are [n, T] (advantages broadcast)."""

    logp: Tensor
    old_logp: Tensor
    adv: Tensor
    mask: Tensor
    token_weights: Tensor | None
    surrogate: Any  # the surrogate's config: `type` and its family's knobs (config/surrogates.py)
    aggregation: str
    counts: dict
    generator: torch.Generator | None
    group_ids: Tensor | None = None
    num_groups: int | float | Tensor | None = None
    seq_weights: Tensor | None = None

    @property
    def kind(self) -> str:
        """The surrogate family's name (a key of losses.SURROGATES)."""
        return self.surrogate.type

    @property
    def clip_range(self) -> tuple[float, float] | None:
        """(eps_low, eps_high) of a surrogate with a clip range; None for one without."""
        s = self.surrogate
        return (s.eps_low, s.eps_high) if hasattr(s, "eps_low") else None

    @property
    def dual_clip_c(self) -> float | None:
        return getattr(self.surrogate, "dual_clip_c", None)  # only the PPO-clip families have it


def _clip_flags(ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Slots where the lower clip, upper clip and dual clip are active (strict inequalities);
    none for a surrogate without a clip range (sapo, reinforce, kl_cov, pmd, tpo)."""
    if b.clip_range is None:
        none = torch.zeros_like(b.mask)  # [n, T]
        return none, none, none
    eps_low, eps_high = b.clip_range
    low = b.mask & (b.adv < 0) & (ratio < 1 - eps_low)  # [n, T]
    high = b.mask & (b.adv > 0) & (ratio > 1 + eps_high)  # [n, T]
    c = b.dual_clip_c
    dual = (
        b.mask & (b.adv < 0) & (ratio > c) if c is not None else torch.zeros_like(b.mask)
    )  # [n, T]
    return low, high, dual


def _ratio_metrics(ratio: Tensor, valid: Tensor) -> dict:
    vals = ratio.detach()[valid]  # [K]
    if vals.numel() == 0:
        return {"ratio_mean": 0.0, "ratio_min": 0.0, "ratio_max": 0.0}
    return {"ratio_mean": vals.mean(), "ratio_min": vals.min(), "ratio_max": vals.max()}


def _check_shapes(logp, old_logp, advantages, mask, token_weights, seq_weights) -> None:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must all be [n, T]; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [n] or [n, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if token_weights is not None and token_weights.shape != logp.shape:
        raise ValueError(
            f"token_weights must be [n, T] = {tuple(logp.shape)}, got {tuple(token_weights.shape)}"
        )
    if seq_weights is not None and seq_weights.shape != logp.shape[:1]:
        raise ValueError(
            f"seq_weights must be [n] = {tuple(logp.shape[:1])}, got {tuple(seq_weights.shape)}"
        )


def _check_option_values(b: SurrogateBatch, ratio_level: str) -> None:
    """Option values and combinations policy_loss cannot honour (option names: losses.py). The
    config models check the ranges too; these checks serve callers that build the spec in code."""
    s = b.surrogate
    if b.clip_range is not None and min(b.clip_range) < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {s.eps_low}, {s.eps_high}")
    if b.kind in ("clip_cov", "kl_cov") and not 0 < s.ratio <= 1:
        raise ValueError(
            f"{b.kind} ratio is a fraction of the valid tokens, in (0, 1]; got {s.ratio}"
        )
    check_group_options(b, ratio_level)
    if ratio_level == "geometric" and b.kind != "clip":
        raise ValueError(
            "ratio_level 'geometric' (GMPO) has its own log-space clip; use surrogate 'clip', "
            f"not {b.kind!r}"
        )
    if b.dual_clip_c is None:
        return
    if not b.dual_clip_c > 1:
        raise ValueError(
            f"dual_clip_c must be > 1 (it bounds -A*rho for A < 0), got {b.dual_clip_c}"
        )
    if ratio_level == "geometric":
        raise ValueError(
            "dual_clip_c applies to the PPO-clip surrogates at token or sequence level, not "
            "ratio_level 'geometric'"
        )


LOG_RATIO_CLAMP = 20.0
SURROGATES = Registry("surrogate")
RATIO_LEVELS = Registry("ratio level")


def _token_log_ratio(b: SurrogateBatch) -> Tensor:
    return (b.logp - b.old_logp).masked_fill(~b.mask, 0.0)  # [n, T]


def _sequence_log_ratio(b: SurrogateBatch) -> Tensor:
    delta = _token_log_ratio(b)  # [n, T]
    log_s = delta.sum(-1, keepdim=True) / b.mask.sum(-1, keepdim=True).clamp(min=1)  # [n, 1]
    # The parentheses matter: (sg(log s_i) + logp) - sg(logp) rounds differently per token (a few
    # ulps), so a sequence sitting on a clip bound would be clipped on some tokens only. logp -
    # sg(logp) is exactly 0.0 in value, so every token of row i carries the bit-identical log s_i.
    return log_s.detach() + (b.logp - b.logp.detach())  # [n, T] value log s_i, gradient per token


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [n, T]


def _ppo_clip(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, Tensor]:
    """PPO clip loss [n, T] and the bool [n, T] of slots PPO clips. Written with `where` on the
    strict clip conditions: same value as the max() form, and rho exactly at 1 +- eps keeps its
    gradient (the max() form would depend on how autograd splits ties)."""
    ratio = _exp_ratio(log_ratio)  # [n, T]
    low, high, dual = _clip_flags(ratio.detach(), b)  # [n, T] each
    clipped = low | high  # [n, T]
    eps_low, eps_high = b.clip_range
    bound = ratio.detach().clamp(1 - eps_low, 1 + eps_high)  # [n, T] constant where clipped
    loss = torch.where(clipped, -b.adv * bound, -b.adv * ratio)  # [n, T]
    if b.dual_clip_c is not None:
        loss = torch.where(dual, -b.adv * b.dual_clip_c, loss)  # [n, T] A<0: min(l, -A c)
    return loss, clipped


def _covariance(b: SurrogateBatch) -> Tensor:
    """(A - mean A)(logp - mean logp) over the valid slots of this call, detached; [n, T]."""
    adv, logp = b.adv.detach(), b.logp.detach()  # [n, T]
    cov = (adv - masked_mean(adv, b.mask)) * (logp - masked_mean(logp, b.mask))  # [n, T]
    return cov.masked_fill(~b.mask, float("-inf"))  # [n, T] invalid slots never selected


@SURROGATES.register("clip")
def clip_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    return _ppo_clip(log_ratio, b)[0], {}


@SURROGATES.register("cispo")
def cispo_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    s = b.surrogate
    weight = _exp_ratio(log_ratio).detach().clamp(1 - s.eps_low, 1 + s.eps_high)  # [n, T]
    return -weight * b.adv * b.logp, {}  # [n, T]


@SURROGATES.register("sapo")
def sapo_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    ratio = _exp_ratio(log_ratio)  # [n, T]
    tau = torch.where(b.adv > 0, b.surrogate.tau_pos, b.surrogate.tau_neg).to(ratio.dtype)  # [n, T]
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * b.adv, {}  # [n, T]


@SURROGATES.register("reinforce")
def reinforce_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    return -b.adv * b.logp, {}  # [n, T]


@SURROGATES.register("clip_cov")
def clip_cov_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    loss, clipped = _ppo_clip(log_ratio, b)  # [n, T] each
    cov = _covariance(b)  # [n, T]
    s = b.surrogate
    eligible = b.mask & ~clipped & (cov > s.lb) & (cov < s.ub)  # [n, T]
    candidates = eligible.flatten().nonzero().squeeze(-1)  # [K]
    n_pick = min(candidates.numel(), max(1, int(s.ratio * int(b.mask.sum()))))
    device = b.generator.device if b.generator is not None else torch.device("cpu")
    perm = torch.randperm(candidates.numel(), generator=b.generator, device=device)  # [K]
    chosen = torch.zeros(b.mask.numel(), dtype=torch.bool, device=b.mask.device)  # [n*T]
    chosen[candidates[perm[:n_pick].to(candidates.device)]] = True
    chosen = chosen.view_as(b.mask)  # [n, T]
    loss = torch.where(chosen, loss.detach(), loss)  # [n, T] value kept, gradient dropped
    return loss, {"clip_cov_frac": masked_mean(chosen.float(), b.mask)}


@SURROGATES.register("kl_cov")
def kl_cov_surrogate(log_ratio: Tensor, b: SurrogateBatch) -> tuple[Tensor, dict]:
    loss = -b.adv * _exp_ratio(log_ratio)  # [n, T]
    n_valid = int(b.mask.sum())
    chosen = torch.zeros_like(b.mask)  # [n, T]
    if n_valid > 0:
        k = min(n_valid, max(1, int(b.surrogate.ratio * n_valid)))
        top = _covariance(b).flatten().topk(k).indices  # [k]; -inf padding ranks last
        chosen.view(-1)[top] = True
        loss = loss + b.surrogate.coef * log_ratio.masked_fill(~chosen, 0.0).abs()  # [n, T]
    return loss, {"kl_cov_frac": masked_mean(chosen.float(), b.mask)}


SURROGATES.register("pmd")(pmd_surrogate)
SURROGATES.register("tpo")(tpo_surrogate)


def _tokenwise(log_ratio_fn, b: SurrogateBatch) -> tuple[Tensor, dict]:
    """token and sequence levels: per-slot surrogate, token weights, configured aggregation."""
    log_ratio = log_ratio_fn(b)  # [n, T]
    loss_mat, extra = SURROGATES[b.kind](log_ratio, b)  # [n, T]
    if b.token_weights is not None:
        loss_mat = loss_mat * b.token_weights  # [n, T]
    loss = aggregate(loss_mat, b.mask, b.aggregation, **b.counts, seq_weights=b.seq_weights)
    ratio = _exp_ratio(log_ratio.detach())  # [n, T]
    low, high, dual = _clip_flags(ratio, b)  # [n, T] each
    metrics = {
        "clip_frac_low": masked_mean(low.float(), b.mask),
        "clip_frac_high": masked_mean(high.float(), b.mask),
        "dual_clip_frac": masked_mean(dual.float(), b.mask),
        **_ratio_metrics(ratio, b.mask),
        **extra,
    }
    return loss, metrics


RATIO_LEVELS.register("token")(partial(_tokenwise, _token_log_ratio))
RATIO_LEVELS.register("sequence")(partial(_tokenwise, _sequence_log_ratio))


@RATIO_LEVELS.register("geometric")
def _geometric(b: SurrogateBatch) -> tuple[Tensor, dict]:
    """GMPO, METHODS section 14 (aggregation ignored, see module docstring)."""
    eps_low, eps_high = b.clip_range  # the clip surrogate's (checked by _check_option_values)
    delta = _token_log_ratio(b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [n, T]
    high = b.mask & (b.adv > 0) & (delta > eps_high)  # [n, T] upper clip, A > 0 only
    low = b.mask & (b.adv < 0) & (delta < -eps_low)  # [n, T] lower clip, A < 0 only
    # sgn(A) min(sgn(A) d, sgn(A) clip(d)): A>0 caps d at eps_high, A<0 floors it at -eps_low, A=0 -> 0
    c = torch.where(high, eps_high, torch.where(low, -eps_low, delta))  # [n, T]
    c = c.masked_fill((b.adv == 0) | ~b.mask, 0.0)  # [n, T]
    lengths = b.mask.sum(-1).clamp(min=1)  # [n]
    seq_ratio = (c.sum(-1) / lengths).exp()  # [n] R_i
    seq_adv = b.adv.masked_fill(~b.mask, 0.0).sum(-1) / lengths  # [n] A_i
    per_seq = -seq_adv * seq_ratio  # [n]
    if b.token_weights is not None:
        log_w = torch.log(b.token_weights + 1e-10).masked_fill(~b.mask, 0.0)  # [n, T]
        per_seq = per_seq * (log_w.sum(-1) / lengths).exp()  # [n] geometric-mean weight
    if b.seq_weights is not None:
        per_seq = per_seq * b.seq_weights  # [n]
    num_seqs = b.counts.get("num_seqs")
    num_seqs = local_counts(b.mask)[1] if num_seqs is None else num_seqs
    loss = per_seq.sum() / safe_count(num_seqs)  # scalar
    metrics = {
        "clip_frac_low": masked_mean(low.float(), b.mask),
        "clip_frac_high": masked_mean(high.float(), b.mask),
        "dual_clip_frac": 0.0,
        **_ratio_metrics(seq_ratio, b.mask.any(-1)),
    }
    return loss, metrics


def _group_level(b: SurrogateBatch) -> tuple[Tensor, dict]:
    """Surrogates with their own reduction over groups (TPO): no aggregate(), no clip."""
    loss, metrics = SURROGATES[b.kind](_token_log_ratio(b), b)  # scalar
    ratio = _exp_ratio(_token_log_ratio(b).detach())  # [n, T] monitored only
    zero = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0}
    return loss, {**zero, **_ratio_metrics(ratio, b.mask), **metrics}


def _check_options(b: SurrogateBatch, ratio_level: str) -> None:
    _ = SURROGATES[b.kind], RATIO_LEVELS[ratio_level]  # unknown names fail here, with hints
    _check_option_values(b, ratio_level)


@dataclass(frozen=True)
class ClipRange:
    """The PPO-clip surrogate's spec for callers that have no config object (the flow objectives):
    the fields of config.surrogates.ClipSurrogate."""

    eps_low: float
    eps_high: float
    dual_clip_c: float | None = None
    type: str = "clip"


PPO_CLIP = ClipRange(0.2, 0.2)  # policy_loss's default surrogate: PPO's clip range 0.2


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    surrogate: Any = PPO_CLIP,
    ratio_level: str = "token",
    aggregation: str = "token_mean",
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
    max_len: int | None = None,
    token_weights: Tensor | None = None,
    generator: torch.Generator | None = None,
    group_ids: Tensor | None = None,
    num_groups: int | float | Tensor | None = None,
    seq_weights: Tensor | None = None,
) -> LossOutput:
    """Policy-gradient loss of logp [n, T] (differentiable) against old_logp [n, T], with advantages
    [n] or [n, T], over mask [n, T] (bool). Counts are the global ones (see aggregation.py).
    surrogate: the surrogate's config, `type` (a SURROGATES name) and its family's knobs, e.g.
    grouprl.config.surrogates.SapoSurrogate(tau_pos=1.0) or ClipRange(0.2, 0.28). group_ids [n]
    and num_groups (global) serve TPO; seq_weights [n] go to aggregate(); generator: clip_cov."""
    _check_shapes(logp, old_logp, advantages, mask, token_weights, seq_weights)
    adv = advantages.detach().to(logp.dtype)  # [n] or [n, T]
    adv = adv.unsqueeze(-1).expand_as(logp) if adv.dim() == 1 else adv  # [n, T]
    # Padding may hold anything (NaN, -inf): zero it once here, so no surrogate ever multiplies a
    # zero gradient by a non-finite padded value (0 * NaN = NaN in backward).
    pad = ~mask  # [n, T]
    weights = None if token_weights is None else token_weights.detach().masked_fill(pad, 0.0)
    b = SurrogateBatch(
        logp=logp.masked_fill(pad, 0.0), old_logp=old_logp.detach().masked_fill(pad, 0.0),
        adv=adv.masked_fill(pad, 0.0), mask=mask, token_weights=weights,
        surrogate=surrogate, aggregation=aggregation,
        counts={"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len},
        generator=generator, group_ids=group_ids, num_groups=num_groups,
        seq_weights=None if seq_weights is None else seq_weights.detach().to(logp.dtype),
    )  # fmt: skip
    _check_options(b, ratio_level)
    level = _group_level if b.kind in GROUP_SURROGATES else RATIO_LEVELS[ratio_level]
    loss, metrics = level(b)
    log_rho = _token_log_ratio(b).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [n, T]
    metrics["approx_kl"] = masked_mean(log_rho.exp() - 1 - log_rho, mask)  # k3 of KL(old || new)
    metrics["pg_loss"] = loss.detach()
    return LossOutput(loss=loss, metrics={k: float(v) for k, v in metrics.items()})
