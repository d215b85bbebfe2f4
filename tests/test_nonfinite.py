"""Non-finite losses and gradients: the update is skipped (weights, optimizer and grads untouched,
lr schedule still advancing), logged and counted; k steps in a row stop the run; no NaN/inf ever
reaches a checkpoint. Tiny Qwen2 on one-digit addition, as in test_train.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import grouprl.train as train_mod
import grouprl.workloads.text as text_wl
import grouprl.workloads.tokens as tokens_mod
from grouprl.config.loading import apply_overrides, validate
from grouprl.envs.rewards import build_reward
from grouprl.objectives import compute_advantages
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.build import build_optimizer
from grouprl.runtime.checkpoint import CheckpointManager, NonFiniteCheckpointError, check_all_finite
from grouprl.runtime.nonfinite import NonFiniteLossError
from grouprl.runtime.run_state import save_checkpoint
from grouprl.train import train
from grouprl.types import LossOutput
from grouprl.workloads import build_workload

PARITY = (
    "def parity(completions, **_):\n    return [float(sum(map(ord, c)) % 2) for c in completions]\n"
)


def make_cfg(out_dir, model_dir, *overrides):
    """Tiny run; the parity reward gives most groups contrast, so every clean step moves weights."""
    reward_file = out_dir / "parity.py"
    reward_file.parent.mkdir(parents=True, exist_ok=True)
    reward_file.write_text(PARITY)
    raw = {
        "run": {"name": "run", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 4, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity", "weight": 0.5}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 5, "lr": 1e-3},
        "checkpoint": {"every": 1, "keep_last": 10},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def train_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def poison_loss(monkeypatch, bad_calls, kind="nan"):
    """total_loss returns NaN (kind "nan": the loss; "grad": a finite loss with NaN gradients) on
    the calls numbered in `bad_calls` (1-based; one call per micro-batch)."""
    real, calls = tokens_mod.total_loss, []

    def poisoned(policy_out, **kwargs):
        res = real(policy_out, **kwargs)
        calls.append(1)
        if len(calls) not in bad_calls:
            return res
        if kind == "nan":
            return LossOutput(loss=res.loss * math.nan, metrics=res.metrics)
        poison = torch.sqrt(policy_out.logp.sum() * 0.0) * 0.0  # value 0, gradient NaN
        return LossOutput(loss=res.loss + poison, metrics=res.metrics)

    monkeypatch.setattr(tokens_mod, "total_loss", poisoned)


def saved_weights(ckpt):
    return load_file(ckpt / "model" / "model.safetensors")


def assert_checkpoints_finite(run_dir):
    for ckpt in CheckpointManager(run_dir).complete():
        check_all_finite(list(saved_weights(ckpt).items()))
        state = CheckpointManager.load(ckpt)
        for slots in state["optimizer"]["state"].values():
            check_all_finite([(k, v) for k, v in slots.items() if torch.is_tensor(v)])


# ---- one update ---------------------------------------------------------------------------------


def _rollout(policy):
    torch.manual_seed(0)
    examples = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "5+4=", "answer": "9"}]
    parity = lambda completions, **_: [float(len(c) % 2) for c in completions]  # noqa: E731
    rollout, _ = collect(policy, examples, 4, SamplingParams(max_new_tokens=4), {"p": parity})
    rollout.rewards["p"][0] = 1.0 - rollout.rewards["p"][1]  # contrast in group 0
    rollout.advantages = compute_advantages(
        "grpo", rollout.rewards, rollout.group_ids, weights={"p": 1.0}
    )
    return rollout


@pytest.mark.parametrize("kind", ["nan", "grad"])
def test_a_nonfinite_update_is_skipped_and_the_others_apply(
    kind, tiny_model_dir, tmp_path, monkeypatch
):
    """2 minibatches: the first update is poisoned and skipped, the second one applies."""
    cfg = make_cfg(tmp_path, tiny_model_dir, "algorithm.minibatches=2", "train.lr_schedule=linear",
                   "train.steps=2")  # fmt: skip
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    rollout = _rollout(policy)
    optimizer, scheduler = build_optimizer(cfg, policy)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    poison_loss(monkeypatch, {1}, kind)
    metrics = train_mod.update(
        cfg, build_workload(cfg, policy=policy), policy, optimizer, scheduler, rollout
    )
    assert metrics["skipped_nonfinite"] == 1.0
    assert metrics[f"skipped_nonfinite/{'loss' if kind == 'nan' else 'grad'}"] == 1.0
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    # one AdamW step happened (the second update), not two: step counts in the state say so
    assert {int(s["step"]) for s in optimizer.state.values()} == {1}
    assert any(not torch.equal(p, b) for p, b in zip(policy.trainable_parameters(), before))
    assert all(torch.isfinite(p).all() for p in policy.trainable_parameters())
    # the schedule advanced for both updates: linear decay over 2 steps x 2 updates = 4 updates
    assert scheduler.last_epoch == 2 and metrics["lr"] == pytest.approx(1e-3 * (1 - 2 / 4))


def test_every_update_skipped_leaves_weights_and_optimizer_untouched(
    tiny_model_dir, tmp_path, monkeypatch
):
    cfg = make_cfg(tmp_path, tiny_model_dir)
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    rollout = _rollout(policy)
    optimizer, scheduler = build_optimizer(cfg, policy)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    poison_loss(monkeypatch, {1}, "grad")
    metrics = train_mod.update(
        cfg, build_workload(cfg, policy=policy), policy, optimizer, scheduler, rollout
    )
    assert metrics["skipped_nonfinite"] == 1.0 and math.isnan(metrics["grad_norm"])
    assert "loss" not in metrics  # no applied micro-batch: no loss metrics
    assert all(torch.equal(p, b) for p, b in zip(policy.trainable_parameters(), before))
    assert all(p.grad is None for p in policy.trainable_parameters())  # grads zeroed
    assert optimizer.state_dict()["state"] == {}  # AdamW never stepped


# ---- the run ------------------------------------------------------------------------------------


def test_skipped_steps_below_the_limit_do_not_stop_the_run(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """NaN losses at steps 2 and 3 (limit 3): both skipped and printed; step 4 resets the streak."""
    poison_loss(monkeypatch, {2, 3})
    train(make_cfg(tmp_path, tiny_model_dir))
    rows = train_rows(tmp_path / "run")
    assert [r["skipped_nonfinite"] for r in rows] == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert rows[1]["grad_norm"] is None and rows[3]["loss"] is not None  # NaN is logged as null
    out = capsys.readouterr().out
    assert "step 2: non-finite loss; 1 update(s) skipped" in out and "2 step(s) in a row" in out
    run_dir = tmp_path / "run"
    ckpts = CheckpointManager(run_dir).complete()
    assert len(ckpts) == 5
    # the skipped steps did not move the weights: checkpoints 1, 2 and 3 are the same
    w = [saved_weights(c) for c in ckpts]
    assert all(torch.equal(w[0][k], w[2][k]) for k in w[0])
    assert any(not torch.equal(w[2][k], w[3][k]) for k in w[0])
    assert_checkpoints_finite(run_dir)


def test_k_nonfinite_steps_in_a_row_stop_the_run_with_a_clear_message(
    tiny_model_dir, tmp_path, monkeypatch
):
    poison_loss(monkeypatch, set(range(2, 100)), "grad")
    with pytest.raises(NonFiniteLossError, match=r"step 4: 3 step\(s\) in a row.*non-finite "
                       r"gradient.*max_nonfinite_steps=3.*no non-finite value was saved"):  # fmt: skip
        train(make_cfg(tmp_path, tiny_model_dir))
    run_dir = tmp_path / "run"
    assert [r["skipped_nonfinite"] for r in train_rows(run_dir)] == [0.0, 1.0, 1.0, 1.0]
    ckpts = CheckpointManager(run_dir).complete()
    assert [c.name for c in ckpts] == ["step-00000001", "step-00000002", "step-00000003"]
    w1, w3 = saved_weights(ckpts[0]), saved_weights(ckpts[-1])
    assert all(torch.equal(w1[k], w3[k]) for k in w1)
    assert_checkpoints_finite(run_dir)


def test_a_nan_advantage_becomes_a_skipped_step(tiny_model_dir, tmp_path, monkeypatch):
    """An advantage of NaN (injected after prepare(), as a buggy estimator would give) makes the
    loss NaN: the step is skipped and the run goes on. (An inf *reward* is refused earlier, with
    a clear error, by the advantage code: see test_an_infinite_reward_is_a_clear_error.)"""
    real_prepare, calls = text_wl.prepare, []

    def nan_advantage_on_step_2(cfg, policy, rollout, weights, **more):
        metrics = real_prepare(cfg, policy, rollout, weights, **more)
        calls.append(1)
        if len(calls) == 2:
            rollout.advantages[0] = math.nan
        return metrics

    monkeypatch.setattr(text_wl, "prepare", nan_advantage_on_step_2)
    train(make_cfg(tmp_path, tiny_model_dir, "train.steps=3", "eval.max_examples=1"))
    rows = train_rows(tmp_path / "run")
    assert [r["skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
    assert_checkpoints_finite(tmp_path / "run")


def test_an_infinite_reward_is_a_clear_error(tiny_model_dir, tmp_path, monkeypatch):
    real_collect, calls = text_wl.collect, []

    def inf_reward_on_step_2(*args, **kwargs):
        rollout, errors = real_collect(*args, **kwargs)
        if "first_group_id" not in kwargs:  # an evaluation's collect, not a training step's
            return rollout, errors
        calls.append(1)
        if len(calls) == 2:
            rollout.rewards["accuracy"][0] = math.inf
        return rollout, errors

    monkeypatch.setattr(text_wl, "collect", inf_reward_on_step_2)
    with pytest.raises(ValueError, match="'accuracy' contains \\+-inf"):
        train(make_cfg(tmp_path, tiny_model_dir, "train.steps=3", "eval.max_examples=1"))
    assert [c.name for c in CheckpointManager(tmp_path / "run").complete()] == ["step-00000001"]


# ---- checkpoints refuse NaN/inf -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_save_refuses_nonfinite_weights_or_optimizer_state(where, tiny_model_dir, tmp_path):
    from grouprl.rollouts.prompt_sampler import PromptSampler

    cfg = make_cfg(tmp_path, tiny_model_dir)
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    optimizer, scheduler = build_optimizer(cfg, policy)
    params = list(policy.trainable_parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    ckpts = CheckpointManager(tmp_path / "run")
    sampler = PromptSampler([{"prompt": "x"}], 0)
    save_checkpoint(ckpts, 1, policy, optimizer, scheduler, sampler, None)
    with torch.no_grad():
        if where == "weights":
            params[3].view(-1)[0] = math.inf
        else:
            optimizer.state[params[5]]["exp_avg_sq"].view(-1)[2] = math.nan
    match = "tensor #3" if where == "weights" else r"optimizer state 5/exp_avg_sq"
    with pytest.raises(NonFiniteCheckpointError, match=match + ".*1 NaN/inf"):
        save_checkpoint(ckpts, 2, policy, optimizer, scheduler, sampler, None)
    assert [c.name for c in ckpts.complete()] == ["step-00000001"]
    assert sorted(p.name for p in ckpts.dir.iterdir()) == ["latest", "step-00000001"]


def test_reward_fn_returning_nan_is_still_a_contract_error():
    """Rewards must be finite or None; NaN from a function is a bug, reported, not trained on."""
    from grouprl.envs.rewards import score_completions

    nan_reward = lambda completions, **_: [math.nan] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="returned nan for sample 0"):
        score_completions({"nan": nan_reward}, ["a"], [{"prompt": "p"}])
    assert build_reward("length")(["ab"], completion_lengths=[2], max_new_tokens=4) == [-0.5]
