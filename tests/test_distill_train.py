"""On-policy distillation end to end (algorithm.distill, preset opd) with tiny models built in code:
the config and its errors, the teacher's log-probs in prepare, the term at step 0 with the
student's own weights as teacher, and a few steps that bring the student closer to the teacher."""

from __future__ import annotations

import json

import pytest
import torch

from grouprl.config.loading import ConfigError, apply_overrides, validate
from grouprl.envs.tasks import build_task
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.teacher import TeacherModel
from grouprl.policies.text.tiny import char_tokenizer, save_tiny
from grouprl.train import train
from grouprl.workloads import build_workload


def _raw(tmp_path, student, teacher, *overrides, name="run"):
    raw = {
        "run": {"name": name, "output_dir": str(tmp_path), "seed": 0, "device": "cpu",
                "console": False},
        "workload": {"type": "text"},
        "model": {"name_or_path": str(student)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}],
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
        "algorithm": {"preset": "opd", "distill": {"teacher": str(teacher)}},
        "train": {"steps": 5, "lr": 3e-3},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
    }  # fmt: skip
    return apply_overrides(raw, list(overrides))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another tiny Qwen2 (other random weights), same char tokenizer, with its final norm scaled
    x4 so that its distributions are more peaked (a random tiny model's are near uniform)."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny(tmp_path_factory.mktemp("teacher"), seed=7)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def _rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


# ---- config -------------------------------------------------------------------------------------


def test_opd_preset_without_a_teacher_names_the_key():
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.teacher"):
        validate({"workload": {"type": "text"}, "model": {"name_or_path": "x"},
                  "task": {"name": "arithmetic"}, "algorithm": {"preset": "opd"}})  # fmt: skip


def test_opd_preset_settings():
    cfg = validate({"workload": {"type": "text"}, "model": {"name_or_path": "x"},
                    "task": {"name": "arithmetic"},
                    "algorithm": {"preset": "opd", "distill": {"teacher": "t", "coef": 0.5}}})  # fmt: skip
    d = cfg.algorithm.distill
    assert (cfg.algorithm.pg_coef, d.estimator, d.coef, d.source) == (0.0, "k1", 0.5, "model")


def test_engine_source_with_full_estimator_names_both_keys():
    with pytest.raises(ConfigError, match=r"estimator='full'.*source='engine'"):
        validate({"workload": {"type": "text"}, "model": {"name_or_path": "x"},
                  "task": {"name": "arithmetic"},
                  "algorithm": {"distill": {"teacher": "t", "source": "engine",
                                            "estimator": "full"}}})  # fmt: skip


def test_another_workload_with_distill_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"workload 'agent' does not support algorithm\.distill"):
        validate({"workload": {"type": "agent"}, "model": {"name_or_path": "tiny"},
                  "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0"}},
                  "algorithm": {"distill": {"teacher": "t"}}})  # fmt: skip


def test_opd_with_a_missing_teacher_folder_fails_naming_the_key(tmp_path, tiny_model_dir):
    cfg = validate(_raw(tmp_path, tiny_model_dir, tmp_path / "no_such_teacher"))
    with pytest.raises(ValueError, match=r"algorithm\.distill\.teacher=.*no such folder"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run directory is touched


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    tok = char_tokenizer()
    tok.add_tokens(["<extra_teacher_token>"])
    other = save_tiny(tmp_path / "other", tokenizer=tok)
    cfg = validate(_raw(tmp_path, tiny_model_dir, other))
    with pytest.raises(ValueError, match=r"algorithm\.distill\.teacher=.*vocabulary differs"):
        train(cfg)


# ---- the term at step 0 with the student's own weights as teacher -----------------------------


@pytest.mark.parametrize("estimator", ["k3", "full", "k1"])
def test_teacher_equal_to_the_students_initial_weights_gives_zero(tmp_path, tiny_model_dir,
                                                                  estimator):  # fmt: skip
    cfg = validate(_raw(tmp_path, tiny_model_dir, tiny_model_dir,
                        f"algorithm.distill.estimator={estimator}"))  # fmt: skip
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    wl = build_workload(cfg, policy=policy)
    assert isinstance(wl.teacher, TeacherModel)
    torch.manual_seed(0)
    rollout = policy.sample(["1+2=", "3+4="], 3, SamplingParams(max_new_tokens=4))
    rollout.rewards = {"accuracy": torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0])}
    wl.prepare(policy, rollout, {"accuracy": 1.0})
    if estimator != "full":
        assert torch.allclose(rollout.teacher_logp, rollout.old_logp, atol=1e-5)
    counts = {"num_tokens": int(rollout.mask.sum()), "num_seqs": len(rollout), "max_len": 4}
    res, _ = wl.micro_loss(rollout, counts, single_pass=True)
    assert abs(res.metrics["distill_kl"]) < 1e-5 and abs(res.metrics["distill_loss"]) < 1e-5
    res.loss.backward()
    grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
    assert grads and max(float(g.abs().max()) for g in grads) < 1e-5


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_a_run_with_its_own_initial_weights_as_teacher_logs_zero_at_step_one(
    tmp_path, tiny_model_dir, estimator
):
    """Step 1's batch is sampled and scored by the initial weights = the teacher's: the logged
    term is 0 (with the RL loss on)."""
    cfg = validate(_raw(tmp_path, tiny_model_dir, tiny_model_dir,
                        f"algorithm.distill.estimator={estimator}", "train.steps=1",
                        "algorithm.pg_coef=1.0"))  # fmt: skip
    train(cfg)
    rows = _rows(tmp_path / "run")
    assert len(rows) == 1 and "pg_loss" in rows[0]
    assert abs(rows[0]["distill_kl"]) < 1e-5 and abs(rows[0]["distill_loss"]) < 1e-5


# ---- a few steps: the student moves towards the teacher ---------------------------------------


def _mean_full_kl(student_dir, teacher_dir, batch):
    """The exact mean KL(student || teacher) over the completion tokens of a fixed batch."""
    from grouprl.objectives.distill import full_reverse_kl

    s = CausalLMPolicy.from_pretrained(str(student_dir))
    t = TeacherModel.from_folder(str(teacher_dir), student_tokenizer=s.tokenizer)
    with torch.no_grad():
        kl = s.distill_kl(batch, t.model, full_reverse_kl)  # [N, T]
    return float(kl.sum() / batch.completion_mask.sum())


@pytest.mark.parametrize(("estimator", "factor"), [("k1", 0.97), ("full", 0.85)])
def test_opd_steps_lower_the_kl_to_the_teacher(tmp_path, tiny_model_dir, teacher_dir, estimator,
                                               factor):  # fmt: skip
    """5 steps of 8 x 8 samples (lr 3e-3): the exact mean KL(student || teacher) on a fixed batch
    the initial student sampled for the 16 training prompts falls (measured: k1 0.305 -> 0.286,
    full 0.305 -> 0.223); k1's per-step value is too noisy at this size to fall step by step
    (its gradient is unbiased, objectives test), full's falls."""
    cfg = validate(_raw(tmp_path, tiny_model_dir, teacher_dir,
                        f"algorithm.distill.estimator={estimator}", "checkpoint.every=5",
                        "rollout.prompts_per_step=8", "rollout.group_size=8"))  # fmt: skip
    train(cfg)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert cfg.algorithm.pg_coef == 0.0  # the opd preset: distillation alone
    assert all(abs(r["loss"] - r["distill_loss"]) < 1e-6 for r in rows)  # pg_coef 0: the term alone
    if estimator == "full":
        first, last = rows[0]["distill_kl"], sum(r["distill_kl"] for r in rows[-2:]) / 2
        assert last < 0.85 * first, (first, last)
    prompts = [ex["prompt"] for ex in build_task("arithmetic", **cfg.task.options).train]
    student = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(1)
    batch = student.sample(prompts, 4, SamplingParams(max_new_tokens=4)).actions
    final = next((tmp_path / "run").glob("checkpoints/*/model"), None)
    assert final is not None
    before = _mean_full_kl(tiny_model_dir, teacher_dir, batch)
    after = _mean_full_kl(final, teacher_dir, batch)
    assert after < factor * before, (before, after)


# ---- the full-vocabulary KL through the policy: chunked == naive --------------------------------


def _naive_full_kl(student, teacher_model, batch, temperature):
    """Whole [N, T, V] logits of both models, no chunking: the reference numbers."""
    from grouprl.objectives.distill import full_reverse_kl

    def logits(model):
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)  # [N, P+T]
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)  # [N, P+T]
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
        p = batch.prompt_ids.shape[1]
        return out[:, p - 1 : -1] / temperature  # [N, T, V]

    s, t = logits(student.model), logits(teacher_model).detach()
    n, T, V = s.shape
    kl = full_reverse_kl(s.reshape(-1, V), t.reshape(-1, V)).view(n, T)  # [N, T]
    return kl.masked_fill(~batch.completion_mask, 0.0)


@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_full_kl_in_chunks_matches_the_naive_full_logits(tiny_model_dir, teacher_dir, chunk_size):
    from grouprl.objectives.distill import full_reverse_kl

    student = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    teacher = TeacherModel.from_folder(str(teacher_dir), student_tokenizer=student.tokenizer)
    torch.manual_seed(0)
    batch = student.sample(["1+2=", "13+4="], 3, SamplingParams(max_new_tokens=5)).actions
    batch.completion_mask[0, 3:] = False  # shorter completions: right padding is exercised
    batch.completion_mask[4, 1:] = False
    batch.completion_ids[~batch.completion_mask] = student.tokenizer.pad_token_id
    got = student.distill_kl(
        batch, teacher.model, full_reverse_kl, temperature=0.7, chunk_size=chunk_size
    )  # [N, T]
    got.sum().backward()
    g_got = [p.grad.clone() for p in student.trainable_parameters()]
    student.model.zero_grad(set_to_none=True)
    want = _naive_full_kl(student, teacher.model, batch, 0.7)
    want.sum().backward()
    g_want = [p.grad for p in student.trainable_parameters()]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert float(want[batch.completion_mask].min()) > 0  # a real KL, not zeros
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
