"""Credit assignment for multi-turn agents: per-turn advantages broadcast to each turn's tokens.

GiGPO, Group-in-Group Policy Optimization, arXiv 2505.10978 (METHODS.md section 11):
  episode advantage  A^E_i = (R_i - mean_g R) / (std_g R + eps)   ("mean_std_norm")
                          or  R_i - mean_g R                       ("mean_norm")
  step returns       R^i_t = sum_{k>=t} gamma^(k-t) r^i_k          (discounted, per trajectory)
  step groups        within one episode group, every (trajectory i, turn t) whose anchor state is the
                     same forms one step group (anchor = exact state key from the env)
  step advantage     A^S_{i,t} = (R^i_t - mean_S) / (std_S + eps)  (or mean-only), over the step group
  combined           A_{i,t} = A^E_i + omega * A^S_{i,t}, the same for every token of turn t
Defaults (GAMMA, OMEGA, ADV_EPS, NORM below, the one declaration): omega = 1.0, gamma = 0.95,
eps = 1e-6, norm = "mean_std_norm" (the ALFWorld recipe; the verl-agent function default is
"mean_norm").

Credit modes (`CREDIT` registry, `agent_advantages` is the entry point):
  "trajectory"  A^E_i on every agent token of trajectory i (GRPO on episode returns; StarPO's GRPO).
  "turn"        discounted per-turn returns R^i_t normalised over ALL valid (trajectory, turn) pairs
                of the episode group, as if every turn shared one anchor: turn t is credited only
                with the rewards from t on (our definition; no anchor states needed).
  "gigpo"       A^E_i + omega * A^S_{i,t} (above).
StarPO-S (RAGEN, arXiv 2504.20073): `keep_top_groups_by_std` keeps the groups with the most
return spread.

Layout: step_rewards Float[N, K] (K = max turns) hold NaN after each episode ended; per-turn outputs
keep that NaN tail; `broadcast_to_tokens` maps them onto tokens with step_ids Long[N, T] (-1 = not an
agent token -> advantage 0) and refuses to read a NaN turn.

Deviations from verl-agent (`gigpo/core_gigpo.py`), each on purpose:
  - one sample per trajectory (token-in/token-out whole trajectories), so the episode statistics
    count each trajectory once (verl-agent, by default, counts one row per step);
  - a degenerate group (one member, or all values equal) gives exactly 0 for every member, as in
    `objectives.advantages` (verl-agent gives a lone member mean 0 / std 1, i.e. its raw return);
    singleton step groups give 0 in both;
  - anchors match exactly (hashable keys); the optional text-similarity grouping is not implemented;
  - keep_top_groups_by_std keeps at least one group (RAGEN's int(ratio * groups) may keep none) and
    breaks ties by the order groups first appear.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal

import torch
from torch import Tensor

from grouprl.objectives.advantages import compute_advantages
from grouprl.objectives.registry import Registry

Norm = Literal["mean_std_norm", "mean_norm"]
CreditMode = Literal["trajectory", "turn", "gigpo"]
_SCALE = {"mean_std_norm": "group", "mean_norm": "none"}  # norm -> advantages.py scale

CREDIT = Registry("agent credit mode")

# The defaults of every function here (module docstring); the agent config should read them too.
GAMMA = 0.95  # discount of the per-turn returns
OMEGA = 1.0  # weight of the step advantage
ADV_EPS = 1e-6  # added to the std in the episode / step normalisation
NORM: Norm = "mean_std_norm"


def _check_step_rewards(step_rewards: Tensor) -> Tensor:
    """Bool[N, K] of valid turns; NaN must only form a tail (after the episode ended), no inf."""
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must be Float[N, K], got shape {tuple(step_rewards.shape)}")
    if torch.isinf(step_rewards).any():
        raise ValueError("step_rewards contain +-inf")
    valid = ~torch.isnan(step_rewards)  # [N, K]
    # a valid turn after a NaN one means a hole, not a tail: the valid count must equal the prefix
    prefix = valid.to(torch.long).cumprod(dim=1)  # [N, K] 1 while the row is still valid
    if (prefix.sum(1) != valid.sum(1)).any():
        rows = torch.nonzero(prefix.sum(1) != valid.sum(1)).flatten().tolist()
        raise ValueError(
            f"step_rewards rows {rows} have NaN before a valid turn (NaN only after the end)"
        )
    return valid  # [N, K]


def _scale(norm: str) -> str:
    if norm not in _SCALE:
        raise ValueError(f"unknown normalisation {norm!r}: allowed are {', '.join(_SCALE)}")
    return _SCALE[norm]


def discounted_returns(step_rewards: Tensor, gamma: float = GAMMA) -> Tensor:
    """R_t = sum_{k>=t} gamma^(k-t) r_k per trajectory -> Float[N, K]; NaN stays NaN after the end."""
    valid = _check_step_rewards(step_rewards)  # [N, K]
    r = torch.where(valid, step_rewards, torch.zeros_like(step_rewards))  # [N, K] NaN -> 0
    out = torch.zeros_like(r)  # [N, K]
    running = torch.zeros_like(r[:, 0])  # [N]
    for t in range(r.shape[1] - 1, -1, -1):  # K is small (max turns), the loop is over turns only
        running = r[:, t] + gamma * running  # [N]
        out[:, t] = running
    return torch.where(valid, out, torch.full_like(out, float("nan")))  # [N, K]


def episode_advantages(
    returns: Tensor, group_ids: Tensor, mode: Norm = NORM, eps: float = ADV_EPS
) -> Tensor:
    """A^E = (R - mean_g) / (sample std_g + eps), or R - mean_g -> Float[N]; degenerate groups 0."""
    return compute_advantages("grpo", returns, group_ids, scale=_scale(mode), eps=eps)  # [N]


def _hashable(key: Any) -> Hashable:
    """Anchor -> hashable key: lists/tuples/arrays/tensors -> tuples, dicts -> sorted item tuples."""
    if isinstance(key, Tensor) or type(key).__module__ == "numpy":
        if getattr(key, "ndim", 0) == 0:
            return key.item()
        return (tuple(key.shape), tuple(key.reshape(-1).tolist()))
    if isinstance(key, list | tuple):
        return tuple(_hashable(k) for k in key)
    if isinstance(key, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in key.items()))
    if isinstance(key, set):
        return frozenset(key)
    hash(key)  # anything else must be hashable already (raises TypeError otherwise)
    return key


def _grouped_normalise(values: Tensor, keys: list[Hashable], mode: Norm, eps: float) -> Tensor:
    """Group-relative normalisation of a flat list of values by arbitrary hashable group keys."""
    dense: dict[Hashable, int] = {}
    ids = torch.tensor([dense.setdefault(k, len(dense)) for k in keys], dtype=torch.long)  # [M]
    return compute_advantages("grpo", values, ids, scale=_scale(mode), eps=eps)  # [M]


def step_advantages(
    step_returns: Tensor,
    anchor_keys: list[list[Any]],
    group_ids: Tensor,
    mode: Norm = NORM,
    eps: float = ADV_EPS,
) -> Tensor:
    """A^S over anchor step groups -> Float[N, K] (NaN after the end; singleton step groups 0).

    anchor_keys[i] lists the anchor of every turn trajectory i played (len = its valid turns).
    """
    valid = _check_step_rewards(step_returns)  # [N, K]
    n = step_returns.shape[0]
    if len(anchor_keys) != n or group_ids.shape != (n,):
        raise ValueError(
            f"need one anchor list and one group id per trajectory: N={n}, "
            f"{len(anchor_keys)} anchor lists, group_ids shape {tuple(group_ids.shape)}"
        )
    counts = valid.sum(1).tolist()  # [N] turns played per trajectory
    keys = []
    for i, (anchors, c) in enumerate(zip(anchor_keys, counts)):
        if len(anchors) != c:
            raise ValueError(f"trajectory {i}: {len(anchors)} anchors but {c} valid turns")
        try:
            keys += [(int(group_ids[i]), _hashable(a)) for a in anchors]
        except TypeError as e:
            raise TypeError(f"trajectory {i}: anchor is not hashable ({e})") from e
    flat = step_returns[valid]  # [M] row-major, the same order as `keys`
    out = torch.full_like(step_returns, float("nan"))  # [N, K]
    out[valid] = _grouped_normalise(flat, keys, mode, eps) if keys else flat  # [M]
    return out  # [N, K]


def gigpo_advantages(
    episode_returns: Tensor,
    step_rewards: Tensor,
    anchor_keys: list[list[Any]],
    group_ids: Tensor,
    *,
    gamma: float = GAMMA,
    omega: float = OMEGA,
    norm: Norm = NORM,
    eps: float = ADV_EPS,
) -> Tensor:
    """A^E[:, None] + omega * A^S -> Float[N, K] (NaN after the end)."""
    a_e = episode_advantages(episode_returns, group_ids, norm, eps)  # [N]
    a_s = step_advantages(
        discounted_returns(step_rewards, gamma), anchor_keys, group_ids, norm, eps
    )
    return a_e.to(a_s.dtype)[:, None] + omega * a_s  # [N, K]


def broadcast_to_tokens(per_turn: Tensor, step_ids: Tensor) -> Tensor:
    """Token advantages Float[N, T]: per_turn[i, step_ids[i, j]], 0 where step_ids is -1."""
    if per_turn.dim() != 2 or step_ids.dim() != 2 or per_turn.shape[0] != step_ids.shape[0]:
        raise ValueError(
            f"per_turn [N, K] and step_ids [N, T] disagree: {tuple(per_turn.shape)} vs "
            f"{tuple(step_ids.shape)}"
        )
    if step_ids.numel() and (step_ids.min() < -1 or step_ids.max() >= per_turn.shape[1]):
        raise ValueError(
            f"step_ids must lie in [-1, {per_turn.shape[1] - 1}] (K = {per_turn.shape[1]})"
        )
    agent = step_ids >= 0  # [N, T]
    vals = per_turn.gather(1, step_ids.clamp(min=0).long())  # [N, T]
    if torch.isnan(vals[agent]).any():
        raise ValueError(
            "a token belongs to a turn with no advantage (NaN): step_ids and step_rewards disagree"
        )
    return torch.where(agent, vals, torch.zeros_like(vals))  # [N, T]


# ----------------------------------------------------------------------------- credit modes
# Each: fn(returns [N], step_rewards [N, K], anchor_keys, group_ids [N], *, gamma, omega, norm, eps)
# -> per-turn advantages Float[N, K] with NaN after the end.


@CREDIT.register("trajectory")
def _trajectory(returns, step_rewards, anchor_keys, group_ids, *, gamma, omega, norm, eps):
    valid = _check_step_rewards(step_rewards)  # [N, K]
    a_e = episode_advantages(returns, group_ids, norm, eps).to(step_rewards.dtype)  # [N]
    return torch.where(valid, a_e[:, None], torch.full_like(step_rewards, float("nan")))  # [N, K]


@CREDIT.register("turn")
def _turn(returns, step_rewards, anchor_keys, group_ids, *, gamma, omega, norm, eps):
    same = [[None] * int(c) for c in _check_step_rewards(step_rewards).sum(1).tolist()]
    return step_advantages(discounted_returns(step_rewards, gamma), same, group_ids, norm, eps)


@CREDIT.register("gigpo")
def _gigpo(returns, step_rewards, anchor_keys, group_ids, *, gamma, omega, norm, eps):
    if anchor_keys is None:
        raise ValueError(
            "credit mode 'gigpo' needs anchor_keys (one anchor per turn per trajectory)"
        )
    return gigpo_advantages(
        returns, step_rewards, anchor_keys, group_ids, gamma=gamma, omega=omega, norm=norm, eps=eps
    )


def agent_advantages(
    mode: CreditMode,
    rewards_return: Tensor,
    step_rewards: Tensor,
    step_ids: Tensor,
    anchor_keys: list[list[Any]] | None,
    group_ids: Tensor,
    *,
    gamma: float = GAMMA,
    omega: float = OMEGA,
    norm: Norm = NORM,
    eps: float = ADV_EPS,
) -> Tensor:
    """Token advantages Float[N, T] for a multi-turn Rollout (0 on env / padding tokens)."""
    fn = CREDIT[mode]
    per_turn = fn(
        rewards_return,
        step_rewards,
        anchor_keys,
        group_ids,
        gamma=gamma,
        omega=omega,
        norm=norm,
        eps=eps,
    )  # [N, K]
    return broadcast_to_tokens(per_turn, step_ids)  # [N, T]


def keep_top_groups_by_std(returns: Tensor, group_ids: Tensor, keep_frac: float = 0.25) -> Tensor:
    """StarPO-S filter: Bool[N], True for members of the max(1, floor(keep_frac * G)) groups with the
    largest sample std of returns (NaN returns ignored; ties -> the group seen first is kept)."""
    if not 0.0 < keep_frac <= 1.0:
        raise ValueError(f"keep_frac must be in (0, 1], got {keep_frac}")
    uniq, first, inv = _first_seen_groups(group_ids)  # [G], [G], [N]
    r = returns.to(torch.float64)  # [N]
    valid = ~torch.isnan(r)  # [N]
    members = [r[(inv == g) & valid] for g in range(uniq.numel())]  # G is small: groups per batch
    stds = torch.stack([m.std() if m.numel() > 1 else r.new_zeros(()) for m in members])  # [G]
    order = torch.argsort(first)  # [G] groups in order of first appearance
    ranked = order[torch.sort(stds[order], descending=True, stable=True).indices]  # [G]
    k = max(1, int(keep_frac * uniq.numel()))
    keep_group = torch.zeros(uniq.numel(), dtype=torch.bool)  # [G]
    keep_group[ranked[:k]] = True
    return keep_group[inv]  # [N]


def _first_seen_groups(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (unique ids [G], index of each group's first member [G], dense group of each sample [N])."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # [G], [N]
    idx = torch.arange(inv.numel())  # [N]
    first = torch.full((uniq.numel(),), inv.numel(), dtype=torch.long).scatter_reduce(
        0, inv, idx, reduce="amin", include_self=True
    )  # [G]
    return uniq, first, inv
