"""What a chat template supports, learned by rendering it, and the stated fallbacks.

A chat template is a program; whether it takes a system message, a `tools=` argument, `tool`
messages or an assistant's `tool_calls` is read off its output, never off its text or the model's
name. `probe_chat` renders small conversations with sentinel strings (cached per tokenizer and
template) and records, for each capability, whether the render succeeds and the sentinel appears:

  system      [system S, user U] renders and contains S (Gemma's template raises instead)
  tools       [user U] with tools=[a schema named T] renders and contains T (Phi-3's, Gemma's
              templates ignore `tools` without a word)
  tool_role   [user, assistant calling T, tool R] renders and contains R (Gemma's raises on the
              role order; Phi-3's drops the message without a word)
  tool_calls  the same render contains T (the assistant's `tool_calls` are written out); the
              render itself (`call_text`) shows the call format the template teaches
              (envs/tools/formats.py detect_tool_format)

Where a capability is missing, every site that renders a chat applies one stated fallback,
announced once per tokenizer and capability (a ChatTemplateFallbackWarning naming the tokenizer's
name_or_path), or, when the run set `model.chat_fallback: error`, raises naming that option:

  system      the system text is folded into the first user message (a blank line between)
  tools       the tools are listed in plain text in the system prompt (envs/tools/schemas.py)
  tool_role   tool results are sent as one user message per run of consecutive results
  tool_calls  an assistant message's calls are written into its content in the call format

The mode is per tokenizer (`set_chat_fallback` stores it on the tokenizer object, so copies of it,
as async rollouts make, keep it), set by the workload or reward that loads it, so code that only
holds the tokenizer (chat deltas, tool prompts, the gateway) applies the same rule. Announcements
are once per process for each template source and capability.
"""

from __future__ import annotations

import json
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Literal

ChatFallback = Literal["announce", "error"]
CHAT_FALLBACKS: tuple[str, ...] = ("announce", "error")
OPTION = "model.chat_fallback"  # the option the error messages name

# plain words: templates pass contents through `trim` and `tojson`, which must leave them intact
_SYSTEM, _USER = "ProbeSystem4c1e", "ProbeUser9d2b"
_TOOL, _RESULT = "probe_tool_7f3a", "ProbeResult5a80"
PROBE_TOOL = _TOOL  # the probe call's function name (its arguments are {})
_CALL_ID = "c00000000"  # 9 alphanumeric characters: Mistral's templates require that shape
_SCHEMA = {
    "type": "function",
    "function": {
        "name": _TOOL,
        "description": "a probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}

FALLBACKS = {
    "system": "the system text is folded into the first user message",
    "tools": "the tools are listed in plain text in the system prompt",
    "tool_role": "tool results are sent as a user message",
    "tool_calls": "an assistant's tool calls are written into its message text",
}
_WHAT = {
    "system": "has no system role",
    "tools": "does not render tools passed as tools=",
    "tool_role": "has no tool role (tool results)",
    "tool_calls": "does not render an assistant's tool_calls",
}


class ChatTemplateFallbackWarning(UserWarning):
    """A chat template lacks a capability and grouprl applies its stated fallback."""


@dataclass(frozen=True)
class ChatSupport:
    """What the template renders (see the module docstring)."""

    source: str
    system: bool
    tools: bool
    tool_role: bool
    tool_calls: bool
    call_text: str = ""  # the render of [user, assistant calling the probe tool, tool result]


# tokenizer -> (template, ChatSupport); (source, template, capability) already announced
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ANNOUNCED: set[tuple[str, str | None, str]] = set()
_MODE_ATTR = "grouprl_chat_fallback"  # the mode, on the tokenizer object


def template_of(tokenizer: Any) -> str | None:
    """The template `apply_chat_template` uses with tools (named templates: "tool_use", else
    "default"), or None."""
    tmpl = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(tmpl, dict):
        tmpl = tmpl.get("tool_use") or tmpl.get("default")
    return tmpl if isinstance(tmpl, str) and tmpl else None


def source_of(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _renders(tokenizer: Any, messages: list[dict], *needles: str, **kwargs: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # a template refuses what it does not support (jinja raise_exception)
        return False
    return isinstance(text, str) and all(n in text for n in needles)


def _as_text(text: str) -> Any:
    return text


def _as_parts(text: str) -> Any:
    return [{"type": "text", "text": text}] if text else []


def _content_shape(tokenizer: Any) -> Any:
    """How the template takes a message's content: a string, or a list of typed parts (LLaVA's
    template renders only parts); the first shape whose [user U] render contains U."""
    for shape in (_as_text, _as_parts):
        if _renders(tokenizer, [{"role": "user", "content": shape(_USER)}], _USER):
            return shape
    return None


def probe_chat(tokenizer: Any) -> ChatSupport:
    """Render the template with sentinels (cached per tokenizer; re-probed if the template
    changes). A tokenizer without a template supports nothing."""
    tmpl = template_of(tokenizer)
    cached = _PROBED.get(tokenizer)
    if cached is not None and cached[0] == tmpl:
        return cached[1]
    source = source_of(tokenizer)
    shape = _content_shape(tokenizer) if tmpl is not None else None
    if shape is None:  # no template, or one that renders no user text at all
        support = ChatSupport(source, False, False, False, False, "")
    else:
        user = {"role": "user", "content": shape(_USER)}
        call = {"id": _CALL_ID, "type": "function", "function": {"name": _TOOL, "arguments": {}}}
        calling = [
            user,
            {"role": "assistant", "content": shape(""), "tool_calls": [call]},
            {"role": "tool", "content": shape(_RESULT), "tool_call_id": _CALL_ID, "name": _TOOL},
        ]
        try:
            text = tokenizer.apply_chat_template(calling, tokenize=False)
        except Exception:
            text = ""
        support = ChatSupport(
            source=source,
            system=_renders(
                tokenizer,
                [{"role": "system", "content": shape(_SYSTEM)}, user],
                _SYSTEM,
                _USER,
                add_generation_prompt=True,
            ),
            tools=_renders(tokenizer, [user], _TOOL, add_generation_prompt=True, tools=[_SCHEMA]),
            tool_role=_RESULT in text,
            tool_calls=_TOOL in text,
            call_text=text,
        )
    try:
        _PROBED[tokenizer] = (tmpl, support)
    except TypeError:  # not weak-referenceable: probe again next time
        pass
    return support


def set_chat_fallback(tokenizer: Any, mode: ChatFallback, option: str = OPTION) -> None:
    """What this tokenizer's users do when its template lacks a capability: "announce" (the
    stated fallback, warned once) or "error" (raise naming `option`, the config key that set it:
    model.chat_fallback for the policy, a reward's own option for its tokenizer)."""
    if mode not in CHAT_FALLBACKS:
        raise ValueError(f"{option} must be one of {list(CHAT_FALLBACKS)}, got {mode!r}")
    setattr(tokenizer, _MODE_ATTR, (mode, option))


def chat_fallback(tokenizer: Any) -> tuple[str, str]:
    """(mode, the option that set it); ("announce", model.chat_fallback) unless set."""
    return getattr(tokenizer, _MODE_ATTR, None) or ("announce", OPTION)


def supports(tokenizer: Any, capability: str) -> bool:
    """True when the template renders `capability`; else announce its fallback once (or raise in
    "error" mode) and return False."""
    if getattr(probe_chat(tokenizer), capability):
        return True
    src = source_of(tokenizer)
    if template_of(tokenizer) is None:
        what = "has no chat template"
    else:
        what = _WHAT[capability]
    mode, option = chat_fallback(tokenizer)
    if mode == "error":
        raise ValueError(
            f"the chat template of {src!r} {what}; set {option}: announce to accept the "
            f"fallback ({FALLBACKS[capability]}), or use a model whose template supports it"
        )
    key = (src, template_of(tokenizer), capability)
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        warnings.warn(
            f"the chat template of {src!r} {what}: {FALLBACKS[capability]} "
            f"({option}: error refuses instead)",
            ChatTemplateFallbackWarning,
            stacklevel=3,
        )
    return False


def fold_system(messages: list[dict]) -> list[dict]:
    """[system S, user U, ...] -> [user "S\\n\\nU", ...] (a lone system message becomes a user
    message); messages without a leading system message are returned as they are."""
    if not messages or messages[0].get("role") != "system":
        return list(messages)
    system, rest = messages[0], list(messages[1:])
    text = _text(system.get("content"))
    if rest and rest[0].get("role") == "user":
        content = rest[0].get("content")
        if isinstance(content, list):  # multimodal parts: the text goes first
            rest[0] = {**rest[0], "content": [{"type": "text", "text": text + "\n\n"}, *content]}
        else:
            rest[0] = {**rest[0], "content": f"{text}\n\n{_text(content)}" if text else content}
        return rest
    return [{"role": "user", "content": text}, *rest]


def _text(content: Any) -> str:
    if isinstance(content, list):  # multimodal parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def tool_results_text(results: list[dict]) -> str:
    """The user message that carries tool results when the template has no tool role: each
    result in <tool_response></tool_response>, in order (the plain-text listing says so)."""
    return "\n".join(
        f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>" for m in results
    )


def calls_text(message: dict, fmt: str) -> str:
    """An assistant message's content with its `tool_calls` written out in call format `fmt`."""
    from grouprl.envs.tools.formats import render_tool_call

    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", {})
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append(render_tool_call(fn.get("name", ""), args, fmt, c.get("id") or _CALL_ID))
    return "\n".join(p for p in (_text(message.get("content")), *calls) if p)


def adapt_messages(tokenizer: Any, messages: list[dict], fmt: str = "hermes") -> list[dict]:
    """`messages` in the form this tokenizer's template renders, by the stated fallbacks: system
    folded into the first user message, tool results as user messages, assistant tool calls as
    text (fmt: the call format). Unchanged where the template supports everything used."""
    out = list(messages)
    if out and out[0].get("role") == "system" and not supports(tokenizer, "system"):
        out = fold_system(out)
    if any(m.get("role") == "tool" for m in out) and not supports(tokenizer, "tool_role"):
        merged: list[dict] = []
        for m in out:
            if m.get("role") != "tool":
                merged.append(m)
            elif merged and merged[-1].get("_tool_results"):
                merged[-1]["_tool_results"].append(m)
            else:
                merged.append({"_tool_results": [m]})
        out = [
            {"role": "user", "content": tool_results_text(m["_tool_results"])}
            if "_tool_results" in m
            else m
            for m in merged
        ]
    if any(m.get("tool_calls") for m in out) and not supports(tokenizer, "tool_calls"):
        out = [
            {k: v for k, v in m.items() if k != "tool_calls"} | {"content": calls_text(m, fmt)}
            if m.get("tool_calls")
            else m
            for m in out
        ]
    return out
