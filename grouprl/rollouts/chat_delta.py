"""Chat-template deltas for multi-turn rollouts: the text and ids appended after an assistant turn.

An observation is appended to a running token sequence as the chat template's delta against a fixed
dummy conversation (the approach of SkyRL; the whole-trajectory-as-one-chat layout of RAGEN /
StarPO, arXiv 2504.20073): the delta is what rendering [user, assistant, user(observation)] with
the generation prompt adds after rendering [user] with the generation prompt plus the assistant's
content. It splits into (head, tail) around the observation, found once per tokenizer with a
sentinel and cached (rebuilt when the template changes):
  head  closes the assistant turn and opens the user turn;
  tail  closes the user turn and opens the next assistant turn (generation prompt).
Templates that are not append-only, or that do not insert a user message's content verbatim exactly
once, are refused with an error rather than producing misaligned tokens. When the sampled turn ended
with EOS and the closing text starts with the EOS text (Qwen's <|im_end|>), that part is dropped:
the sampled EOS already is the marker. `first_messages` builds the initial chat (system message, or
the system prompt folded into the first user message when the template has no system role).
"""

from __future__ import annotations

import weakref
from typing import Any

_SENTINEL = "\x00OBSERVATION\x00"  # stands for the observation inside the dummy conversation
_DUMMY_USER, _DUMMY_ASSISTANT = "dummy question", "dummy answer"
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (template, pieces)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )


def _delta_pieces(tokenizer: Any) -> tuple[str, str]:
    """(head, tail) such that the delta after an assistant's content is head + observation + tail.

    head holds the assistant's closing text and the user turn's opening; tail closes the user turn
    and opens the next assistant turn. Cached per tokenizer (rebuilt if its template changes).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("multi-turn rollouts need a tokenizer with a chat template; it has none")
    cached = _PIECES.get(tokenizer)
    if cached is not None and cached[0] == template:
        return cached[1]
    user = {"role": "user", "content": _DUMMY_USER}
    base = [user, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    prefix = _render(tokenizer, [user], True) + _DUMMY_ASSISTANT

    def delta(obs: str) -> str:
        full = _render(tokenizer, [*base, {"role": "user", "content": obs}], True)
        if not full.startswith(prefix):
            raise ValueError(
                "the chat template is not append-only: rendering [user, assistant, user] does not "
                "start with rendering [user] + generation prompt + the assistant's content, so "
                "observation tokens cannot be appended as a delta"
            )
        return full[len(prefix) :]

    parts = delta(_SENTINEL).split(_SENTINEL)
    probe = "probe 1\n  probe 2 "
    if len(parts) != 2 or delta(probe) != parts[0] + probe + parts[1]:
        raise ValueError(
            "the chat template does not insert a user message's content verbatim exactly once; "
            "multi-turn rollouts cannot build observation deltas for it"
        )
    _PIECES[tokenizer] = (template, (parts[0], parts[1]))
    return parts[0], parts[1]


def observation_delta_text(tokenizer: Any, observation: str, ended_with_eos: bool) -> str:
    """The text the chat template renders after an assistant turn's content up to the next
    assistant turn's generation prompt, with `observation` as the user message in between.

    ended_with_eos: the sampled turn already ends with the EOS token; if the template's closing
    text starts with the EOS text, that part is dropped (the sampled EOS already is the marker).
    """
    head, tail = _delta_pieces(tokenizer)
    eos = tokenizer.eos_token
    if ended_with_eos and eos and head.startswith(eos):
        head = head[len(eos) :]
    return head + observation + tail


def observation_delta_ids(tokenizer: Any, observation: str, ended_with_eos: bool) -> list[int]:
    """Token ids of `observation_delta_text` (tokenised alone, no special tokens added)."""
    text = observation_delta_text(tokenizer, observation, ended_with_eos)
    return tokenizer(text, add_special_tokens=False).input_ids


def first_messages(tokenizer: Any, system_prompt: str, observation: str) -> list[dict]:
    """The initial chat: a system message if the template renders one, else the system prompt
    prepended to the first observation (blank line between); no system message if it is empty."""
    user = {"role": "user", "content": observation}
    if not system_prompt:
        return [user]
    messages = [{"role": "system", "content": system_prompt}, user]
    try:
        supported = system_prompt in _render(tokenizer, messages, True)
    except Exception:  # templates without a system role raise (e.g. jinja raise_exception)
        supported = False
    if supported:
        return messages
    return [{"role": "user", "content": f"{system_prompt}\n\n{observation}"}]
