"""Math word problems from a hub dataset, a local file or a Dataset object, scored by math-verify.

`source`: a local file (.jsonl, .json, .parquet, .csv; read without network), a save_to_disk
folder, a `datasets.Dataset` / `DatasetDict` passed from Python, or a hub dataset name loaded with
`datasets.load_dataset(name, config, split=...)` (records.py). The question column may hold text
or a conversation (TRL's format: a list of {role, content} messages, rendered with the chat
template). GSM8K-style answers ("... #### 1,072") become the ground truth "1072". Every loading
problem is one ValueError / FileNotFoundError that names the file, the line or row, or the
columns that exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from grouprl.envs.answers import gsm8k_answer
from grouprl.envs.rewards.text import accuracy_reward
from grouprl.envs.tasks.base import (
    TaskData,
    check_choice,
    check_split_options,
    check_template,
    train_and_eval,
)
from grouprl.envs.tasks.records import READERS, describe, is_local, load_records, make_prompt

__all__ = ["READERS", "build_math", "load_records", "to_examples"]

# names single_turn.collect passes to reward functions itself ("prompts" comes from "prompt")
RESERVED_COLUMNS = frozenset(
    {"completions", "prompts", "completion_lengths", "truncated", "max_new_tokens"}
)

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
    source: Any,
    question_column: str,
    answer_column: str,
    prompt_template: str,
    system_prompt: str | None,
    answer_format: AnswerFormat,
) -> list[dict[str, Any]]:
    """Rows -> examples {"prompt", "answer", ...the row's other columns}; when the answer column
    held more than the answer (GSM8K's worked solution "... #### 72"), its whole text is kept as
    "solution" too (unless the row has a "solution" column): the reference solution of
    rollout.hooks hint."""
    source = describe(source)
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

        def fill(text: str, row: dict = row, i: int = i) -> str:
            try:
                return prompt_template.format(**{**row, "question": text})
            except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
                # e.g. a column the template names is missing from this row (present in others)
                raise ValueError(
                    f"math task: row {i} of {source!r}: prompt_template={prompt_template!r} "
                    f"cannot be filled ({type(exc).__name__}: {exc})"
                ) from None

        where = f"math task: row {i} of {source!r}, column {question_column!r}"
        prompt = make_prompt(question, fill, system_prompt, where)
        example = {**row, "prompt": prompt, "answer": answer}
        if "solution" not in row and str(raw).strip() != answer:
            example["solution"] = str(raw)  # GSM8K's worked solution: what hints read
        examples.append(example)
    return examples


def build_math(
    source: Any,
    config: str | None = None,
    split: str | None = None,
    question_column: str = "question",
    answer_column: str = "answer",
    prompt_template: str = "{question}",
    system_prompt: str | None = None,
    answer_format: AnswerFormat = "auto",
    eval_source: Any = None,
    eval_config: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
    answer_tag: str | None = None,
) -> TaskData:
    """Math task (e.g. GSM8K, MATH), reward: accuracy via math-verify.

    source:          hub dataset name, a local .jsonl / .json / .parquet / .csv file, a
                     save_to_disk folder, or a datasets.Dataset / DatasetDict object
    config, split:   hub config name and split (default "train"); split also picks the part of a
                     DatasetDict (object or folder); not allowed for single files
    question_column, answer_column: columns holding the question and the answer
    prompt_template: format string with {question} (other columns may be used by name too); for a
                     conversational question column it fills the last user message
    system_prompt:   when set, prompts are chat messages [system, user] instead of plain text
                     (a conversation gets it first unless it starts with a system message)
    answer_format:   "auto" (GSM8K "#### x" when present, else the whole answer), "gsm8k", "raw"
    eval_source, eval_config: a separate eval dataset (file or hub name); eval_split: its split
                     (default "test"), or with no eval_source a second split of `source`
    eval_fraction:   else hold out this fraction of `source` (shuffled with `seed`); 0 = no eval
    max_train, max_eval: keep at most this many examples (None = all)
    answer_tag:      accuracy reads the answer inside <answer_tag>...</answer_tag> (None = anywhere)
    """
    check_choice("answer_format", answer_format, ANSWER_FORMATS)
    given = eval_source is not None or eval_split is not None
    check_split_options("math", seed, max_train, max_eval, eval_fraction, given)
    options = (question_column, answer_column, prompt_template, system_prompt, answer_format)

    if eval_source is not None and eval_split is None:
        eval_split = _default_eval_split(eval_source)

    def load(src: Any, cfg: str | None, part: str | None) -> list[dict]:
        return to_examples(load_records(src, cfg, part), src, *options)

    train, evaluation = train_and_eval(
        load, source, config, split, eval_source, eval_config, eval_split, eval_fraction, seed
    )
    return TaskData(
        train=train[:max_train],
        eval=evaluation[:max_eval],
        reward_fns={"accuracy": accuracy_reward(mode="math", answer_tag=answer_tag)},
        default_reward_weights={"accuracy": 1.0},
    )


def _default_eval_split(eval_source: Any) -> str | None:
    from datasets import DatasetDict

    if isinstance(eval_source, DatasetDict):
        return "test"
    return None if not isinstance(eval_source, str) or is_local(eval_source) else "test"
