import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines import SamplingParams
from grouprl.policies.text.logprobs import selective_log_softmax, token_logp_entropy
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.types import TokenBatch


def _policy(**kw):
    tok = char_tokenizer()
    return CausalLMPolicy(tiny_qwen2(tok), tok, **kw)


def _batch(tok, pairs):
    """TokenBatch from (prompt, completion) strings: prompts left padded, completions right padded."""
    ps = [tok(p).input_ids for p, _ in pairs]
    cs = [tok(c).input_ids for _, c in pairs]
    P, T = max(map(len, ps)), max(map(len, cs))
    pid = torch.zeros(len(pairs), P, dtype=torch.long)
    pm = torch.zeros(len(pairs), P, dtype=torch.bool)
    cid = torch.zeros(len(pairs), T, dtype=torch.long)
    cm = torch.zeros(len(pairs), T, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(ps, cs)):
        pid[i, P - len(p) :], pm[i, P - len(p) :] = torch.tensor(p), True
        cid[i, : len(c)], cm[i, : len(c)] = torch.tensor(c), True
    return TokenBatch(pid, pm, cid, cm, torch.zeros(len(pairs), dtype=torch.bool))


def _naive(model, tok, prompt, completion, temperature=1.0):
    """Full-logits reference on one unpadded sample: logp [T], entropy [T]."""
    p, c = tok(prompt).input_ids, tok(completion).input_ids
    logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / temperature  # [T, V]
    logsm = torch.log_softmax(logits, -1)
    logp = logsm.gather(-1, torch.tensor(c)[:, None])[:, 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


PAIRS = [("ab", "cdefg"), ("a much longer prompt", "x"), ("q:", "hello")]


def test_token_logp_entropy_hand_values():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])  # probs [.5,.5], [.25,.75]
    logp, ent = token_logp_entropy(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(logp, torch.tensor([math.log(0.5), math.log(0.75)]))
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0), h2]))
    # temperature 2 halves the logits: [0, ln3 / 2] -> probs [1/(1+sqrt3), sqrt3/(1+sqrt3)]
    lp, _ = selective_log_softmax(logits[None], torch.tensor([[0, 1]]), temperature=2.0)
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(lp[0], torch.tensor([math.log(0.5), math.log(s3 / (1 + s3))]))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_log_probs_match_naive_alone_and_padded(temperature, chunk_size):
    policy = _policy()
    tok, model = policy.tokenizer, policy.model
    batch = _batch(tok, PAIRS)
    out = policy.log_probs(batch, temperature=temperature, chunk_size=chunk_size)
    for i, (p, c) in enumerate(PAIRS):
        ref_lp, ref_ent = _naive(model, tok, p, c, temperature)
        n = len(c)
        torch.testing.assert_close(out.logp[i, :n], ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy[i, :n], ref_ent, atol=1e-5, rtol=0)
        assert (out.logp[i, n:] == 0).all() and (out.entropy[i, n:] == 0).all()
    # the same sample alone (no padding) scores the same as inside the padded batch
    alone = policy.log_probs(_batch(tok, PAIRS[1:2]), temperature=temperature)
    torch.testing.assert_close(alone.logp[0], out.logp[1, :1], atol=1e-5, rtol=0)


def test_log_probs_gradient_matches_naive_and_entropy_grad_switch():
    policy = _policy()
    tok, model = policy.tokenizer, policy.model
    batch = _batch(tok, PAIRS)
    out = policy.log_probs(batch, chunk_size=1)
    assert out.logp.requires_grad and not out.entropy.requires_grad
    out.logp.sum().backward()
    got = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad()
    sum(_naive(model, tok, p, c)[0].sum() for p, c in PAIRS).backward()
    want = model.model.layers[0].mlp.up_proj.weight.grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    model.zero_grad()
    out = policy.log_probs(batch, entropy_grad=True)
    assert out.entropy.requires_grad
    out.entropy.sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    assert policy.log_probs(batch, with_entropy=False).entropy is None


def test_sample_builds_rollout_consistent_with_log_probs():
    policy = _policy()
    tok = policy.tokenizer
    torch.manual_seed(0)
    prompts = ["ab", [{"role": "user", "content": "hi"}]]
    r = policy.sample(prompts, 3, SamplingParams(max_new_tokens=7))
    b = r.actions
    assert len(r) == 6 and r.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.rewards == {} and torch.equal(r.mask, b.completion_mask)
    assert b.prompt_ids.shape[1] == len("<|user|>\nhi\n<|assistant|>\n")
    assert b.prompt_mask[0].tolist() == [False] * (b.prompt_ids.shape[1] - 2) + [True, True]
    assert b.prompt_ids[0, -2:].tolist() == tok("ab").input_ids
    assert b.completion_ids.shape == (6, 7) and b.truncated.all()  # random model: no EOS in 7
    assert r.info["prompt"][3] == prompts[1] and len(r.info["completion_ids"]) == 6
    assert r.info["completion"][0] == tok.decode(r.info["completion_ids"][0])
    torch.testing.assert_close(r.old_logp, r.engine_logp)
    with torch.no_grad():
        logp = policy.log_probs(b, with_entropy=False).logp
    torch.testing.assert_close(logp, r.engine_logp, atol=1e-5, rtol=0)
    r2 = policy.sample(["x"], 2, SamplingParams(max_new_tokens=3), group_ids=[7])
    assert r2.group_ids.tolist() == [7, 7]
    with pytest.raises(ValueError, match="group_size"):
        policy.sample(["x"], 0, SamplingParams())
    with pytest.raises(ValueError, match="one id per prompt"):
        policy.sample(["x"], 2, SamplingParams(), group_ids=[1, 2])


def test_encode_prompts():
    policy = _policy()
    tok = policy.tokenizer
    assert policy.encode_prompts(["ab"]) == [tok("ab").input_ids]
    chat = policy.encode_prompts([[{"role": "user", "content": "hi"}]])
    assert chat == [tok("<|user|>\nhi\n<|assistant|>\n").input_ids]
    with pytest.raises(TypeError, match="prompt 0"):
        policy.encode_prompts([3])
    no_template = CausalLMPolicy(policy.model, char_tokenizer(chat_template=False))
    with pytest.raises(ValueError, match="chat template"):
        no_template.encode_prompts([[{"role": "user", "content": "hi"}]])


def _perturb(params):
    with torch.no_grad():
        for p in params:
            p.add_(0.5 * torch.randn_like(p))


def test_reference_copy_is_lazy_and_frozen():
    policy = _policy()
    batch = _batch(policy.tokenizer, PAIRS)
    assert policy._ref_model is None  # need_reference=False: nothing allocated
    before = policy.log_probs(batch).logp.detach()
    with policy.reference() as ref:
        torch.testing.assert_close(ref.log_probs(batch), before)
    _perturb(policy.trainable_parameters())
    with policy.reference() as ref:
        r = ref.log_probs(batch)
    assert not r.requires_grad
    torch.testing.assert_close(r, before)
    assert not torch.allclose(policy.log_probs(batch).logp, before)
    assert _policy(need_reference=True)._ref_model is not None


def test_lora_reference_disables_adapter():
    policy = _policy(lora={"r": 4, "alpha": 8})
    base = _policy()  # same seed: same base weights
    batch = _batch(policy.tokenizer, PAIRS)
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    base_logp = base.log_probs(batch).logp.detach()
    torch.testing.assert_close(policy.log_probs(batch).logp, base_logp)  # B = 0 at init
    torch.manual_seed(0)
    _perturb(policy.trainable_parameters())
    assert not torch.allclose(policy.log_probs(batch).logp, base_logp)
    with policy.reference() as ref:
        torch.testing.assert_close(ref.log_probs(batch), base_logp, atol=1e-6, rtol=0)
    assert policy._ref_model is None
    assert not torch.allclose(policy.log_probs(batch).logp, base_logp)  # adapter back on


def test_from_pretrained_and_clear_errors(tiny_model_dir, tmp_path):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    ref = _policy()
    batch = _batch(ref.tokenizer, PAIRS)
    torch.testing.assert_close(policy.log_probs(batch).logp, ref.log_probs(batch).logp)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        CausalLMPolicy.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        CausalLMPolicy.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        CausalLMPolicy.from_pretrained(str(tiny_model_dir), dtype="fp8")
    with pytest.raises(ValueError, match="unknown LoRA keys"):
        CausalLMPolicy.from_pretrained(str(tiny_model_dir), lora={"rank": 4})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not load"):
        CausalLMPolicy.from_pretrained(str(tmp_path))


def test_save_pretrained_lora_merged_loads_in_transformers(tmp_path):
    policy = _policy(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]})
    torch.manual_seed(0)
    _perturb(policy.trainable_parameters())
    batch = _batch(policy.tokenizer, PAIRS)
    want = policy.log_probs(batch).logp.detach()
    policy.save_pretrained(tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "adapter_config.json").exists()  # a plain transformers layout
    reloaded = CausalLMPolicy(AutoModelForCausalLM.from_pretrained(tmp_path), policy.tokenizer)
    torch.testing.assert_close(reloaded.log_probs(batch).logp, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(policy.log_probs(batch).logp, want)  # live model untouched


def test_state_dict_round_trip_and_train_eval():
    policy = _policy(lora={"r": 2})
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    assert state and all("lora_" in k for k in state)
    _perturb(policy.trainable_parameters())
    policy.load_state_dict(state)
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(v, state[k])
    with pytest.raises(KeyError, match="missing"):
        policy.load_state_dict({})
    full = _policy()
    assert set(full.state_dict()) == set(full.model.state_dict())
    assert full.train() is full and full.model.training
    full.eval()
    assert not full.model.training


def test_gradient_checkpointing_same_grads():
    a, b = _policy(), _policy(gradient_checkpointing=True)
    batch = _batch(a.tokenizer, PAIRS)
    for pol in (a, b):
        pol.train()
        pol.log_probs(batch).logp.sum().backward()
    ga = a.model.model.layers[1].self_attn.q_proj.weight.grad
    gb = b.model.model.layers[1].self_attn.q_proj.weight.grad
    torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)
