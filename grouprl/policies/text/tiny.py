"""Tiny language models and tokenizers built in code, for tests and demos (nothing is downloaded).

- `char_tokenizer()`: a byte-level tokenizer with no merges: every byte is one token, so every
  printable ASCII character (and "\\n") is exactly one token and `decode(encode(s)) == s` for any
  NFC-normalised string (non-ASCII characters take 2-4 byte tokens). Ids: 0 <pad>, 1 <eos>,
  2 <unk> (never produced; transformers wants one), then byte b -> id 3 + b, so "a" is 3 + 97 = 100.
  There is no BOS (like Qwen2). It is built as a `Qwen2Tokenizer` on purpose: transformers 5's
  `AutoTokenizer` always rebuilds a qwen2 checkpoint's tokenizer with Qwen2's byte-level pipeline,
  so only a byte-level vocabulary survives save/load unchanged.
  A minimal plain-text chat template makes conversational prompts work:
  "<|user|>\\n{content}\\n<|assistant|>\\n" (the markers are ordinary characters). Left padding.
- `tiny_qwen2(tokenizer)`: a randomly initialised fp32 `Qwen2ForCausalLM` (tied embeddings).
- `save_tiny(dir)`: both of the above written with `save_pretrained`, loadable by
  `AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained(dir)`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
NUM_SPECIAL = 3  # byte b has id NUM_SPECIAL + b

# Role markers are plain characters; the generation prompt ends with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte 0..255 used by byte-level BPE (GPT-2 scheme):
    visible Latin-1 bytes stand for themselves, the others are shifted to code points 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return [table[b] for b in range(256)]


def char_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A one-token-per-byte tokenizer (see the module docstring); no special tokens added on encode."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for b, sym in enumerate(_byte_symbols()):
        vocab[sym] = NUM_SPECIAL + b
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE if chat_template else None,
        model_max_length=1_000_000,
    )


def tiny_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_position: int = 256,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A random-weight fp32 Qwen2 sized to `tokenizer`; the global RNG state is left untouched."""
    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"tiny_qwen2: hidden_size ({hidden_size}) must be divisible by heads ({heads}) "
            f"and heads by kv_heads ({kv_heads})"
        )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


def save_tiny(
    directory: str | Path, tokenizer: PreTrainedTokenizerFast | None = None, **model_kwargs
) -> Path:
    """Build (or take) a char tokenizer, build a tiny Qwen2, save both to `directory`; returns it.

    `model_kwargs` go to `tiny_qwen2` (hidden_size, layers, heads, ..., seed).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else char_tokenizer()
    model = tiny_qwen2(tokenizer, **model_kwargs)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
