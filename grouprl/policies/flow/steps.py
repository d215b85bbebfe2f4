"""The two step loops of a flow / diffusion policy: draw trajectories, and re-score stored ones.

Both go through the same `predict(x_k, cols, k, cond, guidance)` (the policy's denoiser call) and
`step(cols, k, x_k, pred, stochastic, *, noise_level, prev_sample, generator)` (its rules' step), with the same tensors in the same dtypes, so a stored transition re-scored on the same batch
gives bit-identical log-probs (ratio exactly 1 on-policy). `cols` holds the per-row schedule
columns [B, K+1] ("sigmas", "timesteps", and "alphas" for DDIM) and, for a two-expert denoiser,
"expert" [B, K] (which expert runs each step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.flow.samplers import StepOutput
from grouprl.policies.flow.types import FlowBatch, FlowCondition


def bcast(t: Tensor, x: Tensor) -> Tensor:
    """[B] -> [B, 1, ..., 1] in x's dtype, to broadcast against x [B, ...]."""
    return t.reshape(t.shape[0], *([1] * (x.dim() - 1))).to(x.dtype)


def where_rows(rows: Tensor, a: StepOutput, b: StepOutput) -> StepOutput:
    """Row-wise choice between two step outputs (rows: Bool[B]; True takes a)."""
    m = bcast(rows, a.mean).bool()  # [B, 1, ...]
    return StepOutput(
        prev_sample=torch.where(m, a.prev_sample, b.prev_sample),  # [B, ...]
        log_prob=torch.where(rows, a.log_prob, b.log_prob),  # [B]
        mean=torch.where(m, a.mean, b.mean),  # [B, ...]
        std=torch.where(rows, a.std, b.std),  # [B]
    )


def cond_rows(cond: FlowCondition, rows: slice) -> FlowCondition:
    neg = None if cond.negative is None else {k: v[rows] for k, v in cond.negative.items()}
    return FlowCondition({k: v[rows] for k, v in cond.embeds.items()}, neg)


def run_chain(
    predict: Callable[..., Tensor],
    step: Callable[..., StepOutput],
    x0: Tensor,
    cols: dict[str, Tensor],
    cond: FlowCondition,
    gscale: Tensor,
    stochastic: Tensor,
    train: Tensor,
    *,
    generator: torch.Generator | None,
    chunk: int,
    store_means: bool,
    first: int = 0,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """W denoising steps first .. first + W - 1 of the schedule (W = train.shape[1]; the whole
    chain when first = 0 and W = K) from x0 [N, *latent] (rows in chunks of `chunk`, each chunk run
    through every step). stochastic / train: [N, W], the window's columns. Returns latents
    [N, W+1, *latent], logp [N, W] (0 where not trained) and the step means [N, W, *latent] when
    store_means. A window is one segment of a tree rollout (policies/flow/fork.py)."""
    n, k_steps = train.shape
    latents = x0.new_zeros(n, k_steps + 1, *x0.shape[1:])  # [N, W+1, *latent]
    latents[:, 0] = x0
    logp = x0.new_zeros(n, k_steps)  # [N, W]
    means = x0.new_zeros(n, k_steps, *x0.shape[1:]) if store_means else None
    for lo in range(0, n, chunk):
        rows = slice(lo, min(lo + chunk, n))
        sub_cond, sub_cols = cond_rows(cond, rows), {k: v[rows] for k, v in cols.items()}
        x = latents[rows, 0]  # [B, *latent]
        for j in range(k_steps):
            k = first + j  # the schedule's step index
            pred = predict(x, sub_cols, k, sub_cond, gscale[rows])  # [B, *latent]
            out = step(sub_cols, k, x, pred, stochastic[rows, j], generator=generator)
            x = out.prev_sample  # [B, *latent]
            latents[rows, j + 1] = x
            logp[rows, j] = torch.where(train[rows, j], out.log_prob, 0.0)  # [B]
            if means is not None:
                means[rows, j] = out.mean
    return latents, logp, means


def score_chain(
    predict: Callable[..., Tensor],
    step: Callable[..., StepOutput],
    batch: FlowBatch,
    gscale: Tensor,
    steps: list[int] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Re-score the stored transitions x_k -> x_{k+1} of the trained steps (all rows of the batch
    for a step any row trains; only `steps` when given). Returns logp [n, K] (differentiable; 0 at
    unscored slots), mean [n, K, *latent] (0 at unscored slots) and std [n, K] (detached)."""
    n, k_steps = batch.train_mask.shape
    cols: dict[str, Any] = {"sigmas": batch.sigmas, "timesteps": batch.timesteps}
    if batch.alphas is not None:
        cols["alphas"] = batch.alphas
    if batch.expert is not None:  # [n, K] the expert that drew each step scores it
        cols["expert"] = batch.expert
    wanted = set(range(k_steps)) if steps is None else set(steps)
    zero_lp = batch.latents.new_zeros(n)  # [n]
    zero_mean = batch.latents.new_zeros(n, *batch.latents.shape[2:])  # [n, *latent]
    logps, means, stds = [], [], []
    for k in range(k_steps):
        rows = batch.train_mask[:, k]  # [n]
        if k not in wanted or not bool(rows.any()):
            logps.append(zero_lp), means.append(zero_mean), stds.append(zero_lp)
            continue
        x = batch.latents[:, k]  # [n, *latent]
        pred = predict(x, cols, k, batch.cond, gscale)  # [n, *latent]
        out = step(cols, k, x, pred, batch.stochastic[:, k], noise_level=batch.noise_level,
                   prev_sample=batch.latents[:, k + 1])  # fmt: skip
        logps.append(torch.where(rows, out.log_prob, 0.0))  # [n]
        means.append(out.mean * bcast(rows, out.mean))  # [n, *latent]
        stds.append(torch.where(rows, out.std, 0.0))  # [n]
    return torch.stack(logps, 1), torch.stack(means, 1), torch.stack(stds, 1).detach()
