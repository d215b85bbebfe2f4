"""Detached per-token multipliers of the policy loss: lambda-GRPO prefix-share scales and EGSW weights.

Both return Float[N, T] (0 on masked slots) computed once over the whole batch (every group complete);
train.py multiplies them together and hands each micro-batch its rows as `token_scales` (objective.py),
where they multiply the per-token policy loss like the engine-IS weights (normalisers unchanged).

lambda-GRPO, "GRPO is secretly a process reward model" (arXiv 2509.21154, METHODS section 1;
official code coli-saar/grpo-prm). s_{i,t} = 1 / k_{i,t}, k_{i,t} = number of members j of i's group
whose token prefix o_{j,1..t} equals o_{i,1..t} (i included; identical sequences count with their
multiplicity). The scales are not renormalised (as in the official code).
  Reading of "prefix" for padded tensors: slot t of a row is the pair (token id, mask bit), so right
  padding never matches a real token even when the pad id equals a token id, and masked slots in the
  middle of a row (an agent's environment tokens) are still part of the prefix, as they are of the
  trajectory. The prompt is shared by the group, so the group id stands for it.
  Cost: one torch.unique over [N] per position, stopping at the first position where every row is
  alone in its class (from there on k = 1). Measured on 2 busy CPU cores, N = 512, T = 1024, groups
  of 8, ragged lengths: ~20-40 ms when the groups share a 20-token start and then differ (mostly the
  full-tensor passes); ~0.13-0.2 s in the worst case, every member of every group identical (no early
  stop: 1024 unique() calls).

EGSW, Entropy-Guided Sequence Weighting (arXiv 2503.22456, METHODS section 3, PARTIALLY UNCONFIRMED:
no official code; the weight formula comes from a third-party summary). w_{i,t} = G * softmax over the
group of (A_{i,t} + alpha * H_{i,t}) / P. The [inferred] choices of METHODS are implemented as stated:
  (a) the weight is a detached multiplier of the per-token surrogate (hence Float[N, T] here);
  (b) "sequence": H_i = masked mean_t H_{i,t}, A_i = masked mean_t A_{i,t}, one weight per row;
  (c) "token": at each position t the softmax runs over the members that have a valid token at t;
  (d) the softmax is multiplied by the number of members it ran over (G when all take part), so the
      weights average 1 over them and the loss keeps GRPO's scale. Under (c) that number is the
      count at t, not G: a position only one member reaches gets weight 1, not G.
  Rows without a valid token take no part and get 0. Defaults alpha = 0.1, P = 1.0 are OUR choice
  [unconfirmed]: the paper's values could not be read. alpha = 0 gives pure advantage weighting.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grouprl.objectives.registry import Registry

TOKEN_SCALES = Registry("token scale")
EGSW_MODES = Registry("egsw mode")
EGSW_ALPHA = 0.1  # [unconfirmed] default entropy coefficient alpha
EGSW_TEMPERATURE = 1.0  # [unconfirmed] default softmax temperature P


def _check_rows(name: str, mask: Tensor, group_ids: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"{name}: mask must be Bool[N, T], got {mask.dtype} {tuple(mask.shape)}")
    if group_ids.shape != mask.shape[:1]:
        raise ValueError(
            f"{name}: group_ids must be [N] = {tuple(mask.shape[:1])}, got {tuple(group_ids.shape)}"
        )
    for key, value in tensors.items():
        if value.shape != mask.shape and not (
            key == "advantages" and value.shape == mask.shape[:1]
        ):
            raise ValueError(
                f"{name}: {key} must be [N, T] = {tuple(mask.shape)}, got {tuple(value.shape)}"
            )


# ----------------------------------------------------------------------------- lambda-GRPO


@TOKEN_SCALES.register("none")
def no_token_scales(token_ids: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """Plain GRPO: 1 on every valid slot, 0 elsewhere -> Float[N, T]."""
    _check_rows("token_scale 'none'", mask, group_ids, token_ids=token_ids)
    return mask.float()  # [N, T]


@TOKEN_SCALES.register("prefix_share")
def prefix_share_scales(token_ids: Tensor, mask: Tensor, group_ids: Tensor) -> Tensor:
    """lambda-GRPO scales s = 1/k (module docstring): token_ids Long[N, T], mask Bool[N, T],
    group_ids Long[N] -> Float[N, T], 0 on masked slots."""
    _check_rows("prefix_share_scales", mask, group_ids, token_ids=token_ids)
    n, t = mask.shape
    if n == 0 or t == 0:
        return torch.zeros(n, t, device=mask.device)  # [N, T]
    lo = int(token_ids.min())
    width = 2 * (int(token_ids.max()) - lo + 1)  # distinct (token, mask bit) values
    # cls[i] = class of row i's prefix so far; rows share a class iff same group and same prefix.
    cls = torch.unique(group_ids, return_inverse=True)[1]  # [N] the empty prefix: the group
    cols: list[Tensor] = []
    for j in range(t):
        slot = (token_ids[:, j].long() - lo) * 2 + mask[:, j].long()  # [N] (token, mask bit)
        key = cls * width + slot  # [N] (class, slot) as one integer, < N * width
        _, cls, counts = torch.unique(key, return_inverse=True, return_counts=True)  # [N], [C]
        cols.append(1.0 / counts[cls].float())  # [N]
        if counts.max() == 1:  # every prefix is unique: k stays 1 for the rest of each row
            break
    scales = mask.float()  # [N, T] 1 on valid slots, 0 on masked ones
    scales[:, : len(cols)] *= torch.stack(cols, dim=1)  # [N, j+1]
    return scales  # [N, T]


# ----------------------------------------------------------------------------- EGSW


def _group_softmax_times_count(logits: Tensor, valid: Tensor, group_ids: Tensor) -> Tensor:
    """Per column: softmax of logits [N, C] over the valid rows of each group, times the number of
    those rows; 0 on invalid rows -> [N, C]."""
    inv = torch.unique(group_ids, return_inverse=True)[1]  # [N] dense group index
    k = int(inv.max()) + 1 if inv.numel() else 0
    idx = inv[:, None].expand_as(logits)  # [N, C]
    x = logits.masked_fill(~valid, float("-inf"))  # [N, C]
    top = torch.full((k, logits.shape[1]), float("-inf"), dtype=x.dtype, device=x.device)  # [K, C]
    top = top.scatter_reduce(0, idx, x, reduce="amax", include_self=True)  # [K, C]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # [K, C] empty -> 0
    e = (x - top[inv]).exp()  # [N, C], 0 on invalid rows
    zeros = torch.zeros(k, logits.shape[1], dtype=x.dtype, device=x.device)  # [K, C]
    total = zeros.index_add(0, inv, e)  # [K, C]
    count = zeros.index_add(0, inv, valid.to(x.dtype))  # [K, C]
    w = e / total[inv].clamp(min=torch.finfo(x.dtype).tiny) * count[inv]  # [N, C]
    return w.masked_fill(~valid, 0.0)  # [N, C]


@EGSW_MODES.register("off")
def egsw_off(advantages, entropy, mask, group_ids, *, alpha, temperature) -> Tensor:
    """Plain GRPO: 1 on every valid slot -> Float[N, T]."""
    return mask.float()  # [N, T]


@EGSW_MODES.register("sequence")
def egsw_sequence(advantages, entropy, mask, group_ids, *, alpha, temperature) -> Tensor:
    """Trajectory-wise EGSW, choice (b): one weight per row, broadcast to its valid slots."""
    lengths = mask.sum(-1).clamp(min=1)  # [N]
    adv = advantages.masked_fill(~mask, 0.0).sum(-1) / lengths  # [N]
    ent = entropy.masked_fill(~mask, 0.0).sum(-1) / lengths  # [N] mean token entropy H_i
    logits = ((adv + alpha * ent) / temperature)[:, None]  # [N, 1]
    w = _group_softmax_times_count(logits, mask.any(-1, keepdim=True), group_ids)  # [N, 1]
    return w.expand_as(mask).masked_fill(~mask, 0.0)  # [N, T]


@EGSW_MODES.register("token")
def egsw_token(advantages, entropy, mask, group_ids, *, alpha, temperature) -> Tensor:
    """Step-wise EGSW, choice (c): per position, over the members that have a valid token there."""
    logits = (advantages + alpha * entropy) / temperature  # [N, T]
    return _group_softmax_times_count(logits, mask, group_ids)  # [N, T]


def egsw_weights(
    advantages: Tensor,
    entropy: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    alpha: float = EGSW_ALPHA,
    temperature: float = EGSW_TEMPERATURE,
    level: str = "sequence",
) -> Tensor:
    """EGSW weights (module docstring), detached Float[N, T]: advantages [N] or [N, T], entropy
    [N, T], mask Bool[N, T], group_ids [N]; level 'off' | 'sequence' | 'token'."""
    fn = EGSW_MODES[level]
    _check_rows("egsw_weights", mask, group_ids, advantages=advantages, entropy=entropy)
    if not temperature > 0:
        raise ValueError(f"egsw temperature P must be > 0, got {temperature!r}")
    with torch.no_grad():
        dtype = torch.promote_types(entropy.dtype, torch.float32)
        adv = advantages.detach().to(dtype)  # [N] or [N, T]
        adv = adv[:, None].expand_as(mask) if adv.dim() == 1 else adv  # [N, T]
        adv = adv.masked_fill(~mask, 0.0)  # [N, T] padding may hold NaN
        ent = entropy.detach().to(dtype).masked_fill(~mask, 0.0)  # [N, T]
        return fn(adv, ent, mask, group_ids, alpha=alpha, temperature=temperature)  # [N, T]
