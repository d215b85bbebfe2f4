"""Tree rollouts of a flow / diffusion policy: a group sampled as a tree over DENOISING STEPS
(BranchGRPO, arXiv 2509.06040: branching rollouts whose shared prefixes are computed once).

A node is a window of denoising steps run once: `branching = [b_1, ..., b_d]` children per node
at each depth and `branch_at = [s_1 < ... < s_{d-1}]` the STEP indices (0-based, of the K rollout
steps) where depth k + 1 starts, so depth k runs steps [s_{k-1}, s_k) (s_0 = 0, s_d = K). The root
is the condition; each of its b_1 children draws its own initial noise (the policy's
initial_noise mode: "shared" gives one per group) and runs the first window; at a branch step the
node's latent x_{s_k} is copied into b_{k+1} children that continue with fresh noise (the SDE
steps draw from the generator as flat sampling does). A group has G = b_1 * ... * b_d leaves,
consecutive rows per group like a flat group. rollout.tree.segment_tokens means the same in steps
(branch_at = [L, 2L, ...]).

Which steps are stochastic / trained: step selection (schedule.select_steps) draws a mask per
LEAF exactly as sample_groups does; a node's window takes the columns of the first leaf through
it, and every leaf below it carries that node's columns, so a shared transition is identical in
all rows holding it (same latents, log-prob, mask).

Flow-GRPO-Fast's "ODE prefix then SDE branch": with initial_noise "shared" and a first window
whose steps are deterministic for every node of the batch, the b_1 depth-1 nodes would run the
same deterministic chain; it is run once per group and copied (`generated` counts it once). The
same prefix written as branching [1, G] is one node by construction.

What the Rollout records (the text fork's fields, rollouts/fork.py, here over the K step slots):
  tree_path     Long[N, D+1]  node ids [root, depth-1 node, ...], group id * NODES_PER_TREE +
                              index (index 0 the root, then nodes depth by depth)
  tree_segment  Long[N, K]    the depth (1..D) of the window holding each step slot
  generated     Long[N]       denoising steps this row ran itself: a node's window counts at the
                              first leaf through it (the rollout/sampled_actions metric)

Exactness: a tree of depth 1 calls nothing but what sample_groups calls, in the same order (seed
draw, step selection, initial noise, one run_chain over all steps), so it returns the same
latents and log-probs for the same generator state (tests/test_flow_tree.py, torch.equal).
Deviation from BranchGRPO: its branch points and per-depth noise are its own schedule; here the
branch steps are configured and the noise level is the sampler's at every depth.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from grouprl.policies.flow.sampling import chain_rollout, gen_device
from grouprl.policies.flow.schedule import initial_noise, select_steps
from grouprl.policies.flow.steps import run_chain
from grouprl.policies.flow.types import FlowCondition, check_choice
from grouprl.rollouts.fork import NODES_PER_TREE, check_tree
from grouprl.types import Rollout

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy


def check_step_tree(branching: list[int], branch_at: list[int], steps: int) -> None:
    """One error naming the options when the tree cannot be cut from `steps` denoising steps."""
    check_tree(
        branching,
        branch_at,
        steps,
        unit="denoising step indices",
        limit_option="diffusion.rollout_steps",
    )


def _level_ids(branching: list[int], level: int, gids: Tensor) -> Tensor:
    """Node ids of depth level + 1 for groups gids [B]: Long[B * b_1 * ... * b_{level+1}]."""
    width = math.prod(branching[: level + 1])  # nodes of this depth per tree
    before = 1 + sum(math.prod(branching[: j + 1]) for j in range(level))  # root + shallower
    local = torch.arange(width) + before  # [W]
    return (gids[:, None] * NODES_PER_TREE + local[None]).reshape(-1)  # [B * W]


@torch.no_grad()
def sample_tree_groups(
    policy: FlowPolicy,
    cond: FlowCondition | list[str],
    branching: list[int],
    branch_at: list[int],
    *,
    steps: int | None = None,
    mode: Literal["rollout"] = "rollout",
    generator: torch.Generator | None = None,
    group_ids: Tensor | list[int] | None = None,
    optimizer_step: int = 0,
    guidance_scale: float | None = None,
    chunk_size: int | None = None,
    store_means: bool = False,
) -> Rollout:
    """One tree per condition row (module docstring); rewards left empty. Options as
    sampling.sample_groups; mode must be "rollout" with a stochastic sampler (a deterministic
    chain gives identical branches)."""
    rules = policy.rules
    if rules.sampler == "ode":
        raise ValueError(
            "rollout.tree with diffusion.sampler 'ode': every step is deterministic, so all "
            "branches of a node would be the same image; use an SDE sampler"
        )
    check_choice("mode", mode, ("rollout",))
    k_steps = steps or policy.rollout_steps
    check_step_tree(branching, branch_at, k_steps)
    prompts = cond if isinstance(cond, list) else None
    cond = policy.encode(cond) if isinstance(cond, list) else cond
    b, dev = len(cond), policy.device
    g = math.prod(branching)
    gids0 = torch.arange(b) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
    if gids0.shape != (b,):
        raise ValueError(
            f"group_ids must have one id per condition row ({b}), got {tuple(gids0.shape)}"
        )
    gids = gids0.repeat_interleave(g)  # [N] leaves, consecutive per group
    n = len(gids)
    cols = policy.schedule_columns(k_steps, n)  # [N, K+1] each ("expert": [N, K])
    seed = int(torch.randint(2**62, (1,), generator=generator, device=gen_device(generator)))
    sel = select_steps(policy.steps, k_steps, gids, generator=torch.Generator().manual_seed(seed),
                       optimizer_step=optimizer_step)  # fmt: skip
    leaf_train, leaf_stoch = sel.train.to(dev), sel.stochastic.to(dev)  # [N, K] each
    gs = policy.guidance_scale if guidance_scale is None else float(guidance_scale)
    gscale = policy.guidance_columns(n, gs)  # [N] ([N, 2] for two experts)
    cond_n = cond.repeat(g).to(dev)  # [N] rows, the leaves'
    # a row of depth-1 nodes per group member of the first depth (as flat: one noise per row)
    gids1 = gids0.repeat_interleave(branching[0])  # [B * b_1]
    x = initial_noise(policy.latent_shape, gids1, policy.initial_noise, generator=generator,
                      device=dev)  # fmt: skip  # [B * b_1, *latent]
    policy.model.eval()
    bounds = [0, *branch_at, k_steps]
    lat_parts, logp_parts, mean_parts = [], [], []
    train = torch.zeros_like(leaf_train)  # [N, K] the nodes' columns, copied to their leaves
    stoch = torch.zeros_like(leaf_stoch)  # [N, K]
    generated = torch.zeros(n, dtype=torch.long)  # [N]
    for level, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        below = math.prod(branching[level + 1 :])  # leaves under one node of this depth
        if level:
            x = x.repeat_interleave(branching[level], 0)  # [M, *latent] children of each node
        m = len(x)
        rep = torch.arange(m, device=dev) * below  # [M] each node's first leaf
        node_train, node_stoch = leaf_train[rep, lo:hi], leaf_stoch[rep, lo:hi]  # [M, W] each
        sub = {k: v[rep] for k, v in cols.items()}  # [M, K+1] each
        run = partial(
            run_chain, partial(policy.predict, policy.model), rules.step, generator=generator,
            chunk=chunk_size or m, store_means=store_means, first=lo,
        )  # fmt: skip
        once = level == 0 and len(branching) > 1 and _ode_prefix(policy, node_stoch)
        if once:  # Flow-GRPO-Fast's ODE prefix, shared by the whole group: run once per group
            first = torch.arange(0, m, branching[0], device=dev)  # [B]
            lat, lp, mn = run(x[first], {k: v[first] for k, v in sub.items()},
                              cond_rows_of(cond_n, rep[first]), gscale[rep[first]],
                              node_stoch[first], node_train[first])  # fmt: skip
            lat, lp = lat.repeat_interleave(branching[0], 0), lp.repeat_interleave(branching[0], 0)
            mn = None if mn is None else mn.repeat_interleave(branching[0], 0)
            ran = torch.zeros(m, dtype=torch.long)  # [M]
            ran[:: branching[0]] = hi - lo
        else:
            lat, lp, mn = run(x, sub, cond_rows_of(cond_n, rep), gscale[rep], node_stoch,
                              node_train)  # fmt: skip  # [M, W+1, *latent], [M, W], ...
            ran = torch.full((m,), hi - lo, dtype=torch.long)  # [M]
        x = lat[:, -1]  # [M, *latent] the latent at the next branch step
        lat_parts.append(lat[:, :-1].repeat_interleave(below, 0))  # [N, W, *latent]
        logp_parts.append(lp.repeat_interleave(below, 0))  # [N, W]
        if mn is not None:
            mean_parts.append(mn.repeat_interleave(below, 0))  # [N, W, *latent]
        train[:, lo:hi] = node_train.repeat_interleave(below, 0)
        stoch[:, lo:hi] = node_stoch.repeat_interleave(below, 0)
        first_leaf = torch.zeros(n, dtype=torch.long)  # [N] a node's window counts at its 1st leaf
        first_leaf[::below] = ran
        generated += first_leaf
    latents = torch.cat([*lat_parts, x[:, None]], 1)  # [N, K+1, *latent]
    logp = torch.cat(logp_parts, 1)  # [N, K]
    means = torch.cat(mean_parts, 1) if mean_parts else None  # [N, K, *latent]
    depth = len(branching)
    path = torch.empty(n, depth + 1, dtype=torch.long)  # [N, D+1]
    path[:, 0] = gids * NODES_PER_TREE
    for level in range(depth):
        path[:, level + 1] = _level_ids(branching, level, gids0).repeat_interleave(
            math.prod(branching[level + 1 :])
        )  # [N]
    segment = torch.empty(n, k_steps, dtype=torch.long)  # [N, K]
    for level, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        segment[:, lo:hi] = level + 1
    return chain_rollout(
        rules, latents, logp, means, cols, cond_n, gscale, train, stoch, gids, prompts, g,
        tree_path=path, tree_segment=segment, generated=generated,
    )  # fmt: skip


def cond_rows_of(cond: FlowCondition, rows: Tensor) -> FlowCondition:
    """The condition of the rows `rows` (Long[M]) of `cond`."""
    neg = None if cond.negative is None else {k: v[rows] for k, v in cond.negative.items()}
    return FlowCondition({k: v[rows] for k, v in cond.embeds.items()}, neg)


def _ode_prefix(policy: FlowPolicy, node_stoch: Tensor) -> bool:
    """True when the b_1 depth-1 nodes of every group start from one noise (initial_noise
    "shared") and none of them has a stochastic step in the first window: they are one chain."""
    return policy.initial_noise == "shared" and not bool(node_stoch.any())
