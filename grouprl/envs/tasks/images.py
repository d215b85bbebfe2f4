"""Prompt tasks for image / video policies: the synthetic shapes prompts, class lists, prompt files
and hub datasets. The policy draws pictures; the rewards (envs/rewards/image.py, shapes.py) score them.

    task: {name: image_prompts, options: {source: shapes}}
    task: {name: image_prompts, options: {source: file, path: prompts.txt, eval_path: test.txt}}
    task: {name: image_prompts, options: {source: hub, path: <dataset id or local dataset dir>}}
    task: {name: image_prompts, options: {source: classes, classes: [tabby cat, golden retriever]}}

An example is {"prompt": str, ...}; an evaluation example also has "seed", the fixed seed of its
image (the same prompts and seeds before and after training). Every column reaches the reward
functions as a per-sample keyword (e.g. GenEval-style metadata from a jsonl file). Class-conditional
sources add "class_label" (its index in the class list), which a class-conditional velocity model
takes instead of a text embedding (model.condition: class_label).

- shapes: the 12 "<colour> <shape>" prompts of grouprl.envs.shapes with class_label, colour, shape
  and target_rgb columns; default reward color_area (envs/rewards/shapes.py).
- classes: one example per name in `classes`, class_label = its index; no default reward.
- file: a .txt file (one prompt per line, blank lines skipped) or .jsonl (one object per line with a
  `column` field holding the prompt; other fields kept as columns); no default reward.
- hub: `datasets.load_dataset(path, split=split)` (a hub id, or a local folder of data files, which
  goes through the same call), prompt in `column`; no default reward.
Evaluation examples: the `eval_path` file / `eval_split` split when given, else the first `n_eval`
training prompts; each is repeated `eval_repeats` times with consecutive seeds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grouprl.envs.rewards.shapes import color_area
from grouprl.envs.tasks.base import TaskData, check_choice, check_int


def _shapes(**_: Any) -> list[dict]:
    from grouprl.envs.shapes import COLORS, SHAPES, class_names

    names = class_names()
    pairs = [(c, s) for c in COLORS for s in SHAPES]  # class-id order
    return [{"prompt": names[i], "class_label": i, "color": c, "shape": s,
             "target_rgb": list(COLORS[c])} for i, (c, s) in enumerate(pairs)]  # fmt: skip


def _classes(classes: list[str] | None = None, **_: Any) -> list[dict]:
    if not classes or not all(isinstance(c, str) and c for c in classes):
        raise ValueError("source 'classes' needs `classes`: a non-empty list of class names")
    return [{"prompt": c, "class_label": i} for i, c in enumerate(classes)]


def _file(path: str | None = None, column: str = "prompt", **_: Any) -> list[dict]:
    if not path:
        raise ValueError("source 'file' needs `path`: a .txt (one prompt per line) or .jsonl file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"prompt file {str(file)!r} does not exist")
    lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    if file.suffix == ".txt":
        return [{"prompt": line} for line in lines]
    if file.suffix != ".jsonl":
        raise ValueError(f"prompt file {str(file)!r} must end in .txt or .jsonl")
    rows = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get(column), str):
            raise ValueError(f"{str(file)!r} line {i + 1}: needs a string field {column!r}")
        rows.append({"prompt": row[column], **{k: v for k, v in row.items() if k != column}})
    return rows


def _hub(path: str | None = None, column: str = "prompt", split: str = "train", **_: Any):
    if not path:
        raise ValueError("source 'hub' needs `path`: a dataset id or a local dataset folder")
    from datasets import load_dataset

    data = load_dataset(path, split=split)
    if column not in data.column_names:
        raise ValueError(
            f"dataset {path!r} split {split!r} has no column {column!r}; columns: {data.column_names}"
        )
    return [{"prompt": row[column], **{k: v for k, v in row.items() if k != column}}
            for row in data]  # fmt: skip


SOURCES: dict[str, Callable[..., list[dict]]] = {
    "shapes": _shapes,
    "classes": _classes,
    "file": _file,
    "hub": _hub,
}


def build_image_prompts(
    source: str = "shapes",
    path: str | None = None,
    column: str = "prompt",
    split: str = "train",
    classes: list[str] | None = None,
    eval_path: str | None = None,
    eval_split: str | None = None,
    n_eval: int | None = None,
    eval_repeats: int = 1,
    eval_seed: int = 0,
) -> TaskData:
    """Image prompt task (module docstring).

    source:        shapes | classes | file | hub
    path:          file: the .txt / .jsonl file; hub: the dataset id or local dataset folder
    column:        jsonl / hub: the field holding the prompt
    split:         hub: the training split
    classes:       classes: the class names (prompt = name, class_label = index)
    eval_path:     file: held-out prompts (same format); eval_split: hub: the held-out split
    n_eval:        without a held-out file / split: evaluate on the first n_eval training prompts
                   (None: all of them)
    eval_repeats:  evaluation images per prompt (consecutive seeds)
    eval_seed:     the first evaluation seed
    Examples: {"prompt", + the source's columns}; evaluation examples also "seed".
    """
    check_choice("source", source, SOURCES)
    check_int("eval_repeats", eval_repeats, minimum=1)
    check_int("eval_seed", eval_seed)
    load = SOURCES[source]
    train = load(path=path, column=column, split=split, classes=classes)
    if not train:
        raise ValueError(f"image prompt source {source!r} gave no prompts")
    if eval_path is not None and source != "file":
        raise ValueError("eval_path is for source 'file'; use eval_split with source 'hub'")
    if eval_split is not None and source != "hub":
        raise ValueError("eval_split is for source 'hub'")
    if eval_path is not None:
        held_out = _file(path=eval_path, column=column)
    elif eval_split is not None:
        held_out = _hub(path=path, column=column, split=eval_split)
    else:
        if n_eval is not None:
            check_int("n_eval", n_eval, minimum=1)
        held_out = train[:n_eval]
    evals = [
        {**ex, "seed": eval_seed + i * eval_repeats + r}
        for i, ex in enumerate(held_out)
        for r in range(eval_repeats)
    ]
    if source == "shapes":
        return TaskData(train, evals, {"color_area": color_area()}, {"color_area": 1.0})
    return TaskData(train, evals, {})
