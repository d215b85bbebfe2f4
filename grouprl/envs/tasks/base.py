"""The task record (TaskData) and the small validation helpers every task factory uses.

An example is a plain dict with at least "prompt" (a string, or a list of chat messages
{"role", "content"}) plus the task's own columns ("answer", "numbers", "target" ...). Every column
is handed to the reward functions, repeated once per completion.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from string import Formatter
from typing import Any

from grouprl.envs.rewards.loading import RewardFn


@dataclass
class TaskData:
    """A built task: train / eval examples and the reward functions that score completions.

    train, eval:             lists of example dicts (eval may be empty)
    reward_fns:              name -> batched reward function
    default_reward_weights:  name -> weight used when the config does not set one
    """

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    reward_fns: dict[str, RewardFn]
    default_reward_weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.default_reward_weights) - set(self.reward_fns)
        if unknown:
            raise ValueError(
                f"default_reward_weights names {sorted(unknown)} which are not reward functions "
                f"of this task ({sorted(self.reward_fns)})"
            )


def check_choice(option: str, value: Any, allowed: Iterable[str]) -> None:
    """Fail with the option's name and the allowed values when `value` is not one of them."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{option}={value!r} is not allowed; choose one of {allowed}")


def check_int(option: str, value: Any, *, minimum: int | None = None) -> int:
    """`value` as an int (bools refused), at least `minimum`; the error names the option."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{option} must be >= {minimum}, got {value}")
    return value


def check_template(
    option: str, template: str, placeholders: Iterable[str], required: Iterable[str] = ()
) -> None:
    """Fail unless `template` uses only the named `{placeholders}` and every `required` one."""
    if not isinstance(template, str):
        raise TypeError(f"{option} must be a string, got {type(template).__name__}")
    allowed = set(placeholders)
    try:
        used = {name for _, name, _, _ in Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"{option}={template!r} is not a valid format string: {exc}") from None
    unknown = used - allowed
    if unknown:
        raise ValueError(
            f"{option}={template!r} uses unknown placeholders {sorted(unknown)}; "
            f"allowed: {sorted(allowed)}"
        )
    missing = set(required) - used
    if missing:
        raise ValueError(f"{option}={template!r} must contain the placeholders {sorted(missing)}")
    if "" in used:
        raise ValueError(f"{option}={template!r} has an empty '{{}}'; name the placeholder")


def check_split_options(
    task: str, seed: Any, max_train: Any, max_eval: Any, eval_fraction: float,
    eval_given: bool = False,
) -> None:  # fmt: skip
    """The train / eval split options every dataset task takes (eval_given: an eval_source or
    eval_split was set, which excludes eval_fraction)."""
    check_int("seed", seed)
    for name, value in (("max_train", max_train), ("max_eval", max_eval)):
        if value is not None:
            check_int(name, value, minimum=1)
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"{task} task: eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction and eval_given:
        raise ValueError(f"{task} task: give eval_source / eval_split or eval_fraction, not both")


def hold_out(examples: list[dict], eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle, then the first round(eval_fraction * n) (at least one)
    rows held out for evaluation; eval_fraction 0 holds out nothing."""
    if eval_fraction <= 0:
        return examples, []
    examples = list(examples)
    random.Random(seed).shuffle(examples)
    n_eval = max(1, round(eval_fraction * len(examples)))
    if n_eval >= len(examples):
        raise ValueError(
            f"eval_fraction={eval_fraction} leaves no training rows of {len(examples)}"
        )
    return examples[n_eval:], examples[:n_eval]


def train_and_eval(
    load: Callable[[Any, str | None, str | None], list[dict]],
    source: Any, config: str | None, split: str | None,
    eval_source: Any, eval_config: str | None, eval_split: str | None,
    eval_fraction: float, seed: int,
) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """(train, eval) examples of a dataset task; load(source, config, split) -> examples.

    Train: `split` of `source`. Eval, the first that applies: `eval_split` of `eval_source` (with
    `eval_config`); `eval_split` of `source`; else `hold_out(train, eval_fraction, seed)`.
    """
    train = load(source, config, split)
    if eval_source is not None:
        return train, load(eval_source, eval_config, eval_split)
    if eval_split is not None:
        return train, load(source, config, eval_split)
    return hold_out(train, eval_fraction, seed)
