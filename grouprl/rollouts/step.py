"""One training step's batch: sample and score groups through the workload, with DAPO dynamic
sampling (rollouts/filters.py), the signal hooks (hooks/: hint, replay) and a rollout budget
(budget/) when configured, reward failures accounted (envs/rewards/health.py). The training loop
(grouprl/train.py) calls it directly, or hands it to an async rollout source
(runtime/async_rollout.py, runtime/bounded_async.py) that calls it with a snapshot policy."""

from __future__ import annotations

from typing import Any

from grouprl.envs.rewards.health import RewardHealth
from grouprl.rollouts.budget.sampler import BudgetSampler
from grouprl.rollouts.filters import sample_until_full
from grouprl.rollouts.hooks import HookContext, SignalHooks
from grouprl.runtime.distributed import SINGLE, Dist
from grouprl.runtime.reward_guard import drain_reward_metrics
from grouprl.types import Rollout
from grouprl.workloads.base import Collected, Workload


def rollout_step(
    cfg: Any,
    workload: Workload,
    policy: Any,
    sampler: Any,
    reward_fns: dict,
    weights: dict[str, float],
    step: int,
    dist: Dist = SINGLE,
    health: RewardHealth | None = None,
    hooks: SignalHooks | None = None,
) -> tuple[Rollout | None, dict]:
    """Sample and score one batch of groups (with DAPO dynamic sampling when configured).
    policy: the weights that sample (the trainer's, or the one_step_off worker's snapshot).
    Several processes: each samples a share of the groups, all get the whole scored batch.
    health: warns about / stops on a reward that fails on every sample (envs/rewards/health.py).
    hooks: rollout.hooks, applied to each sampling round before dynamic sampling filters it."""
    r, a = cfg.rollout, cfg.algorithm
    errors_total: dict[str, int] = {}
    first_errors: dict[str, str] = {}
    scored = [0]  # samples the reward functions saw this step, over all sampling rounds
    sampled = [0]  # action slots the policy generated this step (all rounds, hint re-samples)

    budget = sampler if isinstance(sampler, BudgetSampler) else None  # rollout.budget

    def account(got: Collected) -> Rollout:
        scored[0] += got.scored
        made = got.rollout.generated  # tree rollouts: a shared segment was generated once
        sampled[0] += int(made.sum() if made is not None else got.rollout.mask.sum())
        for k, v in got.errors.items():
            errors_total[k] = errors_total.get(k, 0) + v
        for k, v in got.first_errors.items():
            first_errors.setdefault(k, v)
        return got.rollout

    def one_round(round_index: int, n_prompts: int | None = None) -> Rollout:
        examples = sampler.next(n_prompts or r.prompts_per_step)
        first_id = (step * a.max_sampling_rounds + round_index) * r.prompts_per_step
        sizes = budget.group_sizes(examples) if budget else None  # allocate: G per prompt
        more = {"group_sizes": sizes} if sizes else {}
        rollout = account(
            workload.collect(policy, examples, first_group_id=first_id, step=step, **more)
        )
        if budget:  # every sampled group into the pass history, before any filter or hook
            budget.observe(rollout, step)
        if hooks:

            def resample(exs: list[dict], prefixes: list[str] | None, size: int) -> Rollout:
                # group ids of their own (per-sample seeds come from them); the hook maps the
                # rows back onto the failed groups' ids
                got = workload.collect(policy, exs, first_group_id=HOOK_GROUP_IDS + first_id,
                                       step=step, group_sizes=[size] * len(exs),
                                       response_prefixes=prefixes)  # fmt: skip
                return account(got)

            rollout = hooks.apply(rollout, HookContext(step, weights, resample))
        return rollout

    metrics: dict[str, float] = {}
    if a.dynamic_sampling == "zero_variance":
        rollout, metrics = sample_until_full(
            one_round, weights, r.prompts_per_step, a.max_sampling_rounds, a.resample_size
        )
    else:
        rollout = one_round(0)
    metrics["rollout/sampled_actions"] = float(sampled[0])  # tokens (text); denoising steps (flows)
    if budget:
        metrics.update(budget.finish_step())  # GRESO's exploration update; budget/ metrics
    metrics.update({f"reward_errors/{k}": float(v) for k, v in errors_total.items()})
    for k, v in dist.sum_counts(drain_reward_metrics(reward_fns)).items():  # isolated rewards'
        metrics[k] = metrics.get(k, 0.0) + v
    if health is not None:
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
    if hooks:
        metrics.update(hooks.metrics())
    if rollout is not None:
        rollout, more = workload.postprocess(rollout)
        metrics.update(more)
    return rollout, metrics


HOOK_GROUP_IDS = 1 << 40  # group ids of rows a hook samples again (never a step's own ids)
