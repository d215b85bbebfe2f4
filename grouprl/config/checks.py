"""Combination checks of a whole config: errors for settings that cannot work together, warnings
for ones that rarely make sense (run after every section validated on its own)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grouprl.config.root import Config

GROUP_BASELINES = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"}
IMAGE_MODELS = ("flow", "unet")


def check_workload(cfg: Config) -> None:
    """The built-in workloads agree with the model and task they are given."""
    name, model_type = cfg.workload.type, cfg.model.type
    if (name == "vlm") != (model_type == "vlm"):
        raise ValueError(
            f"workload {name!r} with model.type={model_type!r}: a vision-language model "
            "(model.type vlm) runs with workload: {type: vlm}, and workload vlm needs one"
        )
    if name in ("text", "agent") and model_type in IMAGE_MODELS:
        raise ValueError(
            f"workload {name!r} samples text, but model.type={model_type!r} is an image / video "
            "policy; use workload: {type: images}"
        )
    if name == "images" and model_type not in IMAGE_MODELS:
        raise ValueError(
            f"workload 'images' needs model.type flow or unet, got {model_type!r}; a language "
            "model runs with workload: {type: text} (or agent)"
        )
    if name == "images":  # a pipeline class grouprl does not train: refused before it loads
        from grouprl.workloads.images.policy import check_image_model

        check_image_model(cfg.model)
    if name == "agent" and cfg.task.name != "env":
        raise ValueError(
            f"workload 'agent' runs multi-turn episodes from task.name 'env', got "
            f"{cfg.task.name!r}; single completions run with workload: {{type: text}}"
        )
    if name in ("text", "images", "vlm") and cfg.task.name == "env":
        raise ValueError(
            f"task.name 'env' gives multi-turn episodes; it runs with workload: {{type: agent}}, "
            f"not {name!r}"
        )


def check_combinations(cfg: Config) -> None:
    """Errors for settings that cannot work together, warnings for ones that rarely make sense."""
    check_workload(cfg)
    a, r = cfg.algorithm, cfg.rollout
    if r.group_size == 1 and a.advantage in GROUP_BASELINES:
        raise ValueError(
            f"rollout.group_size=1 with advantage={a.advantage!r}: every estimator here compares a "
            "sample with its own group, so a group of one has advantage 0 and nothing is learned; "
            "use group_size >= 2"
        )
    b = r.budget
    if b.type != "none" and cfg.curriculum.type != "none":
        raise ValueError(
            f"rollout.budget.type={b.type!r} with curriculum.type={cfg.curriculum.type!r}: both "
            "choose the prompts; use one of them"
        )
    if hasattr(b, "min_group_size") and b.min_group_size > r.group_size:
        raise ValueError(
            f"rollout.budget.min_group_size={b.min_group_size} > rollout.group_size="
            f"{r.group_size}: the total prompts_per_step x group_size cannot give every prompt "
            "that many samples"
        )
    n = r.prompts_per_step * r.group_size
    if n % a.minibatches:
        raise ValueError(
            f"algorithm.minibatches={a.minibatches} must divide the batch of "
            f"prompts_per_step * group_size = {n} samples"
        )
    if a.ratio_level == "sequence" and a.aggregation in ("token_mean", "seq_mean_token_sum",
                                                         "seq_mean_token_sum_norm"):  # fmt: skip
        warnings.warn(
            f"ratio_level='sequence' (GSPO) with aggregation={a.aggregation!r}: the sequence ratio "
            "is one number per sequence, and token-sum style aggregation weights it by length; "
            "GSPO uses seq_mean_token_mean",
            stacklevel=2,
        )
    if a.kl_weighting == "importance" and (
        a.kl_mode != "loss" or a.kl_coef == 0 or a.ratio_level == "geometric"
    ):
        raise ValueError(
            "algorithm.kl_weighting='importance' weights the KL loss term by pi_theta/pi_old; it "
            "needs kl_mode='loss', kl_coef > 0 and ratio_level 'token' or 'sequence' (got "
            f"{a.kl_mode!r}, {a.kl_coef}, {a.ratio_level!r})"
        )
    if a.surrogate.type == "sapo" and a.aggregation != "seq_mean_token_mean":
        warnings.warn("SAPO is defined with seq_mean_token_mean aggregation", stacklevel=2)
    if a.reward_aggregation == "normalize_then_sum" and (a.advantage, a.scale) != ("grpo", "group"):
        raise ValueError(
            "reward_aggregation='normalize_then_sum' (GDPO) defines the whole advantage; it needs "
            f"advantage='grpo' and scale='group', got {a.advantage!r} / {a.scale!r}"
        )
    distill = getattr(a, "distill", None)
    if distill is not None and distill.source == "engine" and r.temperature != 1.0:
        raise ValueError(
            f"algorithm.distill.source='engine' scores the teacher at temperature 1 (vLLM's "
            f"prompt log-probs skip the temperature), but rollout.temperature={r.temperature}; "
            "use algorithm.distill.source 'model' or rollout.temperature 1"
        )
    from grouprl.workloads import refuse_unsupported, workload_of  # imports the modalities

    refuse_unsupported(workload_of(cfg), cfg)  # options the workload cannot honour (one process)
    d = cfg.diffusion
    guard = d is not None and getattr(d.objective, "ratio_norm", "off") == "grpo_guard"
    if guard and not hasattr(a.surrogate, "eps_high"):
        raise ValueError(
            "diffusion.ratio_norm='grpo_guard' clips with algorithm.surrogate.eps_high; surrogate "
            f"{a.surrogate.type!r} has no clip range (use type clip)"
        )
    from grouprl.policies.support import check_model_support

    check_model_support(cfg.model, uses_vllm=r.engine.startswith("vllm"))
    check_hooks(cfg)
    check_bounded_async(cfg)
    check_tree(cfg)
    if a.advantage == "dr_grpo" and a.scale != "none":
        warnings.warn(
            "advantage='dr_grpo' never divides by the std; `scale` is ignored", stacklevel=2
        )


def check_hooks(cfg: Config) -> None:
    """rollout.hooks: at most one of each type; behaviour-policy rows need the per-token
    correction; replay's buffer and a one-step-off sampler would disagree about its state."""
    hooks = cfg.rollout.hooks
    types = [h.type for h in hooks]
    twice = sorted({t for t in types if types.count(t) > 1})
    if twice:
        raise ValueError(f"rollout.hooks lists {', '.join(twice)} more than once")
    off_policy = [f"{h.type}" + (" (context original)" if h.type == "hint" else "")
                  for h in hooks
                  if h.type == "replay" or (h.type == "hint" and h.context == "original")]  # fmt: skip
    if off_policy and cfg.algorithm.engine_correction == "none":
        raise ValueError(
            f"rollout.hooks {', '.join(off_policy)} trains on rows sampled by another policy "
            "(stored or hinted log-probs); set algorithm.engine_correction (e.g. token_truncate) "
            "so each token is reweighted by pi_old / pi_behaviour"
        )
    if hooks and cfg.train.async_mode != "off":
        raise ValueError(
            f"rollout.hooks with train.async_mode={cfg.train.async_mode!r}: the hooks act on the "
            "batch sampled for the current weights (and replay's buffer is checkpointed with "
            "them); use train.async_mode off"
        )
    for h in hooks:
        if h.type == "hint" and h.where == "response" and h.text == "column":
            warnings.warn(
                f"rollout.hooks hint: text 'column' with where 'response' forces the whole "
                f"{h.column!r} column as the start of the completion",
                stacklevel=2,
            )


def check_bounded_async(cfg: Config) -> None:
    """train.async_mode bounded: stale tokens need the per-token pi_prox / pi_behav correction;
    partial rollouts cannot honour stop strings (runtime/bounded_async.py)."""
    t = cfg.train
    if t.async_mode != "bounded":
        return
    ahead = t.max_staleness if t.async_prefetch is None else t.async_prefetch
    if (
        ahead > 0
        and cfg.rollout.old_logp == "recompute"
        and cfg.algorithm.engine_correction == "none"
    ):
        raise ValueError(
            f"train.async_mode bounded with max_staleness/async_prefetch {ahead} trains tokens "
            "sampled by older weights: with rollout.old_logp recompute (the proximal policy) set "
            "algorithm.engine_correction (e.g. token_truncate) for the weight pi_prox / pi_behav, "
            "or use rollout.old_logp engine (clip around the behaviour policy)"
        )
    if t.partial_chunk_tokens is not None and cfg.rollout.stop:
        raise ValueError(
            "train.partial_chunk_tokens with rollout.stop: a stop string could span two chunks; "
            "drop one of them"
        )


def check_tree(cfg: Config) -> None:
    """rollout.tree: its leaves are the group; its branch points lie inside the completion."""
    t, r, a = cfg.rollout.tree, cfg.rollout, cfg.algorithm
    if t.type == "none":
        asked = [f"algorithm.{k}={getattr(a, k)!r}" for k, off in
                 (("tree_advantage", "leaf_group"), ("tree_scales", "none"))
                 if getattr(a, k) != off]  # fmt: skip
        if asked:
            raise ValueError(
                f"{', '.join(asked)} needs a tree: set rollout.tree (e.g. {{type: fixed, "
                "branching: [2, 2, 2], segment_tokens: 16}})"
            )
        return
    if t.leaves != r.group_size:
        raise ValueError(
            f"rollout.tree.branching={t.branching} gives {t.leaves} leaves per group, "
            f"rollout.group_size={r.group_size}: set group_size to the product of branching"
        )
    if cfg.workload.type == "images":  # branch points are denoising steps (policies/flow/fork.py)
        from grouprl.policies.flow.fork import check_step_tree

        if t.type != "fixed":
            raise ValueError(
                f"rollout.tree type {t.type!r} branches at uncertain tokens (text); a flow tree "
                "branches at fixed denoising steps: use type fixed"
            )
        steps = cfg.diffusion.rollout_steps
        check_step_tree(t.branching, t.offsets(steps), steps)
        if cfg.diffusion.objective.type != "policy_gradient":
            raise ValueError(
                f"rollout.tree with diffusion.objective {cfg.diffusion.objective.type!r}: a tree "
                "gives per-step advantages to step log-probs; use objective policy_gradient"
            )
    elif cfg.workload.type == "agent" and cfg.agent is not None:
        if t.type != "fixed":
            raise ValueError(
                f"rollout.tree type {t.type!r} branches at uncertain tokens (text); an agent tree "
                "branches at turn boundaries: use type fixed"
            )
        check_agent_tree(cfg)
    else:
        from grouprl.rollouts.fork import check_tree as check_shape

        if t.type == "fixed":
            check_shape(t.branching, t.offsets(r.max_new_tokens), r.max_new_tokens)
    if cfg.workload.type != "images" and getattr(t, "prune_fraction", 0) > 0:
        raise ValueError(
            "rollout.tree.prune_fraction is implemented for images (BranchGRPO); set it to 0"
        )
    if r.budget.type == "allocate":
        raise ValueError(
            "rollout.tree with rollout.budget allocate: a tree's group size is fixed by its "
            "branching; use one of them"
        )
    if r.hooks:
        raise ValueError(
            "rollout.tree with rollout.hooks: a hint re-samples or replay replaces rows of a "
            "group, which would cut its tree; use one of them"
        )


def check_agent_tree(cfg: Config) -> None:
    """An agent's tree branches at turn boundaries: branch_at counts turns (rollouts/agent_fork.py);
    tree advantages replace the per-turn credit, so they need agent.credit trajectory."""
    t, ag, a = cfg.rollout.tree, cfg.agent, cfg.algorithm
    if t.segment_tokens is not None:
        raise ValueError(
            f"rollout.tree.segment_tokens={t.segment_tokens} counts tokens, but an agent's tree "
            "branches at turn boundaries: set rollout.tree.branch_at in TURNS instead (e.g. "
            "branch_at: [2] forks every episode before its third turn)"
        )
    from grouprl.rollouts.agent_fork import check_turn_tree

    check_turn_tree(t.branching, t.offsets(ag.max_turns), ag.max_turns)
    if a.tree_advantage != "leaf_group" and ag.credit != "trajectory":
        raise ValueError(
            f"algorithm.tree_advantage={a.tree_advantage!r} with agent.credit={ag.credit!r}: both "
            "define the per-token advantage of an agent's tree; set agent.credit=trajectory (the "
            "tree's advantage replaces the per-turn credit) or tree_advantage=leaf_group (the "
            "per-turn credit over the tree's leaves)"
        )
