"""Countdown: reach a target with given numbers, each used at most once, and + - * /.

The setting of TinyZero-style RL demos (numbers 3-4 ints, integer target). Instances are solvable
by construction: the generator combines ALL the numbers with random operations, keeping every
intermediate result a positive integer, and stores that expression as "solution".

Verification never calls eval(): the equation is checked character by character (digits, spaces,
+ - * / and parentheses only), parsed with `ast`, every node is checked (integer literals, the four
binary operators), and evaluated with exact Fractions.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal

from grouprl.envs.answers import between_tags, tag_pair
from grouprl.envs.rewards.loading import RewardFn, column, completion_texts
from grouprl.envs.tasks.base import TaskData, check_choice, check_int, check_template

_ALLOWED_CHARS = re.compile(r"[0-9\s+\-*/()]*")
_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda x, y: x + y,
    ast.Sub: lambda x, y: x - y,
    ast.Mult: lambda x, y: x * y,
    ast.Div: lambda x, y: x / y,  # Fraction division: exact; y == 0 raises ZeroDivisionError
}
MAX_EXPRESSION_CHARS = 200  # longer "equations" are not answers; also bounds ast recursion


class UnsafeExpression(ValueError):
    """The text is not an arithmetic expression of integer literals, + - * / and parentheses."""


def parse_expression(text: str) -> tuple[ast.expr, list[int]]:
    """Validate `text` and return its syntax tree and the integer literals it uses (in order)."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _ALLOWED_CHARS.fullmatch(text):
        raise UnsafeExpression(f"only digits, spaces, + - * / and parentheses allowed: {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise UnsafeExpression(f"not a valid expression: {text!r}") from exc
    literals: list[int] = []
    _check(tree.body, literals)
    return tree.body, literals


def _check(node: ast.AST, literals: list[int]) -> None:
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        _check(node.left, literals)
        _check(node.right, literals)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
    else:
        raise UnsafeExpression(f"{type(node).__name__} is not allowed in an equation")


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a tree that `parse_expression` accepted."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)  # parse_expression allows nothing else
    return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))


def safe_eval(text: str) -> Fraction:
    """Exact value of an arithmetic expression; UnsafeExpression for anything else."""
    node, _ = parse_expression(text)
    return evaluate(node)


# ---------------------------------------------------------------- verifier


def _from_tag(text: str, tags: tuple[str, str]) -> str | None:
    return between_tags(text, *tags)


def _from_last_line(text: str, tags: tuple[str, str]) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


AnswerFrom = Literal["tag", "last_line"]
EXTRACTORS: dict[str, Callable[[str, tuple[str, str]], str | None]] = {
    "tag": _from_tag,  # inside the last <answer_tag>...</answer_tag>
    "last_line": _from_last_line,  # the last non-empty line
}
NumberUse = Literal["at_most_once", "exactly_once"]
_NUMBER_RULES: dict[str, Callable[[Counter, Counter], bool]] = {
    "at_most_once": lambda used, given: not used - given,
    "exactly_once": lambda used, given: used == given,
}


def check_equation(
    equation: str, numbers: list[int], target: int, number_use: NumberUse = "at_most_once"
) -> bool:
    """True when `equation` (its left side if it contains "=") uses `numbers` by the rule and
    evaluates exactly to `target`. Malformed or unsafe input -> False, never an exception."""
    expression = equation.split("=", 1)[0]
    try:
        node, literals = parse_expression(expression)
        if not _NUMBER_RULES[number_use](Counter(literals), Counter(numbers)):
            return False
        return evaluate(node) == Fraction(target)
    except (UnsafeExpression, ZeroDivisionError, RecursionError, MemoryError):
        return False


def countdown_reward(
    answer_from: AnswerFrom = "tag",
    answer_tag: str = "answer",
    number_use: NumberUse = "at_most_once",
) -> RewardFn:
    """Countdown verifier: 1.0 for a correct equation, 0.0 otherwise (malformed included).

    answer_from: "tag" (text inside the last <answer_tag>...</answer_tag>) or "last_line" (the last
                 non-empty line). If the equation contains "=", only its left side is evaluated.
    number_use:  "at_most_once" (each given number at most once) or "exactly_once" (all of them).
    Needs the columns `numbers` and `target`.
    """
    check_choice("answer_from", answer_from, EXTRACTORS)
    check_choice("number_use", number_use, _NUMBER_RULES)
    tags = tag_pair(answer_tag)
    extract = EXTRACTORS[answer_from]

    def countdown(completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        numbers = column(columns, "numbers", n, "countdown")
        targets = column(columns, "target", n, "countdown")
        out: list[float | None] = []
        for text, nums, target in zip(completion_texts(completions), numbers, targets):
            equation = extract(text, tags)
            ok = equation is not None and check_equation(
                equation, [int(x) for x in nums], int(target), number_use
            )
            out.append(float(ok))
        return out

    return countdown


# ---------------------------------------------------------------- generator

DEFAULT_TEMPLATE = (
    "Using the numbers {numbers}, write an equation that equals {target}. "
    "Use + - * / and each number at most once. Put the equation in <answer></answer>."
)


def _combine(x: int, y: int, cap: int, rng: random.Random) -> tuple[int, str]:
    """A random operation on positive ints x, y whose result is again a positive integer.

    Results <= cap are preferred when there are any, so most trees land in the target range
    instead of being thrown away (products of two-digit numbers rarely do).
    """
    choices = [(x + y, "+"), (x * y, "*")]
    if x > y:
        choices.append((x - y, "-"))
    if x % y == 0:
        choices.append((x // y, "/"))
    small = [c for c in choices if c[0] <= cap]
    return rng.choice(small or choices)


def _instance(numbers: list[int], cap: int, rng: random.Random) -> tuple[int, str]:
    """Combine all `numbers` in a random order / tree; returns (target, solution expression)."""
    pool = [(n, str(n)) for n in numbers]
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        (x, ex), (y, ey) = pool[i], pool[j]
        value, op = _combine(x, y, cap, rng)
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(value, f"({ex} {op} {ey})")]
    value, expr = pool[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


def build_countdown(
    seed: int = 0,
    n_train: int = 1000,
    n_eval: int = 100,
    min_numbers: int = 3,
    max_numbers: int = 4,
    min_number: int = 1,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 100,
    prompt_template: str = DEFAULT_TEMPLATE,
    answer_from: AnswerFrom = "tag",
    answer_tag: str = "answer",
    number_use: NumberUse = "at_most_once",
) -> TaskData:
    """Countdown task, solvable instances generated by construction (seeded).

    seed, n_train, n_eval: as in arithmetic; train / eval never share (sorted numbers, target)
    min_numbers, max_numbers: how many numbers per instance (default 3-4)
    min_number, max_number:   range of each number
    min_target, max_target:   range of the target
    prompt_template: format string with {numbers} (written "3, 5, 7") and {target}
    answer_from, answer_tag, number_use: verifier options, see `countdown_reward`
    Examples: {"prompt", "numbers" (list[int]), "target" (int), "solution" (str)}.
    """
    check_int("seed", seed)
    check_int("n_train", n_train, minimum=0)
    check_int("n_eval", n_eval, minimum=0)
    check_int("min_numbers", min_numbers, minimum=2)
    check_int("max_numbers", max_numbers, minimum=min_numbers)
    check_int("min_number", min_number, minimum=1)
    check_int("max_number", max_number, minimum=min_number)
    check_int("min_target", min_target, minimum=1)
    check_int("max_target", max_target, minimum=min_target)
    check_template("prompt_template", prompt_template, ("numbers", "target"), ("numbers", "target"))
    reward = countdown_reward(answer_from=answer_from, answer_tag=answer_tag, number_use=number_use)

    rng = random.Random(seed)
    wanted = n_train + n_eval
    seen: set[tuple[tuple[int, ...], int]] = set()
    examples: list[dict[str, Any]] = []
    attempts, max_attempts = 0, 200 * wanted + 1000
    while len(examples) < wanted:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"could only generate {len(examples)} of {wanted} distinct countdown instances with "
                f"numbers in [{min_number}, {max_number}] and targets in [{min_target}, "
                f"{max_target}]; widen the ranges or ask for fewer"
            )
        count = rng.randint(min_numbers, max_numbers)
        numbers = [rng.randint(min_number, max_number) for _ in range(count)]
        target, solution = _instance(numbers, max_target, rng)
        key = (tuple(sorted(numbers)), target)
        if not min_target <= target <= max_target or key in seen:
            continue
        seen.add(key)
        prompt = prompt_template.format(numbers=", ".join(map(str, numbers)), target=target)
        examples.append(
            {"prompt": prompt, "numbers": numbers, "target": target, "solution": solution}
        )
    return TaskData(
        train=examples[:n_train],
        eval=examples[n_train:],
        reward_fns={"accuracy": reward},
        default_reward_weights={"accuracy": 1.0},
    )
