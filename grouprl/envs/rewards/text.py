"""Built-in text reward functions: accuracy, format, overlong (DAPO), length.

Each public name is a factory: options in, a batched reward function
`fn(completions, **columns) -> list[float | None]` out, called with keyword arguments
(loading.py). Every returned function accepts **kwargs and ignores the columns it does not need;
a completion may be a string or TRL's message list (conversational prompts).

- overlong: soft overlong punishment of DAPO, arXiv 2503.14476 (METHODS.md section 13). Deviation:
  the buffer may be given as a fraction of max_new_tokens (`buffer_frac`, default 0.2 = DAPO's
  4096 / 20480) instead of only an absolute length.
- accuracy(mode="math") wraps math-verify (`parse`, `verify`). Its timeouts use signal.alarm, which
  works only in the main thread; off the main thread we pass timeout None (no time limit), so a
  caller that scores in threads must bound time itself (e.g. a process pool with a deadline).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from grouprl.envs.answers import between_tags, last_number, same_answer, tag_pair
from grouprl.envs.rewards.loading import RewardFn, call_with_options, column, completion_texts

# ---------------------------------------------------------------- accuracy


def _exact_accuracy(answer_tag: str | None = None, answer_column: str = "answer") -> RewardFn:
    """1.0 when the extracted answer equals the gold one (numerically if both are numbers).

    Extraction: the text inside <answer_tag>...</answer_tag> (last pair) when `answer_tag` is set,
    else the last number in the completion. No answer found -> 0.0; missing gold -> None.
    """
    tags = tag_pair(answer_tag) if answer_tag else None

    def accuracy(completions: list[str], **columns: Any) -> list[float | None]:
        golds = column(columns, answer_column, len(completions), "accuracy")
        out: list[float | None] = []
        for text, gold in zip(completion_texts(completions), golds):
            pred = between_tags(text, *tags) if tags else last_number(text)
            if gold is None:
                out.append(None)
            else:
                out.append(float(pred is not None and same_answer(pred, str(gold))))
        return out

    return accuracy


def _math_accuracy(
    answer_tag: str | None = None, answer_column: str = "answer", timeout_s: int = 5
) -> RewardFn:
    """math-verify equivalence of the completion (or its <answer_tag> part) with the gold answer.

    Gold that math-verify cannot parse -> None (no reward, like TRL); no prediction -> 0.0.
    `timeout_s` bounds each parse / comparison in the main thread only (see module docstring).
    """
    import math_verify  # imported here: it pulls in sympy, slow to import

    tags = tag_pair(answer_tag) if answer_tag else None

    def parse_bare(text: str, timeout: int | None) -> list:
        # A bare answer ("1+x^2", "\\frac12", "42") is read as LaTeX math first: math-verify's plain
        # parse reads prose and would take "1+x^2" as 1. Without the raw-string fallback, text that
        # is no math stays unparsed ([]). Text already delimited ($, \\boxed) is parsed as it is.
        if not any(mark in text for mark in ("$", "\\boxed", "\\(", "\\[")):
            wrapped = math_verify.parse(
                f"${text}$", fallback_mode="no_fallback", parsing_timeout=timeout
            )
            if wrapped:
                return wrapped
        return math_verify.parse(text, parsing_timeout=timeout)

    def accuracy(completions: list[str], **columns: Any) -> list[float | None]:
        golds = column(columns, answer_column, len(completions), "accuracy")
        main = threading.current_thread() is threading.main_thread()
        timeout = timeout_s if main else None
        out: list[float | None] = []
        for text, gold in zip(completion_texts(completions), golds):
            gold_parsed = parse_bare(str(gold), timeout) if gold is not None else []
            if not gold_parsed:
                out.append(None)
                continue
            if tags:  # the tag holds a bare answer
                answer = between_tags(text, *tags)
                pred = parse_bare(answer, timeout) if answer else []
            else:  # a whole completion is prose: math-verify finds the answer in it
                pred = math_verify.parse(text, parsing_timeout=timeout)
            ok = bool(pred) and math_verify.verify(gold_parsed, pred, timeout_seconds=timeout)
            out.append(float(ok))
        return out

    return accuracy


def _countdown_accuracy(**options: Any) -> RewardFn:
    """The countdown verifier (options of `grouprl.envs.tasks.countdown.countdown_reward`)."""
    # Imported here: the tasks package imports this module, so a top-level import would be a cycle.
    from grouprl.envs.tasks.countdown import countdown_reward

    return call_with_options(countdown_reward, options, "accuracy(mode='countdown')")


AccuracyMode = Literal["exact", "math", "countdown"]
ACCURACY_MODES: dict[str, Callable[..., RewardFn]] = {
    "exact": _exact_accuracy,
    "math": _math_accuracy,
    "countdown": _countdown_accuracy,
}


def accuracy_reward(mode: AccuracyMode = "exact", **options: Any) -> RewardFn:
    """Correctness reward, 1.0 / 0.0 per completion.

    mode="exact":     options answer_tag (None -> last number), answer_column ("answer").
    mode="math":      options answer_tag, answer_column, timeout_s (5; main thread only).
    mode="countdown": options of the countdown verifier (answer_from, answer_tag, number_use).
    """
    if mode not in ACCURACY_MODES:
        raise ValueError(
            f"accuracy mode={mode!r} is not allowed; choose one of {list(ACCURACY_MODES)}"
        )
    return call_with_options(ACCURACY_MODES[mode], options, f"accuracy(mode={mode!r})")


# ---------------------------------------------------------------- format

DEFAULT_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
FormatMatch = Literal["full", "search"]
_MATCHERS: dict[str, Callable[[re.Pattern, str], Any]] = {
    "full": re.Pattern.fullmatch,  # the whole completion has the shape
    "search": re.Pattern.search,  # the shape appears somewhere
}


def _tags_pattern(tags: Sequence[str]) -> str:
    """ "<a>", "</a>", "<b>", "</b>" -> "\\s*<a>.*?</a>\\s*<b>.*?</b>\\s*" (pairs in order)."""
    if len(tags) == 0 or len(tags) % 2 or not all(isinstance(t, str) and t for t in tags):
        raise ValueError(f"format tags must be non-empty open/close string pairs, got {tags!r}")
    pairs = [re.escape(tags[i]) + r".*?" + re.escape(tags[i + 1]) for i in range(0, len(tags), 2)]
    return r"\s*" + r"\s*".join(pairs) + r"\s*"


def format_reward(
    pattern: str | None = None, tags: Sequence[str] | None = None, match: FormatMatch = "full"
) -> RewardFn:
    """1.0 when the completion has the expected shape, else 0.0.

    pattern: a regex (DOTALL: "." crosses newlines); or
    tags:    open/close pairs that must appear in order, only whitespace between pairs
             (default <think>...</think> <answer>...</answer>). Give one of the two, not both.
    match:   "full" (the whole completion must match) or "search" (anywhere in it).
    """
    if pattern is not None and tags is not None:
        raise ValueError("format reward: give `pattern` or `tags`, not both")
    if match not in _MATCHERS:
        raise ValueError(f"format match={match!r} is not allowed; choose one of {list(_MATCHERS)}")
    source = pattern if pattern is not None else _tags_pattern(tags or DEFAULT_FORMAT_TAGS)
    try:
        regex = re.compile(source, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"format pattern {source!r} is not a valid regex: {exc}") from None
    matcher = _MATCHERS[match]

    def format_(completions: list[str], **_: Any) -> list[float | None]:
        return [float(matcher(regex, t) is not None) for t in completion_texts(completions)]

    return format_


# ---------------------------------------------------------------- lengths


def _lengths(columns: dict[str, Any], n: int, reward: str) -> tuple[Sequence[int], int]:
    """completion_lengths (tokens, length n) and max_new_tokens from the reward call."""
    lengths = column(columns, "completion_lengths", n, reward)
    if "max_new_tokens" not in columns:
        raise KeyError(f"reward {reward!r} needs max_new_tokens; got {sorted(columns)}")
    max_new = int(columns["max_new_tokens"])
    if max_new <= 0:
        raise ValueError(f"reward {reward!r}: max_new_tokens must be > 0, got {max_new}")
    return lengths, max_new


def overlong_reward(
    buffer: int | None = None, buffer_frac: float = 0.2, factor: float = 1.0
) -> RewardFn:
    """DAPO soft overlong punishment (arXiv 2503.14476, METHODS.md section 13).

    L_max = max_new_tokens, L_cache = `buffer` tokens (or buffer_frac * L_max), L_exp = L_max - L_cache:
      0                               if len <= L_exp
      -(len - L_exp) / L_cache * factor if L_exp < len <= L_max
      -factor                         if len > L_max
    """
    if buffer is not None and buffer <= 0:
        raise ValueError(f"overlong buffer must be > 0 tokens, got {buffer}")
    if not 0 < buffer_frac <= 1:
        raise ValueError(f"overlong buffer_frac must be in (0, 1], got {buffer_frac}")
    if factor < 0:
        raise ValueError(f"overlong factor must be >= 0, got {factor}")

    def overlong(completions: list[str], **columns: Any) -> list[float | None]:
        lengths, l_max = _lengths(columns, len(completions), "overlong")
        l_cache = float(buffer) if buffer is not None else buffer_frac * l_max
        if l_cache > l_max:
            raise ValueError(f"overlong buffer {l_cache} is longer than max_new_tokens {l_max}")
        l_exp = l_max - l_cache
        out: list[float | None] = []
        for length in lengths:
            if length <= l_exp:
                out.append(0.0)
            elif length <= l_max:
                out.append(-(length - l_exp) / l_cache * factor)
            else:
                out.append(-factor)
        return out

    return overlong


def _linear_length(length: int, max_new: int, target: int | None) -> float:
    return length / max_new


def _target_length(length: int, max_new: int, target: int | None) -> float:
    assert target is not None  # checked when the reward is built
    return abs(length - target) / max_new


LengthMode = Literal["linear", "target"]
LENGTH_MODES: dict[str, Callable[[int, int, int | None], float]] = {
    "linear": _linear_length,
    "target": _target_length,
}


def length_reward(
    mode: LengthMode = "linear", coef: float = 1.0, target: int | None = None
) -> RewardFn:
    """A length penalty in tokens, scaled by max_new_tokens so it stays in [-coef, 0] or so.

    mode="linear": -coef * len / max_new_tokens                 (shorter is better)
    mode="target": -coef * |len - target| / max_new_tokens      (closer to `target` is better)
    A negative coef turns the penalty into a bonus.
    """
    if mode not in LENGTH_MODES:
        raise ValueError(f"length mode={mode!r} is not allowed; choose one of {list(LENGTH_MODES)}")
    if mode == "target" and (target is None or target < 0):
        raise ValueError(f"length mode='target' needs target >= 0 tokens, got {target!r}")
    shape = LENGTH_MODES[mode]

    def length_(completions: list[str], **columns: Any) -> list[float | None]:
        lengths, max_new = _lengths(columns, len(completions), "length")
        return [-coef * shape(int(n), max_new, target) for n in lengths]

    return length_
