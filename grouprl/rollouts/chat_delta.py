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
the system prompt folded into the first user message when the template has no system role or
moves it later, as Mistral's does).

Tools: every render takes `tools` (JSON schemas) and passes it to `apply_chat_template(tools=...)`,
so the prompt carries the template's own tool listing. Tool results are `{"role": "tool", ...}`
messages; `messages_delta_text` renders them in the template's own form (Qwen's <tool_response>
inside a user turn, Llama's ipython turn, Mistral's [TOOL_RESULTS]) against the same dummy
conversation, checking that the template appends them.

What the template supports is probed by rendering it (rollouts/chat_probe.py): every render here
goes through `adapt_messages`, so a template without a system role gets the system text folded
into the first user message and one without a tool role gets tool results as a user message, each
announced once (or refused under model.chat_fallback: error).

End of turn: a sampled turn that ended with a stop id (policies/text/stop_ids.py: the generation
config's EOS ids and the tokenizer's, e.g. Gemma's <end_of_turn>, Phi-3's <|end|>) already holds
the closing marker; when the template's closing text starts with that token's text, it is dropped.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from grouprl.rollouts.chat_probe import adapt_messages, supports

_SENTINEL = "\x00OBSERVATION\x00"  # stands for the observation inside the dummy conversation
_DUMMY_USER, _DUMMY_ASSISTANT = "dummy question", "dummy answer"
# tokenizer -> {(template, tools json): (head, tail)}
_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _render(
    tokenizer: Any, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None
) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        adapt_messages(tokenizer, messages),
        add_generation_prompt=generation_prompt,
        tokenize=False,
        **extra,
    )


def prompt_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the chat with the generation prompt (tools rendered by the template)."""
    text = _render(tokenizer, messages, True, tools)
    return tokenizer(text, add_special_tokens=False).input_ids


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools, sort_keys=True, default=str) if tools else ""


def _delta_pieces(tokenizer: Any, tools: list[dict] | None = None) -> tuple[str, str, bool]:
    """(head, tail, strip) such that the delta after an assistant's content is head + observation
    + tail, with the observation stripped of surrounding whitespace when `strip` (Llama 3's
    templates `trim` message content; any other change to the content is refused).

    head holds the assistant's closing text and the user turn's opening; tail closes the user turn
    and opens the next assistant turn. Cached per tokenizer (rebuilt if its template changes).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("multi-turn rollouts need a tokenizer with a chat template; it has none")
    key = (template, _tools_key(tools))
    cached = _PIECES.get(tokenizer, {}).get(key)
    if cached is not None:
        return cached
    user = {"role": "user", "content": _DUMMY_USER}
    base = [user, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    prefix = _render(tokenizer, [user], True, tools) + _DUMMY_ASSISTANT

    def delta(obs: str) -> str:
        full = _render(tokenizer, [*base, {"role": "user", "content": obs}], True, tools)
        if not full.startswith(prefix):
            raise ValueError(
                "the chat template is not append-only: rendering [user, assistant, user] does not "
                "start with rendering [user] + generation prompt + the assistant's content, so "
                "observation tokens cannot be appended as a delta"
            )
        return full[len(prefix) :]

    parts = delta(_SENTINEL).split(_SENTINEL)
    probe = "probe 1\n  probe 2 "
    got = delta(probe) if len(parts) == 2 else None
    if got is not None and got == parts[0] + probe + parts[1]:
        strip = False
    elif got is not None and got == parts[0] + probe.strip() + parts[1]:
        strip = True  # the template trims the content (Llama 3.x)
    else:
        raise ValueError(
            "the chat template does not insert a user message's content verbatim (or trimmed) "
            "exactly once; multi-turn rollouts cannot build observation deltas for it"
        )
    if tokenizer not in _PIECES or template not in {k[0] for k in _PIECES[tokenizer]}:
        _PIECES[tokenizer] = {}  # a new template: forget the old one's pieces
    _PIECES[tokenizer][key] = (parts[0], parts[1], strip)
    return parts[0], parts[1], strip


def observation_delta_text(
    tokenizer: Any, observation: str, ended_with_eos: bool | int, tools: list[dict] | None = None
) -> str:
    """The text the chat template renders after an assistant turn's content up to the next
    assistant turn's generation prompt, with `observation` as the user message in between.

    ended_with_eos: the stop id the sampled turn ended with (True: the tokenizer's EOS; False:
    none); if the template's closing text starts with that token's text, that part is dropped
    (the sampled token already is the marker).
    """
    head, tail, strip = _delta_pieces(tokenizer, tools)
    body = observation.strip() if strip else observation
    return _drop_sampled_eos(tokenizer, head, ended_with_eos) + body + tail


def _drop_sampled_eos(tokenizer: Any, head: str, ended_with_eos: bool | int) -> str:
    """head without the text of the stop token the turn ended with, when head starts with it."""
    if ended_with_eos is False or ended_with_eos is None:
        return head
    eos_id = tokenizer.eos_token_id if ended_with_eos is True else int(ended_with_eos)
    eos = tokenizer.convert_ids_to_tokens(eos_id) if eos_id is not None else None
    if not (eos and head.startswith(eos)):
        return head
    rest = head[len(eos) :]
    added = (getattr(tokenizer, "added_tokens_decoder", None) or {}).get(eos_id)
    # a token that strips the whitespace after it (Phi-3's <|end|>: rstrip) absorbed it in the
    # rendered chat; tokenised alone, that whitespace would become a token of its own
    return rest.lstrip() if getattr(added, "rstrip", False) else rest


def observation_delta_ids(
    tokenizer: Any, observation: str, ended_with_eos: bool | int, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of `observation_delta_text` (tokenised alone, no special tokens added)."""
    text = observation_delta_text(tokenizer, observation, ended_with_eos, tools)
    return tokenizer(text, add_special_tokens=False).input_ids


def messages_delta_text(
    tokenizer: Any,
    messages: list[dict],
    ended_with_eos: bool | int,
    tools: list[dict] | None = None,
) -> str:
    """What the template renders after an assistant turn's content for the next `messages`
    (e.g. `tool` results, in order) up to the next assistant turn's generation prompt.

    Rendered against the dummy conversation [user, assistant]: the template writes the messages
    in its own form. The assistant's content must appear right after the generation prompt
    (whitespace the template puts before it, as Mistral's " ", is allowed) and the rest must be
    appended, else the template cannot be used turn by turn and this raises.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("multi-turn rollouts need a tokenizer with a chat template; it has none")
    user = {"role": "user", "content": _DUMMY_USER}
    start = _render(tokenizer, [user], True, tools)
    full = _render(
        tokenizer,
        [user, {"role": "assistant", "content": _DUMMY_ASSISTANT}, *messages],
        True,
        tools,
    )
    at = full.find(_DUMMY_ASSISTANT, len(start))
    if not full.startswith(start) or at < 0 or full[len(start) : at].strip():
        raise ValueError(
            "the chat template is not append-only for these messages (roles "
            f"{[m.get('role') for m in messages]}): rendering them after an assistant turn "
            "changes what comes before it, so their tokens cannot be appended as a delta"
        )
    return _drop_sampled_eos(tokenizer, full[at + len(_DUMMY_ASSISTANT) :], ended_with_eos)


def messages_delta_ids(
    tokenizer: Any,
    messages: list[dict],
    ended_with_eos: bool | int,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of `messages_delta_text` (tokenised alone, no special tokens added)."""
    text = messages_delta_text(tokenizer, messages, ended_with_eos, tools)
    return tokenizer(text, add_special_tokens=False).input_ids


def first_messages(
    tokenizer: Any, system_prompt: str, observation: str, tools: list[dict] | None = None
) -> list[dict]:
    """The initial chat: a system message if the template renders one where it stays (the
    rendering of [system, user] is still the start after an assistant turn follows), else the
    system prompt prepended to the first observation (blank line between); no system message if
    it is empty. A template without a system role (probed: chat_probe.supports) gets the fold,
    announced once. Mistral's template moves the system message to the last user message (and
    drops it once a tool turn follows), so there it is folded into the first observation."""
    user = {"role": "user", "content": observation}
    if not system_prompt:
        return [user]
    folded = [{"role": "user", "content": f"{system_prompt}\n\n{observation}"}]
    if not supports(tokenizer, "system"):
        return folded
    messages = [{"role": "system", "content": system_prompt}, user]
    start = _render(tokenizer, messages, True, tools)
    after = _render(
        tokenizer, [*messages, {"role": "assistant", "content": _DUMMY_ASSISTANT}], False, tools
    )
    if system_prompt in start and system_prompt in after[: len(start)]:
        return messages
    return folded
