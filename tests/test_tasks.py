"""Tasks: arithmetic determinism / disjointness, countdown generator and verifier, math loading."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from grouprl.envs.tasks import TASKS, build_task
from grouprl.envs.tasks.countdown import (
    UnsafeExpression,
    check_equation,
    countdown_reward,
    safe_eval,
)

# ---------------------------------------------------------------- registry


def test_unknown_task_and_option_fail_clearly():
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic"):
        build_task("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['n_trian'\].*n_train"):
        build_task("arithmetic", n_trian=3)


def test_registry_has_the_three_tasks():
    assert {"arithmetic", "countdown", "math"} <= set(TASKS)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_given_the_seed():
    a = build_task("arithmetic", seed=3, n_train=50, n_eval=10)
    b = build_task("arithmetic", seed=3, n_train=50, n_eval=10)
    c = build_task("arithmetic", seed=4, n_train=50, n_eval=10)
    assert a.train == b.train and a.eval == b.eval
    assert a.train != c.train


def test_arithmetic_train_and_eval_are_disjoint_and_correct():
    task = build_task("arithmetic", seed=0, n_train=200, n_eval=100, ops="+-*", max_value=9)
    key = lambda ex: (ex["a"], ex["op"], ex["b"])  # noqa: E731
    train, held = {key(e) for e in task.train}, {key(e) for e in task.eval}
    assert len(train) == 200 and len(held) == 100  # no duplicates inside a split either
    assert not train & held
    for ex in task.train + task.eval:
        assert 0 <= ex["a"] <= 9 and 0 <= ex["b"] <= 9
        expected = {"+": ex["a"] + ex["b"], "-": ex["a"] - ex["b"], "*": ex["a"] * ex["b"]}[
            ex["op"]
        ]
        assert ex["answer"] == str(expected)
        assert ex["prompt"] == f"{ex['a']}{ex['op']}{ex['b']}="
        assert ex["prompt"].isascii()


def test_arithmetic_whole_space_is_used_exactly_once():
    # ops "+" and operands 0..2: exactly 9 problems; asking for all 9 must give each once.
    task = build_task("arithmetic", n_train=6, n_eval=3, ops="+", min_value=0, max_value=2)
    pairs = sorted((e["a"], e["b"]) for e in task.train + task.eval)
    assert pairs == [(a, b) for a in range(3) for b in range(3)]
    with pytest.raises(ValueError, match="exceeds the 9 distinct problems"):
        build_task("arithmetic", n_train=9, n_eval=1, ops="+", min_value=0, max_value=2)


def test_arithmetic_template_and_reward():
    task = build_task(
        "arithmetic", n_train=4, n_eval=0, ops="*", prompt_template="Q: {a} times {b}? A:"
    )
    ex = task.train[0]
    assert ex["prompt"] == f"Q: {ex['a']} times {ex['b']}? A:"
    acc = task.reward_fns["accuracy"]
    assert task.default_reward_weights == {"accuracy": 1.0}
    answers = [ex["answer"]] * 3
    assert acc([ex["answer"], "I think 100000", "no idea"], answer=answers) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ops": "+/"}, "ops='\\+/' must be a non-empty subset"),
        ({"ops": ""}, "must be a non-empty subset"),
        ({"ops": "+-", "prompt_template": "{a}+{b}="}, "must contain the placeholders \\['op'\\]"),
        ({"prompt_template": "{a}{op}{c}="}, "unknown placeholders \\['c'\\]"),
        ({"min_value": 5, "max_value": 4}, "max_value must be >= 5"),
        ({"n_train": -1}, "n_train must be >= 0"),
        ({"seed": "x"}, "seed must be an integer"),
    ],
)
def test_arithmetic_bad_options(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_task("arithmetic", **options)


# ---------------------------------------------------------------- countdown


def test_safe_eval_values():
    assert safe_eval("3 * (5 + 7)") == 36
    assert safe_eval("7 / 2") == Fraction(7, 2)
    assert safe_eval("((1))") == 1
    assert safe_eval("10 - 4 - 3") == 3  # left associative


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os')",  # names and calls: refused by the character check
        "a + 1",
        "(1).real",  # attribute access
        "2 ** 3",  # pow
        "7 // 2",  # floor division
        "7 % 2",
        "-3 + 5",  # unary minus is not one of the four operations
        "1.5 * 2",
        "0x10",
        "1 2",
        "",
        "(" * 150 + "1" + ")" * 150,  # too long
    ],
)
def test_safe_eval_rejects(text):
    with pytest.raises(UnsafeExpression):
        safe_eval(text)


def test_check_equation_rules():
    nums = [3, 5, 7]
    assert check_equation("3 * 5 + 7", nums, 22)
    assert check_equation("3*5+7 = 22", nums, 22)  # the right side is ignored
    assert check_equation("5 * 7 - 3", nums, 32)
    assert check_equation("3 + 5", nums, 8)  # a number may stay unused
    assert not check_equation("3 + 5", nums, 8, number_use="exactly_once")
    assert not check_equation("3 * 3 + 7", nums, 16)  # 3 used twice
    assert not check_equation("3 * 5 + 8", nums, 23)  # 8 was not given
    assert not check_equation("3 * 5 + 7", nums, 21)  # wrong value
    assert not check_equation("7 / (5 - 5)", [7, 5, 5], 0)  # division by zero -> False
    assert check_equation("(7 + 5) / 3 * 3", [7, 5, 3, 3], 12)
    assert check_equation("7 / 2 * 4", [7, 2, 4], 14)  # fractional intermediate, exact result
    assert not check_equation("2 ** 5", [2, 5], 32)


def test_countdown_reward_extraction_modes():
    cols = {"numbers": [[3, 5, 7]] * 4, "target": [22] * 4}
    completions = [
        "think... <answer>3*5+7</answer>",
        "<answer>3*5+8</answer>",
        "3*5+7",  # no tag
        "<answer>import os</answer>",
    ]
    assert countdown_reward()(completions, **cols) == [1.0, 0.0, 0.0, 0.0]
    last = countdown_reward(answer_from="last_line")
    assert last(["so:\n3*5+7\n\n", "3*5+7\nno", "", "<answer>3*5+7</answer>"], **cols) == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="answer_from='first_line' is not allowed"):
        countdown_reward(answer_from="first_line")


def test_countdown_generator_is_solvable_seeded_and_disjoint():
    task = build_task("countdown", seed=1, n_train=200, n_eval=50)
    again = build_task("countdown", seed=1, n_train=200, n_eval=50)
    assert task.train == again.train and task.eval == again.eval
    key = lambda ex: (tuple(sorted(ex["numbers"])), ex["target"])  # noqa: E731
    assert not {key(e) for e in task.train} & {key(e) for e in task.eval}
    examples = task.train + task.eval
    fn = task.reward_fns["accuracy"]
    completions = [f"<answer>{ex['solution']}</answer>" for ex in examples]
    cols = {"numbers": [e["numbers"] for e in examples], "target": [e["target"] for e in examples]}
    assert fn(completions, **cols) == [1.0] * len(examples)
    for ex in examples:
        assert 3 <= len(ex["numbers"]) <= 4 and 1 <= ex["target"] <= 100
        assert all(1 <= x <= 99 for x in ex["numbers"])
        assert check_equation(ex["solution"], ex["numbers"], ex["target"], "exactly_once")
        assert f"numbers {', '.join(map(str, ex['numbers']))}," in ex["prompt"]
        assert ex["prompt"].isascii()


def test_countdown_generator_bad_options():
    with pytest.raises(ValueError, match="max_numbers must be >= 3"):
        build_task("countdown", max_numbers=2)
    with pytest.raises(ValueError, match="must contain the placeholders \\['target'\\]"):
        build_task("countdown", prompt_template="Numbers: {numbers}")
    with pytest.raises(ValueError, match="could only generate"):
        build_task("countdown", n_train=50, n_eval=0, min_number=1, max_number=1, max_numbers=3)


# ---------------------------------------------------------------- math

DATA = Path(__file__).parent / "data"
GSM8K = str(DATA / "gsm8k_tiny.jsonl")
MATH_PARQUET = str(DATA / "math_tiny.parquet")


def test_math_from_jsonl_extracts_gsm8k_answers():
    task = build_task("math", source=GSM8K)
    assert len(task.train) == 10 and task.eval == []
    first = task.train[0]
    assert first["prompt"].startswith("Tom has 3 apples")
    assert first["answer"] == "7"
    assert task.train[3]["answer"] == "3000"  # "#### 3,000": commas stripped
    fn = task.reward_fns["accuracy"]
    out = fn(["3 + 4 = 7, so \\boxed{7}", "I think 8"], answer=["7", "7"])
    assert out == [1.0, 0.0]


def test_math_from_parquet_with_chat_prompts_and_fraction_split():
    task = build_task(
        "math",
        source=MATH_PARQUET,
        question_column="problem",
        answer_column="solution",
        system_prompt="Answer in \\boxed{}.",
        prompt_template="Problem: {question} (level {level})",
        eval_fraction=0.3,
        seed=0,
    )
    assert len(task.train) == 7 and len(task.eval) == 3
    ex = task.train[0]
    assert ex["prompt"][0] == {"role": "system", "content": "Answer in \\boxed{}."}
    assert ex["prompt"][1]["role"] == "user"
    assert ex["prompt"][1]["content"] == f"Problem: {ex['problem']} (level {ex['level']})"
    assert ex["answer"] == ex["solution"]  # raw answers are kept as they are
    questions = [e["problem"] for e in task.train + task.eval]
    assert len(set(questions)) == 10
    again = build_task(
        "math", source=MATH_PARQUET, question_column="problem", answer_column="solution",
        eval_fraction=0.3, seed=0,
    )  # fmt: skip
    assert [e["problem"] for e in again.eval] == [e["problem"] for e in task.eval]
    by_answer = {e["problem"]: e["answer"] for e in task.train + task.eval}
    fn = task.reward_fns["accuracy"]
    out = fn(
        ["so it is $\\boxed{0.75}$", "$\\boxed{x^2+2x+1}$", "$\\boxed{5}$"],
        answer=[
            by_answer["What is $\\frac{1}{2} + \\frac{1}{4}$?"],
            by_answer["Expand $(x+1)^2$."],
            by_answer["What is $7 \\times 6$?"],
        ],
    )
    assert out == [1.0, 1.0, 0.0]


def test_math_eval_source_and_limits(tmp_path):
    task = build_task("math", source=GSM8K, eval_source=GSM8K, max_train=4, max_eval=2)
    assert len(task.train) == 4 and len(task.eval) == 2
    assert task.eval[0]["answer"] == "7"


def test_math_json_list_and_json_lines(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"question": "1+1?", "answer": 2}]))
    assert build_task("math", source=str(as_list)).train[0]["answer"] == "2"
    as_field = tmp_path / "field.json"
    as_field.write_text(json.dumps({"data": [{"question": "q", "answer": "#### 5"}]}))
    assert build_task("math", source=str(as_field)).train[0]["answer"] == "5"
    as_lines = tmp_path / "lines.json"
    as_lines.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    assert [e["answer"] for e in build_task("math", source=str(as_lines)).train] == ["1", "2"]


def test_math_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_task("math", source=str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        build_task("math", source=str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n')
    with pytest.raises(ValueError, match="line 3 is not valid JSON"):
        build_task("math", source=str(bad))
    with pytest.raises(
        ValueError, match=r"column 'prompt' is not in .*; columns: \['answer', 'question'\]"
    ):
        build_task("math", source=GSM8K, question_column="prompt")
    with pytest.raises(ValueError, match="row 0 of .*answer_format='gsm8k'"):
        build_task(
            "math", source=MATH_PARQUET, question_column="problem", answer_column="solution",
            answer_format="gsm8k",
        )  # fmt: skip
    with pytest.raises(ValueError, match="split applies to hub datasets and DatasetDicts"):
        build_task("math", source=GSM8K, split="test")
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        build_task("math", source=GSM8K, eval_fraction=1.0)
    with pytest.raises(ValueError, match="answer_format='boxed' is not allowed"):
        build_task("math", source=GSM8K, answer_format="boxed")
    with pytest.raises(ValueError, match="unknown placeholders \\['topic'\\]"):
        build_task("math", source=GSM8K, prompt_template="{topic}: {question}")


def test_math_hub_source_calls_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if split == "broken":
            raise ConnectionError("offline")
        return [{"question": f"q {split}", "answer": "#### 4"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = build_task("math", source="openai/gsm8k", config="main", eval_split="test")
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert task.train[0]["answer"] == "4" and task.eval[0]["prompt"] == "q test"
    with pytest.raises(ValueError, match="cannot load hub dataset 'openai/gsm8k'.*offline"):
        build_task("math", source="openai/gsm8k", split="broken")


def test_math_directory_source_is_refused(tmp_path):
    (tmp_path / "ds").mkdir()
    with pytest.raises(ValueError, match="must be a file ending with one of"):
        build_task("math", source=str(tmp_path / "ds"))


def test_train_and_eval_takes_eval_source_then_eval_split_then_a_held_out_fraction():
    from grouprl.envs.tasks.base import train_and_eval

    calls = []

    def load(src, cfg, part):
        calls.append((src, cfg, part))
        return [{"prompt": f"{src}/{part}/{i}"} for i in range(4)]

    train, ev = train_and_eval(load, "S", "c", "train", "E", "ec", "test", 0.0, 0)
    assert calls == [("S", "c", "train"), ("E", "ec", "test")]
    assert [e["prompt"] for e in ev] == [f"E/test/{i}" for i in range(4)] and len(train) == 4
    calls.clear()
    train, ev = train_and_eval(load, "S", "c", "train", None, None, "dev", 0.0, 0)
    assert calls == [("S", "c", "train"), ("S", "c", "dev")]
    assert ev[0]["prompt"] == "S/dev/0"
    calls.clear()
    train, ev = train_and_eval(load, "S", "c", "train", None, None, None, 0.5, 0)
    assert calls == [("S", "c", "train")] and len(train) == 2 and len(ev) == 2
    assert sorted(e["prompt"] for e in train + ev) == [f"S/train/{i}" for i in range(4)]


def test_arithmetic_max_train_keeps_the_held_out_split():
    full = build_task("arithmetic", n_train=50, n_eval=7, seed=3)
    few = build_task("arithmetic", n_train=50, n_eval=7, seed=3, max_train=5)
    assert few.train == full.train[:5] and few.eval == full.eval
    with pytest.raises(ValueError, match="max_train"):
        build_task("arithmetic", max_train=0)
