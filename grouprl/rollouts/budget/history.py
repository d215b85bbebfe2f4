"""Per-prompt pass-rate history: what each prompt's groups scored, visit by visit.

A prompt is identified by a stable key: a configured example column, or the prompt itself (a chat
prompt, a list of messages, by its JSON text). A visit is one sampled group: (step, passes, n), a
sample passing when the correctness reward (the text workload's accuracy key: "accuracy" if the
rewards have it, else the first reward) is >= the threshold; a failed reward (NaN) is a fail.

Kept per prompt: the last `window` visits, and two exact counters, the number of most recent
consecutive visits that were all-pass and all-fail (at most one of them is non-zero). The state is
plain lists, numbers and strings (checkpointed as JSON, never pickled).
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from grouprl.types import Rollout


def prompt_key(example: dict, key_column: str | None) -> str:
    """The history key of an example: str(example[key_column]), or the prompt (JSON for chats)."""
    if key_column is not None:
        if key_column not in example:
            raise KeyError(
                f"rollout.budget.key_column {key_column!r} is missing from a training example; "
                f"its columns are {sorted(example)}"
            )
        value = example[key_column]
        if not isinstance(value, Hashable) or isinstance(value, float):
            raise TypeError(
                f"rollout.budget.key_column {key_column!r} holds {value!r}: a key must be a "
                "string or an integer"
            )
        return str(value)
    prompt = example["prompt"]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def correctness_key(rewards: dict[str, torch.Tensor]) -> str:
    """The reward that counts as correctness: "accuracy" when present, else the first one (as the
    text workload's accuracy_key)."""
    if not rewards:
        raise ValueError(
            "the rollout has no rewards: the budget history needs a correctness reward"
        )
    return "accuracy" if "accuracy" in rewards else next(iter(rewards))


def group_outcomes(
    rollout: Rollout, key_column: str | None, threshold: float
) -> Iterator[tuple[str, int, int]]:
    """(key, passes, n) per group of a scored rollout, in the order the groups first appear."""
    if rollout.examples is None:
        raise ValueError("rollout.budget needs rollout.examples (the example of every sample)")
    reward = rollout.rewards[correctness_key(rollout.rewards)]  # [N]
    passed = torch.nan_to_num(reward.detach().float(), nan=-math.inf) >= threshold  # [N]
    ids = rollout.group_ids.tolist()
    first: dict[int, int] = {}
    for i, g in enumerate(ids):
        first.setdefault(g, i)
    for g, row in first.items():
        rows = rollout.group_ids == g  # [N]
        yield (
            prompt_key(rollout.examples[row], key_column),
            int(passed[rows].sum()),
            int(rows.sum()),
        )


class PassHistory:
    """key -> recent visits [[step, passes, n], ...] plus the all-pass / all-fail streaks."""

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"rollout.budget.window must be an integer >= 1, got {window!r}")
        self.window = window
        self._visits: dict[str, list[list[int]]] = {}
        self._streaks: dict[str, list[int]] = {}  # key -> [all_pass, all_fail]

    def __len__(self) -> int:
        return len(self._visits)

    def __contains__(self, key: str) -> bool:
        return key in self._visits

    def record(self, key: str, step: int, passes: int, n: int) -> None:
        """One visit: `passes` of `n` samples passed at `step`."""
        if n < 1 or not 0 <= passes <= n:
            raise ValueError(f"a visit needs n >= 1 and 0 <= passes <= n, got {passes} of {n}")
        visits = self._visits.setdefault(key, [])
        visits.append([int(step), int(passes), int(n)])
        del visits[: -self.window]
        s = self._streaks.setdefault(key, [0, 0])
        s[0] = s[0] + 1 if passes == n else 0
        s[1] = s[1] + 1 if passes == 0 else 0

    def visits(self, key: str) -> list[list[int]]:
        """The last `window` visits [step, passes, n] of `key` (oldest first); [] if never seen."""
        return [list(v) for v in self._visits.get(key, [])]

    def streaks(self, key: str) -> tuple[int, int]:
        """(consecutive all-pass visits, consecutive all-fail visits), most recent first; (0, 0)
        for an unseen key."""
        a, b = self._streaks.get(key, (0, 0))
        return a, b

    def pass_rate(self, key: str, prior_passes: float, prior_fails: float) -> float:
        """Smoothed pass rate over the kept visits: (passes + a) / (samples + a + b), the mean of
        a Beta(a, b) prior updated with them; a / (a + b) for an unseen key."""
        visits = self._visits.get(key, [])
        passes = sum(v[1] for v in visits)
        total = sum(v[2] for v in visits)
        return (passes + prior_passes) / (total + prior_passes + prior_fails)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "prompts": [[k, self.visits(k), list(self._streaks[k])] for k in self._visits],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["window"] != self.window:
            raise ValueError(
                f"the checkpoint's rollout.budget.window is {state['window']}, the config's is "
                f"{self.window}: resume needs the same window"
            )
        visits, streaks = {}, {}
        for key, v, s in state["prompts"]:
            visits[str(key)] = [[int(x) for x in visit] for visit in v]
            streaks[str(key)] = [int(s[0]), int(s[1])]
        self._visits, self._streaks = visits, streaks
