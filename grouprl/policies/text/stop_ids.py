"""The token ids that end a turn (and a completion): the generation config's and the tokenizer's.

Chat models end a turn with a token their generation config lists but their tokenizer may not call
EOS: Gemma's <end_of_turn> (generation_config eos [<eos>, <end_of_turn>], tokenizer EOS <eos>),
Llama 3 instruct's <|eot_id|>, Phi-3's <|end|>, Qwen2.5 instruct's <|im_end|>. Engines stop on
these ids, and the multi-turn runner and the gateway must know that a turn ending with any of them
is closed (its closing text is not appended again). One function decides, for every engine and
runner: the generation config's `eos_token_id` (an int or a list, in its order), then the
tokenizer's `eos_token_id` when the generation config does not list it.
"""

from __future__ import annotations

from typing import Any


def stop_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """Ids that end a turn: generation_config.eos_token_id (int or list, in order) then the
    tokenizer's EOS if not among them; either may be absent, not both."""
    ids: list[int] = []
    gen = getattr(generation_config, "eos_token_id", None) if generation_config else None
    for i in [gen] if isinstance(gen, int) else list(gen or []):
        if int(i) not in ids:
            ids.append(int(i))
    tok = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tok is not None and int(tok) not in ids:
        ids.append(int(tok))
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer has an EOS id")
    return ids


def model_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """`stop_ids` of a transformers model (its `generation_config`; a peft wrapper's base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return stop_ids(getattr(base, "generation_config", None), tokenizer)
