"""Tiny random-weight replicas of the text model families the configs and README name.

Each builder writes, in code and with no download, a folder laid out as the hub download of the
real model is: config.json and generation_config.json (the real architecture class, special-token
ids, sampling defaults and dtype), model.safetensors, tokenizer.json, tokenizer_config.json (with
the family's chat template), special_tokens_map.json, and vocab.json / merges.txt where the family
ships them. Only sizes are shrunk: hidden 64, 2 layers, 2 heads of 32, a byte-level BPE of ~600 merges trained
with the `tokenizers` library on the small corpus below. The tokenizer is built with the family's
own transformers class (Qwen2Tokenizer, LlamaTokenizer, GPT2Tokenizer, or the plain tokenizer.json
of Llama 3), so its pre-tokenizer, normaliser and decoder are the real ones; the special tokens
are the real ones, numbered after the vocabulary as the real ones are (Mistral's control tokens
come first, as in Mistral's own vocabulary).

  qwen2.5  Qwen2ForCausalLM, ChatML with its tools branch (chat_templates.QWEN25)
  qwen3    Qwen3ForCausalLM, <think> tags, enable_thinking (chat_templates.QWEN3)
  llama3   LlamaForCausalLM (Llama 3.2 Instruct), header ids, <|eot_id|> / <|eom_id|>, ipython
  mistral  MistralForCausalLM (Mistral-7B-Instruct-v0.3), [INST] / [TOOL_CALLS] / [TOOL_RESULTS]
  gpt2     GPT2LMHeadModel with GPT-2's dropout 0.1 (resid / embd / attn), no chat template
  gemma2   Gemma2ForCausalLM (gemma-2-it): soft-capping, <end_of_turn>, no system role (GEMMA2)
  phi3     Phi3ForCausalLM (Phi-3-mini-4k-instruct): fused qkv / gate_up, <|end|>, no tool role
  qwen3-moe  Qwen3MoeForCausalLM (Qwen3-30B-A3B: 4 experts, top 2), Qwen3's tokenizer and template
  mixtral  MixtralForCausalLM (Mixtral-8x7B-Instruct: 4 experts, top 2), the mistral tokenizer

Deviations (all of size, none of kind): tiny vocabularies (so ids of ordinary text differ from the
real ones, special tokens keep their order and their place after the vocabulary), 2 layers;
Llama 3 keeps its 256 reserved special tokens; Mistral's tokenizer.model
(sentencepiece protobuf) is not written: tokenizer.json carries the same BPE with byte fallback.

`build(family, out_dir)` writes one folder; `TEXT_REPLICAS` maps each family to its builder
(`fn(out_dir) -> out_dir`), for the replica registry. From a shell:
`python -m grouprl.replicas.text qwen2.5 runs/replicas/qwen2.5` (then point model.name_or_path at
the folder for a smoke run of a config).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grouprl.replicas.chat_templates import TEMPLATES

SEED = 0
BPE_VOCAB = 640  # learned BPE vocabulary (before special tokens)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A tiny model learns to add numbers.",
    "Question: What is 12 + 30? Answer: 42. #### 42",
    "Tom has 3 boxes of 12 apples and gives away 5. How many apples are left? 31",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    'import json\nprint(json.dumps({"name": "python", "arguments": {"code": "print(1)"}}))',
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}',
    "You are a helpful assistant. Use the tools when they help. Think step by step.",
    "The answer is 7. The sum of 1, 2 and 4 is 7. Use +, -, *, / and ( ) once each.",
    "Walk to G, avoid H. <action>right</action> <action>down</action> left up",
    "Paris is the capital of France. The weather in Paris is sunny and 22 degrees.",
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
    "Given the following functions, please respond with a JSON for a function call.",
    "<answer>31</answer> <think>Let me compute 3 * 12 - 5 = 31.</think> The result is 31.",
    "countdown: reach 24 with 3, 4, 6 and 1. (6 - 3) * (4 + 1) - 1 = 14, 6 * 4 * 1 = 24",
    "\t\tindented\r\nwindows line\n\n\nthree newlines   spaces  end. ÄÖÜ é 中文 ✓",
]


# --------------------------------------------------------------------------- tokenizers
def _train_bpe(
    pre_tokenizer: Any, vocab_size: int, normalizer: Any = None, byte_level: bool = True
) -> tuple[dict, list]:
    """Byte-level BPE (vocab, merges as (left, right) pairs) trained on the corpus with the family's pre-tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # byte-level: all 256 byte symbols, so nothing is unknown; else the corpus's characters
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def split_byte_level(regex: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# Qwen's added tokens in id order after the vocabulary (special=False ones are ordinary text
# markers the model writes: tool calls, fill-in-the-middle, and Qwen3's think / tool_response).
QWEN25_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]  # fmt: skip
_QWEN3_ADDED = QWEN25_ADDED + [
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]  # fmt: skip


def qwen_tokenizer(added: list[tuple[str, bool]], template: str) -> Any:
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe(split_byte_level(QWEN_REGEX), BPE_VOCAB, normalizers.NFC())
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",  # set to <|im_end|> below, once the ids are in Qwen's order
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=131072,
        split_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens(
        [AddedToken(t, special=s, normalized=False) for t, s in added], special_tokens=False
    )
    tok.add_special_tokens({"additional_special_tokens": [t for t, s in added if s][1:]})
    tok.eos_token = "<|im_end|>"  # the Instruct models end turns (and generation) with it
    tok.chat_template = template
    return tok, vocab, merges


_LLAMA3_NAMED = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]  # fmt: skip


def _llama3_tokenizer() -> Any:
    """Llama 3's tokenizer.json: byte-level BPE, 256 special tokens after the vocabulary, a BOS
    post-processor; loaded as PreTrainedTokenizerFast as the hub folder declares."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _train_bpe(split_byte_level(_LLAMA3_REGEX), BPE_VOCAB)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = split_byte_level(_LLAMA3_REGEX)
    tk.decoder = decoders.ByteLevel()
    specials = _LLAMA3_NAMED + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = "<|begin_of_text|>"
    tk.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tk.token_to_id(bos))],
            ),
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token="<|eot_id|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=True,
        model_input_names=["input_ids", "attention_mask"],
    )
    tok.chat_template = TEMPLATES["llama3"]
    return tok


_MISTRAL_NAMED = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]  # fmt: skip


def _mistral_tokenizer() -> Any:
    """Mistral v0.3: sentencepiece-style BPE with byte fallback; ids 0-770 are control tokens
    (<unk>, <s>, </s>, [INST] ... [/TOOL_RESULTS], [control_8] ... [control_768]), then the 256
    byte tokens <0x00>..<0xFF>, then the learned pieces."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import LlamaTokenizer

    learned, merges = _train_bpe(
        # trained word by word (pieces never cross a space, as sentencepiece's); the tokenizer
        # itself runs Metaspace without splitting, as LlamaTokenizer sets it up
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        BPE_VOCAB,
        byte_level=False,  # sentencepiece pieces are text; other characters fall back to bytes
    )
    controls = _MISTRAL_NAMED + [f"[control_{i}]" for i in range(8, 769)]
    vocab = {t: i for i, t in enumerate(controls)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    tok = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        model_max_length=1000000000000000019884624838656,
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    tok.chat_template = TEMPLATES["mistral"]
    return tok


def _gpt2_tokenizer() -> Any:
    from tokenizers import pre_tokenizers
    from transformers import GPT2Tokenizer

    vocab, merges = _train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), BPE_VOCAB)
    vocab = dict(vocab)
    vocab["<|endoftext|>"] = len(vocab)  # GPT-2's only special token is its last id
    tok = GPT2Tokenizer(
        vocab=vocab,
        merges=merges,
        errors="replace",
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        add_prefix_space=False,
        model_max_length=1024,
    )
    return tok, vocab, merges


# --------------------------------------------------------------------------- models
# head_dim 32: the smallest vLLM's CPU attention takes; grouped-query attention (2 heads, 1 KV)
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def write_vocab_files(out: Path, vocab: dict, merges: list[tuple[str, str]]) -> None:
    """vocab.json / merges.txt as the families that ship them do (GPT-2, Qwen)."""
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
    )


def save_replica(
    model: Any,
    tok: Any,
    gen: dict,
    out: Path,
    dtype: torch.dtype,
    tokenizer_class: str | None = None,
) -> Path:
    """save_pretrained of model, generation config and tokenizer; the chat template goes into
    tokenizer_config.json (as hub folders of these families have it, not chat_template.jinja)."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    GenerationConfig(**gen).save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    if tokenizer_class is not None:  # the class name the hub folder declares
        path = out / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg["tokenizer_class"] = tokenizer_class
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    special = {
        k: getattr(tok, k)
        for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tok, k, None) is not None
    }
    extra = list(getattr(tok, "extra_special_tokens", None) or [])
    if extra:
        special["additional_special_tokens"] = extra
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out


def _init(model: Any) -> Any:
    torch.manual_seed(SEED)
    model.apply(model._init_weights)
    return model


def build_qwen25(out: Path | str) -> Path:
    """Qwen2.5-Instruct (Qwen2ForCausalLM, ChatML with tools, tied embeddings as the 0.5B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(QWEN25_ADDED, TEMPLATES["qwen2.5"])
    eot, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(
        vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=32768, max_window_layers=2, attention_dropout=0.0, bos_token_id=eot,
        eos_token_id=eos, dtype="bfloat16", **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(cfg)
    gen = dict(
        bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True,
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
    )  # fmt: skip
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    return out


def build_qwen3(out: Path | str) -> Path:
    """Qwen3 (Qwen3ForCausalLM, head_dim and q/k norms, thinking template)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(_QWEN3_ADDED, TEMPLATES["qwen3"])
    eot, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(
        vocab_size=len(tok), max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, head_dim=32, hidden_act="silu", tie_word_embeddings=True,
        use_sliding_window=False, max_window_layers=2, attention_bias=False,
        attention_dropout=0.0, bos_token_id=eot, eos_token_id=eos, dtype="bfloat16", **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(cfg)
    gen = dict(
        bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True,
        temperature=0.6, top_p=0.95, top_k=20,
    )  # fmt: skip
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    return out


def build_llama3(out: Path | str) -> Path:
    """Llama 3.2 Instruct (LlamaForCausalLM, llama3 rope scaling, tied embeddings as the 1B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tok = _llama3_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in _LLAMA3_NAMED}
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    cfg = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=131072, rms_norm_eps=1e-5,
        hidden_act="silu", tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        head_dim=32, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos, dtype="bfloat16", **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    gen = dict(
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos, do_sample=True,
        temperature=0.6, top_p=0.9,
    )  # fmt: skip
    return save_replica(model, tok, gen, out, torch.bfloat16, "PreTrainedTokenizerFast")


def build_mistral(out: Path | str) -> Path:
    """Mistral-7B-Instruct-v0.3 (MistralForCausalLM, no sliding window, untied head)."""
    from transformers import MistralConfig, MistralForCausalLM

    out = Path(out)
    tok = _mistral_tokenizer()
    cfg = MistralConfig(
        vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None, tie_word_embeddings=False,
        head_dim=32, bos_token_id=1, eos_token_id=2, dtype="bfloat16", **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = MistralForCausalLM(cfg)
    return save_replica(model, tok, dict(bos_token_id=1, eos_token_id=2), out, torch.bfloat16)


def build_gpt2(out: Path | str) -> Path:
    """GPT-2 (GPT2LMHeadModel with its real dropout: resid / embd / attn pdrop 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = Path(out)
    tok, vocab, merges = _gpt2_tokenizer()
    eot = vocab["<|endoftext|>"]
    cfg = GPT2Config(
        vocab_size=len(vocab), n_positions=1024, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=eot, eos_token_id=eot,
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(cfg)
    save_replica(model, tok, dict(bos_token_id=eot, eos_token_id=eot), out, torch.float32)
    write_vocab_files(out, vocab, merges)
    return out


def build_qwen25_rm(out: Path | str) -> Path:
    """A Qwen2.5 reward model (Qwen2ForSequenceClassification, num_labels 1, pad_token_id set in
    the config as Skywork-Reward-V2-Qwen folders have it: the score is the logit of the last
    non-pad token), with the Qwen2.5-Instruct tokenizer and chat template. Untied score head."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(QWEN25_ADDED, TEMPLATES["qwen2.5"])
    eot, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen2Config(
        vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=32768, max_window_layers=2, attention_dropout=0.0, bos_token_id=eot,
        eos_token_id=eos, pad_token_id=eot, num_labels=1, dtype="bfloat16", **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen2ForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a visible spread of scores
    gen = dict(bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot)
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    return out


# --------------------------------------------------------------------------- gemma2, phi3
# Gemma's first ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, [@BOS@] 5, <unused0..98> 6-104
# <start_of_turn> 106, <end_of_turn> 107 (gemma-2-*-it tokenizer.json); the replica keeps them
# there, then the 256 byte-fallback tokens, then the learned pieces.
_GEMMA_FIRST = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]"] + [
    f"<unused{i}>" for i in range(99)
]
_GEMMA_TURN = ["<start_of_turn>", "<end_of_turn>"]  # ids 106 and 107 after <unused99> at 105


def _gemma_tokenizer() -> Any:
    """GemmaTokenizer (BPE with byte fallback, spaces as "▁", no prefix space) with Gemma's
    control ids in place and <start_of_turn> / <end_of_turn> at 106 / 107."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import GemmaTokenizer

    learned, merges = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        BPE_VOCAB,
        byte_level=False,
    )
    controls = [*_GEMMA_FIRST, "<unused99>", *_GEMMA_TURN]
    vocab = {t: i for i, t in enumerate(controls)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    tok = GemmaTokenizer(
        vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False,
        model_max_length=1000000000000000019884624838656, spaces_between_special_tokens=False,
    )  # fmt: skip
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    tok.add_special_tokens({"additional_special_tokens": _GEMMA_TURN})
    tok.chat_template = TEMPLATES["gemma2"]
    return tok


def build_gemma2(out: Path | str) -> Path:
    """Gemma 2 instruct (Gemma2ForCausalLM: final-logit soft-capping 30, attention soft-capping 50,
    query_pre_attn_scalar = head_dim, alternating sliding / full layers, tied embeddings, bfloat16
    as gemma-2-9b-it's config); generation_config ends on <eos> 1 and <end_of_turn> 107 while the
    tokenizer's EOS is <eos>; the template raises on a system message."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out = Path(out)
    tok = _gemma_tokenizer()
    cfg = Gemma2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
        attention_dropout=0.0, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Gemma2ForCausalLM(cfg)
    gen = dict(bos_token_id=2, eos_token_id=[1, 107], pad_token_id=0, cache_implementation="hybrid")
    return save_replica(model, tok, gen, out, torch.bfloat16)


# Phi-3's added tokens from id 32000 (Phi-3-mini-4k-instruct tokenizer.json): all special; the
# ones after <|endoftext|> strip the whitespace that follows them (rstrip), as the real ones do.
_PHI3_ADDED = [
    "<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
    "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>",
    "<|user|>",
]  # fmt: skip


def _phi3_tokenizer() -> Any:
    """Llama's SentencePiece-style BPE (LlamaTokenizer: <unk> 0, <s> 1, </s> 2, byte fallback)
    with Phi-3's added tokens after the vocabulary; EOS and PAD <|endoftext|>, no BOS added."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import LlamaTokenizer

    learned, merges = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        BPE_VOCAB,
        byte_level=False,
    )
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    tok = LlamaTokenizer(
        vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        add_bos_token=False, add_eos_token=False, legacy=False, model_max_length=4096,
        padding_side="left",
    )  # fmt: skip
    tok.add_tokens(
        [
            AddedToken(t, special=True, normalized=False, rstrip=k > 0)
            for k, t in enumerate(_PHI3_ADDED)
        ]
    )
    tok.eos_token = tok.pad_token = "<|endoftext|>"
    tok.chat_template = TEMPLATES["phi3"]
    return tok


def build_phi3(out: Path | str) -> Path:
    """Phi-3-mini-4k-instruct (Phi3ForCausalLM: fused qkv_proj and gate_up_proj, untied head,
    sliding window 2047, bfloat16); generation_config ends on <|endoftext|>, <|assistant|> and
    <|end|> while the tokenizer's EOS is <|endoftext|>; the template drops tools and tool turns."""
    from transformers import Phi3Config, Phi3ForCausalLM

    out = Path(out)
    tok = _phi3_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in _PHI3_ADDED}
    vocab = -(-len(tok) // 64) * 64  # padded to a multiple of 64, as 32064 is
    eot = ids["<|endoftext|>"]
    cfg = Phi3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0, hidden_act="silu", max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=eot, pad_token_id=eot,
        sliding_window=2047, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Phi3ForCausalLM(cfg)
    gen = dict(
        bos_token_id=1, eos_token_id=[eot, ids["<|assistant|>"], ids["<|end|>"]], pad_token_id=eot
    )
    return save_replica(model, tok, gen, out, torch.bfloat16)


_TINY_MOE = dict(num_experts_per_tok=2, output_router_logits=False)  # 4 experts, top 2


def build_qwen3_moe(out: Path | str) -> Path:
    """Qwen3-30B-A3B (Qwen3MoeForCausalLM: every layer sparse, experts stacked as 3-D
    parameters in transformers 5, normalised top-k routing, untied head) with Qwen3's tokenizer
    and thinking template."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(_QWEN3_ADDED, TEMPLATES["qwen3"])
    eot, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, head_dim=32, hidden_act="silu", tie_word_embeddings=False,
        use_sliding_window=False, max_window_layers=2, attention_bias=False,
        attention_dropout=0.0, decoder_sparse_step=1, mlp_only_layers=[], num_experts=4,
        moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.001,
        bos_token_id=eot, eos_token_id=eos, dtype="bfloat16", **_TINY_MOE, **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(cfg)
    gen = dict(
        bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True,
        temperature=0.6, top_p=0.95, top_k=20,
    )  # fmt: skip
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    return out


def build_mixtral(out: Path | str) -> Path:
    """Mixtral-8x7B-Instruct (MixtralForCausalLM: every layer sparse, experts stacked as 3-D
    parameters in transformers 5, no sliding window, untied head) with the Mistral tokenizer
    and template of the mistral replica (v0.3's control tokens; Mixtral v0.1 ships v1's)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    out = Path(out)
    tok = _mistral_tokenizer()
    cfg = MixtralConfig(
        vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None, tie_word_embeddings=False,
        head_dim=32, num_local_experts=4, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
        bos_token_id=1, eos_token_id=2, dtype="bfloat16", **_TINY_MOE, **TINY_DECODER,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = MixtralForCausalLM(cfg)
    return save_replica(model, tok, dict(bos_token_id=1, eos_token_id=2), out, torch.bfloat16)


TEXT_REPLICAS: dict[str, Callable[[Path], Path]] = {
    "qwen2.5": build_qwen25,
    "qwen3": build_qwen3,
    "llama3": build_llama3,
    "mistral": build_mistral,
    "gpt2": build_gpt2,
    "qwen2.5-rm": build_qwen25_rm,  # a reward model (sequence classifier), not a policy
    "gemma2": build_gemma2,
    "phi3": build_phi3,
    "qwen3-moe": build_qwen3_moe,
    "mixtral": build_mixtral,
}


def build(family: str, out_dir: Path | str) -> Path:
    """Write the replica of `family` (a key of TEXT_REPLICAS) to `out_dir`; returns the folder."""
    if family not in TEXT_REPLICAS:
        raise ValueError(f"unknown text family {family!r}: allowed are {', '.join(TEXT_REPLICAS)}")
    return TEXT_REPLICAS[family](Path(out_dir))


def main(argv: list[str] | None = None) -> int:
    """`python -m grouprl.replicas.text FAMILY OUT_DIR`: write one replica (for smoke tests)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("family", choices=list(TEXT_REPLICAS))
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    print(build(args.family, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
