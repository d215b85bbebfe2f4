"""The loss side of image / video training: what prepare() fills and what one micro-batch's loss is.

prepare (once per rollout, no grad):
- advantages [N] from the shared estimators (objectives.compute_advantages), clipped to
  +-diffusion.adv_clip_max (Flow-GRPO clips them in the loss; clipping once here is the same);
  with rollout.tree (policies/flow/fork.py) and algorithm.tree_advantage other than leaf_group,
  per-step advantages [N, K] from the tree (objectives/tree.py over the K step slots, e.g.
  BranchGRPO's depth-wise advantage), algorithm.tree_scales "shared_segment" as token_scales, and
  rollout.tree.prune_fraction drops the lowest-reward rows of each tree from the loss (their step
  slots masked and the rows left out of the loss's forward / backward: BranchGRPO's pruning cuts
  backward compute, sampling is unchanged; objectives/tree_prune.py);
- policy-gradient objectives: old log-probs and means recomputed when the batch is used more than
  once (epochs / minibatches > 1); the reference's per-step log-probs and means (KL) computed once
  for the whole batch, so every micro-batch reads them instead of running the reference again;
  kl_mode "reward" folds -kl_coef * (mean KL over the trained steps) into the rewards.
micro_loss (one micro-batch, with grad), keyed by diffusion.objective:
- "policy_gradient": objectives.total_loss unchanged, its KL replaced by the policy's mean-space
  Gaussian KL (kl_out = policy.kl(out, ref_out)); with diffusion.objective.ratio_norm "grpo_guard" the
  policy term is objectives.flow_guard.guard_step_loss (RatioNorm + 1/dt, arXiv 2510.22319) scaled
  to the update's global count, plus the same KL term. Per-step ratio diagnostics are logged
  (policies.flow_math.ratio_diagnostics: ratio/step{k}/mean, /std, /clip_frac).
- "diffusion_nft" / "awm" (objectives.LIKELIHOOD_FREE): velocities of the current weights (and old /
  reference / EMA weights without grad) at forward-noised copies x_t = (1 - t) x0 + t eps of the
  final samples, t drawn from the rollout's sigma schedule (objectives.flow_support).
after_update: the old (NFT) / EMA (AWM) weights follow the trained ones, w <- d w + (1 - d) theta,
with d from diffusion.objective.ema_decay at the current training step.

Deviations: AWM's "old" log-likelihood is the current weights' (on-policy, as its code) also when
epochs > 1. With full fine-tuning a resumed run restarts the old / EMA weights from the current ones
(checkpoints keep them only under LoRA, where they are part of the policy's state_dict).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grouprl.objectives import LIKELIHOOD_FREE, compute_advantages, total_loss
from grouprl.objectives.aggregation import AGG_COUNTS, aggregate
from grouprl.objectives.flow.guard import guard_step_loss
from grouprl.objectives.flow.support import (
    EMA_DECAYS,
    likelihood_free_options,
    stratified_timestep_indices,
)
from grouprl.objectives.tree import shared_segment_scales, tree_from_paths, tree_token_advantages
from grouprl.objectives.tree_prune import prune_rows
from grouprl.policies.flow.gaussian import ratio_diagnostics
from grouprl.rollouts.batching import recompute_old
from grouprl.rollouts.filters import combined_reward
from grouprl.rollouts.reward_metrics import reward_metrics
from grouprl.types import LossOutput, PolicyOutput, Rollout
from grouprl.workloads.images.sampling import likelihood_free, needs_old_weights

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy, ReferenceScorer
    from grouprl.policies.flow.types import FlowBatch


def _score(
    scorer: FlowPolicy | ReferenceScorer, batch: FlowBatch, chunk: int | None
) -> PolicyOutput:
    """No-grad log_probs of the whole batch, in row chunks of `chunk` (None: one call)."""
    n = len(batch)
    if chunk is None or chunk >= n:
        return scorer.log_probs(batch)
    parts = [scorer.log_probs(batch.select(torch.arange(i, min(i + chunk, n))))
             for i in range(0, n, chunk)]  # fmt: skip
    return PolicyOutput(
        logp=torch.cat([p.logp for p in parts]),
        extras={k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras},
    )


@torch.no_grad()
def prepare(
    cfg: Any, policy: FlowPolicy, rollout: Rollout, weights: dict[str, float]
) -> dict[str, float]:
    """Fill advantages (and old / reference scores) on the rollout; return reward metrics."""
    a, d = cfg.algorithm, cfg.diffusion
    batch, chunk = rollout.actions, cfg.train.micro_batch_size
    metrics: dict[str, float] = {}
    if not likelihood_free(cfg):
        current = None
        if recompute_old(cfg):
            current = _score(policy, batch, chunk)
            rollout.old_logp = current.logp  # [N, K]
            if batch.old_mean is not None:
                batch.old_mean = current.extras["mean"]  # [N, K, *latent]
        if a.kl_coef > 0:
            with policy.reference() as ref:
                ref_out = _score(ref, batch, chunk)
            rollout.ref_logp = ref_out.logp  # [N, K]
            batch.ref_mean = ref_out.extras["mean"]  # [N, K, *latent]
            if a.kl_mode == "reward":
                current = current or _score(policy, batch, chunk)
                kl = policy.kl(current, ref_out).masked_fill(~rollout.mask, 0.0)  # [N, K]
                per_sample = kl.sum(1) / rollout.mask.sum(1).clamp(min=1)  # [N]
                rollout.rewards["kl_penalty"] = -a.kl_coef * per_sample  # [N]
                weights = {**weights, "kl_penalty": 1.0}
                metrics["kl"] = float(per_sample.mean())
    tree = rollout.tree_path is not None  # rollout.tree: per-step advantages from the tree
    if tree and a.tree_advantage != "leaf_group":
        parent, node_of_row = tree_from_paths(rollout.tree_path, rollout.tree_segment)
        adv = tree_token_advantages(
            parent, node_of_row.to(rollout.mask.device), rollout.mask,
            combined_reward(rollout.rewards, weights).to(rollout.mask.device),
            rollout.group_ids.to(rollout.mask.device), mode=a.tree_advantage, eps=a.adv_eps,
        )  # fmt: skip  # [N, K]
    else:
        adv = compute_advantages(
            a.advantage, rollout.rewards, rollout.group_ids,
            weights={k: weights[k] for k in rollout.rewards},
            reward_aggregation=a.reward_aggregation, lengths=rollout.mask.sum(1).float(),
            scale=a.scale, eps=a.adv_eps,
        )  # fmt: skip  # [N]
    if tree and a.tree_scales == "shared_segment":
        _, node_of_row = tree_from_paths(rollout.tree_path, rollout.tree_segment)
        rollout.token_scales = shared_segment_scales(
            node_of_row.to(rollout.mask.device), rollout.mask
        )  # [N, K]
    fraction = getattr(cfg.rollout.tree, "prune_fraction", 0.0)
    if tree and fraction > 0:  # BranchGRPO pruning: no gradient through the lowest-value rows
        pruned = prune_rows(combined_reward(rollout.rewards, weights), rollout.group_ids, fraction)
        rollout.mask = rollout.mask & ~pruned.to(rollout.mask.device)[:, None]  # [N, K]
        metrics["tree/pruned_frac"] = float(pruned.float().mean())
    if d.adv_clip_max is not None:
        metrics["advantage/clipped_frac"] = float((adv.abs() > d.adv_clip_max).float().mean())
        adv = adv.clamp(-d.adv_clip_max, d.adv_clip_max)  # [N]
    rollout.advantages = adv.to(rollout.old_logp.device)  # rewards are scored on the CPU
    metrics.update(reward_metrics(rollout.rewards, weights))
    metrics["trained_steps/mean"] = float(rollout.mask.sum(1).float().mean())
    return metrics


# ---- one micro-batch ---------------------------------------------------------------------------


def micro_loss(
    cfg: Any, policy: FlowPolicy, sub: Rollout, counts: dict, single_pass: bool
) -> tuple[LossOutput, Tensor]:
    """The loss of micro-batch `sub` and the old log-probs it used, [n, K] (module docstring)."""
    return OBJECTIVES[cfg.diffusion.objective.type](cfg, policy, sub, counts, single_pass)


def _policy_gradient(cfg, policy, sub, counts, single_pass) -> tuple[LossOutput, Tensor]:
    """Rows with no trained slot (pruned by rollout.tree.prune_fraction) are left out of the
    forward and backward pass: they add exactly 0 to the loss, whose normalisers come from the
    update's global counts. Returns the old log-probs of every row of `sub` [n, K]."""
    live = sub.mask.any(1)  # [n]
    if 0 < int(live.sum()) < len(live):
        rows = torch.nonzero(live).flatten()  # [n']
        res, old_live = _pg_rows(cfg, policy, sub.select(rows), counts, single_pass)
        old = sub.old_logp.clone()  # [n, K]
        old[rows] = old_live
        return res, old
    return _pg_rows(cfg, policy, sub, counts, single_pass)


def _pg_rows(cfg, policy, sub, counts, single_pass) -> tuple[LossOutput, Tensor]:
    a, d = cfg.algorithm, cfg.diffusion
    out = policy.log_probs(sub.actions)  # logp [n, K], extras mean / std / kl_var
    old = out.logp.detach() if single_pass else sub.old_logp  # [n, K]
    kl_out = None
    if sub.ref_logp is not None:
        ref_out = PolicyOutput(logp=sub.ref_logp, extras={"mean": sub.actions.ref_mean})
        kl_out = policy.kl(out, ref_out)  # [n, K]
    if d.objective.ratio_norm == "grpo_guard":
        res = _guard_loss(cfg, policy, sub, out, old, kl_out, counts, single_pass)
    else:
        res = total_loss(
            out, old_logp=old, advantages=sub.advantages, mask=sub.mask, algo=a, counts=counts,
            kl_out=kl_out, group_ids=sub.group_ids, token_scales=sub.token_scales,
        )  # fmt: skip
    eps = getattr(a.surrogate, "eps_high", math.inf)  # a surrogate without a clip: none clipped
    res.metrics.update(ratio_diagnostics(out.logp, old, sub.mask, clip_eps=eps))
    return res, old


def _guard_loss(cfg, policy, sub, out, old, kl_out, counts, single_pass) -> LossOutput:
    """GRPO-Guard policy term over this micro-batch's share of the update, + the KL term."""
    a, d = cfg.algorithm, cfg.diffusion
    batch, mask = sub.actions, sub.mask  # mask Bool[n, K]
    old_mean = out.extras["mean"].detach() if single_pass else batch.old_mean
    if old_mean is None:
        raise ValueError("ratio_norm 'grpo_guard' needs the rollout's step means (store_means)")
    dt = (batch.sigmas[:, :-1] - batch.sigmas[:, 1:]).float()  # [n, K]
    valid = mask & (dt > 0) & (out.extras["std"] > 0)  # [n, K]
    std = torch.where(valid, out.extras["std"], torch.ones_like(dt))  # [n, K]
    dt = torch.where(valid, dt, torch.ones_like(dt))  # [n, K]
    clip_max = d.adv_clip_max if d.adv_clip_max is not None else math.inf
    adv = sub.advantages if sub.advantages.dim() == 2 else sub.advantages[:, None]  # [n, K|1]
    guard = guard_step_loss(
        out.logp, old, out.extras["mean"], old_mean, std, adv, dt,
        eps=a.surrogate.eps_high, adv_clip_max=clip_max, mask=valid,
    )  # fmt: skip
    share = valid.sum() / max(counts["num_tokens"], 1)  # this micro-batch's part of the update
    loss = guard.loss * share  # scalar
    metrics = {f"guard/{k}": v for k, v in guard.metrics.items() if k != "pg_loss"}
    metrics["pg_loss"] = float(loss.detach())
    if kl_out is not None:
        metrics["kl"] = float(kl_out.detach()[mask].mean()) if bool(mask.any()) else 0.0
        if a.kl_mode == "loss" and a.kl_coef > 0:
            agg = {k: v for k, v in counts.items() if k in AGG_COUNTS}
            term = a.kl_coef * aggregate(kl_out, mask, a.aggregation, **agg)  # scalar
            metrics["kl_loss"] = float(term.detach())
            loss = loss + term
    metrics["loss"] = float(loss.detach())
    return LossOutput(loss=loss, metrics=metrics)


def _likelihood_free(cfg, policy, sub, counts, single_pass) -> tuple[LossOutput, Tensor]:
    """DiffusionNFT / AWM on forward-noised copies of the micro-batch's final samples."""
    a, d = cfg.algorithm, cfg.diffusion
    batch = sub.actions
    n, k_s = len(batch), batch.num_steps
    o = d.objective
    idx = stratified_timestep_indices(k_s, o.timesteps, o.timestep_fraction, n)  # [n, K']
    t = batch.sigmas.gather(1, idx.to(batch.sigmas.device)).float()  # [n, K']
    k = t.shape[1]
    x0 = batch.final.float()  # [n, *D]
    noise = torch.randn(n, k, *x0.shape[1:], device=x0.device)  # [n, K', *D]
    cond = batch.cond.repeat(k)  # n * K' rows, sample-major like t.reshape(-1)
    flat = dict(x0=x0.repeat_interleave(k, 0), t=t.reshape(-1), noise=noise.flatten(0, 1),
                cond=cond, guidance_scale=d.guidance_scale if d.train_guidance == "same" else 1.0)  # fmt: skip

    def velocity(which: str) -> Tensor:
        return policy.forward_noising(**flat, which=which).reshape(n, k, *x0.shape[1:])

    nft = d.objective.type == "diffusion_nft"
    extra = {}
    if d.objective.type == "awm" and d.objective.ema_coef > 0:
        extra["v_ema"] = velocity("old")  # AWM's EMA weights live in the policy's "old" slot
    res = LIKELIHOOD_FREE[d.objective.type](
        velocity("current"), x0, noise, t, sub.advantages.float(),
        v_old=velocity("old") if nft else None,
        v_ref=velocity("ref") if a.kl_coef > 0 else None,
        kl_coef=a.kl_coef, num_terms=counts["num_seqs"] * k,
        **likelihood_free_options(d), **extra,
    )  # fmt: skip
    res.metrics["loss"] = float(res.loss.detach())
    return res, sub.old_logp


OBJECTIVES = {
    "policy_gradient": _policy_gradient,
    "diffusion_nft": _likelihood_free,
    "awm": _likelihood_free,
}


def after_update(cfg: Any, policy: FlowPolicy, step: int) -> dict[str, float]:
    """Old (DiffusionNFT) / EMA (AWM with awm_ema_coef > 0) weights follow the trained ones."""
    d = cfg.diffusion
    if needs_old_weights(cfg):
        decay = EMA_DECAYS[d.objective.ema_decay](step)
        policy.update_old(decay)
        return {"old_weights/decay": decay}
    return {}
