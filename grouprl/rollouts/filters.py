"""Which sampled groups to train on: DAPO's zero-variance filter (dynamic sampling, arXiv 2503.14476).

A group whose valid rewards are all equal has advantage 0 under every group-relative estimator, so
it only dilutes the batch. Dynamic sampling drops such groups and samples more prompts until the
batch is full or a cap on generation rounds is reached (then it trains on what it has).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from grouprl.types import Rollout


def combined_reward(rewards: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """Weighted sum of the named rewards per sample, Float[N]; NaN where every reward is NaN."""
    stacked = torch.stack([rewards[k] * weights.get(k, 1.0) for k in rewards])  # [K, N]
    total = torch.nansum(stacked, 0)  # [N]
    return total.masked_fill(torch.isnan(stacked).all(0), math.nan)  # [N]


def informative_groups(reward: Tensor, group_ids: Tensor) -> Tensor:
    """Bool[N]: True for samples whose group's valid rewards are not all equal.

    A group with one valid sample carries no contrast either and is dropped too (DAPO keeps single-
    sample groups only when G = 1, which config refuses for group-relative estimators).
    """
    valid = ~torch.isnan(reward)  # [N]
    keep = torch.zeros_like(valid)
    for g in torch.unique(group_ids):  # few groups per step; clarity over vectorisation
        rows = (group_ids == g) & valid  # [N]
        values = reward[rows]
        keep |= (group_ids == g) & bool(values.numel() > 1 and (values != values[0]).any())
    return keep


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts along N, right-padding every [N, T] tensor to the widest T."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.mask.shape[1] for p in parts)

    def pad(t: Tensor | None) -> Tensor | None:
        if t is None or t.dim() < 2:
            return t
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))  # [n, width]

    def cat(values: list) -> object:
        if values[0] is None:
            return None
        if isinstance(values[0], Tensor):
            return torch.cat([pad(v) if v.dim() == 2 else v for v in values])
        if isinstance(values[0], list):
            return [x for v in values for x in v]
        if isinstance(values[0], dict):
            return {k: cat([v[k] for v in values]) for k in values[0]}
        return type(values[0]).cat(values)  # policy payloads (TokenBatch) know how to join

    names = [f for f in Rollout.__dataclass_fields__]
    return Rollout(**{f: cat([getattr(p, f) for p in parts]) for f in names})


def sample_until_full(
    sample_round: Callable[[int], Rollout],
    weights: dict[str, float],
    groups_wanted: int,
    max_rounds: int,
) -> tuple[Rollout | None, dict[str, float]]:
    """Call `sample_round(round_index)` until `groups_wanted` informative groups are collected.

    Returns the kept rollout truncated to `groups_wanted` groups (None if no group was kept) and
    metrics: rounds used, fraction of groups kept.
    """
    kept: list[Rollout] = []
    n_kept = n_seen = 0
    rounds = 0
    while n_kept < groups_wanted and rounds < max_rounds:
        part = sample_round(rounds)
        rounds += 1
        keep = informative_groups(combined_reward(part.rewards, weights), part.group_ids)  # [N]
        n_seen += len(torch.unique(part.group_ids))
        if keep.any():
            part = part.select(keep.nonzero().squeeze(1))
            kept.append(part)
            n_kept += len(torch.unique(part.group_ids))
    metrics = {"dynamic/rounds": float(rounds), "dynamic/kept_frac": n_kept / max(n_seen, 1)}
    if not kept:
        return None, metrics
    out = cat_rollouts(kept)
    ids = torch.unique_consecutive(out.group_ids)[:groups_wanted]  # groups are stored contiguously
    return out.select(torch.isin(out.group_ids, ids).nonzero().squeeze(1)), metrics
