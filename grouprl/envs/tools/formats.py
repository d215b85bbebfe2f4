"""Tool-call formats: how each model family writes tool calls, parsed back into calls, and the
`tool` messages that carry the results back through the family's chat template.

Three formats (option strings, `agent.tool_format`; "auto" reads the chat template):
  "hermes"       Qwen2.5 / Qwen3 / Hermes: one `<tool_call>{"name": ..., "arguments": {...}}
                 </tool_call>` block per call, several blocks per turn; text around them is free.
  "llama3_json"  Llama 3.1 / 3.2 Instruct: the whole reply is the JSON object
                 {"name": ..., "parameters": {...}} (optionally after <|python_tag|>); several
                 calls are separated by ";" as vLLM's llama3_json parser accepts. A reply that
                 does not start with "{" is not a call (it is the answer).
  "mistral"      Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "<9 chars>"},
                 ...]`. [TOOL_CALLS] is a special token: parse text decoded WITH special tokens.

`parse_tool_calls(text, fmt)` returns every call of the turn in order (ParsedAction each, failed
ones with a reason), or [] when the turn holds no call. `tool_messages` builds the `{"role":
"tool", ...}` messages of the results in call order, with the fields the family's template reads
(Mistral: `tool_call_id`, 9 alphanumeric characters; the others: `name`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from grouprl.envs.tools.calls import (
    ParsedAction,
    check_call_object,
    format_tool_call,
    json_error_call,
    parse_action,
)

ToolFormat = Literal["hermes", "llama3_json", "mistral"]

_HERMES_BLOCK = re.compile(
    r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL | re.IGNORECASE
)


def _parse_hermes(text: str) -> list[ParsedAction]:
    """Every <tool_call> block in order; an unclosed last block runs to the end of the text."""
    return [
        parse_action(f"<tool_call>{m.group(1)}</tool_call>", "tool_call")
        for m in _HERMES_BLOCK.finditer(text)
    ]


def _call_from_object(obj: Any, raw: str, args_key: str) -> ParsedAction:
    """One call from a decoded JSON object with "name" and `args_key` (or "arguments")."""
    if isinstance(obj, dict) and args_key in obj and "arguments" not in obj:
        obj = {**obj, "arguments": obj[args_key]}
    cid = obj.get("id") if isinstance(obj, dict) else None
    return check_call_object(obj, raw, cid if isinstance(cid, str) else None)


def _parse_llama3_json(text: str) -> list[ParsedAction]:
    """The reply as one or more JSON objects separated by ";" (after an optional <|python_tag|>)."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        return []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            calls.append(json_error_call(body[pos:], e))
            break
        calls.append(_call_from_object(obj, body[pos:end], "parameters"))
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            calls.append(
                ParsedAction(
                    ok=False,
                    raw=rest,
                    reason="json_error",
                    error='text after a JSON tool call must be ";" and another call',
                )  # fmt: skip
            )
            break
        pos = len(body) - len(rest[1:].lstrip())
    return calls


def _parse_mistral(text: str) -> list[ParsedAction]:
    """The JSON array after [TOOL_CALLS] (each element one call, with its "id")."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return []
    body = text[start + len("[TOOL_CALLS]") :].strip()
    try:
        arr, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError) as e:
        return [json_error_call(body, e)]
    if not isinstance(arr, list):
        arr = [arr]  # a single object: accepted as one call
    if not arr:
        return [ParsedAction(ok=False, raw=body, reason="empty", error="[TOOL_CALLS] is empty")]
    return [_call_from_object(obj, json.dumps(obj), "arguments") for obj in arr]


TOOL_FORMATS: dict[str, Callable[[str], list[ParsedAction]]] = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3_json,
    "mistral": _parse_mistral,
}


def parse_tool_calls(text: str, fmt: str) -> list[ParsedAction]:
    """Every tool call in one assistant turn, in order ([] when the turn holds none)."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {fmt!r}: allowed are {', '.join(TOOL_FORMATS)}")
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls expects str, got {type(text).__name__}")
    return TOOL_FORMATS[fmt](text)


def text_outside_calls(text: str, fmt: str) -> str:
    """The content of an assistant message whose calls go into its `tool_calls` field: the text
    outside the call blocks (hermes), before [TOOL_CALLS] (mistral), nothing (llama3_json)."""
    if fmt == "hermes":
        return _HERMES_BLOCK.sub("", text).strip()
    if fmt == "mistral":
        start = text.find("[TOOL_CALLS]")
        return (text if start < 0 else text[:start]).strip()
    if fmt == "llama3_json":
        return ""
    raise ValueError(f"unknown tool format {fmt!r}: allowed are {', '.join(TOOL_FORMATS)}")


def detect_tool_format(tokenizer: Any) -> ToolFormat:
    """The call format a chat template writes an assistant's tool call in, read off the render of
    a probe call (rollouts/chat_probe.py), not off the template's text: [TOOL_CALLS] -> mistral,
    <tool_call> -> hermes, {"name": ..., "parameters": ...} -> llama3_json; no template, or one
    that does not render calls: hermes, the format of the plain-text tool listing
    (tools.tools_system_prompt)."""
    if tokenizer is None:
        return "hermes"
    from grouprl.rollouts.chat_probe import PROBE_TOOL, probe_chat

    text = probe_chat(tokenizer).call_text
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if f'"name": "{PROBE_TOOL}", "parameters": ' in text:
        return "llama3_json"
    return "hermes"


def resolve_tool_format(fmt: str, tokenizer: Any) -> ToolFormat:
    """`fmt` itself, or the template's format for "auto"."""
    if fmt == "auto":
        return detect_tool_format(tokenizer)
    if fmt not in TOOL_FORMATS:
        allowed = ", ".join(["auto", *TOOL_FORMATS])
        raise ValueError(f"unknown tool format {fmt!r}: allowed are {allowed}")
    return fmt  # type: ignore[return-value]


def render_tool_call(name: str, arguments: dict[str, Any], fmt: str, cid: str = "c00000000") -> str:
    """The text a model of format `fmt` writes for one call (`parse_tool_calls` inverts it)."""
    if fmt == "hermes":
        return format_tool_call(name, arguments)
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    if fmt == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": arguments, "id": cid}])
    raise ValueError(f"unknown tool format {fmt!r}: allowed are {', '.join(TOOL_FORMATS)}")


def call_id(turn: int, index: int) -> str:
    """A 9-character alphanumeric call id (Mistral's templates require exactly that), unique per
    episode: turn and position of the call in its turn."""
    return f"c{turn:05d}{index:03d}"[:9]


def _id_for(c: ParsedAction, turn: int, index: int, fmt: str) -> str:
    """The model's own id where the format carries one and it is valid (Mistral: 9 alphanumeric
    characters), else a generated one; the call and its result share it."""
    if fmt == "mistral" and isinstance(c.call_id, str) and len(c.call_id) == 9:
        if c.call_id.isalnum():
            return c.call_id
    return call_id(turn, index)


def assistant_tool_calls(calls: list[ParsedAction], turn: int, fmt: str) -> list[dict]:
    """The OpenAI-style `tool_calls` field of an assistant message for parsed calls."""
    return [
        {
            "id": _id_for(c, turn, i, fmt),
            "type": "function",
            "function": {"name": c.name or "", "arguments": c.arguments or {}},
        }
        for i, c in enumerate(calls)
    ]


def tool_messages(
    calls: list[ParsedAction], texts: list[str], turn: int, fmt: str
) -> list[dict[str, str]]:
    """One `tool` message per call, in call order: content = the result text; `name` = the tool
    called; `tool_call_id` = the call's id (the model's own for Mistral, else a generated one)."""
    if len(calls) != len(texts):
        raise ValueError(f"{len(calls)} calls but {len(texts)} results")
    out = []
    for i, (c, text) in enumerate(zip(calls, texts)):
        msg = {"role": "tool", "content": text, "name": c.name or "unknown"}
        msg["tool_call_id"] = _id_for(c, turn, i, fmt)
        out.append(msg)
    return out
