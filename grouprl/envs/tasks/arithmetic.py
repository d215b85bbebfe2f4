"""Synthetic arithmetic: "{a}{op}{b}=" -> the integer result, seeded and tiny.

Built for smoke tests and char-level toy models: prompts are short plain ASCII and the answer is the
integer written in decimal ("-3", "42"). Train and eval problems are drawn without replacement from
the same (a, op, b) space, so no problem appears in both.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable

from grouprl.envs.rewards.text import accuracy_reward
from grouprl.envs.tasks.base import TaskData, check_int, check_template

OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
DEFAULT_TEMPLATE = "{a}{op}{b}="


def _problem(index: int, ops: str, lo: int, width: int) -> tuple[int, str, int]:
    """Decode a flat index into (a, op, b): index = (op_i * width + a_i) * width + b_i."""
    rest, b_i = divmod(index, width)
    op_i, a_i = divmod(rest, width)
    return lo + a_i, ops[op_i], lo + b_i


def build_arithmetic(
    seed: int = 0,
    n_train: int = 1000,
    n_eval: int = 100,
    ops: str = "+-",
    min_value: int = 0,
    max_value: int = 99,
    prompt_template: str = DEFAULT_TEMPLATE,
    max_train: int | None = None,
) -> TaskData:
    """Arithmetic task.

    seed:            random seed; the same options give the same examples
    n_train, n_eval: number of train / held-out eval problems (disjoint (a, op, b) triples)
    ops:             the operators to draw from, a non-empty subset of "+-*" (e.g. "+", "+-*")
    min_value, max_value: operands are integers in [min_value, max_value]
    prompt_template: format string with {a}, {b} and, when several ops are used, {op}
    max_train:       train on the first max_train of the n_train problems only (None: all); the
                     held-out split stays the one of n_train, so a run on fewer problems (which
                     then recur: replay, rollout budgets) is evaluated on the same problems
    Examples: {"prompt", "answer" (str), "a", "b", "op"}; reward: accuracy (exact, last number).
    """
    check_int("seed", seed)
    check_int("n_train", n_train, minimum=0)
    check_int("n_eval", n_eval, minimum=0)
    if max_train is not None:
        check_int("max_train", max_train, minimum=1)
    check_int("min_value", min_value)
    check_int("max_value", max_value, minimum=min_value)
    if (
        not isinstance(ops, str)
        or not ops
        or set(ops) - set(OPERATIONS)
        or len(set(ops)) != len(ops)
    ):
        raise ValueError(f"ops={ops!r} must be a non-empty subset of {''.join(OPERATIONS)!r}")
    required = ("a", "b", "op") if len(ops) > 1 else ("a", "b")
    check_template("prompt_template", prompt_template, ("a", "b", "op"), required)

    width = max_value - min_value + 1
    space = len(ops) * width * width
    if n_train + n_eval > space:
        raise ValueError(
            f"n_train + n_eval = {n_train + n_eval} exceeds the {space} distinct problems with "
            f"ops={ops!r} and operands in [{min_value}, {max_value}]"
        )
    # Sampling indices without replacement makes train/eval disjoint by construction.
    indices = random.Random(seed).sample(range(space), n_train + n_eval)
    examples = []
    for index in indices:
        a, op, b = _problem(index, ops, min_value, width)
        examples.append(
            {
                "prompt": prompt_template.format(a=a, b=b, op=op),
                "answer": str(OPERATIONS[op](a, b)),
                "a": a,
                "b": b,
                "op": op,
            }
        )
    return TaskData(
        train=examples[: n_train if max_train is None else min(max_train, n_train)],
        eval=examples[n_train:],
        reward_fns={"accuracy": accuracy_reward(mode="exact")},
        default_reward_weights={"accuracy": 1.0},
    )
