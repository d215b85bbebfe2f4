"""The training loop: one readable pass from config to a trained policy, modality-blind.

Each step:  sample prompts_per_step x group_size  ->  score with the reward functions
            -> (dynamic sampling: drop zero-variance groups, sample more)
            -> old / reference log-probs  ->  advantages
            -> mu epochs x minibatches (gradient accumulation over micro-batches), AdamW
            -> log, evaluate every k steps, checkpoint every k steps.
"""

from __future__ import annotations

import copy
import faulthandler
import math
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel

from grouprl.config.loading import (
    Config,
    apply_overrides,
    config_json,
    read_config,
    user_settings,
    validate,
)
from grouprl.envs.gym import env_name
from grouprl.envs.rewards.health import DEFAULT_MAX_FAILED_STEPS, RewardHealth
from grouprl.envs.rewards.loading import python_rewards
from grouprl.envs.tasks import TaskData, build_task
from grouprl.objectives import count_tokens, total_loss
from grouprl.policies.dropout import disable_policy_dropout
from grouprl.policies.precision import DTYPES, LossScaler, compute_dtype_of, loss_scaler_for
from grouprl.policies.text.engines.sync import push_weights, release_engine, step_mismatch
from grouprl.rollouts import episodes, image_loss, images
from grouprl.rollouts.curriculum import DumpSampler, response_advantages
from grouprl.rollouts.evaluation import accuracy_key, evaluate
from grouprl.rollouts.filters import sample_until_full
from grouprl.rollouts.images import is_images
from grouprl.rollouts.prepare import prepare
from grouprl.rollouts.prompt_guard import apply_prompt_guard
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.async_rollout import prepare_config, rollout_source
from grouprl.runtime.build import (
    build_optimizer,
    build_policy,
    build_rewards,
    build_sampler,
    causal_lm_policy,
    device_for,
    sampling_params,
    seed_everything,
)
from grouprl.runtime.distributed.dist import SINGLE, Dist
from grouprl.runtime.distributed.dist import setup as setup_dist
from grouprl.runtime.logging import RunLogger
from grouprl.runtime.plots import plot_curves
from grouprl.runtime.reward_guard import drain_reward_metrics, isolate_rewards, isolation_settings
from grouprl.runtime.run_state import check_run_dir, claim_run_dir, resume_from, save_checkpoint
from grouprl.runtime.user_inputs import (
    check_model_path,
    enable_crash_traces,
    is_python_object,
    python_object,
    python_objects_in,
    user_code_on_path,
)
from grouprl.types import Rollout


class UserCodeExit(RuntimeError):
    """User code (a reward, an env, a tool) raised SystemExit inside the run: the run stops with
    an error instead of `grouprl train` exiting 0 with the steps undone."""


class NonFiniteLossError(RuntimeError):
    """train.max_nonfinite_steps steps in a row had a NaN/inf loss or gradient (each such update
    was skipped, so the weights and checkpoints hold finite values only)."""


# ---- one step -----------------------------------------------------------------------------------


def rollout_step(
    cfg,
    policy,
    sampler,
    reward_fns,
    weights,
    params,
    step,
    dist: Dist = SINGLE,
    health: RewardHealth | None = None,
) -> tuple[Rollout | None, dict]:
    """Sample and score one batch of groups (with DAPO dynamic sampling when configured).
    Several processes: each samples a share of the groups, all get the whole scored batch.
    health: warns about / stops on a reward that fails on every sample (envs/rewards/health.py)."""
    r, a = cfg.rollout, cfg.algorithm
    errors_total: dict[str, int] = {}
    first_errors: dict[str, str] = {}
    scored = [0]  # samples the reward functions saw this step, over all sampling rounds
    seed = cfg.run.seed if cfg.rollout.seeding == "per_sample" else None

    def one_round(round_index: int) -> Rollout:
        examples = sampler.next(r.prompts_per_step)
        first_id = (step * a.max_sampling_rounds + round_index) * r.prompts_per_step
        if is_agent(cfg):  # multi-turn episodes: the environment gives the rewards

            def episodes_of(part: list[dict], first: int) -> tuple[Rollout, dict]:
                got = episodes.collect(
                    cfg, policy, part, params, group_size=r.group_size, first_group_id=first
                )
                return got, {}  # no reward-function errors: the env gives the rewards

            return dist.gather_groups(examples, first_id, episodes_of)[0]
        if is_images(cfg):  # images / video: flow or DDIM policy, image rewards
            rollout, errors = images.collect(
                cfg, policy, examples, reward_fns, first_group_id=first_id,
                optimizer_step=step * a.epochs * a.minibatches,  # MixGRPO's window position
                first_errors=first_errors,
            )  # fmt: skip
        else:
            rollout, errors = dist.gather_groups(examples, first_id, lambda part, first: collect(
                policy, part, r.group_size, params, reward_fns,
                first_group_id=first, fail_fast=cfg.run.fail_fast, seed=seed,
                first_errors=first_errors,
            ))  # fmt: skip
        scored[0] += len(rollout.group_ids)  # images and text alike
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
    for k, v in dist.sum_counts(drain_reward_metrics(reward_fns)).items():  # isolated rewards'
        metrics[k] = metrics.get(k, 0.0) + v
    if health is not None and not is_agent(cfg):
        for name, fn in reward_fns.items():  # isolated rewards keep their first error text
            pop = getattr(fn, "pop_first_error", None)
            text = pop() if callable(pop) else None
            if text is not None:
                first_errors.setdefault(name, text)
        failures = {
            name: metrics.get(f"reward_errors/{name}", 0.0)
            + metrics.get(f"reward_timeouts/{name}", 0.0)
            for name in reward_fns
        }
        health.observe(step, failures, scored[0], first_errors)
    if rollout is not None and is_agent(cfg):
        metrics.update(episodes.episode_metrics(rollout))
        rollout = episodes.keep_informative(cfg, rollout)
    return rollout, metrics


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


def is_agent(cfg: Config) -> bool:
    return cfg.task.name == "env"


def max_completion_len(cfg: Config) -> int:
    """L_max of the constant normalisers: one completion, a whole multi-turn episode, or the
    denoising steps of an image rollout."""
    if is_images(cfg):
        return cfg.diffusion.rollout_steps
    return cfg.agent.max_total_tokens if is_agent(cfg) else cfg.rollout.max_new_tokens


def update(
    cfg: Config,
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
    a, temp = cfg.algorithm, cfg.rollout.temperature
    # one_step_off: old_logp was scored with the sampling weights, never the current ones
    single_pass = a.epochs == 1 and a.minibatches == 1 and cfg.train.async_mode == "off"
    need_entropy = a.entropy_coef != 0 or a.top_entropy_quantile < 1
    shares: dict[str, float] = {}  # loss terms: summed over micro-batches of an update
    means: dict[str, float] = {}  # per-micro-batch statistics: averaged
    norms: list[float] = []
    n_micro = n_updates = 0
    skipped = [0, 0]  # updates skipped for a non-finite [loss, gradient norm]
    overflows = 0  # fp16: halvings of the loss scale after an overflow (each redoes its update)
    policy.train()
    for _ in range(a.epochs):
        for mb, micro_batches in dist.split_batch(rollout, a.minibatches, cfg.train.micro_batch_size,
                                        whole_groups=a.surrogate in _GROUP_SURROGATES):  # fmt: skip
            counts = count_tokens(
                rollout.mask[mb],
                max_len=max_completion_len(cfg),
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
                    if is_images(cfg):  # flow / diffusion: rollouts/image_loss.py
                        res, old = image_loss.micro_loss(cfg, policy, sub, counts, single_pass)
                        if single_pass:
                            rollout.old_logp[idx] = old
                    else:
                        out = policy.log_probs(
                            sub.actions,
                            temperature=temp,
                            with_entropy=True,
                            entropy_grad=need_entropy,
                        )
                        old = out.logp.detach() if single_pass else sub.old_logp  # [n, T]
                        if single_pass:  # keep the trainer's score of the sampling weights (pi_old)
                            rollout.old_logp[idx] = old
                        if cfg.rollout.old_logp == "engine":
                            old = sub.engine_logp
                        res = total_loss(
                            out, old_logp=old, advantages=sub.advantages, mask=sub.mask,
                            algo=a, counts=counts, ref_logp=sub.ref_logp, engine_logp=sub.engine_logp,
                            group_ids=sub.group_ids, token_scales=sub.token_scales,
                            seq_weights=sub.seq_weights,
                        )  # fmt: skip
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


def check_nonfinite_streak(cfg: Config, logger, step: int, metrics: dict, streak: int) -> int:
    """Count steps in a row with a skipped update; print each; stop the run at the limit."""
    skipped = metrics.get("skipped_nonfinite", 0.0)
    if not skipped:
        return 0
    streak += 1
    limit = cfg.train.max_nonfinite_steps
    what = "loss" if metrics.get("skipped_nonfinite/loss") else "gradient"
    logger.print(
        f"step {step}: non-finite {what}; {int(skipped)} update(s) skipped, weights untouched "
        f"({streak} step(s) in a row, train.max_nonfinite_steps={limit})"
    )
    if streak >= limit:
        raise NonFiniteLossError(
            f"stopping at step {step}: {streak} step(s) in a row had a non-finite {what} "
            f"(train.max_nonfinite_steps={limit}); those updates were skipped and no non-finite "
            "value was saved. Lower train.lr, check the rewards, or use dtype float32"
        )
    return streak


_LOSS_SHARES = {"loss", "pg_loss", "kl_loss", "entropy_loss"}
_GROUP_SURROGATES = {"tpo"}  # losses defined over whole groups: never split a group
MAX_OVERFLOW_RETRIES = 16  # float16: halvings of the loss scale tried on one minibatch (2^16 -> 1)


def held_out(
    cfg: Config, policy, examples: list[dict], reward_fns, weights, params, step: int
) -> tuple[dict[str, float], list[dict]]:
    """The held-out evaluation of the policy's current weights: metrics and sample rows."""
    policy.eval()
    if is_agent(cfg):
        return episodes.evaluate(cfg, policy, examples, params)
    if is_images(cfg):  # fixed prompts and seeds; the image grid goes to run_dir/images/
        return images.evaluate(cfg, policy, examples, reward_fns, weights, step=step)
    m, rows = evaluate(
        policy, examples, reward_fns, params,
        batch_size=cfg.eval.batch_size, pass_k=cfg.eval.pass_k,
    )  # fmt: skip
    m.update(drain_reward_metrics(reward_fns))
    return m, rows


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
                f"the run stopped: {_exit_origin(exc)} raised SystemExit({exc.code!r}) (e.g. "
                "sys.exit() or exit()) inside the training loop; user code must return or raise "
                "an exception, never exit the trainer"
            ) from exc


def _exit_origin(exc: BaseException) -> str:
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
    stack.callback(_close_all, reward_fns)  # isolated rewards: their workers and descendants end
    eval_examples = task.eval[: cfg.eval.max_examples] if cfg.eval.max_examples else task.eval
    policy = given.policy(cfg, device) if given.policy else build_policy(cfg, device)
    if cfg.train.disable_dropout:
        _disable_dropout(cfg, policy)
    optimizer, scheduler = build_optimizer(cfg, policy)
    scaler = loss_scaler_for(cfg.model.dtype)  # float16: dynamic loss scaling
    policy, optimizer = dist.prepare(policy, optimizer)  # DDP / FSDP2 / DeepSpeed wrapping
    task.train, eval_examples = apply_prompt_guard(  # over-long prompts: filter / truncate / error
        cfg,
        policy,
        task.train,
        eval_examples,
        single_turn_text=not (is_agent(cfg) or is_images(cfg)),
    )
    sampler = build_sampler(cfg, task.train)
    params = sampling_params(cfg)
    if dist.is_main:  # everything is built: only now is the run directory touched
        claim_run_dir(cfg, changes)
    dist.barrier()
    ckpts = dist.checkpoints(run_dir, keep_last=cfg.checkpoint.keep_last)  # main writes

    step, before, after, nonfinite_streak = 0, None, None, 0
    latest = ckpts.latest(verify=True) if cfg.run.resume else None  # checksums: skip damaged
    if latest is not None:
        step, before, after = resume_from(
            latest, policy, optimizer, scheduler, sampler, scaler=scaler
        )
    push_weights(policy)  # a shared engine may hold older weights (another run's, pre-resume)
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

    def run_eval(at_step: int) -> dict[str, float]:
        if not eval_examples:
            return {}
        m, rows = held_out(cfg, policy, eval_examples, reward_fns, weights, params, at_step)
        logger.log(at_step, {f"eval/{k}": v for k, v in m.items()}, split="eval")
        logger.log_samples(at_step, [{"step": at_step, **row} for row in rows])
        if dist.is_main:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        return m

    limits = {r.name.rsplit(":", 1)[-1]: r.max_failed_steps for r in cfg.rewards}
    health = RewardHealth({k: limits.get(k, DEFAULT_MAX_FAILED_STEPS) for k in reward_fns})
    rollouts = rollout_source(cfg, policy, sampler, lambda at, pol: rollout_step(
        cfg, pol, sampler, reward_fns, weights, params, at, dist, health), dist.world)  # fmt: skip
    prepare_cfg = prepare_config(cfg)  # one_step_off: old_logp is the sampling weights' already

    with logger:
        if before is None:
            before = run_eval(0)
        while step < cfg.train.steps:
            rollout, metrics = rollouts.next(step, policy)  # async: sampled while stepping
            release_engine(policy)  # GPU, rollout.vllm.sleep: vLLM frees memory for the update
            step, after = step + 1, None  # a step ran: the final evaluation is due (again)
            if rollout is not None:
                metrics.update(prepare(prepare_cfg, dist.scorer(policy), rollout, weights))
                if isinstance(sampler, DumpSampler):  # the curriculum learns from |advantage|
                    column = cfg.curriculum.source_column
                    sources = [ex[column] for ex in rollout.info["example"]]
                    sampler.update(sources, response_advantages(rollout.advantages, rollout.mask))
                    metrics.update(sampler.metrics())
                metrics.update(update(cfg, policy, optimizer, scheduler, rollout, dist, scaler))
                dist.share_old_logp(rollout)  # processes: every row's trainer score, for below
                if is_images(cfg):  # DiffusionNFT's old / AWM's EMA weights follow
                    metrics.update(image_loss.after_update(cfg, policy, step))
                metrics.update(step_mismatch(cfg, rollout))  # engine vs trainer log-probs
                push_weights(policy)  # the engine samples the next step with the new weights
            else:
                logger.print(f"step {step}: no informative group after dynamic sampling; skipped")
            logger.log(step, metrics)
            nonfinite_streak = check_nonfinite_streak(cfg, logger, step, metrics, nonfinite_streak)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                run_eval(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                save_checkpoint(ckpts, step, policy, optimizer, scheduler,
                                rollouts.saved_sampler(sampler), before, scaler=scaler)  # fmt: skip
        rollouts.close()  # one_step_off: no batch is in flight after the last step
        # the last step's checkpoint is written once, after the final evaluation, holding its
        # result: a crash in between redoes the last step; a finished run resumed does nothing
        if after is None:
            after = run_eval(step)
            save_checkpoint(
                ckpts, step, policy, optimizer, scheduler, sampler, before, after, scaler=scaler
            )
        if dist.is_main:
            plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    return {"before": before, "after": after, "run_dir": str(run_dir),
            "accuracy_key": "success" if is_agent(cfg) else accuracy_key(reward_fns)}  # fmt: skip


def _close_all(reward_fns: dict) -> None:
    """Stop the worker processes of isolated rewards (and everything they started)."""
    for fn in reward_fns.values():
        close = getattr(fn, "close", None)
        if callable(close):
            close()


# ---- evaluation alone, and the Python API ------------------------------------------------------


def run_evaluation(
    cfg: Config, given: Given = NOTHING_GIVEN
) -> tuple[dict[str, float], list[dict]]:
    """The held-out evaluation alone (`Trainer.evaluate`, `grouprl eval`): builds the task,
    rewards and policy as `train` does and evaluates the policy's current weights on the eval
    split, seeded with run.seed. The run directory is neither read nor written (images: the grid
    goes to run_dir/images/, as in training)."""
    with ExitStack() as stack:
        stack.enter_context(user_code_on_path())
        try:
            seed_everything(cfg.run.seed)
            device = device_for(cfg.run.device)
            task = given.task(cfg) if given.task else build_task(cfg.task.name, **cfg.task.options)
            reward_fns, weights = build_rewards(cfg, task)
            reward_fns = isolate_rewards(
                reward_fns, isolation_settings(cfg.rewards), fail_fast=cfg.run.fail_fast
            )
            stack.callback(_close_all, reward_fns)
            policy = given.policy(cfg, device) if given.policy else build_policy(cfg, device)
            examples = task.eval[: cfg.eval.max_examples] if cfg.eval.max_examples else task.eval
            _, examples = apply_prompt_guard(
                cfg, policy, task.train, examples,
                single_turn_text=not (is_agent(cfg) or is_images(cfg)),
            )  # fmt: skip
            if not examples:
                raise ValueError(
                    f"task {cfg.task.name!r} has no held-out examples to evaluate on: give it an "
                    "eval split (e.g. task.options.eval_fraction / eval_source, or the Python "
                    "API's eval_dataset=)"
                )
            return held_out(cfg, policy, examples, reward_fns, weights, sampling_params(cfg), 0)
        except SystemExit as exc:
            raise UserCodeExit(
                f"the evaluation stopped: {_exit_origin(exc)} raised SystemExit({exc.code!r})"
            ) from exc


class Trainer:
    """The Python API: a run of `config` whose parts may be given as Python objects.

        trainer = Trainer("run.yaml", policy=model, tokenizer=tok, reward_fns=my_reward,
                          dataset=[{"prompt": "2+3=", "answer": "5"}, ...])
        result = trainer.train()      # what `grouprl train` does: {"before", "after", "run_dir", ...}
        metrics = trainer.evaluate()  # held-out metrics of the current weights

    config:       a Config, a mapping as the YAML file holds, or a YAML path; `overrides` are
                  dotted key=value strings applied to a mapping or file.
    policy:       a transformers causal LM (its tokenizer as `tokenizer=`), a ready grouprl policy
                  (e.g. a CausalLMPolicy), or a model name / path (model.name_or_path).
    reward_fns:   a function `fn(prompts=..., completions=..., **columns) -> list[float | None]`,
                  a dict name -> function, or a list of functions and reward names ('format',
                  'module:function'); `reward_weights`: name -> weight (default 1).
    dataset:      a list of dicts, a datasets.Dataset / DatasetDict, or a file / hub name: the
                  `source` of the config's task (default task: `prompts`, a "prompt" column plus
                  any columns the rewards read); `eval_dataset`: its held-out `eval_source`.
    env:          a callable returning a text gymnasium env (str observations and actions, a
                  `system_prompt`), or a registered env id: the `env_id` of an agent run.
    A part the config names too (config `rewards` and reward_fns=, model.name_or_path and
    policy=, ...) is an error naming both. The run's config.yaml records each object as
    "<python>:what" (e.g. `rewards: [{name: "<python>:reward_len"}]`); such a file may be given
    back to Trainer with the same objects.

    `self.config` is the validated Config; `self.policy` the policy, once built (by train() or
    evaluate()), whose weights later calls continue from.
    """

    def __init__(
        self,
        config: Config | dict | str | Path,
        *,
        overrides: list[str] = (),
        policy: Any = None,
        tokenizer: Any = None,
        reward_fns: Any = None,
        reward_weights: dict[str, float] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        env: Any = None,
    ) -> None:
        parts = TrainerArguments.sort(
            policy, tokenizer, reward_fns, reward_weights, dataset, eval_dataset, env
        )
        self.config = parts.complete(config, list(overrides))
        self.policy: Any = parts.ready_policy
        self._parts = parts
        self._given = Given(task=parts.task_builder(), policy=self._build_policy)

    def _build_policy(self, cfg: Config, device: torch.device) -> Any:
        if self.policy is None:  # built once: train() and evaluate() share its weights
            self.policy = self._parts.build_policy(cfg, device)
        return self.policy.to(device)

    def train(self) -> dict[str, Any]:
        """Train as `grouprl train` does; returns {"before", "after", "run_dir", "accuracy_key"}."""
        return train(self.config, self._given)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current weights (the initial ones before train())."""
        return run_evaluation(self.config, self._given)[0]


# Trainer argument -> the config key it fills (objects: a "<python>:what" record there)
_ARGUMENT_KEYS = {
    "policy": "model.name_or_path",
    "dataset": "task.options.source",
    "eval_dataset": "task.options.eval_source",
    "env": "task.options.env_id",
    "reward_fns": "rewards",
}


@dataclass
class TrainerArguments:
    """The Trainer's arguments, sorted into what they set in the config (a string as it is, an
    object as its "<python>:what" record) and the objects the run is built from."""

    settings: dict[str, Any]  # Trainer argument -> its config value (string or record)
    rewards: list[dict[str, Any]] | None  # the `rewards` entries reward_fns= makes
    model: tuple[Any, Any] | None = None  # (transformers model, tokenizer)
    ready_policy: Any = None  # a grouprl policy object
    dtype: str | None = None  # model.dtype of a model / policy object
    task_objects: dict[str, Any] | None = None  # task option -> object (source, env_id ...)
    reward_objects: dict[str, Any] | None = None  # reward key -> function

    @classmethod
    def sort(
        cls, policy, tokenizer, reward_fns, reward_weights, dataset, eval_dataset, env
    ) -> TrainerArguments:
        parts = cls(settings={}, rewards=None, task_objects={}, reward_objects={})
        if tokenizer is not None and not isinstance(policy, PreTrainedModel):
            raise ValueError("tokenizer= goes with a transformers model given as policy=")
        if isinstance(policy, str | Path):
            parts.settings["policy"] = str(policy)
        elif isinstance(policy, PreTrainedModel):
            if tokenizer is None:
                raise ValueError(
                    f"policy= is a transformers model ({type(policy).__name__}); give its "
                    "tokenizer too: Trainer(config, policy=model, tokenizer=tokenizer)"
                )
            parts.model = (policy, tokenizer)
            parts.dtype = _dtype_name(compute_dtype_of(policy), DTYPES)
            parts.settings["policy"] = python_object(type(policy).__name__)
        elif policy is not None:
            missing = [m for m in _POLICY_METHODS if not callable(getattr(policy, m, None))]
            if missing:
                raise TypeError(
                    f"policy= must be a transformers model (with tokenizer=), a grouprl policy "
                    f"or a model name / path; {type(policy).__name__} has no {missing}"
                )
            parts.ready_policy = policy
            dtype = getattr(policy, "compute_dtype", None)
            parts.dtype = None if dtype is None else _dtype_name(dtype, DTYPES)
            parts.settings["policy"] = python_object(type(policy).__name__)
        for argument, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
            if isinstance(value, str):
                parts.settings[argument] = value
            elif value is not None:
                parts.task_objects[_ARGUMENT_KEYS[argument].rsplit(".", 1)[-1]] = value
                rows = f" of {len(value)} rows" if isinstance(value, list | Dataset) else ""
                parts.settings[argument] = python_object(type(value).__name__ + rows)
        if env is not None:
            if dataset is not None or eval_dataset is not None or reward_fns is not None:
                raise ValueError(
                    "env= runs an agent in an environment, which gives the rewards and the "
                    "episodes' seeds: dataset=, eval_dataset= and reward_fns= do not apply"
                )
            if isinstance(env, str):
                parts.settings["env"] = env
            elif callable(env):
                parts.task_objects["env_id"] = env
                parts.settings["env"] = python_object(env_name(env))
            else:
                raise TypeError(f"env= must be a callable returning a text env or an env id, "
                                f"got {type(env).__name__}")  # fmt: skip
        if reward_weights is not None and reward_fns is None:
            raise ValueError("reward_weights= applies to reward_fns=; the config's `rewards` "
                             "entries carry their own weights")  # fmt: skip
        if reward_weights is not None:
            parts.settings["reward_weights"] = dict(reward_weights)
        if reward_fns is not None:
            rewards = python_rewards(reward_fns)
            weights = dict(reward_weights or {})
            unknown = sorted(set(weights) - set(rewards))
            if unknown:
                raise ValueError(f"reward_weights names {unknown}, which reward_fns does not "
                                 f"give (rewards: {list(rewards)})")  # fmt: skip
            parts.rewards = []
            for key, fn in rewards.items():
                name = fn if isinstance(fn, str) else python_object(key)
                if not isinstance(fn, str):
                    parts.reward_objects[key] = fn
                parts.rewards.append({"name": name, "weight": float(weights.get(key, 1.0))})
            parts.settings["reward_fns"] = [r["name"] for r in parts.rewards]
        return parts

    def complete(self, config: Config | dict | str | Path, overrides: list[str]) -> Config:
        """The run's Config: `config` plus what the arguments set; a part set twice is an error
        naming both, as is a "<python>:..." record whose object is not given."""
        if isinstance(config, Config):
            if overrides:
                raise ValueError("overrides= applies to a config mapping or file, not a Config")
            if not self.settings:
                return config
            raw = user_settings(config)
            if isinstance(raw.get("task"), dict) and "options" in raw["task"]:
                raw["task"]["options"] = dict(config.task.options)  # Dataset objects as they are
        elif isinstance(config, dict):
            raw = apply_overrides(copy.deepcopy(config), overrides)
        elif isinstance(config, str | Path):
            raw = read_config(config, overrides)
        else:
            raise TypeError(f"config must be a Config, a mapping or a YAML path, got "
                            f"{type(config).__name__}")  # fmt: skip
        self._fill(raw)
        left = {k: v for k, v in python_objects_in(raw).items()
                if not _given_key(k, self.settings)}  # fmt: skip
        if left:
            raise ValueError(
                "the config names objects given from Python ("
                + ", ".join(f"{k}: {v!r}" for k, v in left.items())
                + "); give them to Trainer again ("
                + ", ".join(sorted({f"{_argument_of(k)}=" for k in left}))
                + ")"
            )
        return validate(raw)

    def _fill(self, raw: dict) -> None:
        """Put what the arguments set into the raw config (in place), refusing a part the config
        names already."""

        def named(value: Any) -> bool:  # set by the config itself (a record is not)
            return value is not None and not is_python_object(value)

        def conflict(key: str, value: Any, argument: str) -> ValueError:
            return ValueError(
                f"the config sets {key}={value!r} and Trainer was given {argument}=: give "
                "this part in one place only"
            )

        s = self.settings
        if "policy" in s:
            model = _section(raw, "model")
            if named(model.get("name_or_path")):
                raise conflict("model.name_or_path", model["name_or_path"], "policy")
            model["name_or_path"] = s["policy"]
            if self.model is not None and model.get("type", "causal_lm") != "causal_lm":
                raise conflict("model.type", model["type"], "policy")
            if self.dtype is not None:
                if model.get("dtype", self.dtype) != self.dtype:
                    raise ValueError(
                        f"the config sets model.dtype={model['dtype']!r} and the policy= object "
                        f"computes in {self.dtype}; convert the model or drop model.dtype"
                    )
                model["dtype"] = self.dtype
        task_keys = [a for a in ("dataset", "eval_dataset", "env") if a in s]
        if task_keys:
            task = _section(raw, "task")
            wanted = "env" if "env" in s else "prompts"
            task.setdefault("name", wanted)
            if (task["name"] == "env") != (wanted == "env"):
                raise conflict("task.name", task["name"], task_keys[0])
            options = task.setdefault("options", {})
            if not isinstance(options, dict):
                raise ValueError(f"task.options must be a mapping, got {options!r}")
            for argument in task_keys:
                option = _ARGUMENT_KEYS[argument].rsplit(".", 1)[-1]
                if named(options.get(option)):
                    raise conflict(f"task.options.{option}", options[option], argument)
                options[option] = s[argument]
        if self.rewards is not None:
            task = raw.get("task") if isinstance(raw.get("task"), dict) else {}
            if task.get("name") == "env":  # the environment gives the rewards
                raise conflict("task.name", "env", "reward_fns")
            mine = raw.get("rewards") or []
            names = [r.get("name") if isinstance(r, dict) else r for r in mine]
            if mine and names != s["reward_fns"]:
                raise conflict("rewards", names, "reward_fns")
            if mine and "reward_weights" in s:
                raise conflict("rewards", mine, "reward_weights")
            raw["rewards"] = mine or self.rewards  # the config's entries keep their settings

    def task_builder(self) -> Callable[[Any], TaskData] | None:
        """cfg -> the task with the objects as its options, plus the reward functions given
        (config `rewards` entries "<python>:key" name them as the task's own), or None."""
        if not self.task_objects and not self.reward_objects:
            return None

        def build(cfg: Config) -> TaskData:
            task = build_task(cfg.task.name, **{**cfg.task.options, **self.task_objects})
            task.reward_fns.update({python_object(k): fn for k, fn in self.reward_objects.items()})
            return task

        return build

    def build_policy(self, cfg: Config, device: torch.device) -> Any:
        """The policy: the given one, one over the given transformers model, or the config's."""
        if self.ready_policy is not None:
            return self.ready_policy
        if self.model is not None:
            return causal_lm_policy(cfg, device, loaded=self.model)
        return build_policy(cfg, device)


_POLICY_METHODS = ("sample", "log_probs", "trainable_parameters", "state_dict", "save_pretrained")


def _dtype_name(dtype: torch.dtype, names: dict[str, torch.dtype]) -> str:
    for name, value in names.items():
        if value == dtype:
            return name
    raise ValueError(f"the policy computes in {dtype}; grouprl trains in one of {list(names)}")


def _section(raw: dict, name: str) -> dict:
    section = raw.setdefault(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"config section {name!r} must be a mapping, got {section!r}")
    return section


def _argument_of(key: str) -> str:
    """The Trainer argument that gives the object a config key's record stands for."""
    if key.startswith("rewards["):
        return "reward_fns"
    return next((a for a, k in _ARGUMENT_KEYS.items() if k == key), key)


def _given_key(key: str, settings: dict[str, Any]) -> bool:
    return _argument_of(key) in settings
