"""Vector execution of episodes (envs/vector.py): every mode gives the same rollout, threads really
run the steps at once, processes really put each env in its own process."""

import os
import threading

import pytest
import torch
from test_multi_turn import CounterEnv, scripted_policy

from grouprl.envs.vector import VectorRunner
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.multi_turn import collect_episodes
from grouprl.runtime.env_guard import EnvGuard


def _collect(mode: str, make_env, seeds=(0, 1, 2), group_size=3):
    runner = VectorRunner(mode, workers=4)
    guard = EnvGuard(own_process=runner.own_process)
    with runner:
        return collect_episodes(
            scripted_policy(), guard.wrap(make_env), list(seeds), group_size, SamplingParams(),
            max_turns=4, max_turn_tokens=32, runner=runner,
        )  # fmt: skip


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_every_mode_gives_the_sequential_rollout(mode):
    ref = _collect("sequential", CounterEnv)
    got = _collect(mode, CounterEnv)
    assert torch.equal(got.actions.completion_ids, ref.actions.completion_ids)
    assert torch.equal(got.mask, ref.mask)
    assert torch.equal(got.rewards["return"], ref.rewards["return"])
    assert torch.equal(got.step_rewards.nan_to_num(-9), ref.step_rewards.nan_to_num(-9))
    assert got.anchor_keys == ref.anchor_keys
    assert got.info["turns"] == ref.info["turns"] == [3, 3, 3, 2, 2, 2, 1, 1, 1]  # start = seed % 3


class PidEnv(CounterEnv):
    """Reports the process it steps in."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "anchor": ("pid", os.getpid())}


def test_processes_mode_steps_each_env_in_its_own_process():
    rollout = _collect("processes", PidEnv, seeds=(0,), group_size=3)
    pids = {key[1] for keys in rollout.anchor_keys for key in keys[1:]}  # anchors after a step
    assert os.getpid() not in pids and len(pids) == 3


def test_threads_mode_runs_the_steps_at_once():
    barrier = threading.Barrier(4, timeout=10)  # breaks unless 4 steps wait on it together

    class MeetingEnv(CounterEnv):
        def step(self, action):
            barrier.wait()
            return super().step(action)

    with VectorRunner("threads", workers=4) as runner:
        envs = [MeetingEnv() for _ in range(4)]
        runner.reset(envs, [0, 0, 0, 0])
        results = runner.step(envs, ["<action>inc</action>"] * 4)
    assert [r[0] for r in results] == ["n=1"] * 4


def test_results_keep_input_order_and_errors_propagate():
    def slow_square(env, x):
        threading.Event().wait(0.05 * (3 - x))  # later inputs finish first
        return x * x

    with VectorRunner("threads", workers=3) as runner:
        assert runner.map(slow_square, [None] * 3, [0, 1, 2]) == [0, 1, 4]

        def boom(env, x):
            raise KeyError(x)

        with pytest.raises(KeyError):
            runner.map(boom, [None, None], [1, 2])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="env_execution must be one of"):
        VectorRunner("gpu")
    with pytest.raises(ValueError, match="env_workers"):
        VectorRunner("threads", workers=0)
    with pytest.raises(ValueError, match="arguments"):
        VectorRunner().map(lambda e, a: a, [1, 2], [1])
