"""`http`: a remote scorer behind a URL. POST JSON {"prompts": [...], "completions": [...],
<column>: [...]} (one row per completion; conversational prompts / completions as their message
lists) and read {"rewards": [float | null, ...]} back, one per completion.

Source: the remote reward-server pattern of OpenRLHF's `--remote_rm_url` and verl's reward
servers (a batch of texts in, a list of scores out); the wire format here is grouprl's own.
Remote: the function carries `overlap = True` and `overlap_chunks`, so that single-turn rollouts
generate in that many chunks and score a finished chunk in a background thread while the next one
generates (rollouts/single_turn.py); with per-sample seeding the samples and scores are those of
the unchunked collect. Chunks shrink the generation batch: overlap_chunks 1 turns it off (better
when the scorer is faster than generation; benchmarks/http_reward_overlap.py measures both).
Only JSON-serialisable per-sample columns are sent (others are left out). A batch whose request
fails after its retries raises (the reward-health check counts it; the message names the URL).
"""

from __future__ import annotations

import json
from typing import Any

from grouprl.envs.rewards.openai_client import post_json


def http_reward(
    url: str,
    timeout_s: float = 60.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    headers: dict[str, str] | None = None,
    batch_size: int = 64,
    overlap_chunks: int = 2,
):
    """Scores from a remote HTTP scorer (POST prompts / completions / columns -> rewards).

    Options:
    url: the scorer's endpoint (POST)
    timeout_s: per-request timeout in seconds (default 60)
    retries: extra attempts on connection errors / timeouts / 5xx (default 2)
    backoff_s: first retry sleep, doubled per attempt (default 0.5)
    headers: extra HTTP headers, e.g. {"Authorization": "Bearer ..."}
    batch_size: completions per request (default 64)
    overlap_chunks: rollout chunks scored while the next generates (default 2; 1 = no overlap)
    """
    if batch_size < 1 or retries < 0 or timeout_s <= 0 or overlap_chunks < 1:
        raise ValueError(
            "reward 'http': batch_size >= 1, retries >= 0, timeout_s > 0 and overlap_chunks >= 1 "
            f"are needed, got {batch_size}, {retries}, {timeout_s}, {overlap_chunks}"
        )

    def fn(completions: list, prompts: list | None = None, **columns: Any) -> list[float | None]:
        n = len(completions)
        sendable = {
            k: list(v)
            for k, v in columns.items()
            if isinstance(v, list | tuple) and len(v) == n and _jsonable(v)
        }
        out: list[float | None] = []
        for i in range(0, n, batch_size):
            j = min(n, i + batch_size)
            payload = {
                "prompts": None if prompts is None else list(prompts[i:j]),
                "completions": list(completions[i:j]),
                **{k: v[i:j] for k, v in sendable.items()},
            }
            answer = post_json(
                url, payload, headers=headers, timeout_s=timeout_s, retries=retries,
                backoff_s=backoff_s,
            )  # fmt: skip
            rewards = answer.get("rewards") if isinstance(answer, dict) else None
            if not isinstance(rewards, list) or len(rewards) != j - i:
                raise ValueError(
                    f"reward 'http': {url} must answer {{'rewards': [{j - i} values]}}, got "
                    f"{json.dumps(answer)[:200]}"
                )
            out += rewards
        return out

    fn.overlap = True
    fn.overlap_chunks = overlap_chunks
    return fn


def _jsonable(values: Any) -> bool:
    try:
        json.dumps(values)
    except (TypeError, ValueError):
        return False
    return True
