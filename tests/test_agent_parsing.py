"""grouprl.envs.tools: action / tool-call parsing, ParseStats, tool schemas, ToolSet, tool prompts."""

from __future__ import annotations

import json
from typing import Literal, Optional

import pytest

from grouprl.envs.tools import (
    ACTION_FORMATS,
    ParsedAction,
    ParseStats,
    ToolSet,
    format_tool_call,
    parse_action,
    template_supports_tools,
    tool_schema,
    tools_system_prompt,
)
from grouprl.policies.text.tiny import char_tokenizer

# ----------------------------------------------------------------------------- "action" format


def test_action_plain_and_surrounding_text():
    p = parse_action("<think>the hole is left</think>\n<action>  Right \n</action> thanks")
    assert p == ParsedAction(ok=True, name="Right", arguments={}, raw="Right")


def test_action_first_tag_wins():
    p = parse_action("<action>up</action> or maybe <action>down</action>")
    assert p.ok and p.raw == "up"


def test_action_case_insensitive_tags():
    assert parse_action("<ACTION>left</Action>").raw == "left"


def test_action_unclosed_runs_to_end_or_next_open_tag():
    assert parse_action("I go <action> down\n").raw == "down"  # stopped at the stop string
    assert parse_action("<action>a <action>b</action>").raw == "a"


def test_action_failures_have_reasons():
    no = parse_action("I will move left")
    assert (no.ok, no.reason, no.raw, no.name) == (False, "no_tag", None, None)
    assert "no <action>" in no.error
    empty = parse_action("<action>  </action>")
    assert (empty.ok, empty.reason, empty.raw) == (False, "empty", "")


def test_unknown_format_and_bad_input_fail_loudly():
    with pytest.raises(ValueError, match="allowed are action, tool_call"):
        parse_action("<action>x</action>", fmt="xml")
    with pytest.raises(TypeError, match="str"):
        parse_action(None)
    assert set(ACTION_FORMATS) == {"action", "tool_call"}


# ----------------------------------------------------------------------------- "tool_call" format


def test_tool_call_hermes():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    p = parse_action(text, "tool_call")
    assert (p.ok, p.name, p.arguments) == (True, "add", {"a": 1, "b": 2})
    assert p.raw == '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def test_tool_call_arguments_as_json_string_missing_or_null():
    p = parse_action(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1]}"}</tool_call>', "tool_call"
    )
    assert p.arguments == {"x": [1]}
    assert parse_action('<tool_call>{"name": "f"}</tool_call>', "tool_call").arguments == {}
    assert parse_action('<tool_call>{"name":"f","arguments":null}', "tool_call").arguments == {}


def test_tool_call_first_of_several_and_round_trip():
    text = format_tool_call("a", {"v": 1}) + format_tool_call("b", {"v": 2})
    p = parse_action(text, "tool_call")
    assert (p.name, p.arguments) == ("a", {"v": 1})


@pytest.mark.parametrize(
    "inside, reason",
    [
        ("{name: add}", "json_error"),
        ('{"name": "add", }', "json_error"),
        ("[1, 2]", "not_object"),
        ('{"arguments": {}}', "missing_name"),
        ('{"name": "  ", "arguments": {}}', "missing_name"),
        ('{"name": 3}', "missing_name"),
        ('{"name": "f", "arguments": [1]}', "bad_arguments"),
        ('{"name": "f", "arguments": "not json"}', "bad_arguments"),
        ("", "empty"),
    ],
)
def test_tool_call_failures(inside, reason):
    p = parse_action(f"<tool_call>{inside}</tool_call>", "tool_call")
    assert (p.ok, p.reason, p.name, p.arguments) == (False, reason, None, None)
    assert p.error and p.raw == inside.strip()


def test_tool_call_no_tag():
    assert parse_action('{"name": "add"}', "tool_call").reason == "no_tag"


# ----------------------------------------------------------------------------- ParseStats


def test_parse_stats_counts_and_metrics():
    stats = ParseStats()
    for text in ["<action>a</action>", "nothing", "<action></action>", "also nothing"]:
        stats.record(parse_action(text))
    assert stats.attempts == 4 and stats.num_failures == 3
    assert stats.metrics() == {
        "parse/attempts": 4.0,
        "parse/failures": 3.0,
        "parse/fail_rate": 0.75,  # 3 / 4
        "parse/fail/empty": 1.0,
        "parse/fail/no_tag": 2.0,
    }
    both = stats.merge(ParseStats(attempts=1))
    assert (both.attempts, both.num_failures) == (5, 3) and stats.attempts == 4
    assert ParseStats().metrics("x")["x/fail_rate"] == 0.0


# ----------------------------------------------------------------------------- tool schemas


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number,
            an integer.
        b (float): the second number

    Returns:
        the sum
    """
    return a + b


def test_tool_schema_hand_written():
    assert tool_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number, an integer."},
                    "b": {"type": "number", "description": "the second number"},
                },
                "required": ["a"],
            },
        },
    }


def many(
    q: str,
    flag: bool = False,
    ids: list[int] | None = None,
    opts: dict | None = None,
    mode: Literal["fast", "slow"] = "fast",
    tag: Optional[str] = None,  # noqa: UP045 (both spellings of Optional must work)
) -> str:
    """Search.

    Longer text.

    Args:
        q: query
        flag: a flag
        ids: ids
        opts: options
        mode: how
        tag: a tag
    """
    return q


def test_tool_schema_matches_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    theirs = get_json_schema(many)
    theirs["function"].pop("return")  # transformers also describes the return type; we do not
    assert tool_schema(many) == theirs
    props = tool_schema(many)["function"]["parameters"]["properties"]
    assert props["ids"] == {
        "type": "array",
        "items": {"type": "integer"},
        "nullable": True,
        "description": "ids",
    }
    assert props["mode"]["enum"] == ["fast", "slow"]


def test_tool_schema_errors():
    def untyped(x):
        """Doc."""

    def star(*xs: int):
        """Doc."""

    def stale(x: int):
        """Doc.

        Args:
            y: not a parameter
        """

    def weird(x: set):
        """Doc."""

    with pytest.raises(TypeError, match="needs a type annotation"):
        tool_schema(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        tool_schema(star)
    with pytest.raises(ValueError, match="unknown arguments"):
        tool_schema(stale)
    with pytest.raises(TypeError, match="unsupported type"):
        tool_schema(weird)


# ----------------------------------------------------------------------------- ToolSet


def boom(x: int) -> str:
    """Always fails."""
    raise RuntimeError("kaput")


def listing(xs: list[int], label: str | None = None) -> dict:
    """Summarise."""
    return {"n": len(xs), "label": label}


def test_toolset_calls_and_counts_failures():
    tools = ToolSet([add, boom, listing])
    assert [s["function"]["name"] for s in tools.schemas()] == ["add", "boom", "listing"]

    def call(name, args):
        return tools.call(parse_action(format_tool_call(name, args), "tool_call"))

    assert call("add", {"a": 2, "b": 0.5}) == "2.5"
    assert call("listing", {"xs": [1, 2]}) == '{"n": 2, "label": null}'
    assert call("nope", {}) == "Error: unknown tool 'nope'; tools: add, boom, listing"
    assert "missing arguments ['a']" in call("add", {"b": 1})
    assert "unexpected arguments ['c']" in call("add", {"a": 1, "c": 1})
    assert "a must be of type integer, got 1.5" in call("add", {"a": 1.5})
    assert "a must be of type integer, got true" in call("add", {"a": True})
    assert "xs[1] must be of type integer" in call("listing", {"xs": [1, "2"]})
    assert "b must not be null" in call("add", {"a": 1, "b": None})
    assert call("boom", {"x": 1}) == "Error: boom raised RuntimeError: kaput"
    assert tools.call(parse_action("no call", "tool_call")).startswith("Error: no <tool_call>")
    assert tools.stats.attempts == 11
    assert dict(tools.stats.failures) == {
        "unknown_tool": 1,
        "bad_arguments": 6,  # missing, unexpected, 1.5, True, "2" in a list, null
        "tool_error": 1,
        "no_tag": 1,
    }
    res = tools.invoke(parse_action(format_tool_call("add", {"a": 1}), "tool_call"))
    assert (res.ok, res.text, res.reason) == (True, "2.0", None)


def test_toolset_rejects_duplicate_names():
    with pytest.raises(ValueError, match="unique"):
        ToolSet([add, add])


# ----------------------------------------------------------------------------- prompts


TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tools_system_prompt_plain_text_without_tool_template():
    tools = ToolSet([add])
    tok = char_tokenizer()  # its template knows nothing of tools
    assert not template_supports_tools(tok) and not template_supports_tools(None)
    text = tools_system_prompt(tools, tok)
    assert text == tools_system_prompt(tools)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == tool_schema(add)["function"]
    example = text.split("\n", 3)[-1]
    assert "<tool_call>" in example and parse_action(text, "tool_call").name == "<tool name>"


def test_tools_system_prompt_empty_when_template_takes_tools():
    tok = char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    tools = ToolSet([add, listing])
    assert template_supports_tools(tok) and tools_system_prompt(tools, tok) == ""
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools.schemas(), tokenize=False
    )
    assert text == "<|tools|>add;listing;<|user|>hi\n"  # transformers trims the block's newline
    tok.chat_template = {"default": "x", "tool_use": TOOLS_TEMPLATE}
    assert template_supports_tools(tok)


def test_tools_package_exports_every_public_name_of_its_modules():
    """grouprl.envs.tools is the one import path: a public name added to calls, formats or schemas
    and not exported from the package fails here (no module forwards names to another)."""
    import inspect

    from grouprl.envs import tools
    from grouprl.envs.tools import calls, formats, schemas

    for mod in (calls, formats, schemas):
        public = {
            name
            for name, value in vars(mod).items()
            if not name.startswith("_")
            and not inspect.ismodule(value)
            and getattr(value, "__module__", mod.__name__) == mod.__name__
        }
        assert public, mod.__name__
        assert public <= set(tools.__all__), (mod.__name__, sorted(public - set(tools.__all__)))
        assert not hasattr(mod, "__getattr__"), mod.__name__
    missing = [name for name in tools.__all__ if not hasattr(tools, name)]
    assert missing == []
