"""Group-relative advantage estimators: rewards [N] + group ids [N] -> one advantage per sample [N].

Estimators (one registered function each; look them up by name in `ADVANTAGES`):
  grpo                   (R - mean_g) / (std_g + eps)                DeepSeekMath, arXiv 2402.03300
                         scale="group" | "batch" (std of all valid R) | "none" (no division)
  dr_grpo                R - mean_g  (grpo with scale "none")        Dr. GRPO, arXiv 2503.20783
  rloo                   R_i - mean of the OTHER valid members       RLOO, arXiv 2402.14740
  reinforce_pp_baseline  R - mean_g, then whitened over the batch    REINFORCE++, arXiv 2501.03262
  opo                    R - sum_j L_j R_j / sum_j L_j (length-weighted group mean)  OPO, arXiv 2505.23585
  gpg                    alpha * (R - mean_g), alpha = n_valid / #(valid R != 0)     GPG, arXiv 2504.02546
  grpo_passk             best member gets (r_max - r_second) [/ (std + eps)], others 0  arXiv 2503.19595
  tpo                    (R - mean_g) / std_g^pop, no eps (population std, /n)  TPO, arXiv 2604.06159
                         (METHODS section 9); `scale` and `eps` are ignored. The standardised score u
                         that surrogate "tpo" tilts its target with.

Multi-reward (a dict of Float[N] with `weights`):
  sum_then_normalize (default)  R_i = sum_k w_k r_ik (NaN entries skipped), then the estimator.
  normalize_then_sum (GDPO, arXiv 2601.05242, as TRL implements it)
      z_ik = (r_ik - mean_g,k) / (std_g,k + eps) per reward, R_i = sum_k w_k z_ik,
      A_i = (R_i - mean_batch R) / (std_batch R + eps). This defines the whole advantage, so it only
      combines with estimator "grpo" and scale "group"; anything else raises.

Conventions, edge cases (all tested):
  - std is the unbiased (Bessel, /(n-1)) std, as TRL and verl use. eps defaults to 1e-4 (TRL); verl
    uses 1e-6.
  - NaN reward = "no reward" (the reward function failed): the sample is left out of every statistic
    (group and batch) and gets advantage exactly 0. +-inf rewards are an error.
  - A group is *degenerate* when it has fewer than 2 valid members or all its valid rewards are equal.
    Every member of a degenerate group gets advantage exactly 0.0, for every estimator, including the
    batch-whitened ones (reinforce_pp_baseline, GDPO): there is no within-group baseline, so there is
    no learning signal. We force the exact zero instead of relying on (x - mean) cancelling, which
    leaves ~1e-9 residues for rewards like 0.1.
  - Deviation from verl: verl gives a singleton group mean 0 and std 1, so its lone sample gets
    advantage R (grpo, gpg, opo) — an absolute, not relative, signal. We give 0 (above).
    verl's grpo_passk raises on groups of < 2; we give 0. verl whitens reinforce++ over *tokens*
    (long answers weigh more); we whiten over samples, since advantages here are per sample.
  - gpg: alpha follows verl (B / count_nonzero(R), clamped to >= 1 nonzero), with B and the count
    taken over valid samples only. The GPG paper motivates alpha as compensation for samples that
    carry no gradient; verl approximates that by counting nonzero rewards.
  - opo: a group whose valid lengths sum to 0 uses the plain mean (the equal-weight limit).
  - group_ids may be any integers, in any order; all group work is vectorised (scatter / index_add).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grouprl.objectives.group_stats import Groups, batch_std, whiten
from grouprl.objectives.registry import Registry

AdvantageName = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "tpo"
]
Scale = Literal["group", "batch", "none"]
RewardAggregation = Literal["sum_then_normalize", "normalize_then_sum"]

ADVANTAGES = Registry("advantage estimator")
SCALES = ("group", "batch", "none")


def _check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}: allowed are {', '.join(SCALES)}")


def _divide_by_std(adv: Tensor, r: Tensor, g: Groups, scale: str, eps: float) -> Tensor:
    _check_scale(scale)
    if scale == "none":
        return adv
    std = g.std(r) if scale == "group" else batch_std(r, g.valid)  # [N] or scalar
    denom = (std + eps) * torch.ones_like(adv)  # [N]
    # a zero-variance group with eps=0 would be 0/0: its advantage is exactly 0 by definition
    return torch.where(denom > 0, adv / denom.clamp(min=torch.finfo(adv.dtype).tiny), 0.0)  # [N]


# ----------------------------------------------------------------------------- estimators
# Each: fn(r [N] float64, groups: Groups, *, scale, eps, lengths, [own options]) -> A [N]. Invalid
# samples may hold any finite value in r; estimators must return 0 for them. Estimators that do not
# use scale / eps / lengths ignore them; an option no estimator knows is a TypeError (no silent drop).


@ADVANTAGES.register("grpo")
def grpo(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    return _divide_by_std(g.centered(r), r, g, scale, eps)  # [N]


@ADVANTAGES.register("dr_grpo")
def dr_grpo(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    return g.centered(r)  # [N]  (scale is fixed to "none" by definition)


@ADVANTAGES.register("rloo")
def rloo(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    # R_i - (S - R_i)/(n - 1) = n/(n - 1) * (R_i - mean_g); degenerate groups are already 0.
    n = g.count(r.dtype)  # [N]
    return g.centered(r) * n / (n - 1).clamp(min=1)  # [N]


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None
) -> Tensor:
    c = g.centered(r)  # [N]
    adv = whiten(c, g.valid, eps)  # [N]  degenerate groups still count in the batch statistics
    return torch.where(g.valid & ~g.degenerate(r), adv, torch.zeros_like(adv))  # [N]


@ADVANTAGES.register("opo")
def opo(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    if lengths is None:
        raise ValueError("advantage 'opo' needs `lengths` (completion lengths in tokens, Long[N])")
    if lengths.shape != r.shape:
        raise ValueError(f"lengths must have shape {tuple(r.shape)}, got {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError("lengths must be >= 0")
    w = lengths.to(device=r.device, dtype=r.dtype)  # [N]
    wsum = g.sum(w)  # [N]
    base = torch.where(wsum > 0, g.sum(w * r) / wsum.clamp(min=1e-30), g.mean(r))  # [N]
    keep = g.valid & ~g.degenerate(r)  # [N]
    return torch.where(keep, r - base, torch.zeros_like(r))  # [N]


@ADVANTAGES.register("gpg")
def gpg(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    n_valid = g.valid.sum()  # scalar
    n_nonzero = (g.valid & (r != 0)).sum().clamp(min=1)  # scalar
    return g.centered(r) * (n_valid / n_nonzero).to(r.dtype)  # [N]


@ADVANTAGES.register("grpo_passk")
def grpo_passk(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    idx = torch.arange(r.numel(), device=r.device)  # [N]
    r_max = g.reduce(r, "amax", float("-inf"))  # [N]
    is_top = g.valid & (r == r_max)  # [N]
    # ties -> the first index: the smallest index among the group's top scorers.
    first = torch.where(is_top, idx, torch.full_like(idx, r.numel()))  # [N]
    best_idx = torch.full((g.k,), r.numel(), device=r.device).scatter_reduce(
        0, g.inv, first, reduce="amin", include_self=True
    )[g.inv]  # [N]
    is_best = idx == best_idx  # [N]
    r_second = g.with_valid(g.valid & ~is_best).reduce(r, "amax", float("-inf"))  # [N]
    keep = is_best & ~g.degenerate(r)  # [N]  a tie at the top gives gap 0 anyway
    gap = torch.where(keep, r_max - r_second, torch.zeros_like(r))  # [N]
    return _divide_by_std(gap, r, g, scale, eps)  # [N]


@ADVANTAGES.register("tpo")
def tpo(r: Tensor, g: Groups, *, scale: str, eps: float, lengths: Tensor | None) -> Tensor:
    c = g.centered(r)  # [N] exactly 0 in degenerate groups (zero variance, fewer than 2 valid)
    pop_std = (g.sum(c * c) / g.count(r.dtype).clamp(min=1)).sqrt()  # [N] population std
    return torch.where(c != 0, c / pop_std.clamp(min=torch.finfo(r.dtype).tiny), c)  # [N]


# ----------------------------------------------------------------------------- entry point


def _as_reward_dict(rewards: Tensor | dict[str, Tensor]) -> dict[str, Tensor]:
    if isinstance(rewards, Tensor):
        return {"reward": rewards}
    if not isinstance(rewards, dict) or not rewards:
        raise ValueError(
            "rewards must be a Float[N] tensor or a non-empty dict of Float[N] tensors"
        )
    return rewards


def _stack(
    rewards: dict[str, Tensor], weights: dict[str, float] | None, n: int
) -> tuple[Tensor, Tensor]:
    """-> (r [K, N] float64 with NaN = missing, w [K, 1])."""
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(rewards))
    if unknown:
        raise ValueError(f"weights name unknown rewards {unknown}: rewards are {sorted(rewards)}")
    rows = []
    for key, value in rewards.items():
        if value.shape != (n,):
            raise ValueError(f"reward {key!r} must have shape ({n},), got {tuple(value.shape)}")
        if torch.isinf(value).any():
            raise ValueError(f"reward {key!r} contains +-inf; use NaN for 'no reward'")
        rows.append(value.to(torch.float64))
    r = torch.stack(rows)  # [K, N]
    w = torch.tensor([float(weights.get(k, 1.0)) for k in rewards], dtype=torch.float64)  # [K]
    return r, w.to(r.device)[:, None]  # [K, N], [K, 1]


def compute_advantages(
    name: AdvantageName,
    rewards: Tensor | dict[str, Tensor],
    group_ids: Tensor,
    *,
    weights: dict[str, float] | None = None,
    reward_aggregation: RewardAggregation = "sum_then_normalize",
    lengths: Tensor | None = None,
    scale: Scale = "group",
    eps: float = 1e-4,
    **options: object,
) -> Tensor:
    """One advantage per sample, Float[N] (dtype of the rewards, float32 for integer rewards).

    See the module docstring for every estimator and edge case. `options` go to the estimator.
    """
    estimator = ADVANTAGES[name]
    _check_scale(scale)
    if isinstance(rewards, Tensor) and weights:
        raise ValueError("`weights` need rewards given as a dict of named Float[N] tensors")
    reward_dict = _as_reward_dict(rewards)
    first = next(iter(reward_dict.values()))
    out_dtype = first.dtype if first.is_floating_point() else torch.float32
    n = group_ids.shape[0]
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be Long[N], got shape {tuple(group_ids.shape)}")
    r, w = _stack(reward_dict, weights, n)  # [K, N], [K, 1]
    valid = ~torch.isnan(r).all(0)  # [N]  a sample with every reward missing is missing
    g = Groups.from_ids(group_ids.to(r.device), valid)

    if reward_aggregation == "sum_then_normalize":
        total = torch.nansum(r * w, dim=0)  # [N]  NaN entries skipped
        adv = estimator(total, g, scale=scale, eps=eps, lengths=lengths, **options)  # [N]
    elif reward_aggregation == "normalize_then_sum":
        if name != "grpo" or scale != "group":
            raise ValueError(
                "reward_aggregation 'normalize_then_sum' (GDPO) defines the whole advantage: use "
                f"advantage 'grpo' with scale 'group', got advantage {name!r} with scale {scale!r}"
            )
        z = []
        for row in r:  # K is small (a few reward functions); each row is vectorised
            gk, x = g.with_valid(~torch.isnan(row)), torch.nan_to_num(row)  # x: [N]
            z.append(gk.centered(x) / (gk.std(x) + eps))  # [N]
        z = torch.stack(z)  # [K, N]  0 where the reward is missing or its group degenerate
        total = (z * w).sum(0)  # [N]
        signal = (z != 0).any(0) & valid  # [N]  all-degenerate samples stay exactly 0
        adv = torch.where(signal, whiten(total, valid, eps), torch.zeros_like(total))  # [N]
    else:
        raise ValueError(
            f"unknown reward_aggregation {reward_aggregation!r}: allowed are "
            "normalize_then_sum, sum_then_normalize"
        )
    adv = torch.where(valid, adv, torch.zeros_like(adv))  # [N]  missing rewards -> exactly 0
    return adv.to(out_dtype)  # [N]
