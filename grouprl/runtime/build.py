"""Builders of the modality-blind parts: config sections -> rewards, prompt sampler, optimizer and
lr schedule, sampling parameters, seeds, device (each workload builds its own policy)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from grouprl.config.loading import Config
from grouprl.envs.rewards import build_reward, overlong_reward
from grouprl.rollouts.budget.sampler import BudgetSampler
from grouprl.rollouts.curriculum import DumpSampler
from grouprl.rollouts.prompt_sampler import PromptSampler


def build_rewards(cfg: Config, task, *, required: bool) -> tuple[dict, dict[str, float]]:
    """Reward functions and weights: the config's list, else the task's defaults (+ DAPO overlong).
    required: a task without rewards of its own needs `rewards` in the config (text tasks)."""
    if cfg.rewards:
        fns, weights = {}, {}
        for r in cfg.rewards:
            key = r.name.rsplit(":", 1)[-1] if ":" in r.name else r.name
            if key in fns:
                raise ValueError(f"reward {key!r} is listed twice in `rewards`")
            # a task reward named without options is the task's own (e.g. math accuracy uses
            # math-verify, countdown accuracy the equation checker), not the generic built-in
            reuse = r.name in task.reward_fns and not r.options
            fns[key] = task.reward_fns[r.name] if reuse else build_reward(r.name, **r.options)
            weights[key] = r.weight
    else:
        fns = dict(task.reward_fns)
        weights = {k: task.default_reward_weights.get(k, 1.0) for k in fns}
        if not fns and required:  # e.g. task 'prompts': no reward of its own
            raise ValueError(
                f"task {cfg.task.name!r} has no reward of its own: list `rewards` in the config "
                "(e.g. a user function 'path/to/file.py:function' or a reward model wrapper)"
            )
    if cfg.algorithm.overlong_shaping == "soft" and "overlong" not in fns:
        a = cfg.algorithm
        fns["overlong"] = overlong_reward(
            buffer_frac=a.overlong_buffer_frac, factor=a.overlong_factor
        )
        weights["overlong"] = 1.0
    return fns, weights


def build_sampler(cfg: Config, examples: list[dict]) -> PromptSampler | DumpSampler | BudgetSampler:
    """Uniform seeded sampling, or the DUMP curriculum over the examples' data sources; wrapped
    by rollout.budget's sampler when one is set (config checks refuse it with a curriculum)."""
    b = cfg.rollout.budget
    if b.type != "none":
        inner = PromptSampler(examples, cfg.run.seed)
        return BudgetSampler(inner, b, group_size=cfg.rollout.group_size, seed=cfg.run.seed)
    c = cfg.curriculum
    if c.type == "dump":
        return DumpSampler(
            examples, source_column=c.source_column, window=c.window, c=c.c,
            temperature=c.temperature, seed=cfg.run.seed,
        )  # fmt: skip
    return PromptSampler(examples, cfg.run.seed)


def build_optimizer(cfg: Config, policy) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the policy's trainable weights, which are float32 master weights whatever
    model.dtype is (policies/precision.py), so its moments are float32 too; and the lr schedule."""
    t = cfg.train
    params = policy.trainable_parameters()
    low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if low:
        raise ValueError(
            f"trainable weights in {low}: the optimizer needs float32 master weights "
            "(model.dtype sets the compute dtype only; policies/precision.master_weights)"
        )
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    a = cfg.algorithm
    total = t.steps * a.epochs * a.minibatches  # optimizer updates in the run
    shape = LR_SCHEDULES[t.lr_schedule]

    def factor(u: int) -> float:  # u = updates done so far
        warm = min(1.0, (u + 1) / (t.warmup_steps + 1))
        progress = (u - t.warmup_steps) / max(1, total - t.warmup_steps)
        return warm * shape(min(max(progress, 0.0), 1.0))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# lr multiplier after warm-up as a function of progress in [0, 1]
LR_SCHEDULES = {
    "constant": lambda p: 1.0,
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_for(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device='cuda' but no CUDA device is available")
    return torch.device(name)
