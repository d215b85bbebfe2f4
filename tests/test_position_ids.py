"""Scoring equals the model's own forward with left-padded prompts, whatever position convention
the family uses (issue 28, positions.py): grouprl's old convention `cumsum(mask) - 1` was wrong
for RoBERTa-style embeddings (positions from padding_idx + 1), for decoders that take no position
ids or cannot mask the pads (BART-style learned positions, RWKV's recurrence through the pads,
RecurrentGemma's recurrent blocks), and the fast path's shared prompt cache was wrong for
decoders whose cached continuation differs from one pass (GIT widens its mask by image tokens).
Tiny models from the real config classes, float32."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BartConfig,
    BartForCausalLM,
    GitConfig,
    GitForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
    RobertaConfig,
    RobertaForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
)

from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.fast_logprobs import shares_prompt_cache
from grouprl.policies.text.head import output_head
from grouprl.policies.text.logprobs import chunked_head_logprobs, completion_logprobs
from grouprl.policies.text.positions import decoder_positions
from grouprl.policies.text.scoring_probe import PROBE_BOUNDS, probe_batch, probe_gap
from grouprl.policies.text.tiny import char_tokenizer
from grouprl.types import TokenBatch

V, H = 64, 32
IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)


def roberta():
    return RobertaForCausalLM(RobertaConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, is_decoder=True, **IDS,
    ))  # fmt: skip


def bart():
    return BartForCausalLM(BartConfig(
        vocab_size=V, d_model=H, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
        encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64,
        max_position_embeddings=40, is_decoder=True, is_encoder_decoder=False, **IDS,
    ))  # fmt: skip


def rwkv():
    return RwkvForCausalLM(RwkvConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=2, attention_hidden_size=H,
        intermediate_size=64, context_length=40, bos_token_id=0, eos_token_id=0,
    ))  # fmt: skip


def recurrent_gemma():
    return RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, lru_width=H,
        attention_window_size=16, block_types=["recurrent", "attention"], **IDS,
    ))  # fmt: skip


def git():
    return GitForCausalLM(GitConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=40, num_image_with_embedding=None,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        **IDS,
    ))  # fmt: skip


def llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **IDS,
    ))  # fmt: skip


FAMILIES = {
    "roberta": roberta, "bart": bart, "rwkv": rwkv, "recurrent_gemma": recurrent_gemma,
    "git": git, "llama": llama,
}  # fmt: skip


def _build(name):
    torch.manual_seed(0)
    return FAMILIES[name]().eval()


def _batch() -> TokenBatch:
    """2 groups of 2 rows: prompts of 6 and 3 real tokens left padded to 6; right-padded
    completions of 4, 2, 3, 4 real tokens; ids 3.. (no special token)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (6,), generator=g), torch.randint(3, V, (3,), generator=g)]
    lengths = [4, 2, 3, 4]
    p_ids = torch.full((4, 6), 5)  # [N, P]; the pads are ordinary ids, masked
    p_mask = torch.zeros(4, 6, dtype=torch.bool)
    c_ids = torch.full((4, 4), 5)  # [N, T]
    c_mask = torch.zeros(4, 4, dtype=torch.bool)
    for row, n in enumerate(lengths):
        p = prompts[row // 2]
        p_ids[row, 6 - len(p) :], p_mask[row, 6 - len(p) :] = p, True
        c_ids[row, :n], c_mask[row, :n] = torch.randint(3, V, (n,), generator=g), True
    return TokenBatch(p_ids, p_mask, c_ids, c_mask, torch.zeros(4, dtype=torch.bool))


@torch.no_grad()
def _unpadded_forward(model, b: TokenBatch) -> torch.Tensor:
    """log_softmax(model(row).logits) of each row alone, without padding: [N, T]."""
    out = torch.zeros(b.completion_ids.shape)  # [N, T]
    for row in range(len(b.prompt_ids)):
        p, c = b.prompt_ids[row][b.prompt_mask[row]], b.completion_ids[row][b.completion_mask[row]]
        logits = model(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0]  # [L, V]
        logp = torch.log_softmax(logits[len(p) - 1 : -1].float(), -1)  # [c, V]
        out[row, : len(c)] = logp.gather(-1, c[:, None])[:, 0]
    return out


@pytest.mark.parametrize("path", ["fast", "plain", "forward"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_scoring_equals_the_forward_with_left_padded_prompts(family, path):
    model, b = _build(family), _batch()
    with torch.no_grad():
        ours = completion_logprobs(model, b, with_entropy=False, path=path)[0]  # [N, T]
    gap = (ours - _unpadded_forward(model, b)).abs()[b.completion_mask].max()
    assert gap < 1e-5, f"{family} {path}: {gap:.2e}"


@pytest.mark.parametrize(
    ("family", "offset", "shares"),
    [("llama", 0, True), ("roberta", 2, True), ("bart", None, None), ("rwkv", None, None),
     ("recurrent_gemma", None, None), ("git", 0, False)],
)  # fmt: skip
def test_the_probe_reads_each_familys_convention(family, offset, shares):
    """RoBERTa's offset is its padding_idx + 1 (= 2 here), read from the model, not a table;
    BART and RWKV cannot take left padding (rows are left-aligned); the common case keeps the
    shared prompt cache."""
    model = _build(family)
    assert decoder_positions(model).offset == offset
    if shares is not None:
        assert shares_prompt_cache(model) is shares
    assert not model.training  # the probes leave the mode as they found it


@pytest.mark.parametrize("family", ["roberta", "bart"])
def test_the_load_time_probe_catches_the_old_convention(family):
    """The load-time probe batch has a left-padded row, where the old convention (explicit
    `cumsum(mask) - 1` positions for every family) differs from the model's forward."""
    model = _build(family)
    batch = probe_batch(V)
    assert (~batch.prompt_mask).any()  # a padded row is part of the probe

    def old_convention(b: TokenBatch) -> torch.Tensor:
        P = b.prompt_ids.shape[1]
        ids = torch.cat([b.prompt_ids, b.completion_ids], 1)  # [N, P+T]
        mask = torch.cat([b.prompt_mask, b.completion_mask], 1).long()  # [N, P+T]
        hidden = model.get_decoder()(
            input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
            position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, :-1], use_cache=False,
        ).last_hidden_state[:, P - 1 :]  # fmt: skip  # [N, T, H]
        lp = chunked_head_logprobs(hidden, output_head(model), b.completion_ids,
                                   with_entropy=False)[0]  # fmt: skip
        return lp.masked_fill(~b.completion_mask, 0.0)  # [N, T]

    def now(b: TokenBatch) -> torch.Tensor:
        return completion_logprobs(model, b, with_entropy=False, path="plain")[0]

    assert probe_gap(old_convention, model, batch) > 100 * PROBE_BOUNDS[torch.float32]
    assert probe_gap(now, model, batch) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_fast_engine_samples_from_the_models_forward_with_prompts_of_several_lengths(family):
    """FastEngine's sampled log-probs equal the unpadded forward's: RoBERTa-style offsets in the
    dynamic cache's positions; models that cannot take left padding decode each prompt length
    unpadded (their completions back in the prompts' order); decoders whose cached continuation
    is not their forward (RWKV, RecurrentGemma, GIT) decode without a cache."""
    model = _build(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (6, 3, 5)]
    prompts = [p for p in prompts for _ in range(2)]  # groups of 2
    engine = FastEngine(model, char_tokenizer(), kv_cache="dynamic")
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4), seeds=list(range(6)))
    for p, c, lp in zip(prompts, out.completion_ids, out.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0]  # [L, V]
        ref = torch.log_softmax(logits[len(p) - 1 : -1].float(), -1)  # [c, V]
        ref = ref.gather(-1, torch.tensor(c)[:, None])[:, 0]  # [c]
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=1e-5)
