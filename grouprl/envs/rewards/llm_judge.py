"""`llm_judge`: a generative LLM judge behind an OpenAI-compatible endpoint scores completions
(LLM-as-a-judge, Zheng et al., arXiv 2306.05685: single-answer grading = pointwise; a group of
answers graded together = groupwise, as in the listwise judges of RLAIF-style GRPO recipes).

pointwise: one request per completion; the template's placeholders are {prompt}, {completion}
  and any example column by name ({answer} ...); the answer's score is parsed (below).
groupwise: one request per group (all G completions of one prompt, found by the `group_ids` the
  rollout passes); placeholders {prompt}, {completions} (numbered "[1] ...", "[2] ...") and the
  group's first row of each column. The judge answers per-completion scores ("[k]: X" or "k: X",
  one per completion, each mapped by score_range), or with output "ranking" a best-first order
  of the numbers ("Ranking: 3 > 1 > 2"), mapped to (G - 1 - place) / (G - 1) in [0, 1].
Parsing (pointwise): `score_pattern` (a regex with one group, the LAST match is used), else
  "Score: X" (last), else the final number in the answer. With `score_range` [lo, hi] the value
  becomes (x - lo) / (hi - lo) in [0, 1]; a value outside [lo, hi] is a failed sample.
A conversational prompt is shown as "role: content" lines.
Failures (after retries, or an answer without a score) give None for those samples (NaN, left
out of the advantages) and one warning quoting the first error; when every sample of a call
fails, the call raises with the first error, so that the reward-health check counts the step as
failed and stops a run whose judge is down (envs/rewards/health.py). The per-sample retry of
score_completions then re-raises the remembered error without asking the judge again.
Deviation: no `openai` package; the stdlib client of `openai_client.py`.

Options: see the docstring of `llm_judge`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from grouprl.envs.rewards.loading import completion_text
from grouprl.envs.rewards.openai_client import chat

POINTWISE_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (useless) to 10 (perfect).\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{completion}\n\n"
    "Give a one-sentence reason, then end with a line 'Score: X'."
)
GROUPWISE_TEMPLATE = (
    "Rate each response to the prompt from 0 (useless) to 10 (perfect).\n\n"
    "Prompt:\n{prompt}\n\nResponses:\n{completions}\n\n"
    "Answer with one line per response, '[k]: X', for every response k."
)
_NUMBER = r"-?\d+(?:\.\d+)?"


class JudgeParseError(ValueError):
    """The judge's answer holds no usable score."""


def prompt_text(prompt: Any) -> str:
    """A string prompt as it is; a message list as "role: content" lines."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)


def parse_score(text: str, pattern: str | None) -> float:
    """The pointwise score in text (see the module docstring)."""
    if pattern is not None:
        found = re.findall(pattern, text)
        if not found:
            raise JudgeParseError(f"no match of score_pattern {pattern!r} in {text[-200:]!r}")
        return float(found[-1])
    found = re.findall(r"[Ss]core\s*[:=]\s*\**\s*(" + _NUMBER + ")", text)
    found = found or re.findall(_NUMBER, text)
    if not found:
        raise JudgeParseError(f"no score (no 'Score: X', no number) in {text[-200:]!r}")
    return float(found[-1])


def parse_group_scores(text: str, g: int) -> list[float]:
    """Per-completion scores "[k]: X" / "k: X" for k = 1..g (the last line for each k)."""
    scores: dict[int, float] = {}
    for k, x in re.findall(r"\[?(\d+)\]?\s*[:=]\s*(" + _NUMBER + ")", text):
        scores[int(k)] = float(x)
    missing = [k for k in range(1, g + 1) if k not in scores]
    if missing:
        raise JudgeParseError(f"no score for response(s) {missing} in {text[-300:]!r}")
    return [scores[k] for k in range(1, g + 1)]


def parse_ranking(text: str, g: int) -> list[float]:
    """A best-first order of 1..g (after "Ranking:" when present, else the last g numbers) ->
    per-completion values (g - 1 - place) / (g - 1)."""
    tail = re.split(r"[Rr]anking\s*:", text)[-1]
    order = [int(x) for x in re.findall(r"\d+", tail)][-g:] if g > 0 else []
    if sorted(order) != list(range(1, g + 1)):
        raise JudgeParseError(f"no ranking of 1..{g} in {text[-300:]!r}")
    if g == 1:
        return [1.0]
    values = [0.0] * g
    for place, k in enumerate(order):
        values[k - 1] = (g - 1 - place) / (g - 1)
    return values


def llm_judge(
    base_url: str,
    model: str,
    api_key: str | None = None,
    api_key_env: str | None = None,
    template: str | None = None,
    system: str | None = None,
    mode: Literal["pointwise", "groupwise"] = "pointwise",
    output: Literal["scores", "ranking"] = "scores",
    score_pattern: str | None = None,
    score_range: Sequence[float] | None = (0.0, 10.0),
    retries: int = 2,
    backoff_s: float = 0.5,
    timeout_s: float = 60.0,
    concurrency: int = 8,
    temperature: float = 0.0,
    max_tokens: int = 256,
):
    """LLM-as-a-judge score of each completion from an OpenAI-compatible chat endpoint.

    Options:
    base_url: the server's API root, e.g. http://127.0.0.1:8000/v1
    model: the model name the server expects
    api_key: bearer token (default None: no Authorization header)
    api_key_env: name of an environment variable holding the token (read when the reward is built)
    template: the user message, with the placeholders above (default: a 0..10 rating request)
    system: an optional system message
    mode: "pointwise" | "groupwise"
    output: groupwise answer form, "scores" | "ranking"
    score_pattern: regex with one group capturing the score (default "Score: X", then last number)
    score_range: [lo, hi] mapped to [0, 1] (default [0, 10]; None keeps the raw number)
    retries: extra attempts per request on errors / 5xx / timeouts (default 2)
    backoff_s: first retry sleep, doubled per attempt (default 0.5)
    timeout_s: per-request timeout in seconds (default 60)
    concurrency: requests in flight at once (thread pool, default 8)
    temperature: sampling temperature of the judge (default 0.0)
    max_tokens: judge answer length cap (default 256)
    """
    what = "reward 'llm_judge'"
    if mode not in ("pointwise", "groupwise"):
        raise ValueError(f"{what}: mode must be 'pointwise' or 'groupwise', got {mode!r}")
    if output not in ("scores", "ranking"):
        raise ValueError(f"{what}: output must be 'scores' or 'ranking', got {output!r}")
    if score_pattern is not None and re.compile(score_pattern).groups != 1:
        raise ValueError(f"{what}: score_pattern {score_pattern!r} must have exactly one group")
    if score_range is not None:
        lo, hi = (float(v) for v in score_range)
        if not hi > lo:
            raise ValueError(
                f"{what}: score_range must be [lo, hi] with hi > lo, got {score_range}"
            )
    if concurrency < 1 or retries < 0 or timeout_s <= 0:
        raise ValueError(f"{what}: concurrency >= 1, retries >= 0 and timeout_s > 0 are needed")
    if api_key_env is not None:
        if api_key is not None:
            raise ValueError(f"{what}: give api_key or api_key_env, not both")
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise ValueError(f"{what}: api_key_env={api_key_env!r} is not set in the environment")
    template = template or (GROUPWISE_TEMPLATE if mode == "groupwise" else POINTWISE_TEMPLATE)
    remembered: dict[tuple, str] = {}  # (prompt, completion) -> error of the last all-failed call
    warned = [False]

    def ask(text: str) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return chat(
            base_url, model, messages, api_key=api_key, temperature=temperature,
            max_tokens=max_tokens, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
        )  # fmt: skip

    def scaled(x: float) -> float:
        if score_range is None:
            return x
        if not lo <= x <= hi:
            raise JudgeParseError(f"score {x} is outside score_range [{lo}, {hi}]")
        return (x - lo) / (hi - lo)

    def fill(values: dict[str, Any]) -> str:
        try:
            return template.format_map(values)
        except KeyError as exc:
            raise KeyError(
                f"{what}: the template's placeholder {exc} is no column; there are {sorted(values)}"
            ) from None

    def fn(completions: list, prompts: list | None = None, **columns: Any) -> list[float | None]:
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [None] * n
        keys = [(repr(p), completion_text(c)) for p, c in zip(prompts, completions)]
        if n == 1 and keys[0] in remembered:  # score_completions' per-sample retry
            raise RuntimeError(remembered[keys[0]])
        texts = [k[1] for k in keys]
        cols = {
            k: v
            for k, v in columns.items()
            if isinstance(v, list | tuple) and len(v) == n and k != "group_ids"
        }
        values: list[float | None] = [None] * n
        errors: list[str | None] = [None] * n
        if mode == "pointwise":
            jobs = [
                (
                    [i],
                    {
                        **{k: v[i] for k, v in cols.items()},
                        "prompt": prompt_text(prompts[i]),
                        "completion": texts[i],
                    },
                )
                for i in range(n)
            ]
        else:
            group_ids = columns.get("group_ids")
            if group_ids is None:
                raise ValueError(
                    f"{what}: mode 'groupwise' needs the rollout's group_ids (single-turn "
                    "collect passes them); this caller gives none: use mode 'pointwise'"
                )
            groups: dict[Any, list[int]] = {}
            for i, gid in enumerate(group_ids):
                groups.setdefault(gid, []).append(i)
            jobs = []
            for rows in groups.values():
                numbered = "\n\n".join(f"[{j + 1}] {texts[i]}" for j, i in enumerate(rows))
                first = rows[0]
                values_ = {k: v[first] for k, v in cols.items()}
                values_.update(prompt=prompt_text(prompts[first]), completions=numbered)
                jobs.append((rows, values_))
        requests = [(rows, fill(v)) for rows, v in jobs]  # a template error raises here

        def run(job: tuple[list[int], str]) -> list[float]:
            rows, text = job
            answer = ask(text)
            if mode == "pointwise":
                return [scaled(parse_score(answer, score_pattern))]
            if output == "ranking":
                return parse_ranking(answer, len(rows))
            return [scaled(x) for x in parse_group_scores(answer, len(rows))]

        with ThreadPoolExecutor(max_workers=min(concurrency, len(requests) or 1)) as pool:
            futures = [pool.submit(run, job) for job in requests]
            for (rows, _), fut in zip(requests, futures):
                try:
                    got = fut.result()
                except Exception as exc:  # noqa: BLE001 - a failed request / parse is per sample
                    for i in rows:
                        errors[i] = f"{type(exc).__name__}: {exc}"
                else:
                    for i, v in zip(rows, got):
                        values[i] = v
        failed = [e for e in errors if e is not None]
        remembered.clear()
        if failed and len(failed) == n:
            remembered.update({k: f"{what}: {e}" for k, e in zip(keys, errors)})
            raise RuntimeError(f"{what}: all {n} samples failed; first error: {failed[0]}")
        if failed and not warned[0]:
            warned[0] = True
            warnings.warn(
                f"{what}: {len(failed)} of {n} samples got no score (None); first error: "
                f"{failed[0]}",
                RuntimeWarning,
                stacklevel=2,
            )
        return values

    return fn
