"""Code generation: a problem statement + tests per example, reward = tests passed in the sandbox.

`source` is "synthetic" (the tiny built-in set below, for tests and smoke runs), a local file
(.jsonl, .json, .parquet, .csv), a save_to_disk folder or a datasets.Dataset / DatasetDict object
(records.py). Columns (names configurable; the question may be a conversation, TRL's format):
  question_column  the problem statement (default "question"; MBPP: "text")
  tests_column     the tests (default "tests"; MBPP: "test_list"): a list of assert snippets, a list
                   of {"input", "output"} objects, or {"inputs": [...], "outputs": [...]}; one string
                   is one assert-style test. See grouprl.envs.rewards.code.normalize_tests.
  setup_column     optional code run before the solution (MBPP: "test_setup_code"); None = none
HumanEval converts to this layout as {"question": prompt, "tests": [test + "\\ncheck(<entry_point>)"]}.
Examples keep only {"prompt", "question", "tests", "setup_code"} (+ "solution" in the built-in
set), so a dataset column can never clash with the names the reward call reserves. Every loading
problem is one ValueError naming the file, the row and the column.
"""

from __future__ import annotations

from typing import Any

from grouprl.envs.rewards.code import CODE_REWARD_DEFAULTS, CodeFrom, CodeScore, code_reward
from grouprl.envs.rewards.code_harness import CodeTests, normalize_tests
from grouprl.envs.sandbox import Isolation
from grouprl.envs.tasks.base import TaskData, check_split_options, check_template, hold_out
from grouprl.envs.tasks.records import describe, is_local, load_records, make_prompt

DEFAULT_TEMPLATE = "{question}\n{example}\nWrite your solution in a ```python code block."

# (question, tests, a reference solution): small enough for a tiny model's context
SYNTHETIC: list[tuple[str, Any, str]] = [
    ("Write a function add(a, b) that returns the sum of two integers.",
     ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"],
     "def add(a, b):\n    return a + b"),
    ("Write a function is_even(n) that returns True when n is even.",
     ["assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True"],
     "def is_even(n):\n    return n % 2 == 0"),
    ("Write a function reverse(s) that returns the string s reversed.",
     ["assert reverse('abc') == 'cba'", "assert reverse('') == ''", "assert reverse('ab') == 'ba'"],
     "def reverse(s):\n    return s[::-1]"),
    ("Write a function factorial(n) that returns n! for n >= 0.",
     ["assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(3) == 6"],
     "def factorial(n):\n    out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out"),
    ("Write a function largest(xs) that returns the largest number of a non-empty list.",
     ["assert largest([3, 9, 2]) == 9", "assert largest([-5]) == -5", "assert largest([1, 1]) == 1"],
     "def largest(xs):\n    return max(xs)"),
    ("Write a function count_vowels(s) that counts the letters a, e, i, o, u in s.",
     ["assert count_vowels('banana') == 3", "assert count_vowels('xyz') == 0",
      "assert count_vowels('aeiou') == 5"],
     "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)"),
    ("Write a function square(n) that returns n squared.",
     ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"],
     "def square(n):\n    return n * n"),
    ("Read two integers on one line and print their sum.",
     [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7\n"},
      {"input": "0 0\n", "output": "0\n"}],
     "a, b = map(int, input().split())\nprint(a + b)"),
    ("Read one line of words and print the words in reverse order, separated by spaces.",
     {"inputs": ["a b c\n", "hello world\n", "one\n"], "outputs": ["c b a\n", "world hello\n", "one\n"]},
     "print(' '.join(input().split()[::-1]))"),
    ("Read an integer n, then n integers on the next line, and print the largest.",
     [{"input": "3\n4 9 1\n", "output": "9\n"}, {"input": "1\n-7\n", "output": "-7\n"},
      {"input": "2\n5 5\n", "output": "5\n"}],
     "input()\nprint(max(map(int, input().split())))"),
]  # fmt: skip


def _example_text(tests: CodeTests) -> str:
    """The first test shown in the prompt, as MBPP prompts do."""
    if tests.kind == "assert":
        return f"Your code should pass this test:\n{tests.cases[0]}"
    stdin, stdout = tests.cases[0]
    return f"Example input:\n{stdin.rstrip()}\nExample output:\n{stdout.rstrip()}"


def _rows(source: Any, split: str | None) -> tuple[list[dict], str]:
    if source == "synthetic":
        rows = [{"question": q, "tests": t, "solution": s} for q, t, s in SYNTHETIC]
        return rows, "synthetic"
    if isinstance(source, str) and not is_local(source):
        raise ValueError(
            f"code task: source must be 'synthetic', a file or save_to_disk folder path, or a "
            f"datasets.Dataset, got {source!r}"
        )
    return load_records(source, None, split, task="code"), describe(source)


def to_examples(rows: list[dict], where: str, question_column: str, tests_column: str,
                setup_column: str | None, prompt_template: str,
                system_prompt: str | None) -> list[dict[str, Any]]:  # fmt: skip
    """Rows -> examples {"prompt", "question", "tests", "setup_code"} (+ "solution" if present)."""
    if not rows:
        raise ValueError(f"code task: {where!r} has no rows")
    present = sorted({str(k) for row in rows for k in row})
    for name in filter(None, (question_column, tests_column, setup_column)):
        if name not in present:
            raise ValueError(f"code task: column {name!r} is not in {where!r}; columns: {present}")
    examples = []
    for i, row in enumerate(rows):
        question = row.get(question_column)
        conversational = isinstance(question, list)
        if not conversational and (not isinstance(question, str) or not question.strip()):
            raise ValueError(
                f"code task: row {i} of {where!r}: column {question_column!r} must be a non-empty "
                f"string or a list of {{'role', 'content'}} messages, got {str(question)[:80]!r}"
            )
        tests = normalize_tests(row.get(tests_column), f"code task: row {i} of {where!r}, "
                                f"column {tests_column!r}")  # fmt: skip
        setup = row.get(setup_column) if setup_column else ""
        if not isinstance(setup, str | None):
            raise ValueError(
                f"code task: row {i} of {where!r}: column {setup_column!r} must be a string, got "
                f"{type(setup).__name__}"
            )
        example = _example_text(tests)
        prompt: Any = make_prompt(
            question,
            lambda text, example=example: prompt_template.format(
                question=text.strip(), example=example
            ),
            system_prompt,
            f"code task: row {i} of {where!r}, column {question_column!r}",
        )
        raw = row.get(tests_column)
        text = question
        if conversational:  # the filled last user message
            text = next(m for m in reversed(prompt) if m["role"] == "user")["content"]
        ex = {"prompt": prompt, "question": text, "tests": raw, "setup_code": setup or ""}
        if isinstance(row.get("solution"), str):
            ex["solution"] = row["solution"]
        examples.append(ex)
    return examples


def build_code(
    source: Any = "synthetic",
    split: str | None = None,
    question_column: str = "question",
    tests_column: str = "tests",
    setup_column: str | None = None,
    prompt_template: str = DEFAULT_TEMPLATE,
    system_prompt: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
    mode: CodeScore = CODE_REWARD_DEFAULTS.mode,
    timeout_s: float = CODE_REWARD_DEFAULTS.timeout_s,
    memory_mb: int = CODE_REWARD_DEFAULTS.memory_mb,
    workers: int = CODE_REWARD_DEFAULTS.workers,
    code_from: CodeFrom = CODE_REWARD_DEFAULTS.code_from,
    isolation: Isolation = CODE_REWARD_DEFAULTS.isolation,
) -> TaskData:
    """Code task; reward "code" = tests passed in the sandbox (grouprl.envs.rewards.code).

    source:          "synthetic" (10 built-in problems with reference solutions), a local file
                     (.jsonl / .json / .parquet / .csv), a save_to_disk folder or a Dataset object
    split:           the part of a DatasetDict (object or folder) to use (default "train")
    question_column, tests_column, setup_column: the file's columns (module docstring)
    prompt_template: format string with {question} and optionally {example} (the first test)
    system_prompt:   when set, prompts are chat messages [system, user]
    eval_fraction:   hold out this fraction of the rows (shuffled with `seed`); 0 = no eval split
    max_train, max_eval: keep at most this many examples (None = all)
    mode, timeout_s, memory_mb, workers, code_from, isolation: options of the code reward
                     (grouprl.envs.rewards.code.code_reward; same defaults)
    """
    check_split_options("code", seed, max_train, max_eval, eval_fraction)
    check_template("prompt_template", prompt_template, ("question", "example"), ("question",))
    rows, where = _rows(source, split)
    examples = to_examples(rows, where, question_column, tests_column, setup_column,
                           prompt_template, system_prompt)  # fmt: skip
    examples, evaluation = hold_out(examples, eval_fraction, seed)
    reward = code_reward(mode=mode, timeout_s=timeout_s, memory_mb=memory_mb, workers=workers,
                         code_from=code_from, isolation=isolation)  # fmt: skip
    return TaskData(
        train=examples[:max_train],
        eval=evaluation[:max_eval],
        reward_fns={"code": reward},
        default_reward_weights={"code": 1.0},
    )
