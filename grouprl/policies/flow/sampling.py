"""Drawing a flow / diffusion policy's trajectories: FlowPolicy.sample runs `sample_groups`, which
builds the schedule columns, picks the stochastic and trained steps, draws the initial noise and
runs the step loop (steps.run_chain) through the policy's rules (`rules.set_timesteps`,
`rules.step`: rules.py) and its denoiser call (`policy.predict`).

Choices:
- Step selection (schedule.select_steps) draws from its own generator, seeded by one draw of
  the caller's generator, so the noise stream does not depend on the selection mode.
- mode "eval" and the "ode" sampler (DiffusionNFT / AWM rollouts) make every step deterministic
  and train none of them (mask all False).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from grouprl.policies.flow.schedule import initial_noise, select_steps
from grouprl.policies.flow.steps import run_chain
from grouprl.policies.flow.types import FlowBatch, FlowCondition, check_choice
from grouprl.types import Rollout

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy


@torch.no_grad()
def sample_groups(
    policy: FlowPolicy,
    cond: FlowCondition | list[str],
    group_size: int,
    *,
    steps: int | None = None,
    mode: Literal["rollout", "eval"] = "rollout",
    generator: torch.Generator | None = None,
    group_ids: Tensor | list[int] | None = None,
    optimizer_step: int = 0,
    guidance_scale: float | None = None,
    chunk_size: int | None = None,
    store_means: bool = False,
) -> Rollout:
    """group_size trajectories per condition row of `policy` (a FlowPolicy); rewards left empty.

    mode "rollout": rollout_steps (or `steps`), step selection decides stochastic / trained
    steps. mode "eval": eval_steps, every step deterministic, nothing trained (mask all False).
    Sampler "ode" (DiffusionNFT / AWM rollouts): deterministic steps, mask all False.
    group_ids: one id per condition row (default 0..B-1); optimizer_step: MixGRPO's window
    position; chunk_size: rows per model call; store_means: keep each step's mean (old_mean).
    """
    check_choice("mode", mode, ("rollout", "eval"))
    prompts = cond if isinstance(cond, list) else None
    cond = policy.encode(cond) if isinstance(cond, list) else cond
    b, dev = len(cond), policy.device
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    gids = torch.arange(b) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
    if gids.shape != (b,):
        raise ValueError(
            f"group_ids must have one id per condition row ({b}), got {tuple(gids.shape)}"
        )
    gids = gids.repeat_interleave(group_size)  # [N]
    n = len(gids)
    k_steps = steps or (policy.rollout_steps if mode == "rollout" else policy.eval_steps)
    rules = policy.rules
    cols = policy.schedule_columns(k_steps, n)  # [N, K+1] each ("expert": [N, K])
    seed = int(torch.randint(2**62, (1,), generator=generator, device=gen_device(generator)))
    if mode == "rollout" and rules.sampler != "ode":
        sel = select_steps(policy.steps, k_steps, gids, generator=torch.Generator().manual_seed(seed),
                           optimizer_step=optimizer_step)  # fmt: skip
        train, stochastic = sel.train.to(dev), sel.stochastic.to(dev)  # [N, K] each
    else:
        train = stochastic = torch.zeros(n, k_steps, dtype=torch.bool, device=dev)
    gs = policy.guidance_scale if guidance_scale is None else float(guidance_scale)
    gscale = policy.guidance_columns(n, gs)  # [N] ([N, 2] for two experts)
    cond_n = cond.repeat(group_size).to(dev)
    x = initial_noise(
        policy.latent_shape, gids, policy.initial_noise, generator=generator, device=dev
    )
    policy.model.eval()
    latents, logp, means = run_chain(
        partial(policy.predict, policy.model), rules.step, x, cols, cond_n, gscale, stochastic,
        train, generator=generator, chunk=chunk_size or n, store_means=store_means,
    )  # fmt: skip
    return chain_rollout(rules, latents, logp, means, cols, cond_n, gscale, train, stochastic,
                         gids, prompts, group_size)  # fmt: skip


def chain_rollout(rules, latents, logp, means, cols, cond_n, gscale, train, stochastic, gids,
                  prompts, group_size, **tree: Tensor) -> Rollout:  # fmt: skip
    """The Rollout of sampled chains: latents [N, K+1, ...], logp [N, K], the schedule columns,
    the step masks train / stochastic [N, K]; `tree`: a tree rollout's fields (fork.py)."""
    batch = FlowBatch(
        latents=latents, sigmas=cols["sigmas"], timesteps=cols["timesteps"], cond=cond_n,
        guidance_scale=gscale, train_mask=train, stochastic=stochastic,
        alphas=cols.get("alphas"), old_mean=means, expert=cols.get("expert"), sampler=rules.sampler,
        noise_level=rules.noise_level,
    )  # fmt: skip
    info = {} if prompts is None else {"prompt": [p for p in prompts for _ in range(group_size)]}
    return Rollout(group_ids=gids, rewards={}, actions=batch, old_logp=logp, mask=train.clone(),
                   info=info, **tree)  # fmt: skip


def gen_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")
