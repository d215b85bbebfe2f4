"""A prompt-only dataset for model-based or user rewards: a prompt column, no answer.

The TRL setting of a reward model or a judge scoring free text: each row gives a prompt (text or
a conversation of {role, content} messages, rendered with the chat template), every other column
is passed to the reward functions by name. The task has no reward of its own: list `rewards` in
the config (a user function "module:function" or a built-in such as format / length).
"""

from __future__ import annotations

from typing import Any

from grouprl.envs.tasks.base import TaskData, check_split_options, check_template, train_and_eval
from grouprl.envs.tasks.math import RESERVED_COLUMNS
from grouprl.envs.tasks.records import describe, load_records, make_prompt


def to_examples(
    rows: list[dict], source: Any, prompt_column: str, prompt_template: str,
    system_prompt: str | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows -> examples {"prompt", ...the row's other columns}."""
    where = describe(source)
    present = sorted({k for row in rows for k in row})
    if prompt_column not in present:
        raise ValueError(
            f"prompts task: column {prompt_column!r} is not in {where!r}; columns: {present}"
        )
    reserved = sorted(set(present) & RESERVED_COLUMNS)
    if reserved:
        raise ValueError(
            f"prompts task: columns {reserved} of {where!r} clash with names the reward call "
            f"reserves ({sorted(RESERVED_COLUMNS)}); rename them"
        )
    check_template("prompt_template", prompt_template, {"prompt"}, ("prompt",))
    examples = []
    for i, row in enumerate(rows):
        if row.get(prompt_column) is None:
            raise ValueError(f"prompts task: row {i} of {where!r} has no {prompt_column!r}")
        prompt = make_prompt(
            row[prompt_column], lambda text: prompt_template.format(prompt=text), system_prompt,
            f"prompts task: row {i} of {where!r}, column {prompt_column!r}",
        )  # fmt: skip
        rest = {k: v for k, v in row.items() if k != prompt_column}
        examples.append({**rest, "prompt": prompt})
    return examples


def build_prompts(
    source: Any,
    config: str | None = None,
    split: str | None = None,
    prompt_column: str = "prompt",
    prompt_template: str = "{prompt}",
    system_prompt: str | None = None,
    eval_source: Any = None,
    eval_split: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
) -> TaskData:
    """Prompt-only task; no reward of its own (list `rewards` in the config).

    source, config, split: as the math task (file, save_to_disk folder, Dataset object, hub name)
    prompt_column:   the column with the prompt: text or a list of {role, content} messages
    prompt_template: format string with {prompt}; for a conversation it fills the last user message
    system_prompt:   put first as a system message (unless a conversation starts with one)
    eval_source, eval_split: a held-out source / split; eval_fraction: else hold out this fraction
    max_train, max_eval: keep at most this many examples (None = all)
    """
    given = eval_source is not None or eval_split is not None
    check_split_options("prompts", seed, max_train, max_eval, eval_fraction, given)
    options = (prompt_column, prompt_template, system_prompt)

    def load(src: Any, cfg: str | None, part: str | None) -> list[dict]:
        return to_examples(load_records(src, cfg, part, "prompts"), src, *options)

    train, evaluation = train_and_eval(
        load, source, config, split, eval_source, None, eval_split, eval_fraction, seed
    )
    return TaskData(train=train[:max_train], eval=evaluation[:max_eval], reward_fns={})
