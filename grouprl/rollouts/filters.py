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


def failed_groups(reward: Tensor, group_ids: Tensor, threshold: float) -> list[int]:
    """Ids of the groups (in batch order) in which no valid sample passes (reward >= threshold)
    and at least one sample is valid: the all-fail groups, which carry no gradient. A group whose
    rewards all failed (NaN) is left out: a hint or a replay cannot give it a reward."""
    out = []
    for g in torch.unique_consecutive(group_ids).tolist():  # groups are stored contiguously
        values = reward[group_ids == g]  # [G]
        valid = values[~torch.isnan(values)]
        if valid.numel() and bool((valid < threshold).all()):
            out.append(int(g))
    return out


def splice_rows(rollout: Rollout, keep: Tensor, extra: Rollout) -> Rollout:
    """The rows `keep` (Bool[N]) of `rollout` plus the rows of `extra`, each group's rows
    consecutive again, groups in the batch's order, within a group the kept rows first. Every
    group id of `extra` must be one of the batch's."""
    order = torch.unique_consecutive(rollout.group_ids)  # [B] group ids in batch order
    merged = cat_rollouts([rollout.select(keep.nonzero().squeeze(1)), extra])
    position = (merged.group_ids[:, None] == order[None, :]).long().argmax(1)  # [N'] group index
    if not bool((merged.group_ids == order[position]).all()):
        raise ValueError("splice_rows: extra rows of a group that is not in the batch")
    return merged.select(torch.sort(position, stable=True).indices)


# per-token fields [n, T] and their padding; every other 2-D field (step_rewards [n, max_turns])
# has the same width in every part and is joined as it is
_TOKEN_FIELDS = {"old_logp": 0.0, "mask": 0, "engine_logp": 0.0, "ref_logp": 0.0, "token_version": -1,
                 "teacher_logp": 0.0, "token_scales": 0.0, "advantages": 0.0, "step_ids": -1,
                 "tree_segment": -1, "tree_path": -1}  # fmt: skip
_OWN_WIDTH = {"tree_path"}  # [n, D+1]: padded to the widest of its own kind, not to T


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """Concatenate rollouts along N: per-token fields right-padded to the widest T with their own
    padding (step_ids -1: no turn), the policy payload (TokenBatch) re-padded by its own `cat`,
    lists and dicts joined."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.mask.shape[1] for p in parts)

    def join(name: str, values: list) -> object:
        first = values[0]
        if first is None:
            return None
        if isinstance(first, Tensor):
            if name in _TOKEN_FIELDS and first.dim() == 2:
                pad = _TOKEN_FIELDS[name]
                w = max(v.shape[1] for v in values) if name in _OWN_WIDTH else width
                values = [torch.nn.functional.pad(v, (0, w - v.shape[1]), value=pad)
                          for v in values]  # fmt: skip  # [n, w]
            return torch.cat(values)
        if isinstance(first, list):
            return [x for v in values for x in v]
        if isinstance(first, dict):
            return {k: join(k, [v[k] for v in values]) for k in first}
        return type(first).cat(values)  # policy payloads (TokenBatch) know how to join

    names = [f for f in Rollout.__dataclass_fields__]
    return Rollout(**{n: join(n, [getattr(p, n) for p in parts]) for n in names})


def sample_until_full(
    sample_round: Callable[[int, int], Rollout],
    weights: dict[str, float],
    groups_wanted: int,
    max_rounds: int,
    resample_size: str = "full",
) -> tuple[Rollout | None, dict[str, float]]:
    """Call `sample_round(round_index, prompts)` until `groups_wanted` informative groups are
    collected. The first round samples groups_wanted prompts; a later one as many again (full,
    DAPO) or, with resample_size "needed", ceil(missing / share of groups kept so far), at most
    groups_wanted (GRESO's adaptive batch size, arXiv 2506.02177: sample what the observed
    zero-variance rate says will fill the batch; a round that keeps too few is followed by more).

    Returns the kept rollout truncated to `groups_wanted` groups (None if no group was kept) and
    metrics: rounds used, fraction of groups kept, prompts sampled.
    """
    kept: list[Rollout] = []
    n_kept = n_seen = 0
    rounds = 0
    while n_kept < groups_wanted and rounds < max_rounds:
        size = groups_wanted
        if rounds and resample_size == "needed" and n_kept:
            size = min(groups_wanted, math.ceil((groups_wanted - n_kept) * n_seen / n_kept))
        part = sample_round(rounds, size)
        rounds += 1
        keep = informative_groups(combined_reward(part.rewards, weights), part.group_ids)  # [N]
        n_seen += len(torch.unique(part.group_ids))
        if keep.any():
            part = part.select(keep.nonzero().squeeze(1))
            kept.append(part)
            n_kept += len(torch.unique(part.group_ids))
    metrics = {"dynamic/rounds": float(rounds), "dynamic/kept_frac": n_kept / max(n_seen, 1),
               "dynamic/prompts": float(n_seen)}  # fmt: skip
    if not kept:
        return None, metrics
    out = cat_rollouts(kept)
    ids = torch.unique_consecutive(out.group_ids)[:groups_wanted]  # groups are stored contiguously
    return out.select(torch.isin(out.group_ids, ids).nonzero().squeeze(1)), metrics
