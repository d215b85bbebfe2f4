"""Loading a causal LM and its tokenizer (hub id or local save_pretrained folder), and turning
prompts (plain strings or chat messages) into token ids: the text policy's input side
(causal_lm.py). Chat messages go through the chat-template probe's fallbacks first
(rollouts/chat_probe.py: a system message the template cannot render is folded into the first user
message)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from grouprl.rollouts.chat_probe import adapt_messages

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
Prompt = str | list[dict[str, str]]


def check_source(name_or_path: str) -> None:
    """Fail early with one message for a local path that cannot hold a model."""
    path = Path(name_or_path).expanduser()
    looks_local = (
        path.exists() or name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    )
    if not looks_local:
        return  # a hub id such as "Qwen/Qwen2.5-0.5B"
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a directory; expected a folder written by "
            "save_pretrained (config.json, *.safetensors and tokenizer files) or a hub id"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json; expected a folder written by "
            "save_pretrained (config.json, *.safetensors and tokenizer files)"
        )


def load_causal_lm(
    name_or_path: str, dtype: DType = "float32", trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """(model, tokenizer) from a hub id or a save_pretrained folder; one clear error otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_source(str(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"could not load a causal LM and tokenizer from {str(name_or_path)!r} "
            f"(a hub id or a save_pretrained folder was expected): {first}"
        ) from None
    return model, tokenizer


def encode_prompts(
    tokenizer: Any, prompts: list[Prompt], max_tokens: int | None = None
) -> list[list[int]]:
    """Token ids per prompt: chat messages via the chat template (+ generation prompt), plain
    strings as-is (plus BOS only if this tokenizer normally adds one). max_tokens: keep the last
    max_tokens ids of a longer prompt (left truncation, rollout.prompt_overflow 'truncate')."""
    tok, out = tokenizer, []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            if not getattr(tok, "chat_template", None):
                raise ValueError(
                    "conversational prompts (lists of {'role', 'content'}) need a tokenizer "
                    "with a chat template, and this tokenizer has none"
                )
            # a template without a system role gets the system text in the first user message
            # (rollouts/chat_probe.py: probed, announced once, or refused by model.chat_fallback)
            text = tok.apply_chat_template(
                adapt_messages(tok, prompt), add_generation_prompt=True, tokenize=False
            )
        else:
            raise TypeError(
                f"prompt {i} must be a string or a list of {{'role', 'content'}} dicts, "
                f"got {type(prompt).__name__}"
            )
        ids = tok(text, add_special_tokens=False).input_ids
        bos = tok.bos_token_id
        if isinstance(prompt, str) and bos is not None and ids[:1] != [bos]:
            if tok(text, add_special_tokens=True).input_ids[:1] == [bos]:
                ids = [bos, *ids]
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[-max_tokens:]  # the end of the prompt (and the generation header) stays
        out.append(ids)
    return out
