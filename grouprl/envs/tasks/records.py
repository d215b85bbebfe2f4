"""Dataset rows from every source a TRL user has, as a list of dicts, plus the prompt a row makes.

Sources (`load_records`):
- a `datasets.Dataset` or `DatasetDict` object passed from Python (the split picks the part);
- a list of dicts passed from Python (one example per dict; the Python API's `dataset=`);
- a local file: .jsonl, .json, .parquet, .csv (read without network);
- a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (arrow files, no pickle);
- a hub dataset name, `datasets.load_dataset(name, config, split=...)`.
Every reading problem is one ValueError / FileNotFoundError naming the file and the line or row:
invalid UTF-8 (with its line), malformed JSON lines, a CSV row with the wrong number of fields.

Prompts (`make_prompt`): a column holding a string is filled into the task's template (plain
text; [system, user] messages with a system prompt); a column holding a conversation (a list of
{"role", "content"} messages, TRL's "conversational" format) stays a message list, which the
policy renders with the tokenizer's chat template. The template then fills the content of the
last user message, and a system prompt is put first unless the conversation starts with one. A
prompt of more than MAX_PROMPT_CHARS characters is an error naming the source and the row.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# A prompt this long cannot fit any context; caught here with its row rather than at tokenization.
MAX_PROMPT_CHARS = 1_000_000


def _json_msg(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)[:120]


def _decode(path: Path, data: bytes, line: int | None = None) -> str:
    """UTF-8 text; invalid bytes are an error naming the file and the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = line if line is not None else data[: exc.start].count(b"\n") + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise ValueError(
            f"{path}: line {where} is not valid UTF-8 (byte {data[exc.start]:#04x} at column "
            f"{column})"
        ) from None


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(path, raw, number)
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
    text = _decode(path, path.read_bytes())
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
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of objects")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} is a {type(row).__name__}, not an object")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # a datasets dependency; imported only when needed

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:
        raise ValueError(f"{path}: cannot read as parquet ({exc})") from exc


def _read_csv(path: Path) -> list[dict]:
    """A header line, then one row per line (RFC 4180 quoting); values stay strings."""
    text = _decode(path, path.read_bytes())
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows = []
    try:
        for row in reader:
            if None in row or any(v is None for v in row.values()):  # extra / missing fields
                raise ValueError(
                    f"{path}: line {reader.line_num} does not have the header's "
                    f"{len(reader.fieldnames or [])} fields"
                )
            rows.append(dict(row))
    except csv.Error as exc:
        raise ValueError(f"{path}: line {reader.line_num} is not valid CSV ({exc})") from None
    return rows


READERS: dict[str, Callable[[Path], list[dict]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
    ".csv": _read_csv,
}


def is_saved_dataset(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk (state.json) or DatasetDict's (dataset_dict.json)."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("state.json", "dataset_dict.json")
    )


def is_local(source: Any) -> bool:
    return isinstance(source, str) and (
        source.endswith(LOCAL_SUFFIXES)
        or source.startswith((".", "/", "~"))
        or Path(source).exists()
    )


def describe(source: Any) -> str:
    """How errors name the source: the path / hub name, or the Python object's type."""
    if isinstance(source, list):
        return f"<list of {len(source)} rows passed from Python>"
    return source if isinstance(source, str) else f"<{type(source).__name__} passed from Python>"


def _from_list(rows: list, split: str | None, task: str) -> list[dict]:
    """Rows of a list passed from Python: each a dict with string keys (copied, so that the
    task's columns never alias the caller's objects)."""
    where = describe(rows)
    if split is not None:
        raise ValueError(f"{task} task: split={split!r} applies to a DatasetDict, not to {where}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"{task} task: row {i} of {where} is a {type(row).__name__}, not a dict: "
                f"{str(row)[:80]!r}"
            )
        bad = [k for k in row if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{task} task: row {i} of {where} has non-string keys {bad[:5]!r}")
        out.append(dict(row))
    return out


def _from_dataset(data: Any, split: str | None, where: str, task: str) -> list[dict]:
    """Rows of a datasets.Dataset, or of one split of a DatasetDict (default "train")."""
    if isinstance(data, Mapping):  # DatasetDict
        split = split or "train"
        if split not in data:
            raise ValueError(f"{task} task: {where} has no split {split!r}; splits: {list(data)}")
        data = data[split]
    elif split is not None:
        raise ValueError(f"{task} task: split={split!r} applies to a DatasetDict, not to {where}")
    return [dict(row) for row in data]


def load_records(
    source: Any, config: str | None = None, split: str | None = None, task: str = "math"
) -> list[dict]:
    """Rows of `source` (see the module docstring) as a list of dicts."""
    import datasets  # noqa: F401  (only for the isinstance checks below; installed with grouprl)
    from datasets import Dataset, DatasetDict

    if isinstance(source, Dataset | DatasetDict):
        if config is not None:
            raise ValueError(
                f"{task} task: config applies to hub datasets, not to a Dataset object"
            )
        rows = _from_dataset(source, split, describe(source), task)
    elif isinstance(source, list):
        if config is not None:
            raise ValueError(f"{task} task: config applies to hub datasets, not to a list of rows")
        rows = _from_list(source, split, task)
    elif not isinstance(source, str) or not source:
        raise ValueError(
            f"{task} task: source must be a dataset name, a file or folder path, a "
            f"datasets.Dataset or a list of dicts, got {str(source)[:200]!r}"
        )
    elif is_local(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{task} task: file {str(path)!r} does not exist")
        if config is not None:
            raise ValueError(f"{task} task: config applies to hub datasets, not to {str(path)!r}")
        if is_saved_dataset(path):
            try:
                saved = datasets.load_from_disk(str(path))
            except Exception as exc:
                raise ValueError(
                    f"{task} task: cannot load the saved dataset {path}: {exc}"
                ) from exc
            rows = _from_dataset(saved, split, str(path), task)
        elif path.is_file() and path.suffix in READERS:
            if split is not None:
                raise ValueError(
                    f"{task} task: split applies to hub datasets and DatasetDicts, not to "
                    f"{str(path)!r}"
                )
            rows = READERS[path.suffix](path)
        else:
            raise ValueError(
                f"{task} task: {str(path)!r} must be a file ending with one of {list(READERS)} or "
                "a folder written by save_to_disk"
            )
    else:
        split = split or "train"
        try:
            rows = list(datasets.load_dataset(source, config, split=split))
        except Exception as exc:
            raise ValueError(
                f"{task} task: cannot load hub dataset {source!r} (config={config!r}, "
                f"split={split!r}): {exc}"
            ) from exc
    if not rows:
        raise ValueError(f"{task} task: {describe(source)} has no rows")
    return rows


# ---------------------------------------------------------------- prompts


def is_conversation(value: Any) -> bool:
    """A list of {"role", "content"} messages (TRL's conversational format)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _check_size(text: str, where: str) -> None:
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"{where}: the prompt has {len(text):,} characters (limit {MAX_PROMPT_CHARS:,}); no "
            "model context holds it. Remove the row or shorten it"
        )


def make_prompt(
    value: Any,
    fill: Callable[[str], str],
    system_prompt: str | None,
    where: str,
) -> str | list[dict[str, str]]:
    """The prompt of one row from its prompt column `value` (string or conversation).

    fill: the task's template applied to a text (the question, or the last user message).
    where: "task: row i of source, column c", used in every error.
    """
    if isinstance(value, str):
        text = fill(value)
        _check_size(text, where)
        if system_prompt is None:
            return text
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": text}]
    if not is_conversation(value):
        raise ValueError(
            f"{where}: expected a string or a list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__}: {str(value)[:80]!r}"
        )
    messages = [dict(m) for m in value]
    for j, m in enumerate(messages):
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {j} must have string role and content, got {m!r}")
    users = [j for j, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: the conversation has no user message: {messages!r}"[:300])
    messages[users[-1]]["content"] = fill(messages[users[-1]]["content"])
    _check_size("".join(m["content"] for m in messages), where)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def dataset_summary(value: Any) -> Any:
    """How the resolved config.yaml and the loggers record a Dataset object passed from Python
    (pydantic's model_dump fallback): its size, columns and fingerprint, not its rows. A config
    file holding this summary cannot be run again as it is: it names what was used."""
    from datasets import Dataset, DatasetDict

    if isinstance(value, Dataset):
        return {"python_object": "datasets.Dataset", "rows": len(value),
                "columns": list(value.column_names), "fingerprint": value._fingerprint}  # fmt: skip
    if isinstance(value, DatasetDict):
        return {"python_object": "datasets.DatasetDict",
                "splits": {k: dataset_summary(v) for k, v in value.items()}}  # fmt: skip
    raise TypeError(f"cannot write {type(value).__name__} into the config record")
