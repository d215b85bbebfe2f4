"""Per-stage metrics, the FLOP count and MFU (grouprl/runtime/throughput.py)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grouprl.config.loading import validate
from grouprl.policies.text.tiny import char_tokenizer, save_tiny
from grouprl.runtime.throughput import (
    STAGES,
    StepMeter,
    StepWork,
    matmul_params,
    peak_flops_for,
    peak_of_gpu,
    step_flops,
)
from grouprl.train import train
from tests.tiny_runs import arithmetic_run

PERF = [f"perf/{s}_s" for s in STAGES] + [
    "perf/step_s", "perf/generated_tokens_per_s", "perf/trained_tokens_per_s", "perf/mfu",
]  # fmt: skip


def _qwen2(tied: bool) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=259, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=16, tie_word_embeddings=tied)  # fmt: skip
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_by_hand(tied):
    # d = 8, 2 heads of 4, 1 kv head: q 8*8+8, k 8*4+4, v 8*4+4, o 8*8; MLP 3 * 8*16;
    # 2 layer norms + the final norm 3*8; the LM head 259*8 (tied: the embedding table itself,
    # untied: its own matrix, the lookup table not counted)
    by_hand = (72 + 36 + 36 + 64) + 384 + 24 + 259 * 8
    model = _qwen2(tied)
    assert matmul_params(model) == by_hand == 2688
    total = sum(p.numel() for p in model.parameters())
    assert total == (by_hand if tied else by_hand + 259 * 8)


def test_step_flops_by_hand():
    work = StepWork(params=1000, prefilled=10, sequence=30, scoring_passes=1)
    # sampling 2*1000*(10+20) + scoring 2*1000*30*1 + training 6*1000*30*2 epochs
    assert step_flops(work, generated=20, epochs=2) == 60_000 + 60_000 + 360_000
    assert step_flops(StepWork(params=None, why="x"), generated=20, epochs=1) is None


def test_peak_flops_setting():
    assert peak_flops_for(2e12, torch.device("cpu"), "bfloat16") == (2e12, "")
    peak, note = peak_flops_for(None, torch.device("cpu"), "bfloat16")
    assert peak is None and "run.peak_flops is null" in note
    peak, note = peak_flops_for("auto", torch.device("cpu"), "float32")
    assert peak is None and "run.peak_flops" in note and "cpu" in note


def test_peak_table_by_gpu_name():
    assert peak_of_gpu("NVIDIA H200", "bfloat16") == 989e12
    assert peak_of_gpu("NVIDIA H100 80GB HBM3", "float32") == 494.5e12  # tf32
    assert peak_of_gpu("NVIDIA L40S", "float16") == 362e12  # not L40's, not L4's
    assert peak_of_gpu("NVIDIA L40", "bfloat16") == 181e12
    assert peak_of_gpu("NVIDIA L4", "bfloat16") == 121e12
    assert peak_of_gpu("Tesla T4", "bfloat16") is None


def test_meter_times_stages_and_refuses_unknown_ones():
    meter = StepMeter((None, ""), epochs=1)
    meter.start_step()
    with meter.stage("update"):
        time.sleep(0.02)
    with meter.stage("update"):  # a stage entered twice adds up
        time.sleep(0.02)
    out = meter.metrics(workload=None, rollout=None, metrics={"rollout/sampled_actions": 8.0})
    assert out["perf/update_s"] >= 0.04 and out["perf/generate_s"] == 0.0
    assert out["perf/step_s"] >= out["perf/update_s"]
    assert out["perf/generated_tokens_per_s"] == pytest.approx(8.0 / out["perf/step_s"])
    assert "perf/mfu" not in out and "perf/trained_tokens_per_s" not in out  # a skipped step
    with pytest.raises(ValueError, match="unknown stage 'sampling'"):
        with meter.stage("sampling"):
            pass


def _rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_two_step_run_logs_every_perf_metric(tmp_path, capsys):
    model_dir = tmp_path / "model"
    save_tiny(model_dir, char_tokenizer())
    peak = 1e11  # a made-up peak: MFU is logged on CPU only with a number
    raw = arithmetic_run(tmp_path, model_dir, "workload.type=text", "train.steps=2", f"run.peak_flops={peak}",
                         "eval.every=0", "checkpoint.every=0", "algorithm.epochs=2")  # fmt: skip
    train(validate(raw))
    rows = _rows(tmp_path / "run")
    assert len(rows) == 2
    n = matmul_params(Qwen2ForCausalLM.from_pretrained(model_dir))
    for r in rows:
        assert set(PERF) <= set(r), set(PERF) - set(r)
        stages = sum(r[f"perf/{s}_s"] for s in STAGES)
        assert all(r[f"perf/{s}_s"] > 0 for s in STAGES)
        assert 0 < stages <= r["perf/step_s"] < 120
        generated = r["perf/generated_tokens_per_s"] * r["perf/step_s"]
        assert generated == pytest.approx(r["rollout/sampled_actions"])
        trained = r["perf/trained_tokens_per_s"] * r["perf/step_s"]
        # 4 completions of <= 3 tokens, trained in 2 epochs
        assert trained == pytest.approx(round(trained))  # a whole number of tokens
        trained = round(trained)
        assert trained % 2 == 0 and 2 <= trained <= 2 * 4 * 3
        flops = r["perf/mfu"] * r["perf/step_s"] * peak
        # prompts are "<|user|>\n...<|assistant|>\n" (>= 20 tokens each): at least the trained
        # completions' 6N x epochs, plus prompts and sampling; at most 40-token prompts
        assert flops > 6 * n * trained + 2 * n * generated
        assert flops < n * (2 * 4 * 43 + 2 * 4 * 43 + 6 * 2 * 4 * 43)
        assert 0 < r["perf/mfu"] < 1

    # the default (auto) on CPU: no MFU, and the reason printed once
    raw = arithmetic_run(tmp_path, model_dir, "workload.type=text", "train.steps=2", "run.name=auto", "eval.every=0",
                         "checkpoint.every=0")  # fmt: skip
    capsys.readouterr()
    train(validate(raw))
    rows = _rows(tmp_path / "auto")
    assert all("perf/mfu" not in r and math.isfinite(r["perf/step_s"]) for r in rows)
    assert capsys.readouterr().out.count("run.peak_flops=auto knows no peak") == 1
