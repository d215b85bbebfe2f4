"""Reward functions: answer helpers, accuracy, format, overlong, length, user loading, scoring."""

from __future__ import annotations

import pytest
import torch

from grouprl.envs.answers import (
    between_tags,
    gsm8k_answer,
    last_number,
    same_answer,
    tag_pair,
)
from grouprl.envs.rewards import build_reward, load_reward_fn, score_completions
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


def test_accuracy_countdown_mode():
    acc = build_reward("accuracy", mode="countdown", answer_from="last_line")
    assert acc(["x\n3*5+7", "3*5+7\n?"], numbers=[[3, 5, 7]] * 2, target=[22, 22]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown option.*'answer_column'"):
        build_reward("accuracy", mode="countdown", answer_column="x")


# ---------------------------------------------------------------- format


def test_format_default_tags():
    fmt = build_reward("format")
    completions = [
        "<think>a\nb</think>\n<answer>7</answer>",
        "  <think></think><answer>7</answer>\n",
        "<answer>7</answer>",
        "<think>a</think> extra <answer>7</answer>",
        "<think>a</think><answer>7</answer> trailing",
        "",
    ]
    assert fmt(completions, prompts=["p"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_format_pattern_tags_and_search():
    fmt = build_reward("format", pattern=r"\d+")
    assert fmt(["42", "42 apples", "x"]) == [1.0, 0.0, 0.0]
    search = build_reward("format", pattern=r"\d+", match="search")
    assert search(["42", "42 apples", "x"]) == [1.0, 1.0, 0.0]
    one_tag = build_reward("format", tags=["<answer>", "</answer>"])
    assert one_tag(["<answer>1</answer>", "<answer>1"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not both"):
        build_reward("format", pattern="x", tags=["<a>", "</a>"])
    with pytest.raises(ValueError, match="open/close string pairs"):
        build_reward("format", tags=["<a>"])
    with pytest.raises(ValueError, match="not a valid regex"):
        build_reward("format", pattern="(")
    with pytest.raises(ValueError, match="match='prefix' is not allowed"):
        build_reward("format", match="prefix")


# ---------------------------------------------------------------- overlong and length


def test_overlong_boundaries_hand_computed():
    # L_max = 100, buffer 20 -> L_exp = 80: 0 up to 80, then -(len-80)/20, -1 beyond 100.
    fn = build_reward("overlong", buffer=20)
    lengths = [0, 80, 81, 90, 99, 100, 101, 500]
    out = fn(["x"] * 8, completion_lengths=lengths, max_new_tokens=100, truncated=[False] * 8)
    assert out == pytest.approx([0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0])
    # buffer_frac 0.25 of 40 = 10 tokens, factor 2: L_exp = 30.
    frac = build_reward("overlong", buffer_frac=0.25, factor=2.0)
    out = frac(["x"] * 4, completion_lengths=[30, 31, 35, 40], max_new_tokens=40)
    assert out == pytest.approx([0.0, -0.2, -1.0, -2.0])


def test_overlong_errors():
    with pytest.raises(KeyError, match="needs the column 'completion_lengths'"):
        build_reward("overlong")(["x"], max_new_tokens=10)
    with pytest.raises(KeyError, match="needs max_new_tokens"):
        build_reward("overlong")(["x"], completion_lengths=[3])
    with pytest.raises(ValueError, match="longer than max_new_tokens"):
        build_reward("overlong", buffer=50)(["x"], completion_lengths=[3], max_new_tokens=10)
    with pytest.raises(ValueError, match="buffer_frac must be in"):
        build_reward("overlong", buffer_frac=0.0)


def test_length_rewards_hand_computed():
    linear = build_reward("length", coef=0.5)
    assert linear(["a", "b"], completion_lengths=[10, 40], max_new_tokens=40) == pytest.approx(
        [-0.125, -0.5]
    )
    target = build_reward("length", mode="target", target=20)
    out = target(["a"] * 3, completion_lengths=[10, 20, 40], max_new_tokens=40)
    assert out == pytest.approx([-0.25, 0.0, -0.5])
    with pytest.raises(ValueError, match="needs target >= 0"):
        build_reward("length", mode="target")
    with pytest.raises(ValueError, match="unknown reward 'lenght'"):
        build_reward("lenght")


# ---------------------------------------------------------------- user functions

USER_FILE = """
def reward(completions, **kwargs):
    return [float(len(c)) for c in completions]

def fragile(completions, answer, **kwargs):
    # fails on the sample whose answer is "boom"
    return [1.0 / (a != "boom") for a in answer]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_load_reward_fn_from_path_and_module(user_file, monkeypatch):
    fn = load_reward_fn(f"{user_file}:reward")
    assert fn(["ab", "c"]) == [2.0, 1.0]
    monkeypatch.syspath_prepend(str(user_file.parent))
    by_module = load_reward_fn("my_rewards:reward")
    assert by_module(["abc"]) == [3.0]
    assert build_reward(f"{user_file}:reward")(["x"]) == [1.0]
    builtin = load_reward_fn("grouprl.envs.rewards.text:accuracy_reward")
    assert builtin is accuracy_reward


def test_load_reward_fn_errors(user_file):
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        load_reward_fn("no_colon")
    with pytest.raises(ModuleNotFoundError, match="cannot import module 'no_such_pkg.mod'"):
        load_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_fn(f"{user_file.parent}/missing.py:reward")
    with pytest.raises(AttributeError, match="has no attribute 'rewrd'.*'fragile', 'reward'"):
        load_reward_fn(f"{user_file}:rewrd")
    with pytest.raises(TypeError, match="'NOT_A_FUNCTION' is not callable \\(type int\\)"):
        load_reward_fn(f"{user_file}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="takes no options"):
        build_reward(f"{user_file}:reward", scale=2)


# ---------------------------------------------------------------- score_completions


def _examples(answers):
    return [{"prompt": f"p{i}", "answer": a} for i, a in enumerate(answers)]


def test_score_completions_passes_columns_and_extra():
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs)
        return [1.0, None, 0.5]

    fns = {"acc": accuracy_reward(), "spy": spy}
    extra = {"completion_lengths": [3, 1, 2], "truncated": [False] * 3, "max_new_tokens": 8}
    rewards, errors = score_completions(
        fns, ["7", "8", "x"], _examples(["7", "9", "1"]), extra=extra
    )
    assert rewards["acc"].dtype == torch.float32
    assert rewards["acc"].tolist() == [1.0, 0.0, 0.0]
    assert rewards["spy"][0] == 1.0 and torch.isnan(rewards["spy"][1]) and rewards["spy"][2] == 0.5
    assert errors == {"acc": 0, "spy": 0}
    assert seen["prompts"] == ["p0", "p1", "p2"] and seen["answer"] == ["7", "9", "1"]
    assert seen["max_new_tokens"] == 8 and seen["completion_lengths"] == [3, 1, 2]


def test_failing_user_reward_gives_nan_and_a_count(user_file):
    fragile = load_reward_fn(f"{user_file}:fragile")
    calls = []

    def counted(completions, **kwargs):
        calls.append(len(completions))
        return fragile(completions, **kwargs)

    answers = ["a", "boom", "c", "boom"]
    rewards, errors = score_completions(
        {"fragile": counted}, ["1", "2", "3", "4"], _examples(answers), extra={"max_new_tokens": 8}
    )
    values = rewards["fragile"]
    assert values[0] == 1.0 and values[2] == 1.0
    assert torch.isnan(values[1]) and torch.isnan(values[3])
    assert errors == {"fragile": 2}
    assert calls == [4, 1, 1, 1, 1]  # one batched call, then one retry per sample


def test_fail_fast_reraises_with_name_and_index(user_file):
    fragile = load_reward_fn(f"{user_file}:fragile")
    with pytest.raises(ZeroDivisionError) as info:
        score_completions(
            {"fragile": fragile}, ["1", "2", "3"], _examples(["a", "c", "boom"]), fail_fast=True
        )
    assert info.value.__notes__ == ["raised by reward function 'fragile' on sample 2"]


def test_score_completions_contract_errors():
    examples = _examples(["1", "2"])
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        score_completions({"short": lambda completions, **k: [1.0]}, ["a", "b"], examples)
    with pytest.raises(ValueError, match="returned nan for sample 1"):
        score_completions(
            {"nan": lambda completions, **k: [1.0, float("nan")]}, ["a", "b"], examples
        )
    with pytest.raises(ValueError, match="returned 'good' for sample 0"):
        score_completions({"str": lambda completions, **k: ["good", 1]}, ["a", "b"], examples)
    with pytest.raises(ValueError, match="3 examples for 2 completions"):
        score_completions({}, ["a", "b"], _examples(["1", "2", "3"]))
    with pytest.raises(ValueError, match="clash"):
        score_completions(
            {}, ["a"], [{"prompt": "p", "max_new_tokens": 3}], extra={"max_new_tokens": 4}
        )


def test_batch_only_failure():
    # Fails whenever called with more than one completion: every sample passes alone.
    def batch_hater(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [2.0]

    rewards, errors = score_completions({"b": batch_hater}, ["a", "b"], _examples(["1", "2"]))
    assert rewards["b"].tolist() == [2.0, 2.0] and errors == {"b": 0}
    with pytest.raises(RuntimeError, match="batch too big") as info:
        score_completions({"b": batch_hater}, ["a", "b"], _examples(["1", "2"]), fail_fast=True)
    assert "no single sample fails" in info.value.__notes__[0]


def test_extra_prompts_replace_the_prompt_column():
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs)
        return [0.0]

    score_completions({"spy": spy}, ["a"], [{"prompt": "raw"}], extra={"prompts": ["<chat>raw"]})
    assert seen["prompts"] == ["<chat>raw"]
