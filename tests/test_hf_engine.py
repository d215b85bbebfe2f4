import pytest
import torch
from torch import nn

from grouprl.policies.text.engines import GenerationOutput, HFEngine, SamplingParams, TextEngine
from grouprl.policies.text.engines.hf import _stop_cut
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2


def _biased(tok, bias: dict[int, float], seed=0):
    """Tiny Qwen2 whose lm_head gets a bias, to make EOS / chosen tokens likely."""
    model = tiny_qwen2(tok, seed=seed)
    head = nn.Linear(model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        for token, b in bias.items():
            head.bias[token] = b
    model.lm_head = head
    return model


def _reference_logp(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])  # [1, P+T]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


PROMPTS = ["ab", "hello there, how", "x"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_fresh_forward_with_left_padding(temperature):
    tok = char_tokenizer()
    model = _biased(tok, {tok.eos_token_id: 3.0})
    prompts = [tok(p).input_ids for p in PROMPTS]
    torch.manual_seed(0)
    out = HFEngine(model, tok).generate(
        prompts, SamplingParams(temperature=temperature, max_new_tokens=24)
    )
    assert isinstance(out, GenerationOutput)
    for p, c, lp in zip(prompts, out.completion_ids, out.logprobs):
        ref = _reference_logp(model, p, c, temperature)
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=0)


def test_eos_kept_nothing_after_and_truncation_flag():
    tok = char_tokenizer()
    eos = tok.eos_token_id
    model = _biased(tok, {eos: 3.0})
    torch.manual_seed(1)
    out = HFEngine(model, tok).generate(
        [tok("ab").input_ids] * 16, SamplingParams(max_new_tokens=12)
    )
    n_eos = 0
    for ids, trunc in zip(out.completion_ids, out.truncated):
        assert 1 <= len(ids) <= 12
        assert eos not in ids[:-1]  # nothing after EOS, no padding
        if ids[-1] == eos:
            n_eos += 1
            assert not trunc
        else:
            assert trunc and len(ids) == 12
    assert 0 < n_eos < 16  # the bias makes both outcomes occur with this seed


def test_stop_strings_cut_after_stop_and_spanning_tokens():
    tok = char_tokenizer()
    a, b = tok("a").input_ids[0], tok("b").input_ids[0]
    model = _biased(tok, {a: 8.0, b: 8.0})
    params = SamplingParams(max_new_tokens=30, stop=["ab"])
    torch.manual_seed(0)
    out = HFEngine(model, tok).generate([tok("q").input_ids] * 6, params)
    for ids, trunc in zip(out.completion_ids, out.truncated):
        text = tok.decode(ids)
        assert text.endswith("ab") and "ab" not in text[:-1], text
        assert not trunc
    # generation really stopped early (transformers' StopStringCriteria), not only cut afterwards
    assert max(len(c) for c in out.completion_ids) < 30


def test_stop_cut_unit():
    tok = char_tokenizer()
    ids = tok("xxabyab").input_ids
    assert _stop_cut(ids, ["ab"], tok) == 4
    assert _stop_cut(ids, ["y", "ab"], tok) == 4
    assert _stop_cut(ids, ["zz"], tok) is None
    assert _stop_cut(ids, [], tok) is None


def test_deterministic_under_seed_and_batch_size_chunking():
    tok = char_tokenizer()
    model = _biased(tok, {tok.eos_token_id: 2.0})
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=10, top_k=20, top_p=0.9)
    torch.manual_seed(3)
    a = HFEngine(model, tok).generate(prompts, params)
    torch.manual_seed(3)
    b = HFEngine(model, tok).generate(prompts, params)
    assert a == b
    torch.manual_seed(3)
    c = HFEngine(model, tok, batch_size=2).generate(prompts, params)
    assert len(c.completion_ids) == 3 and all(len(x) >= 1 for x in c.completion_ids)


def test_top_k_one_is_greedy_with_logprob_zero():
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    prompts = [tok(p).input_ids for p in PROMPTS]
    engine = HFEngine(model, tok)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8), greedy=True)
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=8, top_k=1))
    assert greedy.completion_ids == top1.completion_ids
    # the sampling distribution after top-k=1 is a point mass
    assert all(lp == 0.0 for row in top1.logprobs for lp in row)
    # greedy log-probs are under softmax(logits / T)
    for p, c, lp in zip(prompts, greedy.completion_ids, greedy.logprobs):
        torch.testing.assert_close(
            torch.tensor(lp), _reference_logp(model, p, c, 1.0), atol=1e-5, rtol=0
        )


def test_top_p_logprobs_are_renormalised_over_the_nucleus():
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    prompt = tok("ab").input_ids
    torch.manual_seed(0)
    out = HFEngine(model, tok).generate([prompt], SamplingParams(max_new_tokens=1, top_p=0.5))
    token = out.completion_ids[0][0]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)  # [V]
    sorted_p, order = probs.sort(descending=True)
    # nucleus: smallest prefix whose mass reaches 0.5 (transformers keeps tokens while the mass
    # *before* them is < top_p)
    keep = int((sorted_p.cumsum(0) - sorted_p < 0.5).sum())
    nucleus = order[:keep]
    assert token in nucleus.tolist()
    expected = torch.log(probs[token] / probs[nucleus].sum())
    assert abs(out.logprobs[0][0] - expected.item()) < 1e-5


def test_hub_generation_defaults_are_ignored_and_state_restored():
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    prompts = [tok("hello").input_ids]
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 3
    model.generation_config.temperature = 0.1
    model.train()
    torch.manual_seed(0)
    out = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=16))
    ref = _reference_logp(model.eval(), prompts[0], out.completion_ids[0], 1.0)
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), ref, atol=1e-5, rtol=0)
    model.train()
    HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=2))
    assert model.training
    assert model.generation_config.repetition_penalty == 5.0


def test_protocol_validation_and_errors():
    tok = char_tokenizer()
    engine = HFEngine(tiny_qwen2(tok), tok)
    assert isinstance(engine, TextEngine)
    engine.load_weights({})  # no-op by design
    assert engine.generate([], SamplingParams()) == GenerationOutput([], [], [])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="\n")
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(engine.model, tok, batch_size=0)


@pytest.mark.parametrize("engine_cls", ["HFEngine", "FastEngine"])
def test_in_process_engines_share_validation_and_eos_pad(engine_cls):
    from grouprl.policies.text import engines

    cls = getattr(engines, engine_cls)
    tok = char_tokenizer()
    engine = cls(tiny_qwen2(tok), tok)
    assert engine.eos_ids == [tok.eos_token_id] and engine.pad_id == tok.pad_token_id
    with pytest.raises(ValueError, match=f"{engine_cls}.generate: 1 seeds for 2 prompts"):
        engine.generate([[5], [6]], SamplingParams(), seeds=[0])
    with pytest.raises(ValueError, match=f"{engine_cls}.generate: prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match=f"{engine_cls}: batch_size must be >= 1"):
        cls(engine.model, tok, batch_size=0)
