"""Pruning a tree rollout's rows out of the loss (BranchGRPO, arXiv 2509.06040: "pruning cuts
gradient computation while forward exploration is unchanged").

prune_rows(rewards [N], group_ids [N], fraction) -> Bool[N]: in each group (one tree), the
floor(fraction * G) rows with the lowest reward (NaN counts as lowest; ties: the earlier row first,
a stable ascending sort). The caller masks those rows' step slots out of the loss (their gradient
is exactly 0); the rewards and advantages of the tree are computed from every row before pruning.
The images workload leaves rows with no trained slot out of the micro-batch's forward and
backward pass (workloads/images/loss.py), which is the compute BranchGRPO saves.

Deviation / our reading: BranchGRPO prunes branches to cut backward compute; which branches it
drops (by value, by depth) could not be confirmed from its paper here. "Lowest value" = lowest
combined reward of the leaf is our choice, documented in the config option
(rollout.tree.prune_fraction).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def prune_rows(rewards: Tensor, group_ids: Tensor, fraction: float) -> Tensor:
    """Bool[N]: True for the floor(fraction * G) lowest-reward rows of each group of size G."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"rollout.tree.prune_fraction must be in [0, 1), got {fraction}")
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} / "
            f"{tuple(group_ids.shape)}"
        )
    r = torch.nan_to_num(rewards.double().cpu(), nan=-math.inf)  # [N] a failed reward is lowest
    gids = group_ids.cpu()
    pruned = torch.zeros(len(r), dtype=torch.bool)  # [N]
    for g in torch.unique(gids):
        rows = torch.nonzero(gids == g).flatten()  # [G]
        k = math.floor(fraction * len(rows))
        if k:
            order = torch.sort(r[rows], stable=True).indices  # [G] ascending
            pruned[rows[order[:k]]] = True
    return pruned.to(rewards.device)
