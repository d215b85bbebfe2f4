"""A minimal client of the OpenAI-compatible `POST {base_url}/chat/completions` API (stdlib
urllib; no `openai` package), with a per-request timeout and retries with exponential backoff.

Source: the OpenAI Chat Completions wire format (request {model, messages, temperature,
max_tokens}; response {choices: [{message: {content}}]}), as vLLM / SGLang / TGI serve it.
Retried: connection errors, timeouts, HTTP 408 / 429 / 5xx and a body that is no such JSON.
Not retried: other 4xx (a wrong model name or key does not heal by waiting).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class JudgeRequestError(RuntimeError):
    """A chat request that failed after its retries (the message names the last cause)."""


def post_json(
    url: str,
    payload: dict,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float,
    retries: int,
    backoff_s: float,
) -> Any:
    """POST payload as JSON, return the decoded JSON answer; retries (retries extra attempts,
    sleeping backoff_s * 2**k) on the causes named in the module docstring."""
    body = json.dumps(payload).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=body, headers=hdrs, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            last = f"HTTP {exc.code} from {url}: {detail}"
            if exc.code not in RETRY_STATUS:
                break
            continue
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            last = f"{type(reason).__name__} from {url} (timeout_s={timeout_s}): {reason}"
            continue
        try:
            return json.loads(raw)
        except ValueError:
            last = f"{url} answered no JSON: {raw[:200]!r}"
    raise JudgeRequestError(f"{last} (after {attempt + 1} attempt(s))")


def chat(
    base_url: str,
    model: str,
    messages: list[dict],
    *,
    api_key: str | None,
    temperature: float,
    max_tokens: int,
    timeout_s: float,
    retries: int,
    backoff_s: float,
) -> str:
    """The assistant text of one chat completion."""
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payload = {
        "model": model,
        "messages": messages,
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    answer = post_json(
        url, payload, headers=headers, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s
    )
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise JudgeRequestError(
            f"{url} answered no choices[0].message.content: {answer!r:.200}"
        ) from None
    if not isinstance(content, str):
        raise JudgeRequestError(f"{url} answered a non-text content: {content!r:.200}")
    return content
