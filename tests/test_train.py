"""train.train end to end on a tiny model: artifacts, presets, KL, minibatches, exact resume, failures.

Every run is a tiny Qwen2 (hidden 64, 2 layers) on one-digit addition with 4-token completions, so
one run takes a couple of seconds on one CPU thread.
"""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

import grouprl.train as train_mod
import grouprl.workloads.tokens as tokens_mod
from grouprl.config.loading import apply_overrides, load_config, validate
from grouprl.objectives import compute_advantages
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.nonfinite import NonFiniteLossError
from grouprl.runtime.throughput import wall_clock
from grouprl.train import train
from grouprl.types import LossOutput
from grouprl.workloads import build_workload

REWARDS_PY = '''
def parity(completions, **_):
    """0/1 by the parity of the completion's characters: varies within most sampled groups."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def first_group_mixed(completions, **_):
    """Only the first group of G = 2 of each batch has contrast (0, 1); every other sample gets 0."""
    return [float(j == 1) for j in range(len(completions))]


def two_groups_mixed(completions, **_):
    """The first two groups of G = 2 have contrast, the rest are flat."""
    return [float(j in (1, 3)) for j in range(len(completions))]


def infinite(completions, **_):
    return [float("inf")] * len(completions)
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS_PY)
    return path


def make_cfg(out_dir, model_dir, reward_file, *overrides, name="run"):
    """A tiny, fast config; `overrides` are dotted key=value strings as on the command line."""
    raw = {
        "run": {"name": name, "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 6, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity", "weight": 0.5}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def read_metrics(run_dir, split=None, drop_time=True):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if drop_time:  # and the other wall-clock values, perf/* (runtime/throughput.py)
        rows = [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]
    return [r for r in rows if split is None or r["split"] == split]


def final_weights(run_dir):
    ckpt = CheckpointManager(run_dir).latest()
    return load_file(ckpt / "model" / "model.safetensors")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def changed(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def initial_weights(tiny_model_dir):
    return load_file(tiny_model_dir / "model.safetensors")


# ---- artifacts ----------------------------------------------------------------------------------


def test_run_writes_every_artifact(tmp_path, tiny_model_dir, reward_file, initial_weights):
    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file, "eval.every=1", "checkpoint.every=1")
    result = train(cfg)
    run_dir = tmp_path / "run"
    assert result["run_dir"] == str(run_dir) and result["accuracy_key"] == "accuracy"

    # what the user set (config.yaml) and every value used (config.resolved.yaml) load back to
    # the same Config
    assert load_config(run_dir / "config.yaml") == cfg
    assert load_config(run_dir / "config.resolved.yaml") == cfg
    assert "algorithm" not in yaml.safe_load((run_dir / "config.yaml").read_text())
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["algorithm"]["surrogate"]["type"] == "clip" and resolved["train"]["steps"] == 2

    rows = read_metrics(run_dir)
    assert [(r["step"], r["split"]) for r in rows] == [
        (0, "eval"), (1, "train"), (1, "eval"), (2, "train"), (2, "eval"),
    ]  # fmt: skip
    for r in read_metrics(run_dir, "train"):
        for key in ("reward/mean", "reward/std", "reward/accuracy", "reward/parity", "loss",
                    "pg_loss", "grad_norm", "lr", "response_length/mean", "truncated_frac"):  # fmt: skip
            assert math.isfinite(r[key]), key
        assert r["lr"] == pytest.approx(1e-3)
        # reward/mean is the weighted sum: accuracy + 0.5 * parity
        assert r["reward/mean"] == pytest.approx(r["reward/accuracy"] + 0.5 * r["reward/parity"])
    evals = read_metrics(run_dir, "eval")
    assert all(set(r) >= {"eval/accuracy", "eval/response_length"} for r in evals)
    assert result["before"] == {k: evals[0][f"eval/{k}"] for k in result["before"]}
    assert result["after"] == {k: evals[-1][f"eval/{k}"] for k in result["after"]}

    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (run_dir / "samples.md").read_text()
    assert "prompt" in md and "completion" in md
    assert any(ex_prompt in md for ex_prompt in (r["prompt"] for r in _samples(run_dir)))

    ckpts = CheckpointManager(run_dir).complete()
    assert [p.name for p in ckpts] == ["step-00000001", "step-00000002"]  # keep_last=2
    assert CheckpointManager.load(ckpts[-1])["step"] == 2
    # the saved model is a loadable transformers folder holding the trained weights
    loaded = CausalLMPolicy.from_pretrained(str(ckpts[-1] / "model")).model.state_dict()
    saved = final_weights(run_dir)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert changed(saved, initial_weights)


def _samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_existing_run_dir_needs_resume_or_overwrite(tmp_path, tiny_model_dir, reward_file):
    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file, "train.steps=1")
    train(cfg)
    first = read_metrics(tmp_path / "run", drop_time=False)
    with pytest.raises(ValueError, match="already holds a run.*run.resume=true.*run.overwrite"):
        train(cfg)
    assert read_metrics(tmp_path / "run", drop_time=False) == first  # untouched
    train(make_cfg(tmp_path, tiny_model_dir, reward_file, "train.steps=1", "run.overwrite=true"))
    rows = read_metrics(tmp_path / "run")
    assert [(r["step"], r["split"]) for r in rows] == [(0, "eval"), (1, "train"), (1, "eval")]
    assert rows == [{k: v for k, v in r.items() if not wall_clock(k)} for r in first]  # same seed


# ---- algorithms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "cispo"])
def test_presets_train(preset, tmp_path, tiny_model_dir, reward_file, initial_weights):
    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file, f"algorithm.preset={preset}")
    train(cfg)
    run_dir = tmp_path / "run"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["preset"] == preset
    rows = read_metrics(run_dir, "train")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    if preset == "dapo":  # dynamic sampling and the soft overlong penalty are on
        assert all(r["dynamic/rounds"] >= 1 for r in rows)
        assert all("reward/overlong" in r for r in rows)
    assert changed(final_weights(run_dir), initial_weights)


@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_kl_to_reference(mode, tmp_path, tiny_model_dir, reward_file):
    cfg = make_cfg(
        tmp_path, tiny_model_dir, reward_file,
        "algorithm.kl_coef=0.1", f"algorithm.kl_mode={mode}", "train.steps=3", "train.lr=1e-2",
    )  # fmt: skip
    train(cfg)
    rows = read_metrics(tmp_path / "run", "train")
    # step 1: the policy IS the reference, so its KL is 0; after updates it is positive
    assert abs(rows[0]["kl"]) < 1e-5
    assert rows[-1]["kl"] > 1e-6
    if mode == "loss":
        assert all("kl_loss" in r for r in rows)
        assert all("reward/kl_penalty" not in r for r in rows)
    else:
        assert all("kl_loss" not in r for r in rows)
        assert abs(rows[0]["reward/kl_penalty"]) < 1e-5
        assert rows[-1]["reward/kl_penalty"] < 0


def test_kl_in_reward_uses_the_trainers_log_probs(tmp_path, tiny_model_dir, reward_file):
    """At step 1 policy == reference, so the KL penalty must be 0 whatever the sampler's top-k.

    The engine's sampling log-probs are under the top-k renormalised distribution; the penalty has
    to compare the trainer's own log-probs with the reference's (as it does when epochs > 1).
    """
    cfg = make_cfg(
        tmp_path, tiny_model_dir, reward_file, "algorithm.kl_coef=0.1",
        "algorithm.kl_mode=reward", "rollout.top_k=5", "train.steps=1",
    )  # fmt: skip
    train(cfg)
    (row,) = read_metrics(tmp_path / "run", "train")
    assert abs(row["reward/kl_penalty"]) < 1e-5


def test_epochs_minibatches_and_micro_batches(tmp_path, tiny_model_dir, reward_file):
    cfg = make_cfg(
        tmp_path, tiny_model_dir, reward_file, "algorithm.epochs=2", "algorithm.minibatches=2",
        "train.micro_batch_size=2", "train.warmup_steps=10",
    )  # fmt: skip
    train(cfg)
    rows = read_metrics(tmp_path / "run", "train")
    # 2 epochs x 2 minibatches = 4 optimizer updates per step; linear warm-up lr * (u + 1) / 11
    assert rows[0]["lr"] == pytest.approx(1e-3 * 5 / 11)
    assert rows[1]["lr"] == pytest.approx(1e-3 * 9 / 11)
    assert all(math.isfinite(r["loss"]) for r in rows)


def _scored_rollout(policy, reward_file):
    from grouprl.envs.rewards import build_reward

    torch.manual_seed(0)
    examples = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "5+4=", "answer": "9"}]
    rollout, _ = collect(
        policy, examples, 4, SamplingParams(max_new_tokens=4),
        {"parity": build_reward(f"{reward_file}:parity")},
    )  # fmt: skip
    rollout.advantages = compute_advantages(
        "grpo", rollout.rewards, rollout.group_ids, weights={"parity": 1.0}
    )
    return rollout


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_micro_batches_accumulate_to_the_full_batch_gradient(
    aggregation, tiny_model_dir, reward_file, tmp_path
):
    """One SGD step with micro_batch_size 3 equals the step on the whole batch at once."""
    deltas = []
    for micro in (None, 3):
        cfg = make_cfg(
            tmp_path, tiny_model_dir, reward_file, f"algorithm.aggregation={aggregation}",
            "train.max_grad_norm=null", *([f"train.micro_batch_size={micro}"] if micro else []),
        )  # fmt: skip
        policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
        rollout = _scored_rollout(policy, reward_file)
        before = [p.detach().clone() for p in policy.trainable_parameters()]
        opt = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0)
        train_mod.update(cfg, build_workload(cfg, policy=policy), policy, opt, sched, rollout)
        deltas.append([p.detach() - b for p, b in zip(policy.trainable_parameters(), before)])
    assert any(d.abs().max() > 0 for d in deltas[0])
    for full, acc in zip(*deltas):
        torch.testing.assert_close(acc, full, rtol=1e-4, atol=1e-7)


# ---- resume determinism -------------------------------------------------------------------------

RESUME = ("train.steps=4", "checkpoint.every=2", "eval.every=2", "eval.pass_k=2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir, reward_file):
    """Run A: 4 steps, checkpoint every 2, never interrupted."""
    out = tmp_path_factory.mktemp("run_a")
    train(make_cfg(out, tiny_model_dir, reward_file, *RESUME))
    return out / "run"


class Crash(RuntimeError):
    pass


def test_resume_after_crash_is_bit_identical(
    uninterrupted, tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    """Run B crashes inside step 3 (after step 2's checkpoint, after sampling step 3), then
    resumes; weights, metrics and samples equal run A's exactly."""
    undo = _crash_on_update(monkeypatch, 3)
    with pytest.raises(Crash):
        train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME))
    undo()
    run_b = tmp_path / "run"
    assert CheckpointManager(run_b).latest().name == "step-00000002"

    result = train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME, "run.resume=true"))
    assert_same_weights(final_weights(run_b), final_weights(uninterrupted))
    assert read_metrics(run_b) == read_metrics(uninterrupted)
    assert _samples(run_b) == _samples(uninterrupted)
    eval_0 = read_metrics(uninterrupted, "eval")[0]
    assert {f"eval/{k}": v for k, v in result["before"].items()} == {
        k: v for k, v in eval_0.items() if k not in ("step", "split", "time")
    }
    state_a = CheckpointManager.load(CheckpointManager(uninterrupted).latest())
    state_b = CheckpointManager.load(CheckpointManager(run_b).latest())
    assert state_a["sampler"] == state_b["sampler"] and state_a["step"] == state_b["step"] == 4


def _crash_on_update(monkeypatch, n):
    """Make the n-th call of train.update raise Crash; returns a function that undoes it."""
    real_update, calls = train_mod.update, []

    def crashing_update(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Crash(f"simulated crash in update {n}")
        return real_update(*args, **kwargs)

    monkeypatch.setattr(train_mod, "update", crashing_update)
    return lambda: monkeypatch.setattr(train_mod, "update", real_update)


def test_resume_before_the_first_checkpoint_starts_clean(
    uninterrupted, tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    undo = _crash_on_update(monkeypatch, 1)  # dies in step 1, before any checkpoint
    with pytest.raises(Crash):
        train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME))
    undo()
    assert CheckpointManager(tmp_path / "run").latest() is None
    train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME, "run.resume=true"))
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(uninterrupted))
    assert read_metrics(tmp_path / "run") == read_metrics(uninterrupted)


def test_lora_resume_after_crash_is_bit_identical(
    tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    lora = ("model.lora.r=4", "model.lora.alpha=8", "train.lr=1e-2", *RESUME)
    train(make_cfg(tmp_path / "a", tiny_model_dir, reward_file, *lora))
    undo = _crash_on_update(monkeypatch, 3)
    with pytest.raises(Crash):
        train(make_cfg(tmp_path / "b", tiny_model_dir, reward_file, *lora))
    undo()
    train(make_cfg(tmp_path / "b", tiny_model_dir, reward_file, *lora, "run.resume=true"))
    run_a, run_b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert_same_weights(final_weights(run_b), final_weights(run_a))  # merged W + BA
    adapter_a = CheckpointManager.load(CheckpointManager(run_a).latest())["adapter"]
    adapter_b = CheckpointManager.load(CheckpointManager(run_b).latest())["adapter"]
    assert_same_weights(adapter_a, adapter_b)
    assert any(
        k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in adapter_a.items()
    )
    assert read_metrics(run_b) == read_metrics(run_a)


def test_crash_while_saving_keeps_previous_checkpoint(
    uninterrupted, tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    """The step-4 save dies half-way through writing the model: the step-2 checkpoint stays the
    latest complete one, no debris is left, and resuming from it reproduces run A exactly."""
    real_save, calls = CausalLMPolicy.save_pretrained, []

    def dying_save(self, directory):
        calls.append(1)
        if len(calls) == 2:
            (directory / "model.safetensors").write_bytes(b"half a file")
            raise Crash("simulated crash while saving")
        return real_save(self, directory)

    monkeypatch.setattr(CausalLMPolicy, "save_pretrained", dying_save)
    with pytest.raises(Crash):
        train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME))
    monkeypatch.setattr(CausalLMPolicy, "save_pretrained", real_save)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-00000002"]
    assert (ckpt_dir / "latest").read_text().strip() == "step-00000002"
    assert CheckpointManager.load(ckpt_dir / "step-00000002")["step"] == 2

    train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME, "run.resume=true"))
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(uninterrupted))
    assert read_metrics(tmp_path / "run") == read_metrics(uninterrupted)


def test_resume_of_a_finished_run_changes_nothing(
    uninterrupted, tmp_path, tiny_model_dir, reward_file
):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, run_dir)
    train(make_cfg(tmp_path, tiny_model_dir, reward_file, *RESUME, "run.resume=true"))
    assert_same_weights(final_weights(run_dir), final_weights(uninterrupted))
    assert [(r["step"], r["split"]) for r in read_metrics(run_dir, "train")] == [
        (s, "train") for s in (1, 2, 3, 4)
    ]


# ---- failures -----------------------------------------------------------------------------------


def _capture_policy(monkeypatch):
    holder = {}
    real = train_mod.build_policy

    def build(cfg, device):
        holder["policy"] = real(cfg, device)
        return holder["policy"]

    monkeypatch.setattr(train_mod, "build_policy", build)
    return holder


def test_nan_loss_stops_without_touching_weights_or_checkpoints(
    tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    holder, snapshot, calls = _capture_policy(monkeypatch), {}, []
    real_total_loss = tokens_mod.total_loss

    def nan_on_step_2(*args, **kwargs):
        res = real_total_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # one micro-batch per step: the 2nd call is step 2
            snapshot.update({k: v.clone() for k, v in holder["policy"].model.state_dict().items()})
            return LossOutput(loss=res.loss * math.nan, metrics=res.metrics)
        return res

    monkeypatch.setattr(tokens_mod, "total_loss", nan_on_step_2)
    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file, "checkpoint.every=1", "train.steps=3",
                   "train.max_nonfinite_steps=1")  # fmt: skip
    with pytest.raises(NonFiniteLossError, match="non-finite loss"):
        train(cfg)
    now = holder["policy"].model.state_dict()
    assert all(torch.equal(now[k], snapshot[k]) for k in snapshot)
    ckpts = CheckpointManager(tmp_path / "run").complete()
    assert [p.name for p in ckpts] == ["step-00000001"]  # nothing saved for step 2 (or after)
    saved = final_weights(tmp_path / "run")
    assert all(torch.equal(saved[k], snapshot[k]) for k in saved)
    # step 2's update was skipped (and logged), then the run stopped: max_nonfinite_steps=1
    rows = read_metrics(tmp_path / "run", "train")
    assert [(r["step"], r["skipped_nonfinite"]) for r in rows] == [(1, 0.0), (2, 1.0)]


def test_nan_gradient_stops_without_touching_weights(
    tmp_path, tiny_model_dir, reward_file, monkeypatch
):
    holder, snapshot = _capture_policy(monkeypatch), {}
    real_total_loss = tokens_mod.total_loss

    def nan_gradient(policy_out, **kwargs):
        res = real_total_loss(policy_out, **kwargs)
        snapshot.update({k: v.clone() for k, v in holder["policy"].model.state_dict().items()})
        # finite value (0), NaN gradient: d/dx sqrt(x) at 0 is inf, times 0 -> NaN
        poison = torch.sqrt(policy_out.logp.sum() * 0.0) * 0.0
        return LossOutput(loss=res.loss + poison, metrics=res.metrics)

    monkeypatch.setattr(tokens_mod, "total_loss", nan_gradient)
    with pytest.raises(NonFiniteLossError, match="non-finite gradient"):
        train(make_cfg(tmp_path, tiny_model_dir, reward_file, "checkpoint.every=1",
                       "train.max_nonfinite_steps=1"))  # fmt: skip
    now = holder["policy"].model.state_dict()
    assert all(torch.equal(now[k], snapshot[k]) for k in snapshot)
    assert CheckpointManager(tmp_path / "run").complete() == []


def test_infinite_reward_is_a_clear_error(tmp_path, tiny_model_dir, reward_file):
    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file)
    cfg.rewards = cfg.rewards[:1] + [
        cfg.rewards[1].model_copy(update={"name": f"{reward_file}:infinite"})
    ]
    with pytest.raises(ValueError, match="'infinite' returned inf.*finite number or None"):
        train(cfg)
    assert CheckpointManager(tmp_path / "run").complete() == []


def test_dynamic_sampling_with_fewer_samples_than_minibatches(
    tmp_path, tiny_model_dir, reward_file
):
    """DAPO keeps 1 of 2 groups (2 samples) when the step wanted 2 x 2 = 4 in 4 minibatches."""
    cfg = make_cfg(
        tmp_path, tiny_model_dir, reward_file, "algorithm.preset=dapo",
        "algorithm.max_sampling_rounds=1", "algorithm.minibatches=4", "rollout.group_size=2",
        "algorithm.overlong_shaping='off'", "train.steps=1",
    )  # fmt: skip
    cfg.rewards = [cfg.rewards[1].model_copy(update={"name": f"{reward_file}:first_group_mixed"})]
    train(cfg)
    (row,) = read_metrics(tmp_path / "run", "train")
    assert row["dynamic/kept_frac"] == 0.5 and math.isfinite(row["loss"])


def test_dynamic_sampling_partial_batch_keeps_the_update_count(
    tmp_path, tiny_model_dir, reward_file
):
    """2 of 3 groups kept (4 samples) with minibatches=3: still 3 optimizer updates, not 4."""
    cfg = make_cfg(
        tmp_path, tiny_model_dir, reward_file, "algorithm.preset=dapo",
        "algorithm.max_sampling_rounds=1", "algorithm.minibatches=3", "rollout.group_size=2",
        "rollout.prompts_per_step=3", "algorithm.overlong_shaping='off'", "train.steps=1",
        "train.warmup_steps=10",
    )  # fmt: skip
    cfg.rewards = [cfg.rewards[1].model_copy(update={"name": f"{reward_file}:two_groups_mixed"})]
    train(cfg)
    (row,) = read_metrics(tmp_path / "run", "train")
    assert row["dynamic/kept_frac"] == pytest.approx(2 / 3)
    assert row["lr"] == pytest.approx(1e-3 * 4 / 11)  # 3 updates of the linear warm-up
