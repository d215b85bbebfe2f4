"""Property-based tests of the dataset loaders (math and code tasks, local JSON / JSONL files):
missing columns, empty rows, wrong types, huge strings, broken JSON. Every file gives a clear
error (ValueError / FileNotFoundError naming the file and the column, row or line) or examples
whose rewards are defined (a number, or NaN counted as a reward error), never another exception.

Fixed case counts (derandomized), a deadline per case; counts are printed at the end of the
session ("reliability counts", tests/conftest.py). Regression tests pin what the fuzzing found.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grouprl.envs.rewards import score_completions
from grouprl.envs.tasks import build_task

FUZZ = settings(max_examples=200, deadline=20000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
COLUMNS = ["question", "answer", "prompt", "text", "tests", "solution", "setup_code", "completions",
           "prompts", "truncated", "max_new_tokens", "completion_lengths", "x", "", "{question}"]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30),
    st.sampled_from(["#### 42", "1,000", "\\frac12", "{a}", "{", "x" * 20000, "assert True",
                     "9" * 5000, "", "   "]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["input", "output", "inputs", "outputs",
                                                             "k"]), inner, max_size=3)),
    max_leaves=6,
)  # fmt: skip


def mostly(good, bad=values):
    """Usually a well-typed value, sometimes anything (a wrong type, a huge string, None)."""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 0 else good)  # one_of is not weighted


anything = st.dictionaries(st.sampled_from(COLUMNS), values, max_size=5)  # random columns
math_row = st.fixed_dictionaries(
    {"question": mostly(st.text(min_size=1, max_size=40)),
     "answer": mostly(st.one_of(st.text(max_size=20), st.sampled_from(["#### 42", "1,000",
                                                                      "\\frac12", "9" * 5000])))},
    optional={"x": values, "prompt": values, "text": values, "truncated": values},
)  # fmt: skip
asserts = st.lists(st.sampled_from(["assert True", "assert f(1) == 2", "assert", "x = 1"]),
                   min_size=1, max_size=3)  # fmt: skip
io_cases = st.lists(st.fixed_dictionaries({"input": mostly(st.text(max_size=8)),
                                           "output": mostly(st.text(max_size=8))}),
                    min_size=1, max_size=3)  # fmt: skip
code_row = st.fixed_dictionaries(
    {"question": mostly(st.text(min_size=1, max_size=40)),
     "tests": mostly(st.one_of(asserts, io_cases, io_cases.map(lambda c: {
         "inputs": [t["input"] for t in c], "outputs": [t["output"] for t in c]})))},
    optional={"setup_code": mostly(st.text(max_size=10)), "x": values, "solution": values},
)  # fmt: skip
math_rows = st.lists(mostly(math_row, st.one_of(anything, values)), max_size=4)
code_rows = st.lists(mostly(code_row, st.one_of(anything, values)), max_size=4)
good_lines = st.sampled_from(
    [
        '{"question": "q", "answer": "1"}',
        '{"question": "q", "answer": "#### 7"}',
        "",
        '{"question": "2+2?", "answer": "4", "extra": [1, {"a": null}]}',
    ]
)
bad_lines = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "{",
            "[1]",
            "null",
            "[" * 5000,
            "\x00",
            "\ufeff{}",
            '{"question": ' + "1" * 5000 + ', "answer": 2}',
        ]
    ),
)
raw_lines = st.lists(st.integers(0, 5).flatmap(lambda i: bad_lines if i == 0 else good_lines),
                     max_size=4)  # fmt: skip
EXTRA = {"completion_lengths": [3], "truncated": [False], "max_new_tokens": 8}


def _check_error(exc: Exception, path) -> None:
    """A clear loading error names the file, column, row or line at fault (or the option)."""
    text = str(exc)
    assert any(w in text for w in (str(path), "column", "row", "line", "prompt_template")), text


def load_and_score(task: str, path, completion: str, **options) -> str:
    """ "error" (a clear loading error) or "scored" (examples built, their rewards defined)."""
    try:
        data = build_task(task, source=str(path), **options)
    except (ValueError, FileNotFoundError) as exc:
        _check_error(exc, path)
        return "error"
    assert data.train
    for example in data.train[:3]:
        rewards, errors = score_completions(data.reward_fns, [completion], [example], extra=EXTRA)
        for name, value in rewards.items():
            v = float(value[0])
            assert math.isfinite(v) or (math.isnan(v) and errors[name] in (0, 1)), (name, v)
    return "scored"


def count(counts: dict, key: str, outcome: str) -> None:
    for k in (f"fuzz cases: {key}", f"fuzz cases: {key} -> {outcome}"):
        counts[k] = counts.get(k, 0) + 1


def _write(path, content: str) -> None:
    path.write_text(content, encoding="utf-8", errors="surrogatepass")


@FUZZ
@given(
    math_rows,
    st.sampled_from([".jsonl", ".json"]),
    st.sampled_from(["{question}", "Q: {question} {x}", "{answer}{question}"]),
    st.sampled_from(["auto", "auto", "raw", "gsm8k"]),
    st.sampled_from(["42", "\\boxed{1000}", ""]),
)
def test_fuzz_math_task_loader(tmp_path_factory, reliability_counts, data, suffix, template,
                               answer_format, completion):  # fmt: skip
    path = tmp_path_factory.getbasetemp() / f"fuzz_math{suffix}"
    _write(path, "\n".join(map(json.dumps, data)) if suffix == ".jsonl" else json.dumps(data))
    outcome = load_and_score(
        "math", path, completion, prompt_template=template, answer_format=answer_format
    )
    count(reliability_counts, "dataset loader, math task (rows)", outcome)


@FUZZ
@given(raw_lines)
def test_fuzz_math_task_raw_lines(tmp_path_factory, reliability_counts, lines):
    path = tmp_path_factory.getbasetemp() / "fuzz_raw.jsonl"
    _write(path, "\n".join(lines))
    outcome = load_and_score("math", path, "The answer is 7.")
    count(reliability_counts, "dataset loader, math task (raw JSONL lines)", outcome)


@FUZZ
@given(code_rows, st.sampled_from([".jsonl", ".json"]), st.sampled_from([None, "setup_code"]))
def test_fuzz_code_task_loader(tmp_path_factory, reliability_counts, data, suffix, setup_column):
    """Scored with a completion that has no code block (code_from="block"), so the reward runs its
    whole path (tests column, setup column, scoring) except the sandbox, which has its own tests."""
    path = tmp_path_factory.getbasetemp() / f"fuzz_code{suffix}"
    _write(path, "\n".join(map(json.dumps, data)) if suffix == ".jsonl" else json.dumps(data))
    outcome = load_and_score(
        "code", path, "I would loop.", setup_column=setup_column, code_from="block"
    )
    count(reliability_counts, "dataset loader, code task (rows)", outcome)


# ---- regressions: these crashed (or failed late, at the first reward call) before the fix --------


@pytest.mark.parametrize(
    "line, match",
    [
        ("[" * 5000, r"line 1 is not valid JSON \(nested too deeply\)"),
        ('{"question": ' + "1" * 5000 + ', "answer": "2"}', "line 1 is not valid JSON .*4300"),
    ],
)
def test_absurd_json_lines_are_clear_errors(tmp_path, line, match):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        build_task("math", source=str(path))
    path = tmp_path / "d.json"
    path.write_text(line)
    with pytest.raises(ValueError, match="not valid JSON"):
        build_task("math", source=str(path))


@pytest.mark.parametrize("column", ["completions", "completion_lengths", "truncated", "prompts"])
def test_reserved_column_names_fail_at_load_time(tmp_path, column):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2", column: 0}) + "\n")
    with pytest.raises(ValueError, match=rf"columns \['{column}'\] of .* clash with names"):
        build_task("math", source=str(path))


def test_a_template_column_missing_from_one_row_names_the_row(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"question": "a", "answer": "1", "x": "hint"}, {"question": "b", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 1 of .*cannot be filled \(KeyError: 'x'\)"):
        build_task("math", source=str(path), prompt_template="Q: {question} {x}")
