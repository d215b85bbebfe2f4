import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2


def test_ids_are_one_per_ascii_char_and_hand_computable():
    tok = char_tokenizer()
    # byte b -> id 3 + b: "a" = 100, " " = 35, "\n" = 13
    assert tok("a \n").input_ids == [100, 35, 13]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, None)
    assert len(tok) == 259


@pytest.mark.parametrize("text", ["Hello, world!\n  x = {a~b}\t", "2+2=4 ", "é ü 数", ""])
def test_decode_encode_round_trip(text):
    tok = char_tokenizer()
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    if text.isascii():
        assert len(ids) == len(text)


def test_eos_is_special_and_skipped():
    tok = char_tokenizer()
    ids = tok("ab").input_ids + [tok.eos_token_id]
    assert tok.decode(ids) == "ab<eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_left_padding():
    tok = char_tokenizer()
    enc = tok(["ab", "abcd"], padding=True)
    assert enc.input_ids == [[0, 0, 100, 101], [100, 101, 102, 103]]
    assert enc.attention_mask == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_chat_template():
    tok = char_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    assert char_tokenizer(chat_template=False).chat_template is None


def test_tiny_qwen2_is_seeded_fp32_tied_and_leaves_global_rng_alone():
    tok = char_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    m1 = tiny_qwen2(tok, seed=0)
    after = torch.rand(1)
    assert torch.equal(before, after)
    m2 = tiny_qwen2(tok, seed=0)
    m3 = tiny_qwen2(tok, seed=1)
    w1, w2, w3 = (m.model.embed_tokens.weight for m in (m1, m2, m3))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
    assert w1.dtype == torch.float32
    assert m1.lm_head.weight.data_ptr() == w1.data_ptr()
    assert m1.config.vocab_size == len(tok)
    logits = m1(torch.tensor([[100, 101]])).logits
    assert logits.shape == (1, 2, 259)


def test_bad_head_sizes_fail_clearly():
    with pytest.raises(ValueError, match="divisible"):
        tiny_qwen2(char_tokenizer(), hidden_size=64, heads=3)


def test_save_and_load_round_trip(tiny_model_dir, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = "x = 3\n<|user|>"
    assert tok(text).input_ids == char_tokenizer()(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert tok.padding_side == "left" and tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert tok.chat_template is not None
    assert model.dtype == torch.float32
    for (name, a), b in zip(model.state_dict().items(), tiny_model.state_dict().values()):
        assert torch.equal(a, b), name
