"""Rewards as TRL users write them: keyword calls, message-list completions for conversational
prompts, a loud stop for a reward that fails on every sample, and SystemExit from a reward kept
to that sample (issues 14 / 15)."""

import json
import warnings

import pytest
from tiny_runs import arithmetic_run

from grouprl.config.loading import validate
from grouprl.envs.rewards import load_reward_fn, score_completions
from grouprl.envs.rewards.health import RewardFailedError, RewardFailedWarning, RewardHealth
from grouprl.envs.rewards.loading import RewardSignatureError
from grouprl.envs.rewards.text import accuracy_reward, format_reward
from grouprl.train import train

REWARDS_PY = '''
def trl_style(prompts, completions, **kwargs):
    """TRL's documented signature; it checks that prompts and completions are not swapped."""
    assert len(prompts) == len(completions) and "answer" in kwargs
    assert all(isinstance(c, str) for c in completions)
    return [float(sum(map(ord, c)) % 2) for c in completions]


def always_fails(completions, **kwargs):
    raise ValueError("the grader is down")


def exits_on_some(completions, **kwargs):
    if any(sum(map(ord, c)) % 3 == 0 for c in completions):
        raise SystemExit(0)
    return [1.0] * len(completions)


def parity(completions, **kwargs):
    return [float(sum(map(ord, c)) % 2) for c in completions]
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "trl_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def _cfg(out_dir, model_dir, rewards, *overrides):
    return validate(arithmetic_run(
        out_dir, model_dir, *overrides, task={"options": {"n_train": 16}}, rewards=rewards,
        rollout={"group_size": 4, "max_new_tokens": 4}, train={"steps": 2}, eval={"every": 0},
    ))  # fmt: skip


def _train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_trl_style_reward_trains(tmp_path, tiny_model_dir, reward_file):
    # old protocol: fn(completions, **columns) put the completions into `prompts` -> TypeError on
    # every sample, NaN rewards, grad_norm 0 and a run that "succeeds"
    cfg = _cfg(tmp_path, tiny_model_dir, [{"name": f"{reward_file}:trl_style"}])
    train(cfg)
    rows = _train_rows(cfg.run_dir)
    assert all(r.get("reward_errors/trl_style", 0.0) == 0.0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)


def test_a_reward_failing_on_every_sample_warns_then_stops_the_run(
    tmp_path, tiny_model_dir, reward_file
):
    rewards = [{"name": f"{reward_file}:always_fails", "max_failed_steps": 2},
               {"name": f"{reward_file}:parity"}]  # fmt: skip
    cfg = _cfg(tmp_path, tiny_model_dir, rewards, "train.steps=5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RewardFailedError) as info:
            train(cfg)
    seen = [str(w.message) for w in caught if issubclass(w.category, RewardFailedWarning)]
    assert len(seen) == 1 and "'always_fails' failed on all 8 samples of step 0" in seen[0]
    assert "ValueError: the grader is down" in seen[0]
    assert "step 1" in str(info.value) and "max_failed_steps=2" in str(info.value)
    assert "ValueError: the grader is down" in str(info.value)


def test_system_exit_in_a_reward_is_that_samples_error(tmp_path, tiny_model_dir, reward_file):
    rewards = [{"name": f"{reward_file}:exits_on_some"}, {"name": f"{reward_file}:parity"}]
    cfg = _cfg(tmp_path, tiny_model_dir, rewards, "train.steps=3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RewardFailedWarning)
        train(cfg)  # returns: SystemExit(0) did not end the run
    rows = _train_rows(cfg.run_dir)
    assert len(rows) == 3
    assert sum(r.get("reward_errors/exits_on_some", 0.0) for r in rows) > 0


# ---------------------------------------------------------------- the call itself


def test_keyword_call_and_message_completions():
    seen = {}

    def trl(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, extra=kwargs)
        return [1.0] * len(completions)

    msgs = [{"role": "user", "content": "1+1?"}]
    completions = [[{"role": "assistant", "content": "<answer>2</answer>"}]]
    examples = [{"prompt": msgs, "answer": "2"}]
    rewards, errors = score_completions(
        {"trl": trl, "acc": accuracy_reward(answer_tag="answer"),
         "fmt": format_reward(tags=["<answer>", "</answer>"])},
        completions, examples, extra={"max_new_tokens": 4},
    )  # fmt: skip
    assert errors == {"trl": 0, "acc": 0, "fmt": 0}
    assert seen["prompts"] == [msgs] and seen["completions"] == completions
    assert seen["answer"] == ["2"] and seen["extra"] == {"max_new_tokens": 4}
    # the built-ins read the content of the message list
    assert rewards["acc"].tolist() == [1.0] and rewards["fmt"].tolist() == [1.0]


def test_a_function_without_kwargs_gets_only_its_names():
    def narrow(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    rewards, _ = score_completions(
        {"narrow": narrow}, ["2", "3"], [{"prompt": "p", "answer": "2"}] * 2,
        extra={"max_new_tokens": 4},
    )  # fmt: skip
    assert rewards["narrow"].tolist() == [1.0, 0.0]


def test_a_signature_that_cannot_take_the_keywords_is_a_clear_error(tmp_path):
    def positional(texts, **kwargs):
        return [0.0] * len(texts)

    with pytest.raises(RewardSignatureError, match=r"parameters \['texts'\] get no value"):
        score_completions({"positional": positional}, ["a"], [{"prompt": "p"}])
    path = tmp_path / "r.py"
    path.write_text("def f(texts, /):\n    return [0.0]\n\ndef g(texts):\n    return [0.0]\n")
    with pytest.raises(TypeError, match="positional-only"):
        load_reward_fn(f"{path}:f")
    with pytest.raises(TypeError, match="no parameter 'completions' and no \\*\\*kwargs"):
        load_reward_fn(f"{path}:g")


def test_base_exceptions_are_sample_errors_but_ctrl_c_stops():
    def exits(completions, **kwargs):
        if "bad" in completions:
            raise SystemExit(0)
        return [1.0] * len(completions)

    first: dict[str, str] = {}
    rewards, errors = score_completions(
        {"exits": exits}, ["ok", "bad"], [{"prompt": "p"}] * 2, first_errors=first
    )
    assert errors == {"exits": 1} and rewards["exits"][0] == 1.0 and rewards["exits"][1].isnan()
    assert first == {"exits": "sample 1: SystemExit: 0"}
    with pytest.raises(RuntimeError, match="SystemExit"):  # fail_fast: not an exit of the trainer
        score_completions({"exits": exits}, ["bad"], [{"prompt": "p"}], fail_fast=True)

    def interrupted(completions, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_completions({"ctrl_c": interrupted}, ["a"], [{"prompt": "p"}])


def test_reward_health_counts_consecutive_all_failed_steps():
    health = RewardHealth({"r": 2})
    with pytest.warns(RewardFailedWarning, match="first error: boom"):
        health.observe(0, {"r": 4}, 4, {"r": "boom"})
    health.observe(1, {"r": 3}, 4, {})  # one sample worked: the count resets
    with pytest.warns(RewardFailedWarning):
        health.observe(2, {"r": 4}, 4, {"r": "boom"})
    with pytest.raises(RewardFailedError, match="2 such step"):
        health.observe(3, {"r": 4}, 4, {"r": "boom"})


def test_isolated_rewards_use_the_keyword_protocol_too():
    from grouprl.runtime.reward_guard import IsolatedReward

    def trl(prompts, completions, **kwargs):
        return [float(p == "p" and c == "a") for p, c in zip(prompts, completions)]

    def positional(texts, **kwargs):
        return [0.0]

    fns = {"trl": IsolatedReward(trl, "trl", timeout_s=5.0, isolation="thread")}
    rewards, errors = score_completions(fns, ["a", "b"], [{"prompt": "p"}] * 2)
    assert rewards["trl"].tolist() == [1.0, 0.0] and errors == {"trl": 0}
    bad = {
        "positional": IsolatedReward(positional, "positional", timeout_s=5.0, isolation="thread")
    }
    with pytest.raises(RewardSignatureError, match="'texts'"):
        score_completions(bad, ["a"], [{"prompt": "p"}])
