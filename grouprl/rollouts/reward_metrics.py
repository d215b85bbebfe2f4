"""The logged reward metrics of a batch, one definition for every workload.

`reward/mean` and `reward/std` are over the combined reward (the weighted sum of the named rewards,
filters.combined_reward) of the samples that have one; `reward/<name>` is each named reward's mean
over the samples it scored. A reward that scored no sample (all NaN) logs NaN, never 0: "no reward"
must not read as "reward 0".
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grouprl.objectives.group_stats import batch_std
from grouprl.rollouts.filters import combined_reward


def nanmean_or_nan(x: Tensor) -> float:
    """Mean of x over its non-NaN entries; NaN when every entry is NaN (nothing was scored)."""
    return float(torch.nanmean(x)) if bool((~x.isnan()).any()) else math.nan


def reward_metrics(rewards: dict[str, Tensor], weights: dict[str, float]) -> dict[str, float]:
    """reward/mean, reward/std (combined reward, Float[N]) and reward/<name> for each of `rewards`
    ({name: Float[N]}, NaN = not scored), see the module docstring."""
    total = combined_reward(rewards, weights)  # [N]
    metrics = {
        "reward/mean": float(torch.nanmean(total)),
        "reward/std": float(batch_std(total, ~total.isnan())),
    }
    for k, v in rewards.items():
        metrics[f"reward/{k}"] = nanmean_or_nan(v)
    return metrics
