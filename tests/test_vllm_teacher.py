"""algorithm.distill source `engine`: the teacher's log-probs of the sampled tokens scored by a vLLM
engine on the teacher folder (VLLMEngine.score: prompt log-probs of prompt + completion) match the
teacher loaded as a model (fp32, within 1e-4), padding included; a distillation run with it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from grouprl.config.loading import ConfigError, apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.teacher import EngineTeacher, TeacherModel
from grouprl.policies.text.tiny import save_tiny
from grouprl.train import train

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
TOL = 1e-4


def _raw(out_dir, student, teacher, *overrides):
    raw = {
        "run": {"name": "opd-vllm", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "workload": {"type": "text"},
        "model": {"name_or_path": str(student)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}],
        "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5,
                    "vllm": {"gpu_memory_utilization": 0.1}},
        "algorithm": {"preset": "opd", "distill": {"teacher": str(teacher), "source": "engine"}},
        "train": {"steps": 2, "lr": 1e-3},
        "eval": {"every": 0},
    }  # fmt: skip
    return apply_overrides(raw, list(overrides))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    # head_dim 32: vLLM's CPU attention has no head_dim 16
    student = save_tiny(tmp_path_factory.mktemp("student"), heads=2, kv_heads=1)
    teacher = save_tiny(tmp_path_factory.mktemp("teacher"), heads=2, kv_heads=1, seed=3)
    return student, teacher


def test_engine_teacher_matches_the_model_teacher_and_trains(dirs, tmp_path):
    from grouprl.policies.text.engines.vllm_setup import teacher_from_config

    student_dir, teacher_dir = dirs
    cfg = validate(_raw(tmp_path, student_dir, teacher_dir))
    student = CausalLMPolicy.from_pretrained(str(student_dir))
    engine_teacher = teacher_from_config(cfg, student.tokenizer)
    assert isinstance(engine_teacher, EngineTeacher)
    model_teacher = TeacherModel.from_folder(str(teacher_dir), student_tokenizer=student.tokenizer)
    torch.manual_seed(0)
    batch = student.sample(["1+2=", "13+4=", "5="], 3, SamplingParams(max_new_tokens=5)).actions
    got = engine_teacher.log_probs(batch)  # [N, T]
    want = model_teacher.log_probs(batch)  # [N, T]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < TOL
    assert float(got[~batch.completion_mask].abs().sum()) == 0.0  # padding stays 0
    with pytest.raises(ValueError, match=r"rollout\.temperature=0\.7"):
        engine_teacher.log_probs(batch, temperature=0.7)
    del engine_teacher

    train(cfg)  # the run builds its own engine teacher
    rows = [json.loads(x) for x in (tmp_path / "opd-vllm" / "metrics.jsonl").read_text().split("\n")
            if x]  # fmt: skip
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 2 and all(r["distill_kl"] == r["distill_kl"] for r in train_rows)


def test_engine_source_with_a_temperature_is_refused_at_validation(dirs, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.source='engine'.*temperature"):
        validate(_raw(tmp_path, *dirs, "rollout.temperature=0.7"))
