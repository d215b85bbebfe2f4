"""Single-turn rollouts: prompt -> G completions -> reward functions -> a scored Rollout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from grouprl.envs.rewards import RewardFn, score_completions
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.filters import cat_rollouts
from grouprl.rollouts.fork import sample_entropy_tree, sample_tree
from grouprl.rollouts.seeds import group_sizes
from grouprl.types import Rollout


def collect(
    policy: Any,
    examples: list[dict],
    group_size: int | list[int],
    params: SamplingParams,
    reward_fns: dict[str, RewardFn],
    *,
    first_group_id: int = 0,
    greedy: bool = False,
    fail_fast: bool = False,
    seed: int | None = None,
    first_errors: dict[str, str] | None = None,
    response_prefixes: list[str] | None = None,
    tree: Any = None,
) -> tuple[Rollout, dict[str, int]]:
    """Sample `group_size` completions for each example and score them with every reward function.
    group_size: one G for all examples, or one per example (rollout.budget allocate: groups of
    unequal sizes; every later stage keys on group ids, never on a fixed G).

    Group ids are first_group_id, first_group_id + 1, ... one per example, so that several calls
    (dynamic sampling rounds) never share an id. seed: per-sample generators seeded from
    (seed, group id, index) instead of the global RNG (rollout.seeding per_sample). Returns the
    Rollout (rewards filled: name -> Float[N], NaN where a function failed) and name -> number
    of failed samples. Reward functions get the completions as strings, or, for a conversational
    prompt (a list of {role, content} messages), as TRL does: [{"role": "assistant", "content":
    text}], and `group_ids` (one int per sample) for the groupwise rewards. Rewards marked
    `overlap = True` (remote scorers, e.g. `http`) make collect sample in `overlap_chunks` chunks
    of groups, each chunk scored by them in a background thread while the next generates;
    with per-sample seeding the samples and scores equal the unchunked ones. first_errors: filled with name -> the first failure's text (score_completions).
    response_prefixes: one text per example forced as the start of its completions (hints,
    rollouts/hooks/hint.py; CausalLMPolicy.sample). tree: rollout.tree (fixed): each group is
    sampled as a tree (rollouts/fork.py), its leaves the group's rows.
    """
    sizes = group_sizes(group_size, len(examples))  # one G per example
    remote = {k: f for k, f in reward_fns.items() if getattr(f, "overlap", False)}
    chunks = max([int(getattr(f, "overlap_chunks", 1)) for f in remote.values()], default=1)
    chunks = max(1, min(chunks, len(examples)))
    if chunks == 1:
        remote = {}
    local = {k: f for k, f in reward_fns.items() if k not in remote}
    bounds = [round(i * len(examples) / chunks) for i in range(chunks + 1)]
    parts, pending = [], []
    with ThreadPoolExecutor(max_workers=1) as scorer:  # remote scoring overlaps the next chunk
        for lo, hi in zip(bounds, bounds[1:]):
            prefixes = None if response_prefixes is None else response_prefixes[lo:hi]
            part, extra = _sample(
                policy, examples[lo:hi], sizes[lo:hi], params, first_group_id + lo, greedy, seed,
                prefixes, tree,
            )  # fmt: skip
            parts.append(part)
            if remote:
                args = (remote, part.info["_completions"], part.examples)
                pending.append(
                    scorer.submit(
                        score_completions,
                        *args,
                        extra=extra,
                        fail_fast=fail_fast,
                        first_errors=first_errors,
                    )  # fmt: skip
                )
        remote_scores = [f.result() for f in pending]  # joined before the Rollout is returned
    rollout = cat_rollouts(parts)
    completions = rollout.info.pop("_completions")
    batch = rollout.actions
    rollout.rewards, errors = score_completions(
        local,
        completions,
        rollout.examples,
        extra=_extra(batch, params, rollout.group_ids),
        fail_fast=fail_fast,
        first_errors=first_errors,
    )
    for name in remote:
        rollout.rewards[name] = torch.cat([r[name] for r, _ in remote_scores])  # [N]
        errors[name] = sum(e[name] for _, e in remote_scores)
    rollout.rewards = {name: rollout.rewards[name] for name in reward_fns}  # the config's order
    errors = {name: errors[name] for name in reward_fns}
    return rollout, errors


def _extra(batch: Any, params: SamplingParams, group_ids: Any) -> dict:
    return {
        "completion_lengths": batch.lengths.tolist(),
        "truncated": batch.truncated.tolist(),
        "max_new_tokens": params.max_new_tokens,
        "group_ids": [int(g) for g in group_ids],
    }


def _sample(
    policy: Any,
    examples: list[dict],
    sizes: list[int],
    params: SamplingParams,
    first_group_id: int,
    greedy: bool,
    seed: int | None,
    response_prefixes: list[str] | None = None,
    tree: Any = None,
) -> tuple[Rollout, dict]:
    """Sample one chunk of groups (sizes: one G per example); its completions as rewards take
    them go in info["_completions"] (removed before collect returns), its reward extras are
    returned."""
    prompts = [ex["prompt"] for ex in examples]
    group_ids = torch.arange(first_group_id, first_group_id + len(examples))  # [B]
    seeded = {} if seed is None else {"seed": seed}  # policies without seeding never see the key
    if response_prefixes is not None:  # policies without forced starts never see the key
        seeded["response_prefixes"] = response_prefixes
    same = len(set(sizes)) == 1  # one int for equal groups: any Policy.sample takes it
    if tree is not None and not greedy and tree.type == "entropy":  # branch at uncertain tokens
        rollout = sample_entropy_tree(
            policy, prompts, params, tree.branching, threshold=tree.threshold,
            min_tokens=tree.min_tokens, group_ids=group_ids.tolist(), seed=seed,
        )  # fmt: skip
    elif tree is not None and not greedy:  # each group a tree, its leaves the rows
        rollout = sample_tree(
            policy, prompts, params, tree.branching, tree.offsets(params.max_new_tokens),
            group_ids=group_ids.tolist(), seed=seed,
        )  # fmt: skip
    else:
        rollout = policy.sample(
            prompts, sizes[0] if same else sizes, params, group_ids=group_ids, greedy=greedy,
            **seeded,
        )  # fmt: skip
    repeated = [ex for ex, n in zip(examples, sizes) for _ in range(n)]  # one per completion
    rollout.info["_completions"] = [
        [{"role": "assistant", "content": text}] if isinstance(ex["prompt"], list) else text
        for text, ex in zip(rollout.info["completion"], repeated)
    ]  # one per sample: a string, or TRL's message list for a conversational prompt
    rollout.examples = repeated
    return rollout, _extra(rollout.actions, params, rollout.group_ids)
