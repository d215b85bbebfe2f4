"""The reward-function protocol: loading user functions, building with options, batched scoring.

Protocol (TRL's): `fn(completions=..., prompts=..., **columns) -> list[float | None]`, called ONCE
per batch and with KEYWORD arguments only, so `def f(completions, **kwargs)`, TRL's
`def f(prompts, completions, **kwargs)` and grouprl's built-ins all work. The caller passes
`completions`, `prompts`, `completion_lengths` (tokens), `truncated`, `max_new_tokens` and every
example column repeated per completion (e.g. `answer=[...]`). Single-turn rollouts also pass
`group_ids`: one int per completion, equal within a group (the G completions of one prompt), for
rewards that judge a group together (llm_judge's groupwise mode); other callers may omit it. A completion is a string, or, when
its prompt was conversational (a list of {role, content} messages), a message list
`[{"role": "assistant", "content": text}]` as TRL passes it (`completion_text` reads either).
A function without **kwargs gets only the keywords it names. None means "no reward for this
sample" and becomes NaN, which the advantage code excludes from its statistics.

`score_completions` isolates failures: when a batched call raises, each sample is retried alone so
one bad completion costs one NaN (counted in `errors`), not the whole step. Any BaseException
from user code (SystemExit, GeneratorExit ...) counts as that sample's error; only
KeyboardInterrupt (a real Ctrl-C) propagates.
"""

from __future__ import annotations

import inspect
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grouprl.runtime.user_inputs import import_user_module, split_user_spec

# fn(completions=..., **columns) -> one float (or None = "no reward for this sample") per completion.
RewardFn = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as it is; a message list (conversational prompts,
    TRL's form) -> the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list | tuple) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        "a completion must be a string or a list of {'role', 'content'} messages, got "
        f"{type(completion).__name__}: {str(completion)[:80]!r}"
    )


def completion_texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def error_line(exc: BaseException) -> str:
    """The last line of the exception's traceback ("ValueError: bad answer"), at most 300 chars."""
    try:
        return traceback.format_exception_only(exc)[-1].strip()[:300]
    except Exception:  # a __str__ that raises
        return type(exc).__name__


def check_reward_signature(fn: Callable, name: str, items: str = "completions") -> None:
    """Fail at build time for a function the keyword protocol cannot call: it must take `items`
    (default "completions") by keyword, or **kwargs, and have no required positional-only
    parameter."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # builtins / C callables without a signature: the call will tell
    usage = (
        f"reward functions are called with keyword arguments, e.g. def {name}(completions, "
        "**kwargs) or TRL's def f(prompts, completions, **kwargs)"
    )
    positional_only = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if positional_only:
        raise TypeError(
            f"reward function {name!r} has positional-only parameters {positional_only}; {usage}"
        )
    named = {p.name for p in params if p.kind not in _NOT_NAMED}
    if items not in named and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise TypeError(
            f"reward function {name!r} has no parameter {items!r} and no **kwargs; its "
            f"signature is {name}{inspect.signature(fn)}; {usage}"
        )


_NOT_NAMED = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.VAR_POSITIONAL,
    inspect.Parameter.VAR_KEYWORD,
)


class RewardSignatureError(TypeError):
    """A reward function's signature cannot take the keyword call (a bug, never a sample error)."""


def keywords_for(fn: Callable, kwargs: dict, name: str = "") -> dict:
    """kwargs as fn accepts them: all with **kwargs, else only the names it has. A required
    parameter the call does not supply is a RewardSignatureError naming the keywords there are."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    named = {p.name: p for p in params if p.kind not in _NOT_NAMED}
    missing = [
        n for n, p in named.items() if p.default is inspect.Parameter.empty and n not in kwargs
    ]
    required_positional = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if missing or required_positional:
        raise RewardSignatureError(
            f"reward function {name or getattr(fn, '__name__', fn)!r} cannot be called with "
            f"the keywords {sorted(kwargs)}: its parameters {missing + required_positional} "
            f"get no value (signature {inspect.signature(fn)}). Reward functions are called "
            "with keyword arguments: def f(completions, **kwargs), or TRL's def f(prompts, "
            "completions, **kwargs), plus any dataset column by name"
        )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in named}


def _call(fn: Callable, items_name: str, items: list, kwargs: dict) -> Any:
    return fn(**keywords_for(fn, {items_name: items, **kwargs}))


def _check_call(fn: Callable, name: str, items_name: str, items: list, kwargs: dict) -> None:
    """Raise RewardSignatureError before any call when fn cannot take these keywords."""
    keywords_for(fn, {items_name: items, **kwargs}, name)


def call_with_options(factory: Callable[..., Any], options: Mapping[str, Any], what: str) -> Any:
    """`factory(**options)`, failing with the allowed option names when one is unknown."""
    params = inspect.signature(factory).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        allowed = [
            p.name
            for p in params
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for {what}; allowed: {allowed}")
    return factory(**options)


def column(columns: Mapping[str, Any], name: str, n: int, reward: str) -> Sequence[Any]:
    """The per-completion column `name` (length n); a missing column names the ones present."""
    if name not in columns:
        raise KeyError(
            f"reward {reward!r} needs the column {name!r}; columns passed: {sorted(columns)}"
        )
    values = columns[name]
    if len(values) != n:
        raise ValueError(
            f"reward {reward!r}: column {name!r} has {len(values)} rows for {n} completions"
        )
    return values


def load_reward_fn(spec: str) -> RewardFn:
    """Load a user reward function from "package.module:function" or "path/to/file.py:function"."""
    module_part, attr = split_user_spec(spec, "reward function")
    module = import_user_module(module_part, f"reward function {spec!r}")
    if not hasattr(module, attr):
        public = sorted(
            n for n in vars(module) if callable(getattr(module, n)) and not n.startswith("_")
        )
        raise AttributeError(
            f"reward function {spec!r}: module {module_part!r} has no attribute {attr!r}; "
            f"callables there: {public}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(
            f"reward function {spec!r}: {attr!r} is not callable (type {type(fn).__name__})"
        )
    check_reward_signature(fn, spec)
    return fn


def python_rewards(rewards: Any) -> dict[str, RewardFn | str]:
    """The Python API's `reward_fns=` as {key: function, or a reward name as the config's
    `rewards` take it}: a callable, a string, a list of them (a function's key is its __name__,
    a name's key the part after the last ':'), or a dict key -> callable. Each function's
    signature is checked as a loaded user function's is (check_reward_signature); scoring then
    goes through score_completions like every reward (errors counted per sample, NaN)."""
    if isinstance(rewards, Mapping):
        items = list(rewards.items())
        for key, fn in items:
            if not isinstance(key, str) or not key or ":" in key:
                raise ValueError(f"reward_fns: key {key!r} must be a non-empty name without ':'")
            if not callable(fn):
                raise TypeError(
                    f"reward_fns[{key!r}] must be a callable, got {type(fn).__name__}; a reward "
                    "given by name goes in a list: reward_fns=['format', my_fn]"
                )
    else:
        entries = list(rewards) if isinstance(rewards, list | tuple) else [rewards]
        if not entries:
            raise ValueError("reward_fns is empty: give a function, a name, or a list of them")
        items = [(_reward_key(entry), entry) for entry in entries]
    out: dict[str, RewardFn | str] = {}
    for key, entry in items:
        if key in out:
            raise ValueError(
                f"reward_fns: two rewards are named {key!r}; give a dict name -> function to "
                "name them apart"
            )
        if callable(entry):
            check_reward_signature(entry, key)
        out[key] = entry
    return out


def _reward_key(entry: Any) -> str:
    if isinstance(entry, str):
        return entry.rsplit(":", 1)[-1]
    if not callable(entry):
        raise TypeError(
            f"reward_fns: {entry!r} is neither a reward function nor a reward name (a built-in "
            "such as 'format', or 'module:function')"
        )
    name = getattr(entry, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"reward_fns: {entry!r} has no usable __name__ (e.g. a lambda); give a dict "
            "name -> function"
        )
    return name


def _batched_kwargs(examples: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]) -> dict:
    """Example columns as per-completion lists ("prompt" -> "prompts"), plus `extra` as given.

    `extra["prompts"]` (e.g. the prompt text after the chat template) replaces the examples'
    "prompt" column; any other name given twice is an error.
    """
    keys: list[str] = []
    for ex in examples:
        keys.extend(k for k in ex if k not in keys)
    kwargs = {("prompts" if k == "prompt" else k): [ex.get(k) for ex in examples] for k in keys}
    if "prompts" in extra:
        kwargs.pop("prompts", None)
    clash = sorted(set(kwargs) & set(extra)) + (["completions"] if "completions" in kwargs else [])
    if clash:
        raise ValueError(f"example columns {clash} clash with names the reward call reserves")
    kwargs.update(extra)
    return kwargs


def sample_kwargs(kwargs: Mapping[str, Any], i: int, n: int) -> dict:
    """Sample i's slice of a batch's reward kwargs, to call a reward function on one sample:
    lists / tuples / tensors of length n are per-sample (sliced to [i : i + 1]), the rest shared."""
    out = {}
    for k, v in kwargs.items():
        per_sample = isinstance(v, list | tuple) or (isinstance(v, Tensor) and v.dim() > 0)
        out[k] = v[i : i + 1] if per_sample and len(v) == n else v
    return out


def check_reward_values(name: str, values: Any, n: int, offset: int = 0) -> list[float | None]:
    """What reward function `name` returned for n samples, as floats / None (no reward); a wrong
    length or a non-finite / non-number value is an error naming sample `offset + j`."""
    if isinstance(values, Tensor):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise TypeError(f"reward function {name!r} must return a list, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} values for {n} completions"
        )
    out: list[float | None] = []
    for j, v in enumerate(values):
        if v is not None and (not isinstance(v, numbers.Real) or not math.isfinite(float(v))):
            raise ValueError(
                f"reward function {name!r} returned {v!r} for sample {offset + j}; "
                "each value must be a finite number or None"
            )
        out.append(None if v is None else float(v))
    return out


def score_completions(
    reward_fns: Mapping[str, RewardFn],
    completions: Sequence[str],
    examples: Sequence[Mapping[str, Any]],
    *,
    extra: Mapping[str, Any] | None = None,
    fail_fast: bool = False,
    items_name: str = "completions",
    first_errors: dict[str, str] | None = None,
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Score N completions with every reward function; returns (rewards, errors).

    examples: one example dict per completion (already repeated G times per group), so row i of
              every column belongs to completions[i]. Its "prompt" column is passed as `prompts`.
    extra:    keyword arguments passed through, e.g. completion_lengths, truncated, max_new_tokens
              (and optionally prompts); lists / tuples / tensors of length N are per-sample when
              retrying one sample at a time, anything else is passed whole.
    rewards:  name -> Float[N] (float32), NaN where the function gave None or failed.
    errors:   name -> number of samples on which the function raised.
    With fail_fast, the first failure is re-raised (original type; a BaseException that is no
    Exception, e.g. SystemExit, as a RuntimeError) with a note naming the function and the sample.
    items_name:   the keyword the items are passed under ("completions"; image rewards "images").
    first_errors: when given, name -> the first error's last traceback line, for each function
                  that failed on some sample (the caller's warning quotes it).
    """
    n = len(completions)
    if len(examples) != n:
        raise ValueError(f"score_completions: {len(examples)} examples for {n} completions")
    completions = list(completions)
    kwargs = _batched_kwargs(examples, extra or {})
    rewards: dict[str, Tensor] = {}
    errors: dict[str, int] = {}
    for name, fn in reward_fns.items():
        errors[name] = 0
        _check_call(fn, name, items_name, completions, kwargs)  # a signature bug: raise now
        try:
            raw = _call(fn, items_name, completions, kwargs)
        except (KeyboardInterrupt, RewardSignatureError):  # Ctrl-C; a wrapper's signature bug
            raise
        except BaseException as exc:  # SystemExit from user code is a failed sample, not an exit
            values, errors[name], first = _retry_each(
                name, fn, items_name, completions, kwargs, exc, fail_fast
            )
            if first is not None and first_errors is not None:
                first_errors.setdefault(name, first)
        else:
            values = check_reward_values(name, raw, n)  # a contract violation raises: it is a bug
        rewards[name] = torch.tensor(  # [N]
            [math.nan if v is None else v for v in values], dtype=torch.float32
        )
    return rewards, errors


def _reraise(exc: BaseException, note: str) -> None:
    """fail_fast: re-raise with a note; a non-Exception (SystemExit ...) as a RuntimeError, so
    that user code cannot end the trainer with its exit status."""
    if isinstance(exc, Exception):
        exc.add_note(note)
        raise exc
    raise RuntimeError(f"{error_line(exc)} ({note})") from exc


def _retry_each(
    name: str,
    fn: RewardFn,
    items_name: str,
    completions: list,
    kwargs: dict,
    batch_exc: BaseException,
    fail_fast: bool,
) -> tuple[list[float | None], int, str | None]:
    """After a batched call raised: call fn on each sample alone; failures become None.
    Returns (values, number failed, the first failure's last traceback line or None)."""
    n = len(completions)
    values: list[float | None] = []
    failed, first = 0, None
    for i in range(n):
        try:
            raw = _call(fn, items_name, completions[i : i + 1], sample_kwargs(kwargs, i, n))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            if fail_fast:
                _reraise(exc, f"raised by reward function {name!r} on sample {i}")
            values.append(None)
            failed += 1
            first = first or f"sample {i}: {error_line(exc)}"
        else:
            values += check_reward_values(name, raw, 1, offset=i)
    if fail_fast and failed == 0:
        # Every sample passes alone, so the batch itself is the problem: report that.
        _reraise(
            batch_exc,
            f"raised by reward function {name!r} on the batch of {n} (no single sample fails)",
        )
    return values, failed, first
