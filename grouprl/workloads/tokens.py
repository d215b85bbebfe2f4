"""What text and agent workloads share: a token policy's loss on one micro-batch.

Both train a causal LM on the tokens it generated (agents: the tokens of its own turns; the
environment's tokens are masked out), so both score a micro-batch with `policy.log_probs` and
hand the log-probs to the one objective library (objectives.total_loss).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from grouprl.objectives import total_loss
from grouprl.types import LossOutput, Rollout


def token_micro_loss(
    cfg: Any, policy: Any, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
) -> tuple[LossOutput, Tensor]:
    """The loss of micro-batch `sub` and the pi_old log-probs it used, [n, T].

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
    res = total_loss(
        out, old_logp=old, advantages=sub.advantages, mask=sub.mask,
        algo=a, counts=counts, ref_logp=sub.ref_logp, engine_logp=sub.engine_logp,
        group_ids=sub.group_ids, token_scales=sub.token_scales, seq_weights=sub.seq_weights,
    )  # fmt: skip
    return res, kept
