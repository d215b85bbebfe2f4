"""Agent tools: JSON schemas from typed Python functions, `ToolSet` (checked calls), tool prompts.

Builds on the text protocol of calls.py (`ParsedAction`, `ParseStats`, the Hermes / Qwen2.5
`<tool_call>` format of `format_tool_call`). The public names here, calls.py's and formats.py's are
importable from `grouprl.envs.tools`.
  - `tool_schema(fn)`: an OpenAI-style function schema from the annotations and the Google-style
    docstring (int/float/str/bool, list[X], dict, Optional[X], Literal[...]); anything it cannot
    describe to a model (*args, missing annotations, a docstring naming unknown arguments) raises.
  - `ToolSet(functions)`: runs parsed tool calls after checking names and argument types against
    the schemas; every outcome is counted in `stats` and every failure becomes an "Error: ..." text
    the model sees as the tool response (the run goes on).
  - `tools_system_prompt(toolset, tokenizer)`: "" when the chat template renders `tools=` itself
    (probed by rendering, rollouts/chat_probe.py), else a plain-text tool listing plus the call
    format.
  - `load_tools(specs)`: the functions named "module:function" or "path/file.py:function" (config
    `agent.tools`), resolved from the working directory too.
  - `valid_utf8(text)`: text that every tokenizer can encode (lone surrogates become "?").
Tool-call formats (Hermes, Llama 3 JSON, Mistral) and the `tool` messages of results are
formats.py.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from grouprl.envs.tools.calls import ParsedAction, ParseStats
from grouprl.runtime.user_inputs import import_user_module, split_user_spec

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
                res = ToolResult(True, valid_utf8(text))
            except KeyboardInterrupt:  # a real Ctrl-C of the trainer still stops the run
                raise
            except BaseException as e:  # SystemExit too: that call's error, the run goes on
                msg = valid_utf8(f"Error: {parsed.name} raised {type(e).__name__}: {e}")
                res = ToolResult(False, msg, "tool_error")
        self.stats.record_outcome(res.ok, res.reason)
        return res

    def run_calls(self, calls: list[ParsedAction]) -> list[ToolResult]:
        """Run every call of one turn, in order (none is dropped; failures are results too)."""
        return [self.invoke(c) for c in calls]

    def call(self, parsed: ParsedAction) -> str:
        """The tool response text for one parsed call (an "Error: ..." text on failure)."""
        return self.invoke(parsed).text


def valid_utf8(text: str) -> str:
    """`text` as valid UTF-8: lone surrogates (which tokenizers cannot encode) become "?"."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


def load_tools(specs: list[str]) -> list[Callable[..., Any]]:
    """The functions named by "package.module:function" or "path/to/file.py:function" specs."""
    fns = []
    for spec in specs:
        module_part, attr = split_user_spec(spec, "tool")
        fn = getattr(import_user_module(module_part, f"tool {spec!r}"), attr, None)
        if not callable(fn):
            raise AttributeError(f"tool {spec!r}: {module_part!r} has no function {attr!r}")
        fns.append(fn)
    return fns


def template_supports_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders tools passed as `tools=`, learned by
    rendering a probe schema (rollouts/chat_probe.py), not by reading the template's text; when
    it does not, the plain-text listing fallback is announced once (or refused under
    model.chat_fallback: error). No tokenizer: False."""
    if tokenizer is None:
        return False
    from grouprl.rollouts.chat_probe import supports

    return supports(tokenizer, "tools")


def tools_system_prompt(toolset: ToolSet, tokenizer: Any = None, fmt: str = "hermes") -> str:
    """Tool instructions for the system prompt.

    "" when the tokenizer's chat template handles tools itself (the rollout then passes
    `tools=toolset.schemas()` to `apply_chat_template`); otherwise a plain-text description of the
    tools and of the call format `fmt` (tool_formats.TOOL_FORMATS) that the rollout parses.
    """
    return tools_listing(toolset.schemas(), tokenizer, fmt)


def tools_listing(schemas: list[dict], tokenizer: Any = None, fmt: str = "hermes") -> str:
    """`tools_system_prompt` for OpenAI-style schemas ({type: function, function: {...}})."""
    from grouprl.envs.tools.formats import render_tool_call

    if template_supports_tools(tokenizer):
        return ""
    listing = "\n".join(json.dumps(s["function"]) for s in schemas)
    example = render_tool_call("<tool name>", {"<argument>": "<value>"}, fmt)
    return (
        "You can use the following tools (JSON schemas, one per line):\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To use tools, write one call per tool in this form and stop; the results come back "
        f"in the next message, in the order of the calls:\n{example}"
    )
