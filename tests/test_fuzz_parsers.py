"""Property-based tests of model-output parsing: the tool-call / action parser (both formats),
answer extraction, the exact and the math-verify accuracy rewards. Any text gives a defined
result (a ParsedAction, a value or None, a reward in {0, 1} or None), never an exception or a hang.

Fixed case counts (derandomized), a deadline per case; counts are printed at the end of the
session ("reliability counts", tests/conftest.py). Regression tests pin what the fuzzing found.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grouprl.envs.answers import between_tags, gsm8k_answer, last_number, same_answer, to_fraction
from grouprl.envs.rewards.text import accuracy_reward
from grouprl.envs.tools.calls import ParsedAction, format_tool_call, parse_action


def fuzz(n: int, deadline_ms: int):
    return settings(max_examples=n, deadline=deadline_ms, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


def count(counts: dict, key: str) -> None:
    counts[f"fuzz cases: {key}"] = counts.get(f"fuzz cases: {key}", 0) + 1


PIECES = ["<tool_call>", "</tool_call>", "<action>", "</action>", "<TOOL_CALL>", "{", "}", '"name"',
          ":", '"arguments"', "[", "]", ",", '"', "\\", "null", "1e999", "NaN", "Infinity", '"\\ud800"',
          "\x00", "####", "1,234", ".5", "-", "+", "1/2", "\n", " ", "<answer>", "</answer>",
          "1" * 5000, "[" * 3000, '{"a":' * 2000]  # fmt: skip
texts = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    st.builds(
        lambda name, args: f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {args}}}',
        st.one_of(st.text(max_size=6), st.integers(), st.none()),
        st.sampled_from(
            [
                '"{}"',
                '"[1]"',
                '"{\\"x\\": 1}"',
                '"' + "[" * 3000 + '"',
                "[]",
                "{}",
                "null",
                '"not json"',
                '{"k": ' + "1" * 5000 + "}",
            ]
        ),  # fmt: skip
    ),
)
REASONS = {"no_tag", "empty", "json_error", "not_object", "missing_name", "bad_arguments"}


@fuzz(400, 2000)
@given(texts, st.sampled_from(["action", "tool_call"]))
def test_fuzz_parse_action(reliability_counts, text, fmt):
    count(reliability_counts, "tool-call parser (both formats)")
    parsed = parse_action(text, fmt)
    assert isinstance(parsed, ParsedAction)
    if parsed.ok:
        assert isinstance(parsed.name, str) and parsed.name.strip()
        assert isinstance(parsed.arguments, dict) and parsed.error is None
    else:
        assert parsed.reason in REASONS and isinstance(parsed.error, str) and parsed.name is None


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner,
                                                                         max_size=3)),
    max_leaves=6,
)  # fmt: skip


@fuzz(200, 2000)
@given(
    st.text(min_size=1, max_size=20).filter(str.strip),
    st.dictionaries(st.text(max_size=6), json_values, max_size=4),
)
def test_fuzz_tool_call_round_trip(reliability_counts, name, arguments):  # fmt: skip
    count(reliability_counts, "tool-call round trip (format -> parse)")
    text = "thinking... " + format_tool_call(name, arguments) + " trailing <tool_call> junk"
    parsed = parse_action(text, "tool_call")
    assert parsed.ok and parsed.name == name.strip() and parsed.arguments == arguments


@fuzz(400, 2000)
@given(texts, texts)
def test_fuzz_answer_extraction(reliability_counts, text, other):
    count(reliability_counts, "answer extraction (last_number, tags, gsm8k, to_fraction)")
    number = last_number(text)
    assert number is None or (
        re.fullmatch(r"[-+]?\d+(\.\d+)?", number) and to_fraction(number) is not None
    )
    inside = between_tags(text, "<answer>", "</answer>")
    assert inside is None or inside in text
    gold = gsm8k_answer(text)
    assert gold is None or (gold and "####" not in gold)
    value = to_fraction(text)
    assert value is None or isinstance(value, Fraction)
    assert same_answer(text, text) is True  # reflexive, whatever the text
    assert same_answer(text, other) == same_answer(other, text)


golds = st.one_of(texts, st.integers(), st.floats(), st.none(), st.lists(st.integers(), max_size=2))
exact = accuracy_reward(mode="exact")
exact_tag = accuracy_reward(mode="exact", answer_tag="answer")


@fuzz(300, 2000)
@given(texts, golds)
def test_fuzz_exact_accuracy(reliability_counts, completion, gold):
    count(reliability_counts, "exact accuracy reward")
    for reward in (exact, exact_tag):
        (value,) = reward([completion], answer=[gold])
        assert value is None if gold is None else value in (0.0, 1.0)


LATEX = ["\\frac{1}{2}", "\\boxed{", "}", "{", "$", "\\(", "\\)", "x^2", "^", "_", "\\sqrt", "1", "/",
         "\\infty", "\\pi", "=", ",", "1,000", ".5", "-", "\\left(", "\\right)", "\\text{", "<answer>",
         "</answer>", "9" * 400, "{" * 200, "\\frac" * 30, "\\begin{pmatrix}", "&", "\\\\", "\\%",
         "####", " "]  # fmt: skip
math_texts = st.one_of(
    st.text(max_size=40), st.lists(st.sampled_from(LATEX), max_size=12).map("".join)
)
math_plain = accuracy_reward(mode="math", timeout_s=2)
math_tag = accuracy_reward(mode="math", answer_tag="answer", timeout_s=2)


@fuzz(80, 30000)  # math-verify's own timeouts (2 s per parse / comparison) bound each case
@given(math_texts, st.one_of(math_texts, st.integers(), st.none()))
def test_fuzz_math_verifier_wrapper(reliability_counts, completion, gold):
    count(reliability_counts, "math-verify accuracy wrapper")
    for reward in (math_plain, math_tag):
        (value,) = reward([completion], answer=[gold])
        assert value is None or value in (0.0, 1.0)


# ---- regressions: these raised before the fix ------------------------------------------------------


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<tool_call>" + "[" * 5000, "json_error"),  # RecursionError in json
        ('<tool_call>{"name": "f", "arguments": {"n": ' + "7" * 5000 + "}}", "json_error"),
        ('<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}', "bad_arguments"),
        ('<tool_call>{"name": "f", "arguments": "' + "8" * 5000 + '"}', "bad_arguments"),
    ],
)
def test_absurd_json_in_a_tool_call_is_a_parse_failure(text, reason):
    parsed = parse_action(text, "tool_call")
    assert (parsed.ok, parsed.reason) == (False, reason) and len(parsed.error) < 300
