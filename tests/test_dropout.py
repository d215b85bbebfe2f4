"""train.disable_dropout on a tiny GPT-2 (GPT2LMHeadModel; resid / embd / attn pdrop 0.1 as the
real gpt2 config ships): the trainer's log-probs equal the sampler's, and the engine-mismatch
correction sees ratio 1. With dropout left on, the gap was 0.33 nats per token (issue 14)."""

import json
import warnings

import pytest
import torch
from tiny_runs import arithmetic_run

from grouprl.config.loading import validate
from grouprl.policies.dropout import disable_dropout
from grouprl.train import train


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table (printable bytes map to themselves, the rest above 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [table[b] for b in range(256)]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 saved with save_pretrained: config.json, model.safetensors and GPT-2's
    byte-level BPE tokenizer (no merges: one token per byte), <|endoftext|> as bos/eos/unk and no
    pad token, as gpt2 has."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

    d = tmp_path_factory.mktemp("tiny_gpt2")
    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    vocab["<|endoftext|>"] = len(vocab)
    tok = GPT2Tokenizer(vocab=vocab, merges=[])
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(vocab), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _cfg(out_dir, model_dir, *overrides):
    return validate(arithmetic_run(
        out_dir, model_dir, *overrides, task={"options": {"n_train": 16}},
        rollout={"group_size": 4, "max_new_tokens": 6},
        algorithm={"engine_correction": "token_truncate"},
    ))  # fmt: skip


def _train_row(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["split"] == "train")


def test_trainer_and_engine_log_probs_agree_with_dropout_disabled(tmp_path, gpt2_dir):
    cfg = _cfg(tmp_path, gpt2_dir)
    assert cfg.train.disable_dropout is True  # the default
    train(cfg)
    row = _train_row(cfg.run_dir)
    assert row["engine/logp_abs_diff_max"] < 1e-5
    # the mismatch correction then measures engine drift only: every weight is 1
    assert row["engine_is/mean_abs_log_w"] < 1e-5
    assert row["engine_is/mean_weight"] == pytest.approx(1.0, abs=1e-5)
    assert row["engine_is/frac_clipped"] == 0.0


def test_dropout_kept_on_request_shows_the_gap(tmp_path, gpt2_dir):
    from grouprl.runtime.logp_gap import LogpGapError

    # the first-step gap guard stops it, naming dropout among the causes ...
    with pytest.raises(LogpGapError, match="train.disable_dropout"):
        train(_cfg(tmp_path / "stop", gpt2_dir, "train.disable_dropout=false"))
    # ... and a user who keeps dropout on purpose says so with the switch
    cfg = _cfg(tmp_path, gpt2_dir, "train.disable_dropout=false", "rollout.logp_gap_check=warn")
    with pytest.warns(UserWarning, match="differ by"):
        train(cfg)
    assert _train_row(cfg.run_dir)["engine/logp_abs_diff_mean"] > 1e-3  # measured 0.026


def test_disable_dropout_zeroes_modules_and_functional_rates():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.2,
    ))  # fmt: skip
    changed = disable_dropout(model)
    assert changed == ["model.layers.0.self_attn.attention_dropout"]
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
    ids = torch.tensor([[1, 2, 3, 4]])
    model.train()
    a, b = model(ids).logits, model(ids).logits
    assert torch.equal(a, b)  # train mode, yet deterministic


def test_lora_dropout_is_switched_off_with_a_warning(tmp_path, gpt2_dir):
    cfg = _cfg(
        tmp_path,
        gpt2_dir,
        "model.lora.r=4",
        "model.lora.dropout=0.1",
        "model.lora.target_modules=[c_attn,c_proj]",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg)
    assert any("model.lora.dropout=0.1 is switched off" in str(w.message) for w in caught)
    assert _train_row(cfg.run_dir)["engine/logp_abs_diff_max"] < 1e-5
