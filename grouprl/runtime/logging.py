"""What a person sees during a run: metrics.jsonl, optional TensorBoard / W&B, a live console bar,
and a readable table of sampled completions.

Files written under `run_dir`:
  metrics.jsonl  one JSON object per `log()` call: {"step", "split", "time", **metrics}; values are
                 floats, NaN/inf become null. It is always written (plots and resumes read it); the
                 "jsonl" entry in `backends` is accepted for clarity, the others add sinks.
  samples.jsonl  every row passed to `log_samples()`, with its step.
  samples.md     the newest rows as a markdown table, rewritten on every `log_samples()` call.

Backends are a registry (`BACKENDS`, in logging_backends.py): a new sink is one class with
`log(step, metrics, split)` and `close()` plus one line in the dict. A backend that is asked for but
not installed fails at start.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from rich import progress as rp
from rich.console import Console

from grouprl.runtime.logging_backends import BACKENDS
from grouprl.runtime.logging_backends import dashboard_tag as _tag

Split = Literal["train", "eval"]
_RESERVED = ("step", "split", "time")

# (metric key, label, formatter) shown live next to the bar; the latest value of each is kept.
STATUS_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("reward/mean", "reward", lambda v: f"{v:.3f}"),
    ("eval/accuracy", "acc", lambda v: f"{100 * v:.1f}%"),
    ("kl", "kl", lambda v: f"{v:.4f}"),
)


def to_float(key: str, value: Any) -> float | None:
    """A metric value as a JSON-safe float: tensors/numpy scalars -> float, NaN/inf -> None."""
    if isinstance(value, str | bytes) or value is None:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")
    if hasattr(value, "numel"):  # torch.Tensor (duck-typed so this module does not import torch)
        if value.numel() != 1:
            raise TypeError(f"metric {key!r} is a tensor with {value.numel()} elements, need 1")
        value = value.item()
    try:
        x = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r} is not convertible to float: {value!r}") from e
    return x if math.isfinite(x) else None


def jsonable(value: Any) -> Any:
    """Any sample cell as plain JSON (tensors -> lists, non-finite floats -> None, else str())."""
    if hasattr(value, "tolist"):  # torch / numpy
        value = value.tolist()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


def format_status(latest: Mapping[str, float | None]) -> str:
    """`reward 0.520 | acc 61.0% | kl 0.0030` from the latest value of each STATUS_FIELDS key."""
    parts = [
        f"{label} {'n/a' if latest[key] is None else fmt(latest[key])}"
        for key, label, fmt in STATUS_FIELDS
        if key in latest
    ]
    return " | ".join(parts)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# -------------------------------------------------------------------------------------- RunLogger
class RunLogger:
    """Metrics, samples and a progress bar for one run. Use as `with RunLogger(...) as log:`.

    console=True shows a rich progress bar on a terminal; on a non-terminal (a log file, CI) it
    prints one plain status line at most every `console_interval_s` seconds (and on every eval).
    `start_step` is the step a resumed run continues from (call `truncate_after` first).
    """

    def __init__(
        self,
        run_dir: Path | str,
        total_steps: int,
        *,
        backends: Iterable[str] = ("jsonl",),
        console: bool = True,
        run_name: str | None = None,
        config: dict | None = None,
        start_step: int = 0,
        samples_md_rows: int = 200,
        max_cell_chars: int = 400,
        console_interval_s: float = 30.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = int(total_steps)
        self.max_cell_chars = max_cell_chars
        self.console_interval_s = console_interval_s
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logging backend(s) {unknown}; allowed: {sorted(BACKENDS)}")
        self._backends = [
            BACKENDS[b](self.run_dir, run_name, config)
            for b in dict.fromkeys(backends)
            if BACKENDS[b]
        ]
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.samples_md_path = self.run_dir / "samples.md"
        self._metrics_file = _open_append(self.metrics_path)
        self._recent_samples: deque[dict] = deque(maxlen=samples_md_rows)
        if self.samples_path.exists():  # a resumed run keeps showing its earlier samples
            self._recent_samples.extend(_read_jsonl(self.samples_path))
        self.latest: dict[str, float | None] = {}
        self._start_time = time.time()
        self._last_line = -math.inf
        self._closed = False
        self._console = _make_console() if console else None
        self._progress: rp.Progress | None = None
        if self._console is not None and self._console.is_terminal:
            self._progress = rp.Progress(
                rp.TextColumn("{task.description}", style="bold", markup=False),
                rp.BarColumn(),
                rp.MofNCompleteColumn(),
                rp.TimeElapsedColumn(),
                rp.TimeRemainingColumn(),
                rp.TextColumn("{task.fields[status]}", markup=False),
                console=self._console,
                refresh_per_second=2,  # cheap: the bar never needs more
            )
            self._task = self._progress.add_task(
                run_name or "train", total=self.total_steps, completed=start_step, status=""
            )
            self._progress.start()

    # -- metrics --------------------------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, Any], split: Split = "train") -> None:
        """One line of metrics.jsonl plus every backend; updates the live status."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        clash = [k for k in metrics if k in _RESERVED]
        if clash:
            raise ValueError(f"metric names {clash} are reserved for the record itself")
        values = {str(k): to_float(str(k), v) for k, v in metrics.items()}
        record = {"step": int(step), "split": split, "time": round(time.time(), 3), **values}
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics_file.flush()
        for backend in self._backends:
            backend.log(int(step), values, split)
        self.latest.update({_tag(k, split): v for k, v in values.items()})
        self._show(int(step), force=split == "eval")

    def _show(self, step: int, force: bool) -> None:
        status = format_status(self.latest)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
            return
        now = time.monotonic()
        due = force or step >= self.total_steps or now - self._last_line >= self.console_interval_s
        if self._console is not None and due:
            self._last_line = now
            elapsed = time.strftime("%H:%M:%S", time.gmtime(time.time() - self._start_time))
            line = f"step {step}/{self.total_steps}" + (f" | {status}" if status else "")
            self._console.print(f"{line} | {elapsed} elapsed", markup=False, highlight=False)

    def print(self, msg: str) -> None:
        """Print a message above the live bar (or plainly when there is none; always shown)."""
        if self._console is not None:
            self._console.print(msg, markup=False, highlight=False)
        else:
            print(msg, flush=True)

    def truncate_after(self, step: int) -> None:
        """Drop metric and sample lines with step > `step` (a resumed run rewinds to its checkpoint).

        A torn last line (a crash mid-write) is dropped with a warning; a garbled line before it
        raises LogFileError naming the file and line. Rewritten atomically."""
        self._metrics_file.close()
        for path in (self.metrics_path, self.samples_path):
            if path.exists():
                kept = [r for r in _read_jsonl(path) if int(r.get("step", 0)) <= step]
                _atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self._metrics_file = _open_append(self.metrics_path)
        self._recent_samples = deque(
            (r for r in self._recent_samples if int(r.get("step", 0)) <= step),
            maxlen=self._recent_samples.maxlen,
        )
        if self.samples_md_path.exists():
            _atomic_write_text(self.samples_md_path, self._samples_markdown())

    # -- samples --------------------------------------------------------------------------------
    def log_samples(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append rows (prompt, completion, reward(s), answer, ...) and rewrite samples.md."""
        new = [{"step": int(step), **{str(k): jsonable(v) for k, v in row.items()}} for row in rows]
        with _open_append(self.samples_path) as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in new)
        self._recent_samples.extend(new)
        _atomic_write_text(self.samples_md_path, self._samples_markdown())

    def _samples_markdown(self) -> str:
        rows = list(reversed(self._recent_samples))  # newest first
        head = (
            f"# Samples\n\nNewest first; the last {len(rows)} rows of samples.jsonl. "
            f"Cells longer than {self.max_cell_chars} characters are cut.\n\n"
        )
        if not rows:
            return head
        cols = _sample_columns(rows)
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [md_cell(r.get(c, ""), self.max_cell_chars) for c in cols]
            lines.append("| " + " | ".join(cells) + " |")
        return head + "\n".join(lines) + "\n"

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        self._metrics_file.close()
        for backend in self._backends:
            backend.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_console() -> Console:
    return Console(file=sys.stdout)


def _open_append(path: Path):
    """Open for appending; a last line cut by a crash is closed first so new records stay valid."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return open(path, "a", encoding="utf-8")


class LogFileError(ValueError):
    """A jsonl log of the run directory has a garbled line before its last one."""


def _read_jsonl(path: Path) -> list[dict]:
    """The records of a jsonl log, read for a resume. A garbled last line (a crash mid-write: cut
    JSON, cut UTF-8, bytes of junk) is dropped with a warning; a garbled line before it cannot come
    from a crash and raises LogFileError naming the file and the line."""
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                raise ValueError("not an object with an integer step")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            what = f"{path} line {number}: {' '.join(str(exc).split())[:200]}"
            if number == len(lines):
                warnings.warn(f"dropping the torn last line of {what} (a crash mid-write)",
                              stacklevel=3)  # fmt: skip
                break
            raise LogFileError(
                f"{what}; only the last line of a log can be torn by a crash, so this file was "
                "edited or damaged: fix or delete that line to resume"
            ) from None
        out.append(record)
    return out


def _sample_columns(rows: list[dict]) -> list[str]:
    """step, prompt, completion, reward columns, answer, then any other key in first-seen order."""
    seen = list(dict.fromkeys(k for r in rows for k in r))
    first = [c for c in ("step", "prompt", "completion") if c in seen]
    rewards = [c for c in seen if "reward" in c and c not in first]
    last = [c for c in ("answer",) if c in seen]
    return first + rewards + last + [c for c in seen if c not in first + rewards + last]


def md_cell(value: Any, max_chars: int = 400) -> str:
    """One markdown table cell: numbers short, long text cut, `|`, `<` and newlines escaped."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"… (+{len(text) - max_chars} chars)"
    # Backslashes stay as they are: LaTeX answers (\frac, \boxed) must stay readable in the raw file.
    text = text.replace("|", "\\|").replace("<", "&lt;")
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
