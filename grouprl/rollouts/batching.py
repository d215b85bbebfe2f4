"""How one rollout batch is cut into minibatches (optimizer updates) and micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from grouprl.types import Rollout


def split_batch(rollout: Rollout, minibatches: int, micro_size: int | None, *, whole_groups: bool):
    """Yield (minibatch indices, [micro-batch indices]) for one epoch in a random order.

    Exactly `minibatches` near-equal parts, also for a partial dynamic-sampling batch. With
    whole_groups the shuffled units are groups, so no group is ever split across micro-batches.
    """
    if whole_groups:
        ids = torch.unique(rollout.group_ids)  # [B]
        units = [
            (rollout.group_ids == g).nonzero().squeeze(1) for g in ids[torch.randperm(len(ids))]
        ]
    else:
        units = list(torch.randperm(len(rollout)).unsqueeze(1))  # one sample per unit
    for part in chunks(units, min(minibatches, len(units))):
        yield torch.cat(part), fill_micro_batches(part, micro_size)


def fill_micro_batches(units: list[torch.Tensor], size: int | None) -> list[torch.Tensor]:
    """Micro-batches of whole units (index tensors), in order, up to `size` samples each
    (None: all in one); no units, no micro-batches."""
    if not units:
        return []
    if size is None:
        return [torch.cat(units)]
    out, current = [], []
    for unit in units:
        if current and sum(len(u) for u in current) + len(unit) > size:
            out.append(torch.cat(current))
            current = []
        current.append(unit)
    out.append(torch.cat(current))
    return out


def chunks(items: list, k: int) -> list[list]:
    """k contiguous near-equal chunks (the first ones one longer), like torch.tensor_split."""
    n, out, start = len(items), [], 0
    for i in range(k):
        end = start + n // k + (1 if i < n % k else 0)
        out.append(items[start:end])
        start = end
    return out


def single_pass(cfg: Any) -> bool:
    """One epoch over one minibatch, sampled by the weights being trained (train.async_mode off):
    pi_old is then the current weights, so the update takes the detached scores of its own forward
    as old_logp (one forward per micro-batch instead of two) and keeps them on the rollout.
    Under one_step_off the batch was sampled by the previous weights: never single-pass. Under
    bounded async the current weights are the proximal policy (decoupled PPO), so the update's own
    forward is pi_old too (the behaviour policy is engine_logp)."""
    a = cfg.algorithm
    return a.epochs == 1 and a.minibatches == 1 and cfg.train.async_mode in ("off", "bounded")


def recompute_old(cfg: Any) -> bool:
    """prepare() scores old_logp with the current weights before the first update: rollout.old_logp
    'recompute' over several updates of one batch. Not in a single pass (the update's own forward
    gives them), nor under one_step_off (the worker scored the batch with the weights that sampled
    it, before the current ones moved on). Under bounded async prepare scores the proximal policy
    (runtime/bounded_async.py)."""
    return (
        cfg.rollout.old_logp == "recompute"
        and cfg.train.async_mode in ("off", "bounded")
        and not single_pass(cfg)
    )
