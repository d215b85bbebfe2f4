"""`vqa`: visual question answering from a dataset with image columns (geometry, chart, TRL-style).

Rows come from every source `load_records` reads (local .jsonl / .json / .parquet / .csv, a
save_to_disk folder, a `datasets.Dataset` from Python, a hub name); the prompt and its images
become the VLM's message form (multimodal.py, which also holds the rules for untrusted image
files). The datasets users train Qwen2.5-VL on fit without conversion:
  geometry3k-style: images (a list), problem with "<image>", answer        (reward math)
  ChartQA-style:    image, query, label (a list of accepted answers)       (reward exact)
  TRL's form:       prompt messages with {"type": "image"} items, images   (either)

Rewards: `accuracy`, 1.0 / 0.0: "exact" compares the answer (inside <answer_tag>...</answer_tag>
when set, else the whole completion) with the accepted answer(s) after lower-casing and
stripping spaces and a final period; "math" is the math task's math-verify check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from grouprl.envs.rewards.text import accuracy_reward
from grouprl.envs.tasks.base import TaskData, check_split_options, train_and_eval
from grouprl.envs.tasks.multimodal import MAX_PIXELS, load_images, vlm_prompt
from grouprl.envs.tasks.records import describe, is_local, load_records

Reward = Literal["exact", "math"]
PROMPT_COLUMNS = ("prompt", "problem", "question", "query", "messages")
IMAGE_COLUMNS = ("images", "image")
ANSWER_COLUMNS = ("answer", "solution", "label")


def _pick(row: dict, given: str | None, defaults: tuple[str, ...], what: str, where: str) -> str:
    if given is not None:
        if given not in row:
            raise ValueError(f"{where}: no {what} column {given!r}; columns: {sorted(row)}")
        return given
    for name in defaults:
        if name in row:
            return name
    raise ValueError(
        f"{where}: none of the {what} columns {list(defaults)} is present (columns: "
        f"{sorted(row)}); name it with the {what}_column option"
    )


def _normalise(text: str) -> str:
    return " ".join(str(text).strip().rstrip(".").strip().lower().split())


def exact_reward(answer_tag: str | None = None):
    """accuracy 'exact': the answer (inside the tag when set) equals one accepted answer."""

    def accuracy(completions: list, answer: list, **_: Any) -> list[float]:
        out = []
        for c, accepted in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else str(c)
            if answer_tag is not None:
                open_, close = f"<{answer_tag}>", f"</{answer_tag}>"
                if open_ not in text or close not in text.split(open_, 1)[1]:
                    out.append(0.0)
                    continue
                text = text.split(open_, 1)[1].split(close, 1)[0]
            options = accepted if isinstance(accepted, list) else [accepted]
            out.append(float(_normalise(text) in {_normalise(a) for a in options}))
        return out

    return accuracy


def build_vqa(
    source: Any,
    config: str | None = None,
    split: str | None = None,
    prompt_column: str | None = None,
    image_column: str | None = None,
    answer_column: str | None = None,
    template: str = "{prompt}",
    system_prompt: str | None = None,
    reward: Reward = "exact",
    answer_tag: str | None = None,
    image_root: str | None = None,
    max_image_pixels: int = MAX_PIXELS,
    eval_source: Any = None,
    eval_config: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    max_train: int | None = None,
    max_eval: int | None = None,
) -> TaskData:
    """Visual question answering (grouprl/envs/tasks/vqa.py).

    source: hub dataset name, a local .jsonl / .json / .parquet / .csv file, a save_to_disk folder, a datasets.Dataset or a list of dicts
    config, split: hub config name and split (default "train"; split also picks a DatasetDict part)
    prompt_column: the question (a string, "<image>" placeholders allowed, or messages); default the first of prompt, problem, question, query, messages
    image_column: one image or a list per row (paths, PIL images, bytes, {bytes, path} dicts); default images or image
    answer_column: the accepted answer (a string or a list of them); default answer, solution or label
    template: format string with {prompt} (and other columns by name) for string prompts
    system_prompt: a system message put first
    reward: accuracy by exact match (exact) or math-verify (math)
    answer_tag: accuracy reads the answer inside <answer_tag>...</answer_tag> (None: the whole completion for exact, anywhere for math)
    image_root: the folder image paths must stay inside (default: the dataset file's folder)
    max_image_pixels: larger images are an error naming the row
    eval_source, eval_config, eval_split: a separate held-out dataset / split (as in the math task)
    eval_fraction: else hold out this fraction of source (shuffled with seed)
    seed: seeds the hold-out shuffle
    max_train, max_eval: keep at most this many examples
    """
    if reward not in ("exact", "math"):
        raise ValueError(f"reward={reward!r} is not allowed; choose one of ['exact', 'math']")
    given = eval_source is not None or eval_split is not None
    check_split_options("vqa", seed, max_train, max_eval, eval_fraction, given)

    def load(src: Any, cfg: str | None, part: str | None) -> list[dict]:
        rows = load_records(src, cfg, part, task="vqa")
        root = Path(image_root) if image_root else None
        if root is None and isinstance(src, str) and is_local(src):
            path = Path(src).expanduser()
            root = path if path.is_dir() else path.parent
        out = []
        for i, row in enumerate(rows):
            where = f"vqa task: {describe(src)} row {i}"
            p_col = _pick(row, prompt_column, PROMPT_COLUMNS, "prompt", where)
            i_col = _pick(row, image_column, IMAGE_COLUMNS, "image", where)
            a_col = _pick(row, answer_column, ANSWER_COLUMNS, "answer", where)
            images = load_images(row[i_col], where, root, max_image_pixels)
            prompt = row[p_col]
            if isinstance(prompt, str):
                columns = {k: v for k, v in row.items() if isinstance(v, str | int | float)}
                prompt = template.format(**{**columns, "prompt": prompt})
            messages = vlm_prompt(prompt, images, where)
            if system_prompt and messages[0].get("role") != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            answer = row[a_col]
            answer = [str(a) for a in answer] if isinstance(answer, list) else str(answer)
            extra = {k: v for k, v in row.items() if k not in (p_col, i_col, a_col)}
            extra = {k: v for k, v in extra.items() if isinstance(v, str | int | float | bool)}
            out.append({**extra, "prompt": messages, "answer": answer})
        return out

    train, evaluation = train_and_eval(
        load, source, config, split, eval_source, eval_config, eval_split, eval_fraction, seed
    )
    fn = (
        exact_reward(answer_tag)
        if reward == "exact"
        else accuracy_reward(mode="math", answer_tag=answer_tag)
    )
    return TaskData(
        train=train[:max_train],
        eval=evaluation[:max_eval],
        reward_fns={"accuracy": fn},
        default_reward_weights={"accuracy": 1.0},
    )
