"""The agent's text protocol: parse actions and tool calls out of assistant text, describe and run tools.

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

import inspect
import json
import re
import types
import typing
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
    """

    ok: bool
    name: str | None = None
    arguments: dict | None = None
    raw: str | None = None
    error: str | None = None
    reason: str | None = None


def _fail(reason: str, error: str, raw: str | None = None) -> ParsedAction:
    return ParsedAction(ok=False, raw=raw, error=error, reason=reason)


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
    except json.JSONDecodeError as e:
        return _fail("json_error", f"the tool call is not valid JSON: {e}", raw)
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
        except json.JSONDecodeError as e:
            return _fail("bad_arguments", f'"arguments" is a string but not valid JSON: {e}', raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _fail(
            "bad_arguments", f'"arguments" must be an object, got {type(args).__name__}', raw
        )
    return ParsedAction(ok=True, name=name.strip(), arguments=args, raw=raw)


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


# ----------------------------------------------------------------------------- tools

_SIMPLE_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _type_schema(tp: Any, where: str) -> dict:
    """JSON schema of one annotation: int/float/str/bool, list[X], dict, Optional[X], Literal[...]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[tp]}
    if tp is list or origin is list:
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if tp is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {_SIMPLE_TYPES.get(type(a)) for a in args}
        if len(kinds) != 1 or None in kinds:
            raise TypeError(f"{where}: Literal values must all be of one of int/float/str/bool")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: only Optional[X] unions are supported, got {tp}")
        return {**_type_schema(rest[0], where), "nullable": True}
    raise TypeError(
        f"{where}: unsupported type {tp!r} (use int, float, str, bool, list, dict, Optional, Literal)"
    )


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (description before the sections, {arg name: description})."""
    lines = inspect.cleandoc(doc or "").splitlines()
    starts = [i for i, line in enumerate(lines) if _SECTION.match(line)]
    desc = "\n".join(lines[: starts[0] if starts else len(lines)]).strip()
    args: dict[str, str] = {}
    for s, start in enumerate(starts):
        if _SECTION.match(lines[start]).group(1) not in ("Args", "Arguments", "Parameters"):
            continue
        body = lines[start + 1 : starts[s + 1] if s + 1 < len(starts) else len(lines)]
        indents = [len(ln) - len(ln.lstrip()) for ln in body if ln.strip()]
        base, name = min(indents, default=0), None
        for ln in body:
            m = _ARG_LINE.match(ln.strip())
            if m and len(ln) - len(ln.lstrip()) == base:
                name = m.group(1).lstrip("*")
                args[name] = m.group(2).strip()
            elif name is not None and ln.strip():  # a continuation line of the previous argument
                args[name] = f"{args[name]} {ln.strip()}".strip()
    return desc, args


def tool_schema(fn: Callable[..., Any]) -> dict:
    """OpenAI-style function schema from a typed function and its Google-style docstring.

    Parameters with a default are not required. Every parameter needs a type annotation; *args /
    **kwargs are not allowed; an `Args:` entry naming no parameter is an error (a stale docstring).
    Parameters without an `Args:` entry get no description.
    """
    name = fn.__name__
    sig, hints = inspect.signature(fn), typing.get_type_hints(fn)
    desc, arg_docs = _parse_docstring(fn.__doc__)
    stale = set(arg_docs) - set(sig.parameters)
    if stale:
        raise ValueError(f"tool {name!r}: docstring documents unknown arguments {sorted(stale)}")
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args / **kwargs cannot be described to a model")
        if p.name not in hints:
            raise TypeError(f"tool {name!r}: parameter {p.name!r} needs a type annotation")
        props[p.name] = _type_schema(hints[p.name], f"tool {name!r}, parameter {p.name!r}")
        if p.name in arg_docs:
            props[p.name]["description"] = arg_docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
    params = {"type": "object", "properties": props, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": params},
    }


def _check_value(value: Any, schema: dict, where: str) -> str | None:
    """None when `value` fits the schema, else a message saying why not."""
    if value is None:
        return None if schema.get("nullable") else f"{where} must not be null"
    kind = schema["type"]
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    if not checks[kind](value):
        return f"{where} must be of type {kind}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {json.dumps(value)}"
    if kind == "array" and "items" in schema:
        for i, v in enumerate(value):
            if (err := _check_value(v, schema["items"], f"{where}[{i}]")) is not None:
                return err
    return None


@dataclass(frozen=True)
class ToolResult:
    """What running one parsed tool call gave: ok, the text shown to the model, failure reason."""

    ok: bool
    text: str
    reason: str | None = None


class ToolSet:
    """Typed Python functions exposed as tools; runs parsed tool calls and counts failures in `stats`.

    Failure reasons in `stats`: the parse reason when the call did not parse (json_error, ...),
    unknown_tool, bad_arguments (missing / unexpected / wrongly typed), tool_error (the function raised).
    Every failure returns a text starting with "Error:" that the model sees as the tool response.
    """

    def __init__(self, functions: list[Callable[..., Any]]) -> None:
        self.functions = {fn.__name__: fn for fn in functions}
        if len(self.functions) != len(functions):
            raise ValueError(f"tool names must be unique, got {[fn.__name__ for fn in functions]}")
        self._schemas = {name: tool_schema(fn) for name, fn in self.functions.items()}
        self.stats = ParseStats()

    def schemas(self) -> list[dict]:
        return list(self._schemas.values())

    def _validate(self, name: str, arguments: dict) -> str | None:
        params = self._schemas[name]["function"]["parameters"]
        missing = [p for p in params["required"] if p not in arguments]
        unknown = [a for a in arguments if a not in params["properties"]]
        if missing or unknown:
            return f"missing arguments {missing}, unexpected arguments {unknown}"
        for key, value in arguments.items():
            if (err := _check_value(value, params["properties"][key], key)) is not None:
                return err
        return None

    def invoke(self, parsed: ParsedAction) -> ToolResult:
        """Run one parsed call; every outcome (ok or not) is counted in `stats`."""
        if not parsed.ok:
            res = ToolResult(False, f"Error: {parsed.error}", parsed.reason or "parse_error")
        elif parsed.name not in self.functions:
            known = ", ".join(self.functions)
            res = ToolResult(
                False, f"Error: unknown tool {parsed.name!r}; tools: {known}", "unknown_tool"
            )
        elif (err := self._validate(parsed.name, parsed.arguments or {})) is not None:
            res = ToolResult(
                False, f"Error: bad arguments for {parsed.name!r}: {err}", "bad_arguments"
            )
        else:
            try:
                out = self.functions[parsed.name](**(parsed.arguments or {}))
                text = out if isinstance(out, str) else json.dumps(out, default=str)
                res = ToolResult(True, text)
            except Exception as e:  # the model sees the failure; the run goes on
                res = ToolResult(
                    False, f"Error: {parsed.name} raised {type(e).__name__}: {e}", "tool_error"
                )
        self.stats.record_outcome(res.ok, res.reason)
        return res

    def call(self, parsed: ParsedAction) -> str:
        """The tool response text for one parsed call (an "Error: ..." text on failure)."""
        return self.invoke(parsed).text


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders a `tools=` argument (mentions `tools`)."""
    tmpl = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(
        tmpl, dict
    ):  # named templates: transformers picks "tool_use" when tools are given
        tmpl = tmpl.get("tool_use") or tmpl.get("default")
    return isinstance(tmpl, str) and re.search(r"\btools\b", tmpl) is not None


def tools_system_prompt(toolset: ToolSet, tokenizer: Any = None) -> str:
    """Tool instructions for the system prompt.

    "" when the tokenizer's chat template handles tools itself (the rollout then passes
    `tools=toolset.schemas()` to `apply_chat_template`); otherwise a plain-text description of the
    tools and of the <tool_call> format that `parse_action(..., fmt="tool_call")` reads.
    """
    if template_supports_tools(tokenizer):
        return ""
    listing = "\n".join(json.dumps(s["function"]) for s in toolset.schemas())
    example = format_tool_call("<tool name>", {"<argument>": "<value>"})
    return (
        "You can use the following tools (JSON schemas, one per line):\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To use a tool, write exactly one call in this form and stop; its result comes back "
        f"in the next message:\n{example}"
    )
