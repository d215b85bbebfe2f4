"""Reward functions: answer helpers, accuracy, format, overlong, length, user loading, scoring."""

from __future__ import annotations

import pytest

from grouprl.envs.answers import (
    between_tags,
    gsm8k_answer,
    last_number,
    same_answer,
    tag_pair,
)
from grouprl.envs.rewards import build_reward
from grouprl.envs.rewards.text import accuracy_reward

# ---------------------------------------------------------------- answer helpers


def test_last_number():
    assert last_number("3 apples and 1,234 pears.") == "1234"
    assert last_number("it is -7") == "-7"
    assert last_number("2.50 dollars") == "2.50"
    assert last_number("no digits") is None
    assert last_number("12+30=42\n") == "42"


def test_between_tags_takes_the_last_pair():
    text = "use <answer></answer> please. <answer> 5 </answer> and <answer>6</answer>"
    assert between_tags(text, "<answer>", "</answer>") == "6"
    assert between_tags("<answer>7", "<answer>", "</answer>") is None
    assert between_tags("7</answer>", "<answer>", "</answer>") is None
    assert tag_pair("answer") == ("<answer>", "</answer>") == tag_pair("<answer>")
    with pytest.raises(ValueError, match="plain name"):
        tag_pair("</>")


def test_gsm8k_answer_and_same_answer():
    assert gsm8k_answer("She sold 48/2 = 24 clips.\n#### 1,072") == "1072"
    assert gsm8k_answer("no mark") is None
    assert gsm8k_answer("#### ") is None
    assert same_answer("42.0", "42") and same_answer("1,000", "1000")
    assert not same_answer("41", "42")
    assert same_answer(" yes ", "yes") and not same_answer("Yes", "yes")


# ---------------------------------------------------------------- accuracy


def test_exact_accuracy_last_number_and_tags():
    acc = accuracy_reward(mode="exact")
    completions = ["12+30=42", "42.0", "41", "", "the answer is 4 2"]
    assert acc(completions, answer=["42"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    tagged = accuracy_reward(mode="exact", answer_tag="answer")
    out = tagged(["<answer>42</answer> 7", "42", "<answer>x</answer>"], answer=["42", "42", "x"])
    assert out == [1.0, 0.0, 1.0]


def test_exact_accuracy_missing_gold_and_column():
    acc = accuracy_reward()
    assert acc(["1", "2"], answer=[None, "2"], prompts=["a", "b"]) == [None, 1.0]
    with pytest.raises(KeyError, match="needs the column 'answer'.*'solution'"):
        acc(["1"], solution=["1"])
    with pytest.raises(ValueError, match="unknown option"):
        accuracy_reward(mode="exact", timeout_s=3)
    with pytest.raises(ValueError, match="mode='fuzzy' is not allowed"):
        accuracy_reward(mode="fuzzy")


def test_math_accuracy():
    acc = build_reward("accuracy", mode="math")
    completions = [
        "so the result is $\\boxed{\\frac{1}{2}}$",
        "0.5",
        "I give up",
        "x = 3",
        "anything",
    ]
    golds = ["\\frac12", "1/2", "1/2", "4", "\\unparseable{"]
    out = acc(completions, answer=golds)
    assert out[:4] == [1.0, 1.0, 0.0, 0.0]
    assert out[4] is None  # gold math-verify cannot parse: no reward
    tagged = build_reward("accuracy", mode="math", answer_tag="answer")
    assert tagged(["<answer>x^2+1</answer>", "x^2+1"], answer=["1+x^2", "1+x^2"]) == [1.0, 0.0]


def test_math_accuracy_off_the_main_thread():
    # signal-based timeouts only work in the main thread: the reward must still work in a thread.
    from concurrent.futures import ThreadPoolExecutor

    acc = build_reward("accuracy", mode="math")
    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(acc, ["\\boxed{2}", "3"], answer=["2", "2"]).result()
    assert out == [1.0, 0.0]
