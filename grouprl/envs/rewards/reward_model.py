"""`reward_model`: a transformers sequence-classification reward model (Bradley-Terry RM with one
output logit, e.g. Skywork-Reward-Llama / -Qwen) scoring prompt + completion.

Source: the RM recipe of InstructGPT (Ouyang et al., arXiv 2203.02155) as the hub checkpoints ship
it: `AutoModelForSequenceClassification` with num_labels 1, whose score is the logit at the last
non-pad token of the conversation rendered with the RM tokenizer's chat template.
Rendering: with a chat template, [prompt messages..., {"role": "assistant", "content": completion}]
(a string prompt becomes one user message; a system message the template cannot render is folded
into the first user message, rollouts/chat_probe.py); without one, prompt text + completion text.
Deviations: the value is `scale * logit + shift` (defaults 1, 0: the raw logit); a text longer than
`max_length` tokens is truncated from the LEFT (the end of the completion, which the score reads,
is kept) and a warning names the option once; the score is read at the last ATTENDED position
(from the attention mask, with position ids counted from the first real token) instead of
transformers' "last token that is not the pad id", which misreads left padding and texts that
contain the pad token. Only heads named `score` (the transformers *ForSequenceClassification
classes) are supported; remote-code heads (InternLM2's v_head) are not.

Options: see the docstring of `reward_model`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Literal

import torch

from grouprl.envs.rewards.loading import completion_text
from grouprl.rollouts.chat_probe import CHAT_FALLBACKS, adapt_messages, set_chat_fallback

Dtype = Literal["float32", "bfloat16", "float16"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def load_reward_model(model: str, device: str, dtype: Dtype) -> tuple[Any, Any]:
    """(model in eval mode on device/dtype, tokenizer), cached per process."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModelForSequenceClassification.from_pretrained(model, dtype=_DTYPES[dtype])
    if net.config.num_labels != 1:
        raise ValueError(
            f"reward 'reward_model': {model!r} has num_labels={net.config.num_labels}; a reward "
            "model has one output logit"
        )
    if not isinstance(getattr(net, "score", None), torch.nn.Linear):
        raise ValueError(
            f"reward 'reward_model': {model!r} loads as {type(net).__name__}, which has no "
            "linear `score` head (a transformers *ForSequenceClassification class is needed)"
        )
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"reward 'reward_model': tokenizer of {model!r} has no pad/eos token")
        tok.pad_token = tok.eos_token
    if net.config.pad_token_id is None:
        net.config.pad_token_id = tok.pad_token_id
    return net.to(device).eval(), tok


def render(tok: Any, prompt: Any, completion: Any) -> str:
    """The text the RM reads: its chat template over [prompt messages..., assistant completion],
    or prompt + completion when the tokenizer has no template. A system message the RM's template
    cannot render is folded into the first user message (rollouts/chat_probe.py; announced once,
    or refused under the option chat_fallback: error)."""
    text = completion_text(completion)
    if getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if prompt is None:
            messages = []
        messages = [*messages, {"role": "assistant", "content": text}]
        return tok.apply_chat_template(adapt_messages(tok, messages), tokenize=False)
    if prompt is None:
        return text
    if not isinstance(prompt, str):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return prompt + text


def reward_model(
    model: str,
    batch_size: int = 8,
    max_length: int = 4096,
    device: str | None = None,
    dtype: Dtype = "float32",
    padding_side: Literal["right", "left"] | None = None,
    scale: float = 1.0,
    shift: float = 0.0,
    chat_fallback: Literal["announce", "error"] = "announce",
):
    """Reward-model score (sequence classifier, one logit) of prompt + completion.

    Options:
    model: hub id or local folder of the reward model (loaded once per process)
    batch_size: texts per forward pass (default 8)
    max_length: tokens per text; longer texts are cut from the left, with one warning (default 4096)
    device: "cpu", "cuda", "cuda:1" ... (None = the current CUDA device when there is one, else CPU)
    dtype: "float32" | "bfloat16" | "float16" (default float32)
    padding_side: "right" | "left" (default: the tokenizer's); scores do not depend on it
    scale: multiply the logit (default 1.0)
    shift: add after scaling (default 0.0)
    chat_fallback: "announce" | "error": no system role in the RM's template: fold it, or refuse
    """
    if dtype not in _DTYPES:
        raise ValueError(
            f"reward 'reward_model': dtype must be one of {list(_DTYPES)}, got {dtype!r}"
        )
    if batch_size < 1 or max_length < 2:
        raise ValueError("reward 'reward_model': batch_size >= 1 and max_length >= 2 are needed")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if chat_fallback not in CHAT_FALLBACKS:
        raise ValueError(
            f"reward 'reward_model': chat_fallback must be one of {list(CHAT_FALLBACKS)}, "
            f"got {chat_fallback!r}"
        )
    net, tok = load_reward_model(model, dev, dtype)
    set_chat_fallback(tok, chat_fallback, "the reward_model option chat_fallback")
    warned = [False]

    @torch.no_grad()
    def fn(completions: list, prompts: list | None = None, **_: Any) -> list[float | None]:
        prompts = prompts if prompts is not None else [None] * len(completions)
        texts = [render(tok, p, c) for p, c in zip(prompts, completions)]
        out: list[float | None] = []
        for i in range(0, len(texts), batch_size):
            chunk = texts[i : i + batch_size]
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in chunk]
            if any(len(x) > max_length for x in ids) and not warned[0]:
                warned[0] = True
                warnings.warn(
                    f"reward 'reward_model': a text has more than max_length={max_length} "
                    "tokens and is cut from the left; raise the option max_length",
                    stacklevel=2,
                )
            ids = [x[-max_length:] for x in ids]
            width = max(len(x) for x in ids)
            pad = tok.pad_token_id
            left = (padding_side or tok.padding_side) == "left"
            rows, masks = [], []
            for x in ids:
                fill = [pad] * (width - len(x))
                rows.append(fill + x if left else x + fill)
                mask = [0] * len(fill)
                masks.append(mask + [1] * len(x) if left else [1] * len(x) + mask)
            input_ids = torch.tensor(rows, device=dev)  # [B, T]
            attention = torch.tensor(masks, device=dev)  # [B, T]
            # transformers' classifier reads the last non-pad token by input id, which fails
            # on left padding or a pad id inside the text: read the last attended position.
            positions = (attention.cumsum(1) - 1).clamp(min=0)  # [B, T] left padding: from 0
            hidden = net.base_model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions
            )[0]  # [B, T, H]
            last = _last_positions(attention)  # [B]
            rows_h = hidden[torch.arange(len(ids), device=dev), last]  # [B, H]
            logits = net.score(rows_h).float()[:, 0]  # [B]
            out += [scale * v + shift for v in logits.tolist()]
        return out

    return fn


def _last_positions(attention: torch.Tensor) -> torch.Tensor:
    """Index of the last attended token per row of a [B, T] 0/1 mask."""
    t = attention.shape[1]
    pos = torch.arange(t, device=attention.device).expand_as(attention)  # [B, T]
    return torch.where(attention.bool(), pos, -1).max(dim=1).values  # [B]
