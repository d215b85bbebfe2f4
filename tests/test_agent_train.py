"""Multi-turn agents through the training loop: env task, episodes, credit modes, evaluation."""

from __future__ import annotations

import json
import math

import pytest

from grouprl.config.loading import apply_overrides, validate
from grouprl.train import train


def make_cfg(out_dir, model_dir, *overrides):
    raw = {
        "run": {"name": "run", "output_dir": str(out_dir), "device": "cpu", "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0",
                                            "env_kwargs": {"max_steps": 3}, "n_eval": 2}},
        "agent": {"max_turns": 2, "max_turn_tokens": 6, "max_total_tokens": 400},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "stop": ["</action>"]},
        "algorithm": {"preset": "gigpo", "kl_coef": 0.0},
        "train": {"steps": 1, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


@pytest.mark.parametrize("credit", ["gigpo", "trajectory", "turn"])
def test_agent_run_end_to_end(credit, tmp_path, tiny_model_dir):
    result = train(make_cfg(tmp_path, tiny_model_dir, f"agent.credit={credit}"))
    assert result["accuracy_key"] == "success"
    assert set(result["after"]) >= {"accuracy", "return", "turns", "invalid_actions"}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r["split"] == "train"][0]
    assert 0.0 <= step["episode/success"] <= 1.0 and 1 <= step["episode/turns"] <= 2
    assert math.isfinite(step["loss"]) and "reward/return" in step
    assert "transcript" in (tmp_path / "run" / "samples.md").read_text()


def test_env_task_refuses_reward_functions(tmp_path, tiny_model_dir):
    from grouprl.envs.tasks import build_task
    from grouprl.workloads import build_rewards

    cfg = make_cfg(tmp_path, tiny_model_dir)
    cfg_with = validate(
        apply_overrides(cfg.model_dump(mode="json"), ["rewards=[{name: accuracy}]"])
    )
    task = build_task(cfg.task.name, **cfg.task.options)
    assert build_rewards(cfg, task) == ({}, {"return": 1.0})
    with pytest.raises(ValueError, match="environment"):
        build_rewards(cfg_with, task)


def test_env_task_seeds_are_disjoint_and_bad_env_fails_clearly():
    from grouprl.envs.tasks import build_task

    task = build_task("env", env_id="grouprl/FrozenLake-v0", n_train=5, n_eval=3)
    train_seeds = {ex["seed"] for ex in task.train}
    assert len(train_seeds) == 5 and train_seeds.isdisjoint(ex["seed"] for ex in task.eval)
    with pytest.raises(Exception, match="NoSuchEnv"):
        build_task("env", env_id="grouprl/NoSuchEnv-v0")


def test_sampled_evaluation_reports_success_and_pass_at_k(tmp_path, tiny_model_dir):
    """eval.pass_k = k adds k sampled episodes per held-out seed: their mean success and pass@k,
    both fractions, pass@k >= the mean (some of k succeeded vs the average of the k)."""
    result = train(make_cfg(tmp_path, tiny_model_dir, "eval.pass_k=3", "train.steps=1"))
    for when in ("before", "after"):
        m = result[when]
        assert 0.0 <= m["sampled_success"] <= m["pass@3"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/pass@3" in r for r in rows)


def test_short_system_prompt_option(tmp_path):
    from grouprl.envs.gym import make_text_env

    env = make_text_env("grouprl/FrozenLake-v0", system_prompt="Walk to G.")
    assert env.unwrapped.system_prompt == "Walk to G."
    assert "FrozenLake" in make_text_env("grouprl/FrozenLake-v0").unwrapped.system_prompt
