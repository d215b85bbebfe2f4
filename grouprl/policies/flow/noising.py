"""The forward noising process of a flow-matching policy, for the objectives that train on it
(DiffusionNFT, AWM: objectives/flow/losses.py): the velocity the network predicts at
x_t = (1 - t) x0 + t noise, under the current, old or reference weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from grouprl.policies.flow.steps import bcast
from grouprl.policies.flow.types import FlowCondition, check_choice

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy


def forward_noising(
    policy: FlowPolicy, x0: Tensor, t: Tensor, noise: Tensor, cond: FlowCondition, *,
    which: Literal["current", "old", "ref"] = "current", guidance_scale: float = 1.0,
) -> Tensor:  # fmt: skip
    """Velocity Float[B, ...] of `policy` (a FlowPolicy) at x_t (t: Float[B] in [0, 1]);
    "current" keeps the graph, "old" / "ref" run without grad under the old / reference weights."""
    check_choice("which", which, ("current", "old", "ref"))
    t = t.float().to(x0.device)  # [B]
    xt = (1 - bcast(t, x0)) * x0.float() + bcast(t, x0) * noise.float()  # [B, ...]
    cols = {
        "sigmas": t[:, None],
        "timesteps": (t * policy.rules.scheduler_config.get("num_train_timesteps", 1000))[:, None],
    }
    gscale = torch.full_like(t, guidance_scale)  # [B]
    if which == "current":
        return policy.predict(policy.model, xt, cols, 0, cond, gscale)
    ctx = policy.old_weights() if which == "old" else policy.reference()
    with torch.no_grad(), ctx as scorer:
        model = policy.model if which == "old" else scorer.model
        return policy.predict(model, xt, cols, 0, cond, gscale)
