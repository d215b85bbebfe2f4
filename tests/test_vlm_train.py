"""The vlm workload end to end on the Qwen2-VL replica: a config trains, logs its images, saves a
folder transformers loads with the trained log-probs, and refuses what it cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grouprl.config.loading import load_config
from grouprl.replicas.vision import build_qwen2_vl
from grouprl.train import train

DEMO = Path(__file__).resolve().parents[1] / "configs" / "vlm" / "shapes_demo.yaml"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("vlm"))


def _cfg(folder, tmp_path, *extra):
    return load_config(DEMO, [
        f"model.name_or_path={folder}", f"run.output_dir={tmp_path}", "run.overwrite=true",
        "task.options.n_train=32", "task.options.n_eval=8", "rollout.prompts_per_step=2",
        "rollout.group_size=3", "train.steps=2", "eval.every=2", "eval.max_examples=8",
        "checkpoint.every=2", *extra,
    ])  # fmt: skip


@pytest.mark.parametrize(
    "extra", [[], ["model.lora={r: 4, alpha: 8}", "model.dtype=bfloat16", "algorithm.kl_coef=0.05"]]
)
def test_trains_logs_images_and_saves_a_folder_transformers_loads(folder, tmp_path, extra):
    from transformers import AutoModelForImageTextToText

    cfg = _cfg(folder, tmp_path, *extra)
    result = train(cfg)
    run = Path(result["run_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in rows) and set(result["after"]) >= {"accuracy"}
    md = (run / "samples.md").read_text()
    assert "<image 56x56>" in md.replace("&lt;", "<") and "](images/eval-" in md
    assert list((run / "images").glob("eval-*.png"))
    model_dir = run / "checkpoints" / "step-00000002" / "model"
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert (model_dir / "preprocessor_config.json").exists() and (
        model_dir / "chat_template.json"
    ).exists()
    if extra:
        assert (model_dir / "adapter" / "adapter_config.json").exists()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_options_that_cannot_apply_are_errors(folder, tmp_path):
    with pytest.raises(ValueError, match="rollout.engine='hf'"):
        train(_cfg(folder, tmp_path, "rollout.engine=hf"))
    with pytest.raises(ValueError, match="workload 'text' with model.type='vlm'"):
        _cfg(folder, tmp_path, "workload.type=text")
