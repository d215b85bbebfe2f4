"""Tasks: arithmetic determinism / disjointness, countdown generator and verifier, math loading."""

from __future__ import annotations

import pytest

from grouprl.envs.tasks import TASKS, build_task

# ---------------------------------------------------------------- registry


def test_unknown_task_and_option_fail_clearly():
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic"):
        build_task("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['n_trian'\].*n_train"):
        build_task("arithmetic", n_trian=3)


def test_registry_has_the_three_tasks():
    assert {"arithmetic"} <= set(TASKS)


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
