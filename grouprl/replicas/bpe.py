"""Byte-level BPE tokenizer files trained with the `tokenizers` library (for the replicas).

`train_merges(corpus, n_merges, pre_tokenizer=..., normalizer=..., end_of_word_suffix=...)` runs
`tokenizers`' BpeTrainer over a small corpus, starting from all 256 byte symbols (GPT-2's
bytes-to-unicode alphabet, so no input is ever unknown), and returns the learned merges in order.

`write_clip_bpe(folder, corpus, n_merges)` writes CLIP's tokenizer files, `vocab.json` and
`merges.txt`, built as OpenAI's CLIP vocabulary is: the 256 byte symbols (`byte_alphabet` order), the same 256 with the
end-of-word marker `</w>`, one token per merge in merge order, then `<|startoftext|>` and
`<|endoftext|>` as the last two ids. The merges are learned with CLIP's own pre-tokenization (NFC,
whitespace runs collapsed, lower-cased; CLIP's word regex; byte-level symbols; `</w>` on each word's
last symbol). Only the size differs from the real 49408-token vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# CLIP's pre-tokenizer split (the word regex of CLIP's simple_tokenizer, as transformers' CLIP
# tokenizer uses it); \p{L} letters, \p{N} single digits, any other non-space run
CLIP_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
EOW = "</w>"


def byte_alphabet() -> list[str]:
    """The 256 printable symbols standing for the bytes, in the order of GPT-2's / CLIP's table:
    first the bytes that are printable Latin-1 (each stands for itself, in byte order), then the
    other bytes in byte order, standing for the code points 256, 257, ... So "!" is id 0 of a CLIP
    vocabulary."""
    from tokenizers import pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]  # fmt: skip
    others = [b for b in range(256) if b not in printable]
    ordered = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    if set(ordered) != set(pre_tokenizers.ByteLevel.alphabet()):  # the library's own alphabet
        raise RuntimeError("the byte alphabet differs from tokenizers' ByteLevel alphabet")
    return ordered


def train_merges(
    corpus: Iterable[str],
    n_merges: int,
    *,
    pre_tokenizer: Any,
    normalizer: Any = None,
    end_of_word_suffix: str | None = None,
) -> list[tuple[str, str]]:
    """The first `n_merges` (or fewer, if the corpus runs out) BPE merges learned on `corpus`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    suffixed = [a + end_of_word_suffix for a in alphabet] if end_of_word_suffix else []
    tok = Tokenizer(models.BPE(end_of_word_suffix=end_of_word_suffix))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(suffixed) + n_merges,
        initial_alphabet=alphabet,
        end_of_word_suffix=end_of_word_suffix,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    pairs = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    return [(a, b) for a, b in pairs][:n_merges]


def clip_pre_tokenization() -> tuple[Any, Any]:
    """(normalizer, pre_tokenizer) of CLIP's tokenizer, as `tokenizers` objects."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return normalizer, pre


def clip_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """CLIP's vocabulary layout: bytes, bytes + </w>, one token per merge, the two specials."""
    tokens = byte_alphabet()
    tokens = tokens + [t + EOW for t in tokens]
    tokens += ["".join(pair) for pair in merges]
    tokens += list(CLIP_SPECIALS)
    vocab: dict[str, int] = {}
    for t in tokens:
        vocab.setdefault(t, len(vocab))
    return vocab


def write_clip_bpe(folder: str | Path, corpus: Iterable[str], n_merges: int) -> Path:
    """vocab.json and merges.txt of a CLIP tokenizer with `n_merges` merges (module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    normalizer, pre = clip_pre_tokenization()
    merges = train_merges(corpus, n_merges, pre_tokenizer=pre, normalizer=normalizer,
                          end_of_word_suffix=EOW)  # fmt: skip
    (folder / "vocab.json").write_text(json.dumps(clip_vocab(merges), ensure_ascii=False))
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
