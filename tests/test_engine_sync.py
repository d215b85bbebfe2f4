"""Engine <-> trainer plumbing that needs no vLLM: mismatch metrics (hand-computed), which rows
the step metrics use, weight-push helpers, request grouping, and a one-step HF-engine run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from grouprl.config.loading import ConfigError, apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.sync import (
    engine_mismatch,
    push_weights,
    release_engine,
    step_mismatch,
)
from grouprl.policies.text.engines.vllm import engine_state_dict, prompt_runs
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.types import Rollout

T = torch.tensor
MASK = T([[True, True, False], [True, False, False], [False, False, False]])


def test_engine_mismatch_hand_computed():
    trainer = T([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-3.0, 0.0, 0.0]])
    engine = T([[-1.5, -1.0, -9.0], [-0.5, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    m = engine_mismatch(trainer, engine, MASK)
    # d = trainer - engine on real tokens: row 0 (0.5, -1.0), row 1 (0.0); row 2 has no token
    assert m["engine/logp_abs_diff_mean"] == pytest.approx(1.5 / 3)
    assert m["engine/logp_abs_diff_max"] == pytest.approx(1.0)
    assert m["engine/seq_kl_k1"] == pytest.approx((0.5 + 0.0) / 2)  # sum of -d per row
    k3_row0 = (math.exp(0.5) - 1.5) + (math.exp(-1.0) - 1.0 + 1.0)
    assert m["engine/seq_kl_k3"] == pytest.approx(k3_row0 / 2)


def test_engine_mismatch_edges():
    assert (
        engine_mismatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=bool)) == {}
    )
    same = engine_mismatch(torch.full((3, 3), -2.0), torch.full((3, 3), -2.0), MASK)
    assert all(v == 0 for v in same.values())
    huge = engine_mismatch(T([[0.0]]), T([[-1e4]]), T([[True]]))  # clamped, stays finite
    assert huge["engine/logp_abs_diff_max"] == 20.0 and math.isfinite(huge["engine/seq_kl_k3"])
    with pytest.raises(ValueError, match=r"must all be \[N, T\]"):
        engine_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=bool))


def cfg_of(old_logp: str, epochs: int = 1, minibatches: int = 1):
    return SimpleNamespace(
        algorithm=SimpleNamespace(epochs=epochs, minibatches=minibatches),
        rollout=SimpleNamespace(old_logp=old_logp),
    )


def test_step_mismatch_uses_trainer_scores_only():
    r = Rollout(
        group_ids=T([0, 0, 1]), rewards={}, actions=None, mask=MASK,
        old_logp=torch.full((3, 3), -1.0), engine_logp=torch.full((3, 3), -1.5),
    )  # fmt: skip
    for cfg in (cfg_of("recompute"), cfg_of("engine"), cfg_of("recompute", epochs=2)):
        assert step_mismatch(cfg, r)["engine/logp_abs_diff_max"] == pytest.approx(0.5)
    assert step_mismatch(cfg_of("engine", minibatches=2), r) == {}  # no trainer score made
    r.engine_logp = None
    assert step_mismatch(cfg_of("recompute"), r) == {}


def test_prompt_runs():
    assert list(prompt_runs([], [])) == []
    prompts = [[1], [1], [1], [2, 3], [2, 3], [1]]
    assert list(prompt_runs(prompts, [5, 6, 7, 8, 9, 10])) == [(0, 3), (3, 2), (5, 1)]
    # runs break where the seeds do not count up by one (vLLM seeds sample i of n with s + i)
    assert list(prompt_runs(prompts, [5, 6, 9, 1, 2, 3])) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert list(prompt_runs([[1], [1, 1], [1]], [0, 1, 2])) == [(0, 1), (1, 1), (2, 1)]


def test_engine_state_dict_full_lora_and_errors():
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    state = engine_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert engine_state_dict(state) is state
    policy = CausalLMPolicy(tiny_qwen2(tok), tok, lora={"r": 2, "alpha": 4})
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.1)
    merged = engine_state_dict(policy.model)
    assert set(merged) == set(model.state_dict())  # plain names, no adapter keys
    layer = policy.model.base_model.model.model.layers[0].self_attn.q_proj
    w = layer.base_layer.weight + layer.get_delta_weight("default")
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], w)
    assert any("lora_B" in n for n, _ in policy.model.named_parameters())  # adapter kept
    with pytest.raises(TypeError, match="model or a state dict"):
        engine_state_dict([1, 2])


def test_pushes_send_each_tensor_once_with_its_aliases():
    # issue 28: weights are walked by tensor identity; a tied head travels once, under the
    # embedding's name, and its own name goes with it as an alias (engines/vllm_push.py)
    from grouprl.policies.text.engines.server.client import base_aliases, weight_specs
    from grouprl.policies.text.engines.vllm_push import unique_parameters, unique_tensors

    tok = char_tokenizer()
    model = tiny_qwen2(tok)  # tie_word_embeddings, as Qwen2.5's small sizes
    items, aliases = unique_tensors(model.state_dict())
    assert aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert [n for n, _ in items] == [k for k in model.state_dict() if k != "lm_head.weight"]
    params, param_aliases = unique_parameters(model)
    assert param_aliases == aliases and len(params) == len(items)
    specs, kind, _, spec_aliases = weight_specs(model)
    assert kind == "full" and spec_aliases == aliases and len(specs) == len(items)
    # equal values are not the same tensor: two copies both travel
    state = {"a": torch.ones(3), "b": torch.ones(3)}
    assert unique_tensors(state) == ([("a", state["a"]), ("b", state["b"])], {})
    # a merged peft model keeps the tie (the merged copy views the same embedding)
    policy = CausalLMPolicy(tiny_qwen2(tok), tok, lora={"r": 2, "alpha": 4})
    assert unique_tensors(engine_state_dict(policy.model))[1] == aliases
    assert base_aliases(policy.model) == aliases


def test_release_engine_lets_a_sleeping_engine_sleep():
    slept = []
    release_engine(SimpleNamespace(engine=SimpleNamespace(sleep=lambda: slept.append(1))))
    assert slept == [1]
    release_engine(SimpleNamespace(engine=SimpleNamespace()))  # HF engine: no sleep
    release_engine(SimpleNamespace())  # no text engine


def test_push_weights_hands_the_model_to_the_engine():
    got = []
    engine = SimpleNamespace(load_weights=got.append)
    model = object()
    push_weights(SimpleNamespace(engine=engine, model=model))
    assert got == [model]
    push_weights(SimpleNamespace(model=model))  # a policy without a text engine: nothing to do


def test_hf_engine_run_logs_mismatch_near_zero(tmp_path, tiny_model_dir):
    raw = {
        "run": {"name": "hf", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "task": {"name": "arithmetic", "options": {"n_train": 8, "n_eval": 2, "max_value": 9}},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {"steps": 1},
    }  # fmt: skip
    from grouprl.train import train

    train(validate(apply_overrides(raw, [])))
    rows = [json.loads(x) for x in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["split"] == "train")
    # generate (KV cache) vs one full forward, same fp32 weights: numerically tiny
    assert 0 <= step["engine/logp_abs_diff_max"] < 1e-4
    assert abs(step["engine/seq_kl_k1"]) < 1e-4


def test_config_engine_options():
    raw = {"model": {"name_or_path": "m"}, "task": {"name": "arithmetic"}}
    cfg = validate(apply_overrides(raw, ["rollout.engine=vllm", "rollout.vllm.sleep=level2"]))
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.sleep == "level2"
    assert cfg.rollout.vllm.prefix_caching == "on" and cfg.rollout.vllm.enforce_eager
    with pytest.raises(ConfigError, match="sleep"):
        validate(apply_overrides(raw, ["rollout.vllm.sleep=level3"]))
    with pytest.raises(ConfigError, match="engine"):
        validate(apply_overrides(raw, ["rollout.engine=sglang"]))
