"""The training loop: one readable pass from config to a trained policy, modality-blind.

Each step:  sample prompts_per_step x group_size  ->  score with the reward functions
            -> (dynamic sampling: drop zero-variance groups, sample more)
            -> old / reference log-probs  ->  advantages
            -> mu epochs x minibatches (gradient accumulation over micro-batches), AdamW
            -> log, evaluate every k steps, checkpoint every k steps.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grouprl.checkpoint import CheckpointManager, restore_rng
from grouprl.config import Config, save_resolved
from grouprl.data import PromptSampler
from grouprl.envs.rewards import build_reward, overlong_reward
from grouprl.envs.tasks import build_task
from grouprl.evaluation import accuracy_key, evaluate
from grouprl.logging import RunLogger
from grouprl.objectives import count_tokens, total_loss
from grouprl.plots import plot_curves
from grouprl.policies.causal_lm import CausalLMPolicy
from grouprl.rollouts.curriculum import DumpSampler
from grouprl.rollouts.engines.base import SamplingParams
from grouprl.rollouts.filters import sample_until_full
from grouprl.rollouts.prepare import prepare
from grouprl.rollouts.single_turn import collect
from grouprl.types import Rollout


class NonFiniteLossError(RuntimeError):
    """A loss or gradient was NaN/inf; the weights and checkpoints were left untouched."""


# ---- building the pieces ------------------------------------------------------------------------


def build_rewards(cfg: Config, task) -> tuple[dict, dict[str, float]]:
    """Reward functions and weights: the config's list, else the task's defaults (+ DAPO overlong)."""
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
    if cfg.algorithm.overlong_shaping == "soft" and "overlong" not in fns:
        a = cfg.algorithm
        fns["overlong"] = overlong_reward(
            buffer_frac=a.overlong_buffer_frac, factor=a.overlong_factor
        )
        weights["overlong"] = 1.0
    return fns, weights


def build_policy(cfg: Config, device: torch.device) -> CausalLMPolicy:
    m = cfg.model
    policy = CausalLMPolicy.from_pretrained(
        m.name_or_path,
        dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        lora=m.lora.model_dump() if m.lora else None,
        gradient_checkpointing=m.gradient_checkpointing,
        logprob_chunk_size=m.logprob_chunk_size,
        # the frozen copy is made before any checkpoint is loaded, so it stays the initial model
        need_reference=cfg.algorithm.kl_coef > 0,
    )
    return policy.to(device)


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
    t = cfg.train
    opt = torch.optim.AdamW(
        policy.trainable_parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
    )
    warmup = t.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / (warmup + 1)))
    return opt, sched


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


# ---- one step -----------------------------------------------------------------------------------


def rollout_step(
    cfg, policy, sampler, reward_fns, weights, params, step
) -> tuple[Rollout | None, dict]:
    """Sample and score one batch of groups (with DAPO dynamic sampling when configured)."""
    r, a = cfg.rollout, cfg.algorithm
    errors_total: dict[str, int] = {}

    def one_round(round_index: int) -> Rollout:
        examples = sampler.next(r.prompts_per_step)
        first_id = (step * a.max_sampling_rounds + round_index) * r.prompts_per_step
        rollout, errors = collect(
            policy, examples, r.group_size, params, reward_fns,
            first_group_id=first_id, fail_fast=cfg.run.fail_fast,
        )  # fmt: skip
        for k, v in errors.items():
            errors_total[k] = errors_total.get(k, 0) + v
        return rollout

    metrics: dict[str, float] = {}
    if a.dynamic_sampling == "zero_variance":
        rollout, metrics = sample_until_full(
            one_round, weights, r.prompts_per_step, a.max_sampling_rounds
        )
    else:
        rollout = one_round(0)
    metrics.update({f"reward_errors/{k}": float(v) for k, v in errors_total.items()})
    return rollout, metrics


def update(cfg: Config, policy, optimizer, scheduler, rollout: Rollout) -> dict[str, float]:
    """mu epochs x minibatches optimizer updates; micro-batches accumulate with global counts."""
    a, temp = cfg.algorithm, cfg.rollout.temperature
    single_pass = a.epochs == 1 and a.minibatches == 1
    need_entropy = a.entropy_coef != 0 or a.top_entropy_quantile < 1
    shares: dict[str, float] = {}  # loss terms: summed over micro-batches of an update
    means: dict[str, float] = {}  # per-micro-batch statistics: averaged
    norms: list[float] = []
    n_micro = n_updates = 0
    policy.train()
    for _ in range(a.epochs):
        for mb, micro_batches in _split(rollout, a.minibatches, cfg.train.micro_batch_size,
                                        whole_groups=a.surrogate in _GROUP_SURROGATES):  # fmt: skip
            counts = count_tokens(
                rollout.mask[mb],
                max_len=cfg.rollout.max_new_tokens,
                group_ids=rollout.group_ids[mb],
            )  # global counts of this optimizer update: tokens, sequences, groups
            optimizer.zero_grad(set_to_none=True)
            for idx in micro_batches:
                sub = rollout.select(idx)
                out = policy.log_probs(
                    sub.actions, temperature=temp, with_entropy=True, entropy_grad=need_entropy
                )
                old = out.logp.detach() if single_pass else sub.old_logp  # [n, T]
                if cfg.rollout.old_logp == "engine":
                    old = sub.engine_logp
                res = total_loss(
                    out, old_logp=old, advantages=sub.advantages, mask=sub.mask,
                    algo=a, counts=counts, ref_logp=sub.ref_logp, engine_logp=sub.engine_logp,
                    group_ids=sub.group_ids, token_scales=sub.token_scales,
                    seq_weights=sub.seq_weights,
                )  # fmt: skip
                if not torch.isfinite(res.loss):
                    raise NonFiniteLossError(
                        f"non-finite loss ({float(res.loss.detach())}) at an update; this step was "
                        "abandoned before the update and no checkpoint was written for it. Lower "
                        "train.lr, check the rewards, or use dtype float32"
                    )
                res.loss.backward()
                for k, v in res.metrics.items():
                    acc = shares if k in _LOSS_SHARES else means
                    acc[k] = acc.get(k, 0.0) + v
                n_micro += 1
            norm = _clip(policy, cfg.train.max_grad_norm)
            if not math.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteLossError(
                    f"non-finite gradient norm ({norm}); this step was abandoned before the update "
                    "and no checkpoint was written for it. Lower train.lr or check the rewards"
                )
            norms.append(norm)
            optimizer.step()
            scheduler.step()
            n_updates += 1
    metrics = {k: v / max(n_micro, 1) for k, v in means.items()}
    metrics.update({k: v / max(n_updates, 1) for k, v in shares.items()})
    metrics["grad_norm"] = sum(norms) / max(len(norms), 1)
    metrics["lr"] = scheduler.get_last_lr()[0]
    return metrics


_LOSS_SHARES = {"loss", "pg_loss", "kl_loss", "entropy_loss"}
_GROUP_SURROGATES = {"tpo"}  # losses defined over whole groups: never split a group


def _split(rollout: Rollout, minibatches: int, micro_size: int | None, *, whole_groups: bool):
    """Yield (minibatch indices, [micro-batch indices]) for one epoch in a random order.

    Exactly `minibatches` near-equal parts, also for a partial dynamic-sampling batch. With
    whole_groups the shuffled units are groups, so no group is ever split across micro-batches.
    """
    if whole_groups:
        ids = torch.unique(rollout.group_ids)  # [B]
        units = [
            (rollout.group_ids == g).nonzero().squeeze(1) for g in ids[torch.randperm(len(ids))]
        ]
    else:
        units = list(torch.randperm(len(rollout)).unsqueeze(1))  # one sample per unit
    for part in _chunks(units, min(minibatches, len(units))):
        mb = torch.cat(part)
        size = micro_size or len(mb)
        micro, current = [], []
        for unit in part:  # fill micro-batches with whole units up to `size` samples
            if current and sum(len(u) for u in current) + len(unit) > size:
                micro.append(torch.cat(current))
                current = []
            current.append(unit)
        micro.append(torch.cat(current))
        yield mb, micro


def _chunks(items: list, k: int) -> list[list]:
    """k contiguous near-equal chunks (the first ones one longer), like torch.tensor_split."""
    n, out, start = len(items), [], 0
    for i in range(k):
        end = start + n // k + (1 if i < n % k else 0)
        out.append(items[start:end])
        start = end
    return out


def _clip(policy, max_norm: float | None) -> float:
    params = [p for p in policy.trainable_parameters() if p.grad is not None]
    if not params:
        return 0.0
    bound = max_norm if max_norm is not None else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, bound))


# ---- the loop -----------------------------------------------------------------------------------


def train(cfg: Config) -> dict[str, Any]:
    """Run the configured training; returns {"before": eval metrics, "after": ..., "run_dir": ...}."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one a person should read
    run_dir = cfg.run_dir
    _claim_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir / "config.yaml")
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.run.seed)
    device = _device(cfg.run.device)

    task = build_task(cfg.task.name, **cfg.task.options)
    reward_fns, weights = build_rewards(cfg, task)
    eval_examples = task.eval[: cfg.eval.max_examples] if cfg.eval.max_examples else task.eval
    policy = build_policy(cfg, device)
    optimizer, scheduler = build_optimizer(cfg, policy)
    sampler = build_sampler(cfg, task.train)
    params = sampling_params(cfg)
    ckpts = CheckpointManager(run_dir, keep_last=cfg.checkpoint.keep_last)

    step, before = 0, None
    latest = ckpts.latest() if cfg.run.resume else None
    if latest is not None:
        step, before = _resume(latest, policy, optimizer, scheduler, sampler)
    logger = RunLogger(
        run_dir, cfg.train.steps, backends=cfg.run.log_backends, console=cfg.run.console,
        run_name=cfg.run.name, config=cfg.model_dump(mode="json"), start_step=step,
    )  # fmt: skip
    if cfg.run.resume:  # rewind the logs to the checkpoint; with none yet, drop them all
        logger.truncate_after(step if latest is not None else -1)
    if latest is not None:
        logger.print(f"resumed from {latest} at step {step}")

    def run_eval(at_step: int) -> dict[str, float]:
        if not eval_examples:
            return {}
        policy.eval()
        m, rows = evaluate(
            policy, eval_examples, reward_fns, params,
            batch_size=cfg.eval.batch_size, pass_k=cfg.eval.pass_k,
        )  # fmt: skip
        logger.log(at_step, {f"eval/{k}": v for k, v in m.items()}, split="eval")
        logger.log_samples(at_step, [{"step": at_step, **row} for row in rows])
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        return m

    with logger:
        if before is None:
            before = run_eval(0)
        while step < cfg.train.steps:
            rollout, metrics = rollout_step(cfg, policy, sampler, reward_fns, weights, params, step)
            step += 1
            if rollout is not None:
                metrics.update(prepare(cfg, policy, rollout, weights))
                if isinstance(sampler, DumpSampler):  # the curriculum learns from |advantage|
                    column = cfg.curriculum.source_column
                    sources = [ex[column] for ex in rollout.info["example"]]
                    sampler.update(sources, rollout.advantages.tolist())
                    metrics.update(sampler.metrics())
                metrics.update(update(cfg, policy, optimizer, scheduler, rollout))
            else:
                logger.print(f"step {step}: no informative group after dynamic sampling; skipped")
            logger.log(step, metrics)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                run_eval(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                _save(ckpts, step, policy, optimizer, scheduler, sampler, before)
        after = run_eval(step)
        _save(ckpts, step, policy, optimizer, scheduler, sampler, before)
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return {"before": before, "after": after, "run_dir": str(run_dir),
            "accuracy_key": accuracy_key(reward_fns)}  # fmt: skip


def _claim_run_dir(cfg: Config) -> None:
    """Refuse to mix two runs in one directory unless resuming or explicitly overwriting."""
    run_dir = cfg.run_dir
    if cfg.run.resume or not (run_dir / "metrics.jsonl").exists():
        return
    if not cfg.run.overwrite:
        raise ValueError(
            f"run directory {str(run_dir)!r} already holds a run; set run.resume=true to continue "
            "it, run.overwrite=true to start afresh, or choose another run.name"
        )
    for name in ("metrics.jsonl", "samples.jsonl", "samples.md", "curves.png"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device='cuda' but no CUDA device is available")
    return torch.device(name)


def _save(ckpts, step, policy, optimizer, scheduler, sampler, before) -> None:
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "eval_before": before,
        # LoRA adapters are small and not recoverable from the merged save: keep them here too
        "adapter": policy.state_dict() if policy.lora is not None else None,
    }
    ckpts.save(
        step,
        save_model=policy.save_pretrained,
        state=state,
        check_finite=policy.trainable_parameters(),
    )


def _resume(path: Path, policy, optimizer, scheduler, sampler) -> tuple[int, dict | None]:
    state = CheckpointManager.load(path)
    if state.get("adapter") is not None:
        policy.load_state_dict(state["adapter"])
    else:
        policy.load_saved_weights(path / "model")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    restore_rng(state)
    return int(state["step"]), state.get("eval_before")
