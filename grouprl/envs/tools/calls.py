"""The agent's text protocol: parse actions and tool calls out of assistant text.

Describing and running tools (schemas, ToolSet, tool prompts) is schemas.py; the tool-call
formats of the model families (Hermes, Llama 3 JSON, Mistral) are formats.py.

Two action formats (option strings, one parser each in `ACTION_FORMATS`):
  "action"     `<action>move left</action>`; raw = the text inside the tag, stripped. For this
               format `name` is raw as well and `arguments` is {} (text envs map raw to a move).
               verl-agent and RAGEN ask for actions in a tag like this (peers/agents.md).
  "tool_call"  Hermes / Qwen2.5 style `<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>`;
               raw = the JSON text inside the tag. `arguments` may also be a JSON *string* holding an
               object (OpenAI style); a missing `arguments` means {}.

Parsing rules (the same for both formats; every failure has a short machine `reason` and a human
`error` message, and callers count them with `ParseStats` instead of ignoring them):
  - text outside the tags is ignored (thinking, chatter); tags match case-insensitively;
  - several tags: the FIRST one is used, the rest are ignored (one action per turn);
  - an opening tag without a closing tag is accepted and runs to the end of the text, because
    generation is often stopped at the closing tag (vLLM drops the stop string by default);
  - empty content, invalid JSON, JSON that is not an object, a missing / non-string / empty name, or
    arguments that are not an object are failures (ok=False).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

ActionFormat = Literal["action", "tool_call"]


@dataclass(frozen=True)
class ParsedAction:
    """The result of parsing one assistant turn.

    ok:        True when an action / tool call was found and is well formed
    name:      tool name ("tool_call") or the action text itself ("action"); None on failure
    arguments: tool arguments ("tool_call"), {} for "action"; None on failure
    raw:       the text inside the first tag, stripped (None when no tag was found)
    error:     a human-readable reason for the failure (None when ok)
    reason:    a short machine key for the failure, used by `ParseStats` (None when ok):
               no_tag, empty, json_error, not_object, missing_name, bad_arguments
    call_id:   the id the model gave the call (Mistral's [TOOL_CALLS] carry one), else None
    """

    ok: bool
    name: str | None = None
    arguments: dict | None = None
    raw: str | None = None
    error: str | None = None
    reason: str | None = None
    call_id: str | None = None


def _brief(exc: Exception) -> str:
    return str(exc)[:200] if not isinstance(exc, RecursionError) else "nested too deeply"


def _fail(reason: str, error: str, raw: str | None = None) -> ParsedAction:
    return ParsedAction(ok=False, raw=raw, error=error, reason=reason)


def json_error_call(raw: str, exc: Exception) -> ParsedAction:
    """The failed call of a tool call whose text `raw` is not valid JSON (reason "json_error");
    shared by every call format (formats.py)."""
    return _fail("json_error", f"the tool call is not valid JSON: {_brief(exc)}", raw)


def _first_tag(text: str, tag: str) -> str | None:
    """Content of the first <tag>...</tag>; an unclosed <tag> runs to the next <tag> or the end."""
    m = re.search(rf"<{tag}>(.*?)(?=</{tag}>|<{tag}>|\Z)", text, flags=re.DOTALL | re.IGNORECASE)
    return None if m is None else m.group(1).strip()


def _parse_action_tag(text: str) -> ParsedAction:
    raw = _first_tag(text, "action")
    if raw is None:
        return _fail("no_tag", "no <action>...</action> tag in the reply")
    if not raw:
        return _fail("empty", "the <action> tag is empty", raw)
    return ParsedAction(ok=True, name=raw, arguments={}, raw=raw)


def _parse_tool_call(text: str) -> ParsedAction:
    raw = _first_tag(text, "tool_call")
    if raw is None:
        return _fail("no_tag", "no <tool_call>...</tool_call> tag in the reply")
    if not raw:
        return _fail("empty", "the <tool_call> tag is empty", raw)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also: ints over 4300 digits, absurd nesting
        return json_error_call(raw, e)
    return check_call_object(obj, raw)


def check_call_object(obj: Any, raw: str, call_id: str | None = None) -> ParsedAction:
    """One decoded JSON tool call {"name": ..., "arguments": ...} checked (the rules of the
    module docstring); shared by every call format (formats.py)."""
    if not isinstance(obj, dict):
        return _fail(
            "not_object", f"the tool call must be a JSON object, got {type(obj).__name__}", raw
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _fail("missing_name", 'the tool call has no "name" string', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments serialised as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return _fail(
                "bad_arguments", f'"arguments" is a string but not valid JSON: {_brief(e)}', raw
            )
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _fail(
            "bad_arguments", f'"arguments" must be an object, got {type(args).__name__}', raw
        )
    return ParsedAction(ok=True, name=name.strip(), arguments=args, raw=raw, call_id=call_id)


ACTION_FORMATS: dict[str, Callable[[str], ParsedAction]] = {
    "action": _parse_action_tag,
    "tool_call": _parse_tool_call,
}


def parse_action(text: str, fmt: ActionFormat = "action") -> ParsedAction:
    """Parse the first action (fmt="action") or tool call (fmt="tool_call") out of assistant text."""
    if fmt not in ACTION_FORMATS:
        raise ValueError(f"unknown action format {fmt!r}: allowed are {', '.join(ACTION_FORMATS)}")
    if not isinstance(text, str):
        raise TypeError(
            f"parse_action expects the assistant text as str, got {type(text).__name__}"
        )
    return ACTION_FORMATS[fmt](text)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The Hermes text of one tool call (what a model is taught to write); `parse_action` inverts it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@dataclass
class ParseStats:
    """Counts parse (or tool call) attempts and failures by reason, for logging; never reset silently."""

    attempts: int = 0
    failures: Counter = field(default_factory=Counter)

    def record(self, parsed: ParsedAction) -> ParsedAction:
        """Count one parse result (returned unchanged, so `stats.record(parse_action(t))` reads well)."""
        self.record_outcome(parsed.ok, parsed.reason)
        return parsed

    def record_outcome(self, ok: bool, reason: str | None = None) -> None:
        self.attempts += 1
        if not ok:
            self.failures[reason or "unknown"] += 1

    @property
    def num_failures(self) -> int:
        return sum(self.failures.values())

    def merge(self, other: ParseStats) -> ParseStats:
        """A new ParseStats with both counts added (e.g. over envs or workers)."""
        return ParseStats(self.attempts + other.attempts, self.failures + other.failures)

    def metrics(self, prefix: str = "parse") -> dict[str, float]:
        """Flat float metrics: attempts, failures, fail_rate and one count per failure reason."""
        out = {
            f"{prefix}/attempts": float(self.attempts),
            f"{prefix}/failures": float(self.num_failures),
            f"{prefix}/fail_rate": self.num_failures / self.attempts if self.attempts else 0.0,
        }
        out.update({f"{prefix}/fail/{k}": float(v) for k, v in sorted(self.failures.items())})
        return out
