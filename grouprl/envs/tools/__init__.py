"""Agent tools: call parsing (calls), the tool-call formats of model families (formats) and typed
tool schemas, checked tool runs and tool prompts (schemas). Every public name of the three modules
is importable from here."""

from grouprl.envs.tools.calls import (
    ACTION_FORMATS,
    ActionFormat,
    ParsedAction,
    ParseStats,
    check_call_object,
    format_tool_call,
    json_error_call,
    parse_action,
)
from grouprl.envs.tools.formats import (
    TOOL_FORMATS,
    ToolFormat,
    assistant_tool_calls,
    call_id,
    detect_tool_format,
    parse_tool_calls,
    render_tool_call,
    resolve_tool_format,
    text_outside_calls,
    tool_messages,
)
from grouprl.envs.tools.schemas import (
    ToolResult,
    ToolSet,
    load_tools,
    template_supports_tools,
    tool_schema,
    tools_listing,
    tools_system_prompt,
    valid_utf8,
)

__all__ = [
    "ACTION_FORMATS",
    "TOOL_FORMATS",
    "ActionFormat",
    "ParseStats",
    "ParsedAction",
    "ToolFormat",
    "ToolResult",
    "ToolSet",
    "assistant_tool_calls",
    "call_id",
    "check_call_object",
    "detect_tool_format",
    "format_tool_call",
    "json_error_call",
    "load_tools",
    "parse_action",
    "parse_tool_calls",
    "render_tool_call",
    "resolve_tool_format",
    "template_supports_tools",
    "text_outside_calls",
    "tool_messages",
    "tool_schema",
    "tools_listing",
    "tools_system_prompt",
    "valid_utf8",
]
