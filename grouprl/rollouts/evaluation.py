"""Held-out evaluation: greedy accuracy and pass@k on the task's eval split."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from grouprl.envs.rewards import RewardFn
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect


def accuracy_key(reward_fns: dict[str, RewardFn]) -> str:
    """The reward that counts as correctness: "accuracy" when present, else the first one."""
    return "accuracy" if "accuracy" in reward_fns else next(iter(reward_fns))


@torch.no_grad()
def evaluate(
    policy: Any,
    examples: list[dict],
    reward_fns: dict[str, RewardFn],
    params: SamplingParams,
    *,
    batch_size: int,
    pass_k: int = 0,
    n_samples: int = 4,
) -> tuple[dict[str, float], list[dict]]:
    """Greedy accuracy (mean of the correctness reward, NaN counted as wrong), mean greedy length,
    and pass@k (k samples at the rollout temperature; a problem passes if any sample scores >= 1).

    Returns (metrics, rows): rows are the first `n_samples` greedy completions for the sample table.
    """
    key = accuracy_key(reward_fns)
    scorer = {key: reward_fns[key]}
    correct, lengths, passed, rows = [], [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        greedy, _ = collect(policy, chunk, 1, params, scorer, greedy=True)
        correct.append(torch.nan_to_num(greedy.rewards[key], nan=0.0))  # [b]
        lengths.append(greedy.actions.lengths.float())  # [b]
        for i in range(min(len(chunk), n_samples - len(rows))):
            rows.append(
                {
                    "prompt": greedy.info["prompt"][i],
                    "completion": greedy.info["completion"][i],
                    key: float(greedy.rewards[key][i]),
                    "answer": chunk[i].get("answer", ""),
                }
            )
        if pass_k > 0:
            sampled, _ = collect(policy, chunk, pass_k, replace(params), scorer)
            best = torch.nan_to_num(sampled.rewards[key], nan=0.0).view(len(chunk), pass_k)
            passed.append((best.max(1).values >= 1.0).float())  # [b]
    metrics = {
        "accuracy": float(torch.cat(correct).mean()),
        "response_length": float(torch.cat(lengths).mean()),
    }
    if pass_k > 0:
        metrics[f"pass@{pass_k}"] = float(torch.cat(passed).mean())
    return metrics, rows
