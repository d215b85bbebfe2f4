"""Math word problems from a hub dataset or a local file, scored by math-verify.

`source` is either a local file (.jsonl, .json, .parquet; read without network) or a hub dataset
name loaded with `datasets.load_dataset(name, config, split=...)`. GSM8K-style answers
("... #### 1,072") become the ground truth "1072". Every loading problem is one ValueError /
FileNotFoundError that names the file, the line or the columns that exist.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from grouprl.envs.answers import gsm8k_answer
from grouprl.envs.rewards.text import accuracy_reward
from grouprl.envs.tasks.base import TaskData, check_choice, check_int, check_template

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
# names single_turn.collect passes to reward functions itself ("prompts" comes from "prompt")
RESERVED_COLUMNS = frozenset(
    {"completions", "prompts", "completion_lengths", "truncated", "max_new_tokens"}
)

# ---------------------------------------------------------------- loading


def _json_msg(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:120]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:  # also: huge ints, absurd nesting
                raise ValueError(
                    f"{path}: line {number} is not valid JSON ({_json_msg(exc)})"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {number} is a {type(row).__name__}, not an object")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    """A JSON list of objects, or {"<field>": [objects]}; one object per line is read as JSONL."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several top-level values: the JSON Lines layout
            return _read_jsonl(path)
        raise ValueError(f"{path}: line {exc.lineno} is not valid JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({_json_msg(exc)})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a list of objects or one field holding that list")
        data = lists[0]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a list of objects")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # a datasets dependency; imported only when needed

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:
        raise ValueError(f"{path}: cannot read as parquet ({exc})") from exc


READERS: dict[str, Callable[[Path], list[dict]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def _is_local(source: str) -> bool:
    return (
        source.endswith(LOCAL_SUFFIXES)
        or source.startswith((".", "/", "~"))
        or Path(source).exists()
    )


def load_records(source: str, config: str | None = None, split: str | None = None) -> list[dict]:
    """Rows of a local file or a hub dataset split (default "train") as a list of dicts."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"math task: source must be a dataset name or a file path, got {source!r}")
    if _is_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"math task: file {str(path)!r} does not exist")
        if path.suffix not in READERS or not path.is_file():
            raise ValueError(
                f"math task: {str(path)!r} must be a file ending with one of {list(READERS)}"
            )
        if split is not None or config is not None:
            raise ValueError(
                f"math task: split / config apply to hub datasets, not to {str(path)!r}"
            )
        rows = READERS[path.suffix](path)
    else:
        import datasets  # heavy; only hub sources need it

        split = split or "train"
        try:
            rows = list(datasets.load_dataset(source, config, split=split))
        except Exception as exc:
            raise ValueError(
                f"math task: cannot load hub dataset {source!r} (config={config!r}, "
                f"split={split!r}): {exc}"
            ) from exc
    if not rows:
        raise ValueError(f"math task: {source!r} has no rows")
    return rows


# ---------------------------------------------------------------- examples


def _raw_answer(text: str) -> str | None:
    return text.strip() or None


AnswerFormat = Literal["auto", "gsm8k", "raw"]
ANSWER_FORMATS: dict[str, Callable[[str], str | None]] = {
    "auto": lambda text: gsm8k_answer(text) if "####" in text else _raw_answer(text),
    "gsm8k": gsm8k_answer,  # the text after "####", commas removed
    "raw": _raw_answer,  # the whole answer, stripped (math-verify parses it)
}


def to_examples(
    rows: list[dict],
    source: str,
    question_column: str,
    answer_column: str,
    prompt_template: str,
    system_prompt: str | None,
    answer_format: AnswerFormat,
) -> list[dict[str, Any]]:
    """Rows -> examples {"prompt", "answer", ...the row's other columns}."""
    present = sorted({k for row in rows for k in row})
    reserved = sorted(set(present) & RESERVED_COLUMNS)
    if reserved:
        raise ValueError(
            f"math task: columns {reserved} of {source!r} clash with names the reward call "
            f"reserves ({sorted(RESERVED_COLUMNS)}); rename them"
        )
    for name in (question_column, answer_column):
        if name not in present:
            raise ValueError(f"math task: column {name!r} is not in {source!r}; columns: {present}")
    check_template("prompt_template", prompt_template, set(present) | {"question"}, ("question",))
    extract = ANSWER_FORMATS[answer_format]
    examples = []
    for i, row in enumerate(rows):
        question, raw = row.get(question_column), row.get(answer_column)
        answer = extract(str(raw)) if raw is not None else None
        if question is None or answer is None:
            raise ValueError(
                f"math task: row {i} of {source!r} has no usable {question_column!r} / "
                f"{answer_column!r} (answer_format={answer_format!r}): {str(raw)[:80]!r}"
            )
        try:
            text = prompt_template.format(**{**row, "question": question})
        except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
            # e.g. a column the template names is missing from this row (present in others)
            raise ValueError(
                f"math task: row {i} of {source!r}: prompt_template={prompt_template!r} cannot "
                f"be filled ({type(exc).__name__}: {exc})"
            ) from None
        prompt: str | list[dict[str, str]] = text
        if system_prompt is not None:
            prompt = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": text},
            ]
        examples.append({**row, "prompt": prompt, "answer": answer})
    return examples


def build_math(
    source: str,
    config: str | None = None,
    split: str | None = None,
    question_column: str = "question",
    answer_column: str = "answer",
    prompt_template: str = "{question}",
    system_prompt: str | None = None,
    answer_format: AnswerFormat = "auto",
    eval_source: str | None = None,
    eval_config: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
    answer_tag: str | None = None,
) -> TaskData:
    """Math task (e.g. GSM8K, MATH), reward: accuracy via math-verify.

    source:          hub dataset name, or a local .jsonl / .json / .parquet file
    config, split:   hub config name and split (default "train"); not allowed for local files
    question_column, answer_column: columns holding the question and the answer
    prompt_template: format string with {question} (other columns may be used by name too)
    system_prompt:   when set, prompts are chat messages [system, user] instead of plain text
    answer_format:   "auto" (GSM8K "#### x" when present, else the whole answer), "gsm8k", "raw"
    eval_source, eval_config: a separate eval dataset (file or hub name); eval_split: its split
                     (default "test"), or with no eval_source a second split of `source`
    eval_fraction:   else hold out this fraction of `source` (shuffled with `seed`); 0 = no eval
    max_train, max_eval: keep at most this many examples (None = all)
    answer_tag:      accuracy reads the answer inside <answer_tag>...</answer_tag> (None = anywhere)
    """
    check_choice("answer_format", answer_format, ANSWER_FORMATS)
    check_int("seed", seed)
    for name, value in (("max_train", max_train), ("max_eval", max_eval)):
        if value is not None:
            check_int(name, value, minimum=1)
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction and (eval_source is not None or eval_split is not None):
        raise ValueError("give eval_source / eval_split or eval_fraction, not both")
    options = (question_column, answer_column, prompt_template, system_prompt, answer_format)

    train = to_examples(load_records(source, config, split), source, *options)
    evaluation: list[dict[str, Any]] = []
    if eval_source is not None:
        rows = load_records(
            eval_source, eval_config, eval_split or _default_eval_split(eval_source)
        )
        evaluation = to_examples(rows, eval_source, *options)
    elif eval_split is not None:
        evaluation = to_examples(load_records(source, config, eval_split), source, *options)
    elif eval_fraction > 0:
        random.Random(seed).shuffle(train)
        n_eval = max(1, round(eval_fraction * len(train)))
        if n_eval >= len(train):
            raise ValueError(
                f"eval_fraction={eval_fraction} leaves no training rows of {len(train)}"
            )
        evaluation, train = train[:n_eval], train[n_eval:]
    return TaskData(
        train=train[:max_train],
        eval=evaluation[:max_eval],
        reward_fns={"accuracy": accuracy_reward(mode="math", answer_tag=answer_tag)},
        default_reward_weights={"accuracy": 1.0},
    )


def _default_eval_split(eval_source: str) -> str | None:
    return None if _is_local(eval_source) else "test"
