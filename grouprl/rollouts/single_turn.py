"""Single-turn rollouts: prompt -> G completions -> reward functions -> a scored Rollout."""

from __future__ import annotations

from typing import Any

import torch

from grouprl.envs.rewards import RewardFn, score_completions
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.types import Rollout


def collect(
    policy: Any,
    examples: list[dict],
    group_size: int,
    params: SamplingParams,
    reward_fns: dict[str, RewardFn],
    *,
    first_group_id: int = 0,
    greedy: bool = False,
    fail_fast: bool = False,
    seed: int | None = None,
    first_errors: dict[str, str] | None = None,
) -> tuple[Rollout, dict[str, int]]:
    """Sample `group_size` completions for each example and score them with every reward function.

    Group ids are first_group_id, first_group_id + 1, ... one per example, so that several calls
    (dynamic sampling rounds) never share an id. seed: per-sample generators seeded from
    (seed, group id, index) instead of the global RNG (rollout.seeding per_sample). Returns the
    Rollout (rewards filled: name -> Float[N], NaN where a function failed) and name -> number
    of failed samples. Reward functions get the completions as strings, or, for a conversational
    prompt (a list of {role, content} messages), as TRL does: [{"role": "assistant", "content":
    text}], and `group_ids` (one int per sample) for the groupwise rewards. first_errors: filled with name -> the first failure's text (score_completions).
    """
    prompts = [ex["prompt"] for ex in examples]
    group_ids = torch.arange(first_group_id, first_group_id + len(examples))  # [B]
    seeded = {} if seed is None else {"seed": seed}  # policies without seeding never see the key
    rollout = policy.sample(
        prompts, group_size, params, group_ids=group_ids, greedy=greedy, **seeded
    )
    batch = rollout.actions
    repeated = [ex for ex in examples for _ in range(group_size)]  # one example per completion
    completions = [
        [{"role": "assistant", "content": text}] if isinstance(ex["prompt"], list) else text
        for text, ex in zip(rollout.info["completion"], repeated)
    ]  # one per sample: a string, or TRL's message list for a conversational prompt
    rollout.rewards, errors = score_completions(
        reward_fns,
        completions,
        repeated,
        extra={
            "completion_lengths": batch.lengths.tolist(),
            "truncated": batch.truncated.tolist(),
            "max_new_tokens": params.max_new_tokens,
            "group_ids": [int(g) for g in group_ids for _ in range(group_size)],
        },
        fail_fast=fail_fast,
        first_errors=first_errors,
    )
    rollout.examples = repeated
    return rollout, errors
