"""FastEngine's decoders (rollouts/engines/kv_decode.py) against the model's own forward.

The static-buffer decoder runs a Llama-family model's modules in our own loop, so every logit it
returns is compared with one full forward of the same rows (prompt + tokens so far), for four
architectures (qwen2 with q/k/v bias, llama, mistral, qwen3 with q/k norms), left-padded prompts
of different lengths, repeated and dropped rows, and LoRA adapters. The engine then gives the
same tokens and log-probs with either cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grouprl.policies.text.engines import SamplingParams
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.engines.kv_decode import (
    DynamicKVDecoder,
    StaticKVDecoder,
    make_decoder,
    static_kv_unsupported,
)
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2

V = 50
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=128,
)


def _model(kind: str, **extra):
    cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    config = cls[0](**SIZES, **extra)
    torch.manual_seed(0)
    model = cls[1](config).eval()
    with torch.no_grad():  # random norms so that the q/k norms and layer norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask [n, longest row], rows right-aligned (pad id 0)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _reference(model, rows: list[list[int]]) -> torch.Tensor:
    """Last-position logits of each row from one full forward, left padded: [n, V]."""
    ids, mask = _left_pad(rows)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    return out.logits[:, -1]


def _run_and_compare(model, decoder, prompts: list[list[int]], steps: int, drop_at: int) -> None:
    """Prefill, repeat rows, decode `steps` tokens (dropping rows at step drop_at); each step's
    logits must equal a full forward over the rows' sequences so far."""
    ids, mask = _left_pad(prompts)
    with torch.no_grad():
        logits = decoder.prefill(ids, mask)
        torch.testing.assert_close(logits, _reference(model, prompts), atol=2e-5, rtol=1e-5)
        copies = torch.tensor([2, 1, 3][: len(prompts)])  # a group's rows, unequal on purpose
        rows = torch.repeat_interleave(torch.arange(len(prompts)), copies)
        decoder.select(rows)
        seqs = [list(prompts[r]) for r in rows.tolist()]
        logits = logits[rows]
        gen = torch.Generator().manual_seed(1)
        for t in range(steps):
            tok = torch.randint(1, V, (len(seqs),), generator=gen)
            for s, x in zip(seqs, tok.tolist()):
                s.append(x)
            if t == drop_at:  # drop the first and last rows (as finished completions are)
                keep = torch.arange(1, len(seqs) - 1)
                decoder.select(keep)
                seqs, tok = [seqs[i] for i in keep.tolist()], tok[keep]
            logits = decoder.step(tok)
            torch.testing.assert_close(logits, _reference(model, seqs), atol=2e-5, rtol=1e-5)


PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral", "qwen3"])
@pytest.mark.parametrize("prompts", [PROMPTS, [[3, 4, 5], [6, 7, 8]]], ids=["padded", "unpadded"])
def test_static_decoder_logits_equal_the_models_forward(kind, prompts):
    model = _model(kind)
    decoder = make_decoder(model, capacity=7 + 6)
    assert isinstance(decoder, StaticKVDecoder)
    _run_and_compare(model, decoder, prompts, steps=6, drop_at=3)


def test_dynamic_decoder_logits_equal_the_models_forward():
    model = _model("qwen2")
    _run_and_compare(model, DynamicKVDecoder(model), PROMPTS, steps=5, drop_at=2)


def test_static_decoder_runs_lora_adapters():
    peft = pytest.importorskip("peft")
    model = _model("qwen2")
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    )
    base = wrapped.get_base_model()
    decoder = make_decoder(base, capacity=7 + 4, kv_cache="static")
    _run_and_compare(base, decoder, PROMPTS, steps=4, drop_at=1)
    with wrapped.disable_adapter():  # the adapters changed the logits, so they were run
        plain = _reference(base, PROMPTS)
    assert not torch.allclose(plain, _reference(base, PROMPTS), atol=1e-4)


def test_which_models_get_the_static_cache():
    assert static_kv_unsupported(_model("qwen2"), 100) is None
    mistral = _model("mistral", sliding_window=16)
    assert static_kv_unsupported(mistral, 16) is None
    assert "sliding window 16" in static_kv_unsupported(mistral, 17)
    assert isinstance(make_decoder(mistral, 17), DynamicKVDecoder)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in static_kv_unsupported(gpt2, 10)
    assert isinstance(make_decoder(gpt2, 10), DynamicKVDecoder)
    with pytest.raises(ValueError, match="StaticKVDecoder: model type 'gpt2'"):
        make_decoder(gpt2, 10, kv_cache="static")
    with pytest.raises(ValueError, match="kv_cache must be"):
        make_decoder(gpt2, 10, kv_cache="paged")
    with pytest.raises(ValueError, match="kv_cache must be"):
        FastEngine(tiny_qwen2(char_tokenizer()), char_tokenizer(), kv_cache="paged")


def test_static_decoder_refuses_to_overrun_its_buffers():
    model = _model("llama")
    decoder = StaticKVDecoder(model, capacity=4)
    with pytest.raises(ValueError, match="prompt of 5 columns > capacity 4"):
        decoder.prefill(torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.long))
    decoder = StaticKVDecoder(model, capacity=4)
    with torch.no_grad():
        decoder.prefill(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
        decoder.step(torch.ones(1, dtype=torch.long))
        with pytest.raises(ValueError, match="all 4 cache columns are used"):
            decoder.step(torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("greedy", [True, False])
def test_engine_gives_the_same_completions_with_either_cache(greedy):
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=3)
    prompts = [tok(p).input_ids for p in ("ab", "hello there", "x") for _ in range(3)]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, stop=["q"])
    seeds = list(range(len(prompts)))
    out = {}
    for kv in ("static", "dynamic"):
        out[kv] = FastEngine(model, tok, kv_cache=kv).generate(
            prompts, params, greedy=greedy, seeds=seeds
        )
    assert out["static"].completion_ids == out["dynamic"].completion_ids
    assert out["static"].truncated == out["dynamic"].truncated
    for a, b in zip(out["static"].logprobs, out["dynamic"].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
