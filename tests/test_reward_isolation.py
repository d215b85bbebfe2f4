"""Rewards and environments that raise or hang: per-sample deadlines, isolation, counts, fail_fast.

Deadlines are a fraction of a second; a hanging call sleeps far longer, so a test that did not
enforce the deadline would take minutes, not pass.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time

import pytest
import torch

from grouprl.config.loading import ConfigError, apply_overrides, validate
from grouprl.envs.rewards import score_completions
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.rollouts.multi_turn import collect_episodes
from grouprl.runtime.env_guard import EnvFailure, EnvGuard, GuardedEnv
from grouprl.runtime.reward_guard import (
    IsolatedReward,
    RewardFailure,
    drain_reward_metrics,
    isolate_rewards,
    isolation_settings,
)

HANG_S = 30.0  # what a hanging call would cost without the deadline


def flaky(completions, **columns):
    """1.0 / 0.0 by length parity; "hang" sleeps, "boom" raises, "die" kills its process."""
    out = []
    for text in completions:
        if "hang" in text:
            time.sleep(HANG_S)
        if "boom" in text:
            raise RuntimeError(f"cannot score {text!r}")
        if "die" in text:
            os._exit(3)
        out.append(float(len(text) % 2))
    return out


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_hanging_and_raising_samples_get_nan_the_others_keep_their_values(isolation):
    reward = IsolatedReward(flaky, "flaky", timeout_s=0.5, isolation=isolation, workers=2)
    start = time.monotonic()
    values = reward(["ab", "hang", "abc", "boom", "a"], prompts=list("pqrst"))
    assert time.monotonic() - start < 10
    assert values == [0.0, None, 1.0, None, 1.0]
    assert reward.pop_metrics() == {"reward_errors/flaky": 1.0, "reward_timeouts/flaky": 1.0}
    assert reward.pop_metrics() == {"reward_errors/flaky": 0.0, "reward_timeouts/flaky": 0.0}
    assert reward(["xy", "xyz"]) == [0.0, 1.0]  # still works after a killed / abandoned call
    if isolation == "thread":
        assert reward.abandoned_threads == 1
    reward.close()


def test_a_dying_worker_costs_one_sample_and_is_replaced():
    reward = IsolatedReward(flaky, "flaky", timeout_s=5.0)
    assert reward(["ab", "die", "abc"]) == [0.0, None, 1.0]
    assert reward.pop_metrics()["reward_errors/flaky"] == 1.0
    assert len(reward._pool) == 1 and reward._pool[0].proc.is_alive()
    reward.close()
    assert reward._pool == []


def test_workers_score_in_parallel_and_per_sample_columns_are_sliced():
    # 4 samples meet at a barrier that only opens when 4 calls wait on it together: it passes
    # only if the 4 workers score at once (no wall-clock threshold, so a busy CI box cannot flake)
    barrier = multiprocessing.get_context("fork").Barrier(4, timeout=20)

    def meeting_echo(completions, answer, max_new_tokens):
        assert len(completions) == len(answer) == 1 and max_new_tokens == 7
        if completions[0] != "warm":
            barrier.wait()
        return [float(completions[0] == answer[0])]

    reward = IsolatedReward(meeting_echo, "echo", timeout_s=30.0, workers=4)
    reward(["warm"] * 4, answer=["warm"] * 4, max_new_tokens=7)  # fork the 4 workers first
    values = reward(["1", "2", "3", "4"], answer=["1", "0", "3", "0"], max_new_tokens=7)
    assert values == [1.0, 0.0, 1.0, 0.0]
    assert reward.pop_metrics().get("reward_timeouts/echo", 0) == 0
    reward.close()


def test_fail_fast_raises_naming_the_reward_and_sample():
    reward = IsolatedReward(flaky, "flaky", timeout_s=0.3, fail_fast=True)
    with pytest.raises(RewardFailure, match=r"'flaky' on sample 1: timed out after 0.3 s"):
        reward(["a", "hang"])
    with pytest.raises(RewardFailure, match=r"'flaky' on sample 0: RuntimeError: cannot score"):
        reward(["boom"])
    reward.close()


def test_contract_violations_still_raise():
    reward = IsolatedReward(lambda completions, **_: [math.inf], "inf", timeout_s=2.0)
    with pytest.raises(ValueError, match="'inf' returned inf for sample 0"):
        reward(["x"])
    reward.close()


def test_closures_and_the_wrapped_functions_own_metrics_come_back():
    class Counting:
        """A reward with its own pop_metrics; its counts live in the worker process."""

        def __init__(self):
            self.seen = 0

        def __call__(self, completions, **_):
            self.seen += len(completions)
            return [1.0] * len(completions)

        def pop_metrics(self):
            out, self.seen = {"counting/seen": float(self.seen)}, 0
            return out

    for isolation in ("process", "thread"):
        reward = IsolatedReward(Counting(), "counting", timeout_s=2.0, isolation=isolation)
        assert reward(["a", "b", "c"]) == [1.0, 1.0, 1.0]
        assert drain_reward_metrics({"counting": reward, "plain": flaky}) == {
            "reward_errors/counting": 0.0, "reward_timeouts/counting": 0.0, "counting/seen": 3.0,
        }  # fmt: skip
        reward.close()


def test_through_score_completions_nan_and_counts():
    fns = isolate_rewards({"flaky": flaky, "len": lambda completions, **_: [1.0] * len(completions)},
                          {"flaky": {"timeout_s": 0.3}})  # fmt: skip
    rewards, errors = score_completions(fns, ["ab", "hang"], [{"prompt": "p"}] * 2)
    assert rewards["flaky"][0] == 0.0 and math.isnan(rewards["flaky"][1])
    assert rewards["len"].tolist() == [1.0, 1.0] and errors == {"flaky": 0, "len": 0}
    assert drain_reward_metrics(fns)["reward_timeouts/flaky"] == 1.0
    fns["flaky"].close()


def test_bad_settings_fail_clearly():
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        IsolatedReward(flaky, "f", timeout_s=0)
    with pytest.raises(ValueError, match=r"isolation='gpu'; allowed: \['process', 'thread'\]"):
        IsolatedReward(flaky, "f", timeout_s=1, isolation="gpu")
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        IsolatedReward(flaky, "f", timeout_s=1, workers=0)
    with pytest.raises(ValueError, match=r"unknown rewards \['nope'\]"):
        isolate_rewards({"flaky": flaky}, {"nope": {"timeout_s": 1}})
    raw = {"model": {"name_or_path": "m"}, "task": {"name": "arithmetic"}}
    cfg = validate(apply_overrides(raw, []))
    cfg.rewards = validate({**raw, "rewards": [
        {"name": "accuracy", "workers": 2}]}).rewards  # fmt: skip
    with pytest.raises(ValueError, match=r"rewards\[0\] \('accuracy'\).*only with a timeout_s"):
        isolation_settings(cfg.rewards)
    r = validate({**raw, "rewards": [{"name": "pkg.mod:fn", "timeout_s": 2, "workers": 3}]})
    assert isolation_settings(r.rewards) == {
        "fn": {"timeout_s": 2.0, "isolation": "process", "workers": 3}
    }
    with pytest.raises(ConfigError, match=r"rewards.0.timeout_s"):
        validate({**raw, "rewards": [{"name": "accuracy", "timeout_s": -1}]})


# ---- the training loop -------------------------------------------------------------------------

REWARD_PY = '''
import time

def by_prompt(completions, prompts, **_):
    """prompt 1+1= -> 1.0, 1+2= -> hangs, 2+... -> raises (one sample per call when isolated)."""
    out = []
    for p in prompts:
        if p.startswith("1+2"):
            time.sleep(30)
        if p.startswith("2"):
            raise ValueError("no reward for " + p)
        out.append(1.0)
    return out
'''


def _loop_cfg(tmp_path, model_dir, *overrides):
    (tmp_path / "rw.py").write_text(REWARD_PY)
    raw = {
        "run": {"name": "run", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic", "options": {"n_train": 4, "n_eval": 0, "ops": "+",
                                                   "min_value": 1, "max_value": 2}},
        "rewards": [{"name": "accuracy"},
                    {"name": f"{tmp_path / 'rw.py'}:by_prompt", "timeout_s": 0.5, "workers": 4}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def test_the_loop_counts_reward_timeouts_and_errors(tmp_path, tiny_model_dir):
    import json

    from grouprl.envs.tasks import build_task
    from grouprl.rollouts.prompt_sampler import PromptSampler
    from grouprl.train import train

    cfg = _loop_cfg(tmp_path, tiny_model_dir)
    start = time.monotonic()
    train(cfg)
    assert time.monotonic() - start < 120
    # the prompts each step draws (same seeded sampler as the run)
    sampler = PromptSampler(build_task("arithmetic", **cfg.task.options).train, cfg.run.seed)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in (r for r in rows if r["split"] == "train"):
        prompts = [ex["prompt"] for ex in sampler.next(2)]
        hangs = 2 * sum(p.startswith("1+2") for p in prompts)  # group_size 2
        raises = 2 * sum(p.startswith("2") for p in prompts)
        assert row["reward_timeouts/by_prompt"] == hangs
        assert row["reward_errors/by_prompt"] == raises
        fine = 2 * sum(p.startswith("1+1") for p in prompts)
        expect = 1.0 if fine else None  # NaN (logged as null) when no sample has a reward
        assert row["reward/by_prompt"] == expect


def test_the_loop_stops_with_fail_fast(tmp_path, tiny_model_dir):
    from grouprl.train import train

    cfg = _loop_cfg(tmp_path, tiny_model_dir, "run.fail_fast=true",
                    "task.options.min_value=2", "task.options.n_train=1")  # all raise  # fmt: skip
    with pytest.raises(RewardFailure, match="'by_prompt' on sample 0: ValueError: no reward"):
        train(cfg)


# ---- environments ------------------------------------------------------------------------------


class FlakyEnv:
    """Every episode starts at "start"; the step's behaviour is fixed when the env is made."""

    system_prompt = "Say something."

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode

    def reset(self, seed=None, options=None):
        if self.mode == "bad_reset":
            raise OSError("no such level")
        return "start", {"anchor": "start"}

    def step(self, action):
        if self.mode == "raise":
            raise KeyError("missing state")
        if self.mode == "hang":
            time.sleep(HANG_S)
        if self.mode == "die":
            os._exit(9)
        return "done", 1.0, True, False, {"success": True}


@pytest.mark.parametrize("timeout_s", [None, 0.5])
def test_guarded_env_step_failures_end_the_episode(timeout_s):
    modes = ["ok", "raise"] + (["hang", "die"] if timeout_s else [])
    for mode in modes:
        env = GuardedEnv(lambda m=mode: FlakyEnv(m), timeout_s, fail_fast=False)
        assert env.reset(seed=0) == ("start", {"anchor": "start"})
        assert env.system_prompt == "Say something."  # attributes reach through
        with pytest.raises(AttributeError):
            env.no_such_attribute  # noqa: B018
        obs, reward, terminated, truncated, info = env.step("hi")
        if mode == "ok":
            assert (obs, reward, terminated, truncated) == ("done", 1.0, True, False)
            assert env.error is None
        else:
            assert (reward, terminated, truncated) == (0.0, False, True)
            assert obs.startswith("[environment error: ") and info["env_error"] == env.error
            assert {"raise": "KeyError", "hang": "TimeoutError", "die": "died"}[mode] in env.error
            with pytest.raises(EnvFailure, match="after the episode ended"):
                env.step("again")
        env.close()


def test_env_fail_fast_and_failing_reset():
    env = GuardedEnv(lambda: FlakyEnv("raise"), None, fail_fast=True)
    env.reset(seed=1)
    with pytest.raises(EnvFailure, match="env step failed: KeyError"):
        env.step("x")
    for timeout_s in (None, 0.5):
        env = GuardedEnv(lambda: FlakyEnv("bad_reset"), timeout_s, fail_fast=False)
        with pytest.raises(EnvFailure, match=r"reset \(seed 3\) failed: .*no such level"):
            env.reset(seed=3)
        env.close()


class OneReplyEngine:
    """Every turn of every episode replies "hi" and stops."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, params, *, greedy=False):
        reply = self.tok("hi", add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        return GenerationOutput([reply] * len(prompts), [[-0.5] * 3] * len(prompts),
                                [False] * len(prompts))  # fmt: skip


def test_episodes_with_failing_envs_end_with_a_recorded_error():
    tok = char_tokenizer()
    policy = CausalLMPolicy(tiny_qwen2(tok), tok, engine=OneReplyEngine(tok))
    modes = iter(["ok", "raise", "hang", "ok", "die", "ok"])
    guard = EnvGuard(timeout_s=0.5)
    start = time.monotonic()
    rollout = collect_episodes(
        policy, guard.wrap(lambda: FlakyEnv(next(modes))), [0, 1, 2], 2, SamplingParams(),
        max_turns=3, max_turn_tokens=8,
    )  # fmt: skip
    assert time.monotonic() - start < 15
    errors = guard.errors()
    assert [e is not None for e in errors] == [False, True, True, False, True, False]
    assert rollout.info["end_reason"] == ["terminated", "env_truncated", "env_truncated",
                                          "terminated", "env_truncated", "terminated"]  # fmt: skip
    assert rollout.rewards["return"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert "[environment error: KeyError" in rollout.info["transcript"][1]
    assert torch.equal(rollout.group_ids, torch.tensor([0, 0, 1, 1, 2, 2]))


def test_episode_metrics_count_env_errors(monkeypatch):
    from grouprl.workloads import agent as episodes

    tok = char_tokenizer()
    policy = CausalLMPolicy(tiny_qwen2(tok), tok, engine=OneReplyEngine(tok))
    modes = iter(["raise", "ok", "ok", "raise"])
    monkeypatch.setattr(episodes, "_make_env", lambda ex: lambda: FlakyEnv(next(modes)))
    raw = {"model": {"name_or_path": "m"}, "task": {"name": "env"},
           "agent": {"max_turns": 2, "max_turn_tokens": 8}}  # fmt: skip
    cfg = validate(raw)
    examples = [{"env_id": "x", "seed": 0}, {"env_id": "x", "seed": 1}]
    rollout = episodes.collect(cfg, policy, examples, SamplingParams(), group_size=2)
    assert rollout.info["env_error"][1] is None and "KeyError" in rollout.info["env_error"][0]
    assert episodes.episode_metrics(rollout)["env_errors"] == 2.0
    cfg = validate({**raw, "run": {"fail_fast": True}})
    modes = iter(["ok", "raise", "ok", "ok"])
    with pytest.raises(EnvFailure, match="KeyError"):
        episodes.collect(cfg, policy, examples, SamplingParams(), group_size=2)
