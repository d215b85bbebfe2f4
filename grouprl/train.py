"""The training loop: one readable pass from config to a trained policy, modality-blind.

It knows a Workload (grouprl/workloads/: what text, agents, images ... do at each point below),
a Policy, the objectives and the runtime, and never asks which modality it runs.

Each step:  workload.collect: prompts_per_step x group_size samples, scored
            -> (dynamic sampling: drop zero-variance groups, sample more)
            -> workload.prepare: old / reference log-probs, advantages
            -> mu epochs x minibatches of workload.micro_loss (gradient accumulation over
               micro-batches), AdamW
            -> log, evaluate every k steps, checkpoint every k steps.
"""

from __future__ import annotations

import faulthandler
import math
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grouprl.config.loading import (
    Config,
    config_json,
)
from grouprl.envs.rewards.health import DEFAULT_MAX_FAILED_STEPS, RewardHealth
from grouprl.envs.tasks import TaskData, build_task
from grouprl.objectives import count_tokens
from grouprl.objectives.group_losses import GROUP_SURROGATES
from grouprl.policies.dropout import disable_policy_dropout
from grouprl.policies.precision import LossScaler, loss_scaler_for
from grouprl.policies.text.engines.sync import push_weights, release_engine
from grouprl.rollouts.batching import single_pass as is_single_pass
from grouprl.rollouts.curriculum import DumpSampler, response_advantages
from grouprl.rollouts.hooks import SignalHooks
from grouprl.rollouts.prompt_guard import apply_prompt_guard
from grouprl.rollouts.step import rollout_step
from grouprl.runtime.async_rollout import rollout_source
from grouprl.runtime.build import build_optimizer, build_sampler, seed_everything
from grouprl.runtime.distributed import SINGLE, Dist
from grouprl.runtime.distributed import setup as setup_dist
from grouprl.runtime.logging import RunLogger
from grouprl.runtime.logp_gap import first_step_gap
from grouprl.runtime.nonfinite import check_nonfinite_streak
from grouprl.runtime.plots import plot_curves
from grouprl.runtime.reward_guard import isolate_rewards, isolation_settings
from grouprl.runtime.run_state import check_run_dir, claim_run_dir, resume_from, save_checkpoint
from grouprl.runtime.throughput import StepMeter
from grouprl.runtime.user_inputs import (
    check_model_path,
    enable_crash_traces,
    user_code_on_path,
)
from grouprl.types import Rollout
from grouprl.workloads import build_policy, build_rewards, refuse_unsupported, workload_of
from grouprl.workloads.base import Parts, Workload


class UserCodeExit(RuntimeError):
    """User code (a reward, an env, a tool) raised SystemExit inside the run: the run stops with
    an error instead of `grouprl train` exiting 0 with the steps undone."""


# ---- one step -----------------------------------------------------------------------------------


def _disable_dropout(cfg: Config, policy) -> None:
    """train.disable_dropout: all dropout p = 0 (policies/dropout.py); a LoRA dropout the user set
    is switched off with a warning naming both options."""
    lora = getattr(cfg.model, "lora", None)
    if lora is not None and getattr(lora, "dropout", 0.0) > 0:
        warnings.warn(
            f"model.lora.dropout={lora.dropout} is switched off by train.disable_dropout=true "
            "(the sampler never applies dropout, so the trainer's log-probs would not match its "
            "own); set train.disable_dropout=false to keep it",
            stacklevel=2,
        )
    disable_policy_dropout(policy)


def update(
    cfg: Config,
    workload: Workload,
    policy,
    optimizer,
    scheduler,
    rollout: Rollout,
    dist: Dist = SINGLE,
    scaler: LossScaler | None = None,
) -> dict[str, float]:
    """mu epochs x minibatches optimizer updates; micro-batches accumulate with global counts.
    Several processes: each trains its share of every minibatch (grouprl/runtime/distributed/dist.py).
    scaler: float16's dynamic loss scaling (policies/precision.py); an update that overflows halves
    the scale and is redone on the same minibatch (up to MAX_OVERFLOW_RETRIES times), without
    counting as a non-finite failure."""
    scaler = scaler if scaler is not None else LossScaler(False)
    a = cfg.algorithm
    single_pass = is_single_pass(cfg)  # pi_old = the update's own detached forward
    whole_groups = a.surrogate.type in GROUP_SURROGATES  # a group-level loss never splits a group
    shares: dict[str, float] = {}  # loss terms: summed over micro-batches of an update
    means: dict[str, float] = {}  # per-micro-batch statistics: averaged
    norms: list[float] = []
    n_micro = n_updates = 0
    skipped = [0, 0]  # updates skipped for a non-finite [loss, gradient norm]
    overflows = 0  # fp16: halvings of the loss scale after an overflow (each redoes its update)
    policy.train()
    for _ in range(a.epochs):
        for mb, micro_batches in dist.split_batch(rollout, a.minibatches, cfg.train.micro_batch_size,
                                                  whole_groups=whole_groups):  # fmt: skip
            counts = count_tokens(
                rollout.mask[mb],
                max_len=workload.max_len(),
                group_ids=rollout.group_ids[mb],
            )  # global counts of this optimizer update: tokens, sequences, groups
            # float16: an update whose gradients overflow at the current loss scale is redone on
            # the same minibatch at the halved scale (GradScaler would drop it: here a minibatch
            # is a whole sampling round's data), at most MAX_OVERFLOW_RETRIES times
            for attempt in range(MAX_OVERFLOW_RETRIES + 1):
                optimizer.zero_grad(set_to_none=True)
                parts: list[dict[str, float]] = []  # metrics of this update's micro-batches
                for k, idx in enumerate(micro_batches):
                    dist.set_sync(k == len(micro_batches) - 1)  # processes sync grads on the last
                    # an empty idx: zero-weight padding (distributed)
                    sub = dist.select(rollout, idx)
                    res, old = workload.micro_loss(sub, counts, single_pass=single_pass)
                    if single_pass:  # keep the trainer's score of the sampling weights (pi_old)
                        rollout.old_logp[idx] = old
                    if not torch.isfinite(res.loss) and dist.world == 1:
                        break  # the update is skipped below (processes: all agree first)
                    dist.backward(scaler.scale_loss(res.loss))
                    if len(idx):
                        parts.append(res.metrics)
                finite_loss = dist.all_finite(parts, micro_batches)
                params = policy.trainable_parameters()
                if finite_loss:
                    scaler.unscale_(params)
                norm = (
                    dist.clip_grad_norm(params, cfg.train.max_grad_norm)
                    if finite_loss
                    else math.nan
                )
                overflow = not math.isfinite(norm) and finite_loss and scaler.skip()
                overflows += int(overflow)  # each halving of the scale
                if not overflow or attempt == MAX_OVERFLOW_RETRIES:
                    break
            if not math.isfinite(norm):  # NaN/inf loss or gradient: skip this one update
                optimizer.zero_grad(set_to_none=True)
                if not overflow:  # an fp16 overflow left after the retries is not a failure
                    skipped[0 if not finite_loss else 1] += 1
                _advance_schedule_only(scheduler)
                continue
            for part in parts:
                for k, v in part.items():
                    acc = shares if k in _LOSS_SHARES else means
                    acc[k] = acc.get(k, 0.0) + v
            n_micro += len(parts)
            norms.append(norm)
            scaler.step(optimizer)
            scheduler.step()
            n_updates += 1
    means, shares, n_micro = dist.sum_metrics(means, shares, n_micro)  # over all processes
    metrics = {k: v / max(n_micro, 1) for k, v in means.items()}
    metrics.update({k: v / max(n_updates, 1) for k, v in shares.items()})
    metrics["grad_norm"] = sum(norms) / len(norms) if norms else math.nan
    metrics["lr"] = scheduler.get_last_lr()[0]
    metrics["skipped_nonfinite"] = float(sum(skipped))  # updates skipped: [loss, gradient]
    metrics["skipped_nonfinite/loss"], metrics["skipped_nonfinite/grad"] = map(float, skipped)
    if scaler.enabled:
        metrics["amp/loss_scale"], metrics["amp/overflows"] = scaler.scale, float(overflows)
    return metrics


def _advance_schedule_only(scheduler) -> None:
    """Step the lr schedule for a skipped update, so the lr stays a function of the update index
    (torch warns when a scheduler steps before any optimizer step: expected here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


_LOSS_SHARES = {"loss", "pg_loss", "kl_loss", "entropy_loss", "distill_loss"}
MAX_OVERFLOW_RETRIES = 16  # float16: halvings of the loss scale tried on one minibatch (2^16 -> 1)


# ---- the loop -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Given:
    """Parts of a run built by the caller (the Python API's Trainer, `grouprl eval`); the loop
    builds every other part from the config. Builders rather than objects, so that each runs
    where its config-made counterpart would (after the seeding, before the run directory is
    touched).

    task:   cfg -> the task (train / eval examples and the task's reward functions)
    policy: (cfg, device) -> the policy
    """

    task: Callable[[Any], TaskData] | None = None
    policy: Callable[[Any, torch.device], Any] | None = None


NOTHING_GIVEN = Given()


def train(cfg: Config, given: Given = NOTHING_GIVEN) -> dict[str, Any]:
    """Run the configured training; returns {"before": eval metrics, "after": ..., "run_dir": ...}.

    Setup order (the run directory is touched only once everything is built): read-only checks of
    the run directory (a run there needs run.resume / run.overwrite; a resume compares configs),
    then task, rewards, model, optimizer and sampler, and only then the run directory is claimed
    (an old run deleted with run.overwrite, the configs written). User modules resolve from the
    working directory (user_inputs.user_code_on_path); SystemExit from user code becomes
    UserCodeExit; a crash of the interpreter (a segfaulting reward) prints every thread's Python
    stack, naming the function that crashed (faulthandler). given: parts built by the caller."""
    with ExitStack() as stack:
        stack.enter_context(user_code_on_path())
        if enable_crash_traces():
            stack.callback(faulthandler.disable)
        try:
            return _train(cfg, stack, given)
        except SystemExit as exc:
            raise UserCodeExit(
                f"the run stopped: {exit_origin(exc)} raised SystemExit({exc.code!r}) (e.g. "
                "sys.exit() or exit()) inside the training loop; user code must return or raise "
                "an exception, never exit the trainer"
            ) from exc


def exit_origin(exc: BaseException) -> str:
    """'function f (file.py, line 3)' for the innermost frame outside grouprl, torch and the
    standard library: the user code that raised."""
    import sysconfig
    import traceback

    ours = str(Path(__file__).resolve().parent)
    skip = (ours, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(skip)]  # fmt: skip
    if not frames:
        return "user code"
    f = frames[-1]
    return f"function {f.name!r} ({f.filename}, line {f.lineno})"


def _train(cfg: Config, stack: ExitStack, given: Given) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one a person should read
    run_dir = cfg.run_dir
    dist = setup_dist(cfg)  # accelerate launch: this process's place; else one process
    kind = workload_of(cfg)
    refuse_unsupported(kind, cfg, dist.world)  # what the workload cannot do: one clear error
    changes = check_run_dir(cfg)  # reads only: refuses mixing runs and unasked config changes
    check_model_path(cfg.model)  # a missing local folder: one clear error, not the hub's
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.run.seed)
    device = dist.device_for(cfg.run.device)

    task = given.task(cfg) if given.task else build_task(cfg.task.name, **cfg.task.options)
    reward_fns, weights = build_rewards(cfg, task)
    reward_fns = isolate_rewards(
        reward_fns, isolation_settings(cfg.rewards), fail_fast=cfg.run.fail_fast
    )  # rewards with a timeout_s run per sample in workers with a deadline
    stack.callback(close_rewards, reward_fns)  # isolated rewards: their workers and descendants end
    eval_examples = task.eval[: cfg.eval.max_examples] if cfg.eval.max_examples else task.eval
    policy = given.policy(cfg, device) if given.policy else build_policy(cfg, device)
    lora_targets = getattr(policy, "lora_targets", None)  # resolved from the model: logged, saved
    if cfg.train.disable_dropout:
        _disable_dropout(cfg, policy)
    optimizer, scheduler = build_optimizer(cfg, policy)
    scaler = loss_scaler_for(cfg.model.dtype)  # float16: dynamic loss scaling
    policy, optimizer = dist.prepare(policy, optimizer)  # DDP / FSDP2 / DeepSpeed wrapping
    if kind.capabilities.prompt_guard:  # over-long prompts: filter / truncate / error
        task.train, eval_examples = apply_prompt_guard(cfg, policy, task.train, eval_examples)
    workload = kind(Parts(cfg, policy, reward_fns, weights, dist))
    sampler = build_sampler(cfg, task.train)
    hooks = SignalHooks(cfg.rollout.hooks)  # hint / replay for groups without signal
    if dist.is_main:  # everything is built: only now is the run directory touched
        claim_run_dir(cfg, changes, lora_targets=lora_targets)
    dist.barrier()
    ckpts = dist.checkpoints(run_dir, keep_last=cfg.checkpoint.keep_last)  # main writes

    step, before, after, nonfinite_streak = 0, None, None, 0
    latest = ckpts.latest(verify=True) if cfg.run.resume else None  # checksums: skip damaged
    if latest is not None:
        step, before, after = resume_from(
            latest, policy, optimizer, scheduler, sampler, scaler=scaler, hooks=hooks
        )
    push_weights(policy, dist)  # a shared engine may hold older weights (another run's, pre-resume)
    logger = dist.logger_class(RunLogger)(
        run_dir, cfg.train.steps, backends=cfg.run.log_backends, console=cfg.run.console,
        run_name=cfg.run.name, config=config_json(cfg), start_step=step,
    )  # fmt: skip
    if cfg.run.resume:  # rewind the logs to the checkpoint; with none yet, drop them all
        logger.truncate_after(step if latest is not None else -1)
    for note in ckpts.rejected:
        logger.print(note)
    if latest is not None:
        logger.print(f"resumed from {latest} at step {step}")
    head_note = getattr(policy, "head_note", None)
    if head_note:  # the load-time probe's choice (policies/text/scoring_probe.py)
        logger.print(head_note)
    gap_due = True  # runtime/logp_gap.py: checked on the first step that has a rollout

    def run_eval(at_step: int) -> dict[str, float]:
        if not eval_examples:
            return {}
        policy.eval()
        m, rows = workload.evaluate(eval_examples, step=at_step)
        logger.log(at_step, {f"eval/{k}": v for k, v in m.items()}, split="eval")
        logger.log_samples(at_step, [{"step": at_step, **row} for row in rows])
        if dist.is_main:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        return m

    limits = {r.name.rsplit(":", 1)[-1]: r.max_failed_steps for r in cfg.rewards}
    health = RewardHealth({k: limits.get(k, DEFAULT_MAX_FAILED_STEPS) for k in reward_fns})
    rollouts = rollout_source(cfg, policy, sampler, lambda at, pol: rollout_step(
        cfg, workload, pol, sampler, reward_fns, weights, at, dist, health, hooks), dist.world)  # fmt: skip

    meter = StepMeter.for_run(cfg, device, dist.world)  # perf/ metrics (runtime/throughput.py)
    with logger:
        if before is None:
            before = run_eval(0)
        while step < cfg.train.steps:
            meter.start_step()
            with meter.stage("generate"):
                rollout, metrics = rollouts.next(step, policy)  # async: sampled while stepping
                release_engine(policy)  # GPU, rollout.vllm.sleep: vLLM frees memory for the update
            step, after = step + 1, None  # a step ran: the final evaluation is due (again)
            if rollout is not None:
                with meter.stage("prepare"):
                    metrics.update(workload.prepare(dist.scorer(policy), rollout, weights))
                rollouts.after_prepare(rollout)  # bounded async: staleness down-weights
                if isinstance(sampler, DumpSampler):  # the curriculum learns from |advantage|
                    column = cfg.curriculum.source_column
                    sources = [ex[column] for ex in rollout.examples]
                    sampler.update(sources, response_advantages(rollout.advantages, rollout.mask))
                    metrics.update(sampler.metrics())
                with meter.stage("update"):
                    metrics.update(
                        update(cfg, workload, policy, optimizer, scheduler, rollout, dist, scaler)
                    )
                dist.share_old_logp(rollout)  # processes: every row's trainer score, for below
                # engine-vs-trainer mismatch; DiffusionNFT's old / AWM's EMA weights follow
                metrics.update(workload.after_update(step, rollout))
            if gap_due:  # the first step of this run or resume: a silent gap stops the run
                gap_due = first_step_gap(cfg, rollout, logger.print)
            if rollout is not None:
                with meter.stage("weight_sync"):
                    push_weights(policy, dist)  # the engine samples the next step with new weights
            else:
                logger.print(f"step {step}: no informative group after dynamic sampling; skipped")
            metrics.update(meter.metrics(workload, rollout, metrics))
            for note in meter.pop_notes():
                logger.print(note)
            logger.log(step, metrics)
            nonfinite_streak = check_nonfinite_streak(cfg, logger, step, metrics, nonfinite_streak)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                run_eval(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                save_checkpoint(ckpts, step, policy, optimizer, scheduler,
                                rollouts.saved_sampler(sampler), before, scaler=scaler,
                                hooks=hooks)  # fmt: skip
        rollouts.close()  # one_step_off: no batch is in flight after the last step
        # the last step's checkpoint is written once, after the final evaluation, holding its
        # result: a crash in between redoes the last step; a finished run resumed does nothing
        if after is None:
            after = run_eval(step)
            save_checkpoint(
                ckpts, step, policy, optimizer, scheduler, sampler, before, after, scaler=scaler,
                hooks=hooks,
            )  # fmt: skip
        if dist.is_main:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return {"before": before, "after": after, "run_dir": str(run_dir),
            "accuracy_key": workload.accuracy_key()}  # fmt: skip


def close_rewards(reward_fns: dict) -> None:
    """Stop the worker processes of isolated rewards (and everything they started)."""
    for fn in reward_fns.values():
        close = getattr(fn, "close", None)
        if callable(close):
            close()
