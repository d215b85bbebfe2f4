"""The methods-of-the-field presets run end to end in the loop and do what they say on the batch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grouprl.config.loading import apply_overrides, validate
from grouprl.train import train


def make_cfg(out_dir, model_dir, *overrides):
    raw = {
        "run": {"name": "run", "output_dir": str(out_dir), "device": "cpu", "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 24, "n_eval": 4, "ops": "+-", "max_value": 9}},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def train_rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize(
    "preset", ["lambda_grpo", "pmd_mean", "tpo", "delta_l", "egsw", "entropy_only"]
)
def test_method_presets_train(preset, tmp_path, tiny_model_dir):
    train(make_cfg(tmp_path, tiny_model_dir, f"algorithm.preset={preset}"))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    if preset == "tpo":
        assert all("tpo_kl" in r for r in rows)
    if preset == "entropy_only":  # no policy-gradient term: the loss is -0.001 * mean entropy
        for r in rows:
            assert r["loss"] == pytest.approx(-0.001 * r["entropy"], rel=1e-4)


def test_two_grpo_sets_group_size_two(tmp_path, tiny_model_dir):
    raw_overrides = ["algorithm.preset=two_grpo"]
    cfg = make_cfg(tmp_path, tiny_model_dir, *raw_overrides)
    assert cfg.rollout.group_size == 4  # an explicit value beats the preset
    cfg = validate(
        apply_overrides(
            {**cfg.model_dump(mode="json"), "rollout": {"prompts_per_step": 2,
                                                        "max_new_tokens": 4}},
            ["algorithm.preset=two_grpo"],
        )
    )  # fmt: skip
    assert cfg.rollout.group_size == 2
    train(cfg)
    assert len(train_rows(tmp_path / "run")) == 2


def test_dump_curriculum_learns_source_mix(tmp_path, tiny_model_dir):
    """Two sources (the operator column): the curriculum's probabilities are logged every step and
    stay a distribution."""
    cfg = make_cfg(
        tmp_path, tiny_model_dir, "algorithm.preset=dump", "curriculum.source_column=op",
        "train.steps=3",
    )  # fmt: skip
    train(cfg)
    rows = train_rows(tmp_path / "run")
    for r in rows:
        probs = [v for k, v in r.items() if k.startswith("curriculum/p/")]
        assert len(probs) == 2 and sum(probs) == pytest.approx(1.0)
    assert all("kl_loss" in r for r in rows)  # the preset's KL 0.001 is on


def test_dump_resumes_identically(tmp_path, tiny_model_dir):
    """The curriculum state is checkpointed: crash after step 2, resume, same weights as no crash."""
    from safetensors.torch import load_file

    from grouprl.runtime.checkpoint import CheckpointManager

    common = ["algorithm.preset=dump", "curriculum.source_column=op", "train.steps=3",
              "checkpoint.every=2"]  # fmt: skip
    train(make_cfg(tmp_path / "a", tiny_model_dir, *common))
    cfg_b = make_cfg(tmp_path / "b", tiny_model_dir, *common, "train.steps=2")
    train(cfg_b)
    train(make_cfg(tmp_path / "b", tiny_model_dir, *common, "run.resume=true"))
    wa = load_file(
        CheckpointManager(tmp_path / "a" / "run").latest() / "model" / "model.safetensors"
    )
    wb = load_file(
        CheckpointManager(tmp_path / "b" / "run").latest() / "model" / "model.safetensors"
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_grpo_pair_advantages_by_hand():
    """G = 2, sample std (Bessel): a discordant pair (0, 1) has mean 0.5 and std sqrt(0.5) =
    0.7071, so A = +-0.5 / 0.7071 = +-1/sqrt(2) (METHODS section 10); a tied pair gives 0."""
    from grouprl.objectives import compute_advantages

    adv = compute_advantages(
        "grpo", torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), eps=0.0
    )
    assert adv.tolist() == pytest.approx([-(2**-0.5), 2**-0.5, 0.0, 0.0])
