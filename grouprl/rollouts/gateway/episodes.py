"""Episodes of an agent program against the gateway, and those episodes as one Rollout.

`run_episodes` calls the program fn(base_url, episode_id, example) group_size times per example
(threads, gateway.concurrency at once; each within gateway.episode_timeout_s), each under its own
open episode; a program that raises or passes the deadline fails the step with an error naming
the episode (a thread cannot be killed: a program past its deadline has its episode ended, so its
further calls get 410). Its return value is the reward: a number, or {reward, success?}.

`episode_rows` turns one episode's calls into rows (rollouts/episode_record.Episode, assembled by
episode_record.assemble as the agent workload's are): a segment (record.py: calls whose prompts
extend each other token for token) is one row; prompt = its first call's prompt ids; completion =
everything after, up to the end of its last call; mask 1 exactly on the tokens the engine sampled
in the segment's calls, with their recorded log-probs as old / engine log-probs; the messages
between the calls (tool results, user turns) are masked out. step_ids = the call index.
An episode with several segments (history rewritten) is an error naming the episode under
gateway.on_rewrite=error; under split each segment is a row of the episode's group with the
episode's reward (such an episode then counts once per segment in its group's statistics).
Rows are cut at no length: the server already refused a call past gateway.max_episode_tokens.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grouprl.rollouts.episode_record import Episode, assemble
from grouprl.rollouts.gateway.record import Call, EpisodeLog
from grouprl.rollouts.gateway.server import Gateway
from grouprl.types import Rollout

Program = Callable[[str, str, dict], Any]  # (base_url, episode_id, example) -> reward
EpisodeReward = Callable[[dict, list[dict]], float]  # (example, calls) -> reward


@dataclass
class Finished:
    """One finished episode: its record, example, group, index in the group, reward, success."""

    log: EpisodeLog
    example: dict
    group: int
    index: int
    reward: float
    success: bool


def _reward_of(value: Any, episode_id: str) -> tuple[float, bool | None]:
    """(reward, success or None) from what the program returned."""
    success = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(
                f"episode {episode_id!r}: the program returned a dict without 'reward'"
            )
        success = bool(value["success"]) if "success" in value else None
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"episode {episode_id!r}: the program must return a number or {{reward, success?}}, "
            f"got {type(value).__name__}"
        )
    if not math.isfinite(value):
        raise ValueError(f"episode {episode_id!r}: the program returned the reward {value}")
    return float(value), success


def run_episodes(
    gateway: Gateway,
    program: Program,
    examples: list[dict],
    group_size: int,
    *,
    first_group_id: int = 0,
    concurrency: int = 4,
    timeout_s: float = 300.0,
    reward_fn: EpisodeReward | None = None,
) -> list[Finished]:
    """group_size episodes per example, in example order (see the module docstring). reward_fn:
    score each episode from its example and calls instead of the program's return value."""
    jobs = [
        (ex, first_group_id + g, j, f"ep-{first_group_id + g}-{j}-{uuid.uuid4().hex[:8]}")
        for g, ex in enumerate(examples)
        for j in range(group_size)
    ]
    limiter = threading.Semaphore(concurrency)

    def one(job: tuple) -> Finished:
        example, group, index, eid = job
        gateway.episodes.open(eid)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = program(gateway.base_url, eid, example)
            except BaseException as exc:  # reported below, naming the episode
                box["error"] = exc

        with limiter:
            worker = threading.Thread(target=target, name=f"program-{eid}", daemon=True)
            worker.start()
            worker.join(timeout_s)
        log = gateway.episodes.end(eid)  # later calls of the program: 410
        if worker.is_alive():
            raise TimeoutError(
                f"episode {eid!r}: the program ran past gateway.episode_timeout_s={timeout_s}s"
            )
        if "error" in box:
            exc = box["error"]
            raise RuntimeError(
                f"episode {eid!r}: the program raised {type(exc).__name__}: {exc}"
            ) from exc
        if not log.calls:
            raise ValueError(f"episode {eid!r}: the program made no call to the gateway")
        if reward_fn is not None:
            reward, success = float(reward_fn(example, [c.summary() for c in log.calls])), None
            if not math.isfinite(reward):
                raise ValueError(f"episode {eid!r}: gateway.reward_fn returned {reward}")
        else:
            reward, success = _reward_of(box.get("value"), eid)
        return Finished(
            log, example, group, index, reward, reward > 0 if success is None else success
        )

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, jobs))


def episode_rows(f: Finished, on_rewrite: str) -> list[Episode]:
    """One Episode record per segment of `f` (see the module docstring)."""
    segments: dict[int, list[Call]] = {}
    for c in f.log.calls:
        segments.setdefault(c.segment, []).append(c)
    if len(segments) > 1 and on_rewrite == "error":
        first_new = next(i for i, c in enumerate(f.log.calls) if c.segment > 0)
        raise ValueError(
            f"episode {f.log.id!r}: call {first_new} does not extend the previous call's prompt + "
            "completion (the program rewrote or dropped the history); set gateway.on_rewrite=split "
            "to train on each part as its own row"
        )
    rows = []
    for calls in segments.values():
        start = calls[0].prompt_ids
        e = Episode(None, f.group, f.index, _messages(calls[-1]), list(start), None, index=f.index)
        for k, c in enumerate(calls):
            if c.prompt_ids[: len(start)] != start or len(c.prompt_ids) < len(start) + len(e.ids):
                raise AssertionError(
                    f"episode {f.log.id!r}: segment prompts do not nest"
                )  # record.py
            e.extend(c.prompt_ids[len(start) + len(e.ids) :], None, -1)  # messages between calls
            e.extend(c.completion_ids, c.logprobs, k)
            e.rewards.append(0.0)
            e.anchors.append(None)
        e.rewards[-1] = f.reward
        e.success = f.success
        e.end = "terminated" if calls[-1].finish_reason != "length" else "length"
        e.log.append(_transcript(f, calls))
        rows.append(e)
    return rows


def _messages(last: Call) -> list[dict]:
    if last.kind == "chat":
        return [*last.messages, last.message]
    return [
        {"role": "user", "content": last.prompt_text},
        {"role": "assistant", "content": last.text},
    ]


def _transcript(f: Finished, calls: list[Call]) -> str:
    lines = [f"### Episode {f.log.id} (group {f.group}), reward {f.reward:+.3f}\n"]
    for k, c in enumerate(calls):
        lines.append(
            f"**call {k}** ({c.kind}, weight version {c.weight_version}, {c.finish_reason}, "
            f"{len(c.prompt_ids)} prompt + {len(c.completion_ids)} completion tokens)\n\n{c.text}\n"
        )
    return "\n".join(lines)


def episodes_rollout(finished: list[Finished], tokenizer: Any, on_rewrite: str) -> Rollout:
    """Every finished episode's rows as one Rollout (episode_record.assemble's layout), with info
    `episode_id`, `calls`, `segments`, `weight_version` (the oldest version among a row's calls)."""
    rows, ids, calls, segments, versions = [], [], [], [], []
    for f in finished:
        got = episode_rows(f, on_rewrite)
        rows += got
        for e in got:
            ids.append(f.log.id)
            calls.append(len(e.rewards))
            segments.append(len(got))
            versions.append(min(c.weight_version for c in f.log.calls))
    max_calls = max(len(e.rewards) for e in rows)
    rollout = assemble(rows, tokenizer, max_calls)
    rollout.info.update(episode_id=ids, calls=calls, segments=segments, weight_version=versions)
    return rollout
