"""What the gateway records: every call of an episode (token ids, sampling log-probs, weight
version, finish reason), the open / ended episodes, and how a call's prompt tokens are built.

Token-in / token-out, as rollouts/multi_turn.py: a call whose messages are the previous call's
messages + the assistant message the gateway returned (content and tool calls equal; call ids
ignored) + new messages gets as prompt the previous prompt ids + the previous completion ids
exactly as sampled + the chat template's delta for the new messages (rollouts/chat_delta.py),
so the episode is one token sequence the policy's own samples sit in. A call that does not extend
the previous one that way (the program rewrote or dropped history, changed the tools, or mixed
/v1/completions and /v1/chat/completions) is rendered afresh and starts a new *segment*; the
workload then splits the episode into one row per segment or refuses it (gateway.on_rewrite).
Tools: the request's schemas go to the chat template as `tools=` when it renders them (probed,
rollouts/chat_probe.py), else (as in the multi-turn rollouts) a plain-text listing of them and of
the call format is appended to the system message of a fresh rendering (a system message is put
first when there is none). A template without a system or tool role gets the probe's fallbacks
(system text folded into the first user message, tool results as a user message). A turn that
ended with any of the policy's stop ids is closed (its closing text is not appended again).
/v1/completions calls extend the same way on text: the new prompt starts with the previous prompt
text + the returned text; the rest is tokenised alone and appended.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from grouprl.envs.tools.schemas import template_supports_tools, tools_listing
from grouprl.rollouts.chat_delta import messages_delta_ids, prompt_ids
from grouprl.rollouts.chat_probe import adapt_messages


class GatewayError(Exception):
    """A request the gateway refuses: the HTTP status and a message naming what is wrong."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class Call:
    """One recorded call.

    kind:           "chat" | "completion"
    prompt_ids:     the prompt as the engine saw it (chat: rendered by the chat template)
    completion_ids: the sampled tokens (EOS kept when it ended the call)
    logprobs:       the sampling log-prob of each completion token (same length)
    weight_version: the trainer's weight version that sampled it
    finish_reason:  "stop" | "length" | "tool_calls"
    segment:        index of the stretch of calls whose prompts extend each other
    messages:       the request's messages, normalised (chat), else None
    tools:          the request's tool schemas (chat), else None
    prompt_text:    the request's prompt (completion), else None
    text:           the completion's text (special tokens dropped)
    message:        the assistant message returned (chat), else None
    temperature:    the sampling temperature
    """

    kind: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    segment: int
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt_text: str | None = None
    text: str = ""
    message: dict | None = None
    temperature: float = 1.0

    def summary(self) -> dict[str, Any]:
        """The call as plain data (for reward functions and sample logs)."""
        return {
            "kind": self.kind,
            "messages": self.messages,
            "prompt": self.prompt_text,
            "text": self.text,
            "message": self.message,
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "segment": self.segment,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.completion_ids),
        }


@dataclass
class EpisodeLog:
    """One episode's calls, in the order they were answered; `open` until the workload ends it."""

    id: str
    calls: list[Call] = field(default_factory=list)
    open: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time


class EpisodeStore:
    """Episodes by id: opened by the workload before the program runs, ended after it returns.
    A call for an id never opened is a 404, for an ended one a 410 (OpenAI clients do not retry
    either)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, EpisodeLog] = {}

    def open(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} was opened already")
            log = self._episodes[episode_id] = EpisodeLog(episode_id)
            return log

    def end(self, episode_id: str) -> EpisodeLog:
        """Mark the episode ended (later calls: 410) and return its record; waits for a call in
        flight to finish so that the record is complete."""
        with self._lock:
            log = self._episodes[episode_id]
        with log.lock:
            log.open = False
        return log

    def get_open(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            log = self._episodes.get(episode_id)
        if log is None:
            raise GatewayError(404, f"unknown episode {episode_id!r}: no such episode is running")
        if not log.open:
            raise GatewayError(410, f"episode {episode_id!r} has ended; it takes no more calls")
        return log


# ---- messages: normalised for comparison and rendering -------------------------------------------


def _arguments(value: Any) -> Any:
    """Tool-call arguments as an object: OpenAI clients send a JSON string, templates want a dict."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalise_message(m: Any, index: int) -> dict:
    """A request message as the chat template takes it: role, content (str; a list of text parts
    is joined), tool_calls with object arguments, name / tool_call_id when given. Anything else
    (images, audio) is a 400 naming the message."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise GatewayError(400, f"messages[{index}] must be an object with a string 'role'")
    role, content = m["role"], m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise GatewayError(400, f"messages[{index}]: only text content parts are served")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if content is not None and not isinstance(content, str):
        raise GatewayError(400, f"messages[{index}].content must be a string, a list or null")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise GatewayError(400, f"messages[{index}].tool_calls must be a list")
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": _arguments((c.get("function") or {}).get("arguments")),
                },
            }
            for c in calls
            if isinstance(c, dict)
        ]
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _same(a: dict, b: dict) -> bool:
    """Equal as the template renders them, call ids aside."""

    def key(m: dict) -> tuple:
        calls = [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])
        ]
        return m["role"], m["content"], json.dumps(calls, sort_keys=True, default=str)

    return key(a) == key(b)


# ---- the prompt of a call --------------------------------------------------------------------------


def _with_tool_listing(messages: list[dict], listing: str) -> list[dict]:
    """The tools' plain-text listing at the end of the system message (one is put first when
    the chat has none)."""
    if not listing:
        return messages
    if messages[0]["role"] == "system":
        content = "\n\n".join(p for p in (messages[0]["content"], listing) if p)
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


def chat_prompt(
    tokenizer: Any,
    log: EpisodeLog,
    messages: list[dict],
    tools: list[dict] | None,
    tool_format: str = "hermes",
    stop_ids: list[int] | None = None,
) -> tuple[list[int], int]:
    """(prompt ids, segment) of a chat call (see the module docstring). tool_format: the call
    format the plain-text tool listing teaches (templates without a tools branch) and that an
    assistant's tool calls are written in where the template does not render them; stop_ids: the
    ids that end a turn (the policy's, policies/text/stop_ids.py; None: the tokenizer's EOS)."""
    stops = set(stop_ids) if stop_ids is not None else {tokenizer.eos_token_id}
    template_tools = tools if tools and template_supports_tools(tokenizer) else None
    prev = log.calls[-1] if log.calls else None
    if prev is not None and prev.kind == "chat" and prev.tools == tools:
        n = len(prev.messages)
        if (
            len(messages) > n + 1
            and all(_same(a, b) for a, b in zip(messages[:n], prev.messages))
            and _same(messages[n], prev.message)
        ):
            last = prev.completion_ids[-1] if prev.completion_ids else None
            ended = last if last in stops else False  # the sampled end of turn
            delta = messages_delta_ids(tokenizer, messages[n + 1 :], ended, template_tools)
            return prev.prompt_ids + prev.completion_ids + delta, prev.segment
    segment = prev.segment + 1 if prev is not None else 0
    if tools and template_tools is None:
        messages = _with_tool_listing(messages, tools_listing(tools, tokenizer, tool_format))
    # the template's missing roles by the stated fallbacks (rollouts/chat_probe.py), calls as text
    # in this gateway's call format
    messages = adapt_messages(tokenizer, messages, tool_format)
    return prompt_ids(tokenizer, messages, template_tools), segment


def completion_prompt(tokenizer: Any, log: EpisodeLog, prompt: str) -> tuple[list[int], int]:
    """(prompt ids, segment) of a /v1/completions call (see the module docstring)."""
    prev = log.calls[-1] if log.calls else None
    if prev is not None and prev.kind == "completion":
        before = prev.prompt_text + prev.text
        if prompt.startswith(before) and len(prompt) > len(before):
            rest = tokenizer(prompt[len(before) :], add_special_tokens=False).input_ids
            return prev.prompt_ids + prev.completion_ids + rest, prev.segment
    segment = prev.segment + 1 if prev is not None else 0
    return tokenizer(prompt).input_ids, segment


def now() -> int:
    return int(time.time())
