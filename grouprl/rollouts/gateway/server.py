"""An OpenAI-compatible HTTP gateway in front of the policy's engine, recording every call.

Endpoints (127.0.0.1 only, stdlib `http.server`, one thread per connection):
  POST /v1/chat/completions  messages (text content), tools, tool_choice (auto / none),
                             temperature, top_p, max_tokens / max_completion_tokens, n=1, stop,
                             seed, logprobs (top_logprobs 0), user, parallel_tool_calls
  POST /v1/completions       prompt (one string), the same sampling fields, logprobs (0 or 1)
  GET  /v1/models            the one model (gateway.model_name)
The response is OpenAI's shape (`choices[0].message` with `content` and `tool_calls` parsed in the
model family's format, envs/tools/formats.py; `usage`; `logprobs` when asked), plus a `grouprl`
object: episode id, weight version, prompt and completion token ids.

Episode id: the header `X-Episode-Id`, or the request's `user` field (both given: they must be
equal). Every call is recorded under it (record.py): the prompt token ids as the chat template
rendered them (or the episode's tokens so far + the new messages' delta), the completion ids,
their sampling log-probs, the weight version and the finish reason. Calls of one episode are
answered one at a time; calls of different episodes that arrive together are generated as one
batch (batcher.py, at most `max_batch`).

Errors are JSON `{"error": {"message", "type", ...}}` with a 4xx status, never a hang: malformed
JSON / fields 400, no episode id 400, unknown episode 404, ended episode 410, no Content-Length
411, body over 8 MiB 413, a model other than gateway.model_name 404, a body slower than
gateway.request_timeout_s to arrive 408; an engine busy for longer than that 503.

Deviations from OpenAI's API, on purpose:
- Sampling is the run's (rollout.temperature / top_p / top_k): a request asking for other values
  is a 400 naming the option, because the recorded log-probs must be those of the distribution the
  trainer scores. max_tokens may be lower than rollout.max_new_tokens, not higher.
- A stop string stays in the returned text (the tokens trained on hold it; a program that sends
  the text back then extends the episode token for token).
- One choice (n=1), no streaming, no top_logprobs, text content only.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import replace
from http.server import ThreadingHTTPServer
from typing import Any

from jinja2 import TemplateError

from grouprl.envs.tools.formats import (
    assistant_tool_calls,
    parse_tool_calls,
    resolve_tool_format,
    text_outside_calls,
)
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.server.http import JsonHandler
from grouprl.rollouts.gateway.batcher import EngineBatcher
from grouprl.rollouts.gateway.record import (
    Call,
    EpisodeStore,
    GatewayError,
    chat_prompt,
    completion_prompt,
    normalise_message,
    now,
)

MAX_BODY = 8 << 20  # bytes
EPISODE_HEADER = "X-Episode-Id"
_COMMON = {"model", "temperature", "top_p", "max_tokens", "n", "stop", "seed", "user", "stream"}
CHAT_FIELDS = _COMMON | {
    "messages", "tools", "tool_choice", "max_completion_tokens", "logprobs", "top_logprobs",
    "parallel_tool_calls",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}


def _error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Gateway:
    """The server over `policy` (anything with `engine` and `tokenizer`). params: the run's
    sampling (rollout:); weight_version: bumped by the trainer after each update; max_batch: calls
    generated together at most. Use as a
    context manager (or start / stop); `base_url` is http://127.0.0.1:PORT/v1."""

    def __init__(
        self,
        policy: Any,
        params: SamplingParams,
        *,
        model_name: str = "grouprl-policy",
        max_episode_tokens: int = 2048,
        request_timeout_s: float = 60.0,
        tool_format: str = "auto",
        weight_version: int = 0,
        max_batch: int = 64,
        port: int = 0,
    ) -> None:
        self.policy, self.params = policy, params
        self.model_name, self.max_episode_tokens = model_name, max_episode_tokens
        self.request_timeout_s = request_timeout_s
        self.tool_format = resolve_tool_format(tool_format, policy.tokenizer)
        self.weight_version = weight_version
        self.episodes = EpisodeStore()
        self.max_batch = max_batch
        self._batcher: EngineBatcher | None = None
        self._port = port
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._http is None:
            raise RuntimeError("the gateway is not running (start() it first)")
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def start(self) -> Gateway:
        self._batcher = EngineBatcher(
            self.policy, max_batch=self.max_batch, timeout_s=self.request_timeout_s
        )
        handler = type("Handler", (_Handler,), {"gateway": self, "timeout": self.request_timeout_s})
        self._http = ThreadingHTTPServer(("127.0.0.1", self._port), handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.05,), name="grouprl-gateway", daemon=True
        )  # polls for shutdown every 50 ms
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._thread.join(timeout=10)
            self._http = self._thread = None
        if self._batcher is not None:
            self._batcher.stop()
            self._batcher = None

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- requests --------------------------------------------------------------------------------

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "grouprl"}
            ],
        }

    def chat(self, body: dict, episode_id: str | None) -> dict:
        self._check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError(400, "'messages' must be a non-empty list of messages")
        messages = [normalise_message(m, i) for i, m in enumerate(messages)]
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)
        ):
            raise GatewayError(400, "'tools' must be a list of {type: function, function: {...}}")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise GatewayError(400, f"tool_choice {choice!r} is not served (auto or none)")
        if body.get("top_logprobs"):
            raise GatewayError(400, "top_logprobs is not served (0 only)")
        params, seed = self._sampling(body, "max_completion_tokens")
        log = self._episode(body, episode_id)
        with log.lock:
            self._still_open(log)
            try:
                ids, segment = chat_prompt(
                    self.policy.tokenizer, log, messages, tools, self.tool_format,
                    self.policy.stop_ids,
                )  # fmt: skip
            except (ValueError, TemplateError) as exc:  # the template refuses these messages
                raise GatewayError(
                    400, f"the chat template cannot render these messages: {exc}"
                ) from None
            out_ids, logp, truncated = self._generate(ids, params, seed)
            tok = self.policy.tokenizer
            fmt = self.tool_format if tools and choice != "none" else None
            message = assistant_message(tok, out_ids, fmt, turn=len(log.calls))
            text = tok.decode(out_ids, skip_special_tokens=True)
            calls = message.get("tool_calls")
            reason = "length" if truncated else "tool_calls" if calls else "stop"
            log.calls.append(
                Call(
                    "chat",
                    ids,
                    out_ids,
                    logp,
                    self.weight_version,
                    reason,
                    segment,
                    messages=messages,
                    tools=tools,
                    text=text,
                    message=message,
                    temperature=params.temperature,
                )
            )
            call = log.calls[-1]
        wire = wire_message(message)
        logprobs = None
        if body.get("logprobs"):
            logprobs = {
                "content": [
                    {
                        "token": (piece := tok.decode([i])),
                        "logprob": lp,
                        "bytes": list(piece.encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for i, lp in zip(out_ids, logp)
                ],
                "refusal": None,
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": [
                {"index": 0, "message": wire, "finish_reason": reason, "logprobs": logprobs}
            ],
            "usage": _usage(ids, out_ids),
            "grouprl": _extension(call, log.id),
        }

    def completion(self, body: dict, episode_id: str | None) -> dict:
        self._check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise GatewayError(400, "'prompt' must be one non-empty string")
        if body.get("echo"):
            raise GatewayError(400, "echo is not served")
        want = body.get("logprobs")
        if want not in (None, 0, 1) or isinstance(want, bool):
            raise GatewayError(400, f"logprobs must be 0 or 1 (no top-k lists), got {want!r}")
        params, seed = self._sampling(body, None)
        log = self._episode(body, episode_id)
        tok = self.policy.tokenizer
        with log.lock:
            self._still_open(log)
            ids, segment = completion_prompt(tok, log, prompt)
            out_ids, logp, truncated = self._generate(ids, params, seed)
            text = tok.decode(out_ids, skip_special_tokens=True)
            reason = "length" if truncated else "stop"
            log.calls.append(
                Call(
                    "completion",
                    ids,
                    out_ids,
                    logp,
                    self.weight_version,
                    reason,
                    segment,
                    prompt_text=prompt,
                    text=text,
                    temperature=params.temperature,
                )
            )
            call = log.calls[-1]
        logprobs = None
        if want == 1:
            pieces = [tok.decode([i]) for i in out_ids]
            offsets, at = [], len(prompt)
            for p in pieces:
                offsets.append(at)
                at += len(p)
            logprobs = {
                "tokens": pieces,
                "token_logprobs": logp,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}],
            "usage": _usage(ids, out_ids),
            "grouprl": _extension(call, log.id),
        }

    # ---- pieces ----------------------------------------------------------------------------------

    def _check_fields(self, body: dict, allowed: set[str], route: str) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise GatewayError(
                400, f"{route} does not serve {unknown}; the fields served are {sorted(allowed)}"
            )
        if body.get("model") != self.model_name:
            raise GatewayError(
                404,
                f"model {body.get('model')!r} is not served; the one model is {self.model_name!r}",
                "not_found_error",
            )
        if body.get("n", 1) != 1:
            raise GatewayError(400, f"n={body.get('n')!r}: one choice per call only (n=1)")
        if body.get("stream"):
            raise GatewayError(400, "stream=true is not served")

    def _sampling(self, body: dict, alias: str | None) -> tuple[SamplingParams, int | None]:
        """The run's sampling with the request's max_tokens / stop / seed (see the docstring)."""
        p = self.params
        for key, option, have in (
            ("temperature", "rollout.temperature", p.temperature),
            ("top_p", "rollout.top_p", p.top_p),
        ):
            value = body.get(key)
            if value is not None and value != have:
                raise GatewayError(
                    400,
                    f"{key}={value!r}: this gateway samples with the run's {option}={have} (the "
                    "recorded log-probs must be those the trainer scores); omit it or send that",
                )
        limit = body.get(alias) if alias and body.get(alias) is not None else body.get("max_tokens")
        if limit is None:
            limit = p.max_new_tokens
        if (
            not isinstance(limit, int)
            or isinstance(limit, bool)
            or not 1 <= limit <= p.max_new_tokens
        ):
            raise GatewayError(
                400,
                f"max_tokens={limit!r} must be an integer in [1, {p.max_new_tokens}] "
                "(rollout.max_new_tokens)",
            )
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise GatewayError(400, "'stop' must be a non-empty string or a list of them")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise GatewayError(400, f"seed must be an integer, got {seed!r}")
        merged = list(dict.fromkeys([*p.stop, *stop]))
        return replace(p, max_new_tokens=limit, stop=merged), seed

    def _episode(self, body: dict, episode_id: str | None):
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise GatewayError(400, "'user' (the episode id) must be a string")
        if episode_id and user and episode_id != user:
            raise GatewayError(
                400, f"the {EPISODE_HEADER} header {episode_id!r} and 'user' {user!r} differ"
            )
        eid = episode_id or user
        if not eid:
            raise GatewayError(
                400, f"no episode id: send the {EPISODE_HEADER} header or the 'user' field"
            )
        return self.episodes.get_open(eid)

    def _still_open(self, log: Any) -> None:
        if not log.open:
            raise GatewayError(410, f"episode {log.id!r} has ended; it takes no more calls")

    def _generate(
        self, ids: list[int], params: SamplingParams, seed: int | None
    ) -> tuple[list[int], list[float], bool]:
        if len(ids) + params.max_new_tokens > self.max_episode_tokens:
            raise GatewayError(
                400,
                f"the prompt has {len(ids)} tokens; with max_tokens={params.max_new_tokens} the "
                f"episode would pass gateway.max_episode_tokens={self.max_episode_tokens}",
            )
        return self._batcher.generate(ids, params, seed)


def assistant_message(tok: Any, out_ids: list[int], fmt: str | None, turn: int) -> dict:
    """The assistant message of a completion, as recorded (tool-call arguments as objects): with a
    tool format `fmt`, well-formed calls in it go to `tool_calls` (ids from the call index `turn`)
    and the text outside them is the content; a reply with a malformed call stays plain text."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": tok.decode(out_ids, skip_special_tokens=True),
    }
    if fmt is None:
        return message
    raw = _raw_text(tok, out_ids)
    calls = parse_tool_calls(raw, fmt)
    if calls and all(c.ok for c in calls):
        message["content"] = text_outside_calls(raw, fmt)
        message["tool_calls"] = assistant_tool_calls(calls, turn, fmt)
    return message


def wire_message(message: dict) -> dict:
    """A recorded assistant message in OpenAI's wire shape (arguments as JSON text, null content
    when empty)."""
    wire: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        wire["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in message["tool_calls"]
        ]
    return wire


def _extension(call: Call, episode_id: str) -> dict:
    """The `grouprl` object of a response: what the call recorded."""
    return {
        "episode_id": episode_id,
        "weight_version": call.weight_version,
        "prompt_token_ids": call.prompt_ids,
        "completion_token_ids": call.completion_ids,
    }


def _usage(ids: list[int], out_ids: list[int]) -> dict:
    return {
        "prompt_tokens": len(ids),
        "completion_tokens": len(out_ids),
        "total_tokens": len(ids) + len(out_ids),
    }


def _raw_text(tok: Any, ids: list[int]) -> str:
    """A completion's text with special tokens kept (Mistral's [TOOL_CALLS] is one), minus the
    special tokens that close it."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    end = len(ids)
    while end > 0 and ids[end - 1] in special:
        end -= 1
    return tok.decode(ids[:end], skip_special_tokens=False)


class _Handler(JsonHandler):
    """HTTP plumbing: route, read and parse the body, answer JSON (errors included)."""

    gateway: Gateway

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, self.gateway.models())
        else:
            self._send(404, _error_body(404, f"no route GET {self.path}", "not_found_error"))

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        routes = {
            "/v1/chat/completions": self.gateway.chat,
            "/v1/completions": self.gateway.completion,
        }
        try:
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                raise GatewayError(404, f"no route POST {self.path}", "not_found_error")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise GatewayError(411, "a Content-Length header is needed")
            if int(length) > MAX_BODY:
                raise GatewayError(413, f"the body has {length} bytes; at most {MAX_BODY}")
            try:
                raw = self.rfile.read(int(length))
            except TimeoutError:
                raise GatewayError(
                    408,
                    f"the body did not arrive within gateway.request_timeout_s={self.timeout}s",
                ) from None
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise GatewayError(400, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise GatewayError(400, "the body must be a JSON object")
            self._send(200, route(body, self.headers.get(EPISODE_HEADER)))
        except GatewayError as exc:
            unread = exc.status in (408, 411, 413)
            self._send(exc.status, _error_body(exc.status, exc.message, exc.kind), close=unread)
        except Exception as exc:  # a bug or an engine failure: a 500 naming it, not a hang
            self._send(500, _error_body(500, f"{type(exc).__name__}: {exc}", "server_error"))
