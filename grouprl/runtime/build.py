"""Builders: config sections -> the objects the training loop uses (policy, rewards, sampler ...)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from grouprl.config.loading import Config
from grouprl.envs.rewards import build_reward, overlong_reward
from grouprl.policies.text.causal_lm import LOCAL_ENGINES, CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.curriculum import DumpSampler
from grouprl.rollouts.prompt_sampler import PromptSampler


def build_rewards(cfg: Config, task) -> tuple[dict, dict[str, float]]:
    """Reward functions and weights: the config's list, else the task's defaults (+ DAPO overlong)."""
    if cfg.task.name == "env":  # multi-turn: the environment's episode return is the reward
        if cfg.rewards:
            raise ValueError("task 'env' takes its rewards from the environment; remove `rewards`")
        return {}, {"return": 1.0}
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
        if not fns and cfg.model.type == "causal_lm":  # e.g. task 'prompts': no reward of its own
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


def build_policy(cfg: Config, device: torch.device) -> Any:
    """The policy of model.type (POLICIES: causal_lm -> CausalLMPolicy, flow / unet -> the image
    and video policies of grouprl/policies/flow/build.py)."""
    return POLICIES[cfg.model.type](cfg, device)


def causal_lm_policy(
    cfg: Config, device: torch.device, loaded: tuple[Any, Any] | None = None
) -> CausalLMPolicy:
    """model: -> CausalLMPolicy; loaded: (transformers model, tokenizer) given from Python (the
    Python API) instead of model.name_or_path, in the dtype model.dtype names."""
    m = cfg.model
    settings = dict(
        lora=m.lora.model_dump() if m.lora else None,
        gradient_checkpointing=m.gradient_checkpointing,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_path=m.logprob_path,
        # the frozen copy is made before any checkpoint is loaded, so it stays the initial model
        need_reference=cfg.algorithm.kl_coef > 0,
    )
    if loaded is not None and cfg.rollout.engine not in LOCAL_ENGINES:
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r} loads the model from model.name_or_path; a "
            f"model given as an object samples with one of {sorted(LOCAL_ENGINES)}"
        )
    engine = TEXT_ENGINES[cfg.rollout.engine](cfg, device)
    if loaded is not None:
        model, tokenizer = loaded
        policy = CausalLMPolicy(model, tokenizer, compute_dtype=m.dtype, engine=engine, **settings)
    else:
        policy = CausalLMPolicy.from_pretrained(
            m.name_or_path, dtype=m.dtype, trust_remote_code=m.trust_remote_code, engine=engine,
            **settings,
        )  # fmt: skip
    return policy.to(device)


def _vllm_engine(cfg: Config, device: torch.device):
    from grouprl.policies.text.engines.vllm_setup import engine_from_config  # imports vllm: lazily

    return engine_from_config(cfg, device)


# rollout.engine -> the policy's engine; None: CausalLMPolicy's HFEngine over its own model, a
# string: that CausalLMPolicy.LOCAL_ENGINES engine over its own model
TEXT_ENGINES = {
    "hf": lambda cfg, device: None,
    "fast": lambda cfg, device: "fast",
    "vllm": _vllm_engine,
}


def _flow_policy(cfg: Config, device: torch.device):
    from grouprl.policies.flow.build import (
        build_flow_policy,  # diffusers: imported for image runs only
    )

    return build_flow_policy(cfg, device)


# model.type -> policy builder
POLICIES = {"causal_lm": causal_lm_policy, "flow": _flow_policy, "unet": _flow_policy}


def build_sampler(cfg: Config, examples: list[dict]) -> PromptSampler | DumpSampler:
    """Uniform seeded sampling, or the DUMP curriculum over the examples' data sources."""
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


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=list(r.stop),
    )


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
