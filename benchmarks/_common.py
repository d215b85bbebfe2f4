"""Shared helpers of the benchmark scripts: machine facts, memory and time, workload models, output.

Every benchmark prints a table, writes a JSON file and a PNG into its output folder, and runs
each side of a comparison in its own fresh process (so one side's allocations and imports never
count against the other). Nothing here asserts on time: the scripts measure and report.

Memory: `peak_rss_bytes()` is the kernel's high-water mark of the process's resident set
(ru_maxrss); `reset_peak()` lowers that mark to the current RSS (Linux /proc/self/clear_refs), so a
phase's own peak can be read after it. Linux only.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "benchmarks" / "results"

# ---- machine ------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, load, versions, date."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average_1m_5m_15m": list(os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if threads is not None:
        info["torch_threads"] = threads
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def describe_machine(info: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.1f}" for x in info["load_average_1m_5m_15m"])
    threads = f", {info['torch_threads']} torch threads" if "torch_threads" in info else ""
    return (
        f"{info['cpu']}, {info['cores']} cores{threads}, load average {load}; "
        f"torch {info['torch']}, transformers {info.get('transformers', '?')}; {info['date']}"
    )


def warn_if_loaded(info: dict[str, Any], alternated: bool = True) -> str | None:
    """A warning line when other work shares the cores (timings are then inflated and noisy)."""
    load = info["load_average_1m_5m_15m"][0]
    if load > 0.75 * (info["cores"] or 1):
        tail = "; the alternated A/B ratios are the meaningful numbers" if alternated else ""
        return (
            f"note: load average {load:.1f} on {info['cores']} cores: other processes share the CPU, "
            f"so absolute times are inflated{tail}"
        )
    return None


# ---- memory and time ----------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """High-water mark of the resident set (VmHWM; lowered by reset_peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak() -> bool:
    """Lower the high-water RSS mark to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Timer:
    """Accumulates wall time of named phases: `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._name: str | None = None

    def __call__(self, name: str) -> Timer:
        self._name = name
        return self

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._name is not None
        dt = time.perf_counter() - self._t0
        self.totals[self._name] = self.totals.get(self._name, 0.0) + dt
        self._name = None

    def pop(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    """Sample standard deviation (0 for fewer than two values)."""
    return float(statistics.stdev(xs)) if len(xs) > 1 else 0.0


# ---- workload models (random weights, built from a config in code) ------------------------------

# The workload: Qwen2 architecture, hidden 256, 4 layers, intermediate 1024; "small" keeps
# the byte-level vocabulary of grouprl.policies.text.tiny (259 tokens, ~4.0M parameters), "large" widens
# the vocabulary to 32k (~12.2M parameters, most of them in the tied embedding / LM head).
MODELS: dict[str, dict[str, int]] = {
    "small": dict(vocab=0, hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2),
    "large": dict(vocab=32000, hidden=256, layers=4, intermediate=1024, heads=4, kv_heads=2),
}


def wide_char_tokenizer(vocab_size: int = 0):
    """grouprl's byte-level tokenizer, optionally padded with extra tokens up to `vocab_size`.

    The extra tokens are two-byte symbols with no merge rule, so encoding never produces them
    (prompts tokenize exactly as with the plain byte tokenizer) but a model can sample them and
    they decode to two bytes, like the rarely used tokens of a real 32k vocabulary.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    from grouprl.policies.text.tiny import CHAT_TEMPLATE, char_tokenizer

    base = char_tokenizer()
    if vocab_size <= len(base):
        return base
    vocab = dict(base.get_vocab())
    symbols = sorted((s for s in vocab if len(s) == 1), key=vocab.__getitem__)
    for a in symbols:
        for b in symbols:
            if len(vocab) >= vocab_size:
                break
            vocab.setdefault(a + b, len(vocab))
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=base.unk_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )


def build_model_dir(directory: Path, name: str, seed: int = 0, max_position: int = 512) -> Path:
    """Write the random-weight workload model `name` (MODELS) + tokenizer with save_pretrained."""
    from grouprl.policies.text.tiny import tiny_qwen2

    spec = MODELS[name]
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    (directory.parent / ".gitignore").write_text("*\n")  # model weights never go into git
    tokenizer = wide_char_tokenizer(spec["vocab"])
    model = tiny_qwen2(
        tokenizer,
        hidden_size=spec["hidden"],
        layers=spec["layers"],
        heads=spec["heads"],
        kv_heads=spec["kv_heads"],
        intermediate=spec["intermediate"],
        max_position=max_position,
        seed=seed,
    )
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)
    return directory


def digit_reward(completions: Sequence[str]) -> list[float]:
    """Fraction of the completion's characters that are decimal digits (0 for an empty one).

    A dense reward with spread inside every group even for a random model, so both frameworks
    compute non-zero advantages and gradients; it is the same function on both sides.
    """
    return [sum(c.isdigit() for c in s) / len(s) if s else 0.0 for s in completions]


# ---- processes -----------------------------------------------------------------------------------


def bench_python() -> str:
    """The python of .venv-bench (TRL pinned there, never in grouprl's own environment); made by
    scripts/bench_env.sh on first use."""
    script = ROOT / "scripts" / "bench_env.sh"
    out = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"could not make the benchmark environment with {script}")
    return out.stdout.strip().splitlines()[-1]


def run_worker(python: str, script: Path, args: list[str], timeout: float = 1800) -> dict:
    """Run `python script --worker ...` in a fresh process; it writes its result as JSON."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = Path(f.name)
    try:
        cmd = [python, str(script), *args, "--result", str(out_path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"worker failed ({proc.returncode}): {' '.join(cmd)}")
        return json.loads(out_path.read_text())
    finally:
        out_path.unlink(missing_ok=True)


# ---- output --------------------------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (also valid markdown)."""
    cells = [[str(h) for h in header]] + [
        [f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=float) + "\n")
    return path


def bar_png(
    path: Path,
    panels: Sequence[tuple[str, dict[str, Sequence[float]], Sequence[str]]],
    title: str,
    errors: Sequence[dict[str, Sequence[float]] | None] | None = None,
) -> Path:
    """One PNG with a bar-chart panel per (ylabel, {series: values per group}, group labels).

    Series are drawn side by side within each group; `errors` (same shape) adds error bars.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for k, (ylabel, series, groups) in enumerate(panels):
        ax = axes[0][k]
        width = 0.8 / max(len(series), 1)
        for j, (name, values) in enumerate(series.items()):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
            err = errors[k].get(name) if errors and errors[k] else None
            ax.bar(xs, values, width, label=name, yerr=err, capsize=3 if err else 0)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def worker_setup(threads: int) -> None:
    """Threads and quiet logs inside a worker process."""
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
