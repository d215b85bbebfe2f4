"""What text and agent workloads share: a token policy's preparation of a batch and its loss.

Both train a causal LM on the tokens it generated (agents: the tokens of its own turns; the
environment's tokens are masked out), so both:
- prepare the batch once, between sampling and the update: old / reference log-probs, advantages
  and loss weights. Fills, on the Rollout: old_logp (when the update is off-policy), ref_logp (KL),
  advantages [N] (agents: [N, T] from their per-turn credit), token_scales [N, T] (lambda-GRPO
  prefix-share scales x EGSW weights) and seq_weights [N] (Delta-L), all computed over the WHOLE
  batch, so that any micro-batch split sees the same numbers; with algorithm.distill (k1 / k3)
  also teacher_logp [N, T], the teacher's log-probs of the sampled tokens;
- score a micro-batch with `policy.log_probs` and hand the log-probs to the one objective library
  (objectives.total_loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grouprl.objectives import compute_advantages, sequence_kl, total_loss
from grouprl.objectives.aggregation import delta_l_weights
from grouprl.objectives.distill import SAMPLED_ESTIMATORS, full_reverse_kl
from grouprl.objectives.token_scales import egsw_weights, prefix_share_scales
from grouprl.objectives.tree import shared_segment_scales, tree_from_paths, tree_token_advantages
from grouprl.rollouts.batching import recompute_old
from grouprl.rollouts.filters import combined_reward
from grouprl.rollouts.reward_metrics import reward_metrics
from grouprl.runtime.throughput import StepWork, matmul_params
from grouprl.types import LossOutput, Rollout


def token_work(cfg: Any, policy: Any, rollout: Rollout) -> StepWork:
    """The step's work for the FLOP estimate (runtime/throughput.py): the causal LM's matmul
    parameters, the prompt tokens prefilled, the real prompt + completion tokens trained and the
    no-grad scoring passes of prepare() (old log-probs when recomputed, the reference for a KL; a
    distillation teacher's forward is not counted: it is another model)."""
    batch = rollout.actions
    prompt = int(batch.prompt_mask.sum())
    a = cfg.algorithm
    passes = int(recompute_old(cfg)) + int(a.kl_coef > 0)
    passes += int(a.kl_coef > 0 and a.kl_mode == "reward" and not recompute_old(cfg))
    return StepWork(
        params=matmul_params(policy.model),
        prefilled=prompt,
        sequence=prompt + int(batch.completion_mask.sum()),
        scoring_passes=passes,
    )


# rollout -> per-token advantages [N, T] (agents: per-turn credit); None: group advantages [N]
TokenCredit = Callable[[Rollout], Tensor] | None


@torch.no_grad()
def prepare(
    cfg: Any,
    policy: Any,
    rollout: Rollout,
    weights: dict[str, float],
    credit: TokenCredit = None,
    teacher: Any = None,
) -> dict[str, float]:
    """Fill the rollout for the loss (see module docstring); return reward / length metrics.
    credit: per-token advantages of multi-turn episodes (workloads/agent.py); None for the group
    advantages of algorithm.advantage. teacher: the distillation teacher (algorithm.distill):
    anything with `log_probs(batch, temperature) -> [N, T]`."""
    a, temp = cfg.algorithm, cfg.rollout.temperature
    batch = rollout.actions
    current = None  # a no-grad forward of the current policy, made at most once

    def current_policy():
        nonlocal current
        if current is None:
            current = policy.log_probs(batch, temperature=temp, with_entropy=a.egsw != "off")
        return current

    if recompute_old(cfg):
        rollout.old_logp = current_policy().logp  # [N, T]
    # single pass: old_logp is set to the detached current logp inside update() (same weights)
    if a.kl_coef > 0:
        with policy.reference() as ref:
            rollout.ref_logp = ref.log_probs(batch, temperature=temp)  # [N, T]
        if a.kl_mode == "reward":  # the trainer's log-probs, never the engine's
            kl = sequence_kl(current_policy().logp, rollout.ref_logp, rollout.mask, a.kl_estimator)
            rollout.rewards["kl_penalty"] = -a.kl_coef * kl  # [N]
            weights = {**weights, "kl_penalty": 1.0}
    distill = getattr(a, "distill", None)
    if distill is not None and distill.estimator in SAMPLED_ESTIMATORS:
        if teacher is None:
            raise ValueError("algorithm.distill is set but the workload built no teacher")
        rollout.teacher_logp = teacher.log_probs(batch, temperature=temp).to(
            rollout.mask.device
        )  # [N, T]
    lengths = batch.lengths.float()  # [N]
    # a tree rollout's (parent [M], node_of_row [N, T]), made once when its advantages or scales
    # read it
    tree = None
    if rollout.tree_path is not None and (a.tree_advantage, a.tree_scales) != (
        "leaf_group",
        "none",
    ):
        tree = tree_from_paths(rollout.tree_path, rollout.tree_segment)
    if credit is not None:  # multi-turn episodes: per-turn credit
        rollout.advantages = credit(rollout)  # [N, T]
    elif tree is not None and a.tree_advantage != "leaf_group":  # rollout.tree
        parent, node_of_row = tree
        rollout.advantages = tree_token_advantages(
            parent, node_of_row, rollout.mask, combined_reward(rollout.rewards, weights),
            rollout.group_ids, mode=a.tree_advantage, eps=a.adv_eps,
        )  # fmt: skip  # [N, T]
    else:
        rollout.advantages = compute_advantages(
            a.advantage, rollout.rewards, rollout.group_ids,
            weights={k: weights[k] for k in rollout.rewards},
            reward_aggregation=a.reward_aggregation, lengths=lengths, scale=a.scale,
            eps=a.adv_eps,
        )  # fmt: skip  # [N]
    rollout.token_scales = _token_scales(a, rollout, current_policy, tree)  # [N, T] or None
    if a.aggregation == "delta_l":
        rollout.seq_weights = delta_l_weights(lengths, a.delta_l_alpha)  # [N]

    metrics = reward_metrics(rollout.rewards, weights)
    metrics.update({"response_length/mean": float(lengths.mean()),
                    "response_length/max": float(lengths.max()),
                    "truncated_frac": float(batch.truncated.float().mean())})  # fmt: skip
    return metrics


def _token_scales(a: Any, rollout: Rollout, current_policy, tree: Any) -> Tensor | None:
    """The tree's shared-segment scales and lambda-GRPO's prefix scales times EGSW weights,
    Float[N, T]; None when none is on. tree: (parent, node_of_row) of a tree rollout, or None."""
    scales = None
    if tree is not None and a.tree_scales == "shared_segment":
        scales = shared_segment_scales(tree[1], rollout.mask)  # [N, T]
    if a.token_scale == "prefix_share":
        tokens = rollout.actions.completion_ids  # [N, T]
        share = prefix_share_scales(tokens, rollout.mask, rollout.group_ids)  # [N, T]
        scales = share if scales is None else scales * share
    if a.egsw != "off":
        entropy = current_policy().entropy  # [N, T]
        w = egsw_weights(
            rollout.advantages, entropy, rollout.mask, rollout.group_ids,
            alpha=a.egsw_alpha, temperature=a.egsw_temperature, level=a.egsw,
        )  # fmt: skip  # [N, T]
        scales = w if scales is None else scales * w
    return scales


def token_micro_loss(
    cfg: Any,
    policy: Any,
    sub: Rollout,
    counts: dict[str, Any],
    *,
    single_pass: bool,
    teacher: Any = None,
) -> tuple[LossOutput, Tensor]:
    """The loss of micro-batch `sub` and the pi_old log-probs it used, [n, T].
    teacher: the distillation teacher; with algorithm.distill.estimator 'full' the exact KL of
    this micro-batch is computed here (it needs both models' logits at once, chunked).

    single_pass: the update's own forward is pi_old (detached); otherwise the rollout's old_logp
    (or, with rollout.old_logp 'engine', the engine's log-probs)."""
    a = cfg.algorithm
    need_entropy = a.entropy_coef != 0 or a.top_entropy_quantile < 1
    out = policy.log_probs(
        sub.actions,
        temperature=cfg.rollout.temperature,
        with_entropy=True,
        entropy_grad=need_entropy,
    )
    old = out.logp.detach() if single_pass else sub.old_logp  # [n, T]
    kept = old  # the trainer's score of the sampling weights, kept on the rollout (single pass)
    if cfg.rollout.old_logp == "engine":
        old = sub.engine_logp  # [n, T]
    distill, distill_kl = getattr(a, "distill", None), None
    if distill is not None and distill.estimator == "full":
        if teacher is None:
            raise ValueError("algorithm.distill.estimator='full' but the workload built no teacher")
        if not hasattr(policy, "distill_kl"):
            raise ValueError(
                "algorithm.distill.estimator='full' needs a policy with distill_kl (a single "
                f"process' CausalLMPolicy), got {type(policy).__name__}; use k1 or k3"
            )
        distill_kl = policy.distill_kl(
            sub.actions, teacher.model, full_reverse_kl,
            temperature=cfg.rollout.temperature, chunk_size=distill.chunk_size,
        )  # fmt: skip  # [n, T]
    res = total_loss(
        out, old_logp=old, advantages=sub.advantages, mask=sub.mask,
        algo=a, counts=counts, ref_logp=sub.ref_logp, engine_logp=sub.engine_logp,
        group_ids=sub.group_ids, token_scales=sub.token_scales, seq_weights=sub.seq_weights,
        teacher_logp=sub.teacher_logp, distill_kl=distill_kl,
    )  # fmt: skip
    return res, kept
