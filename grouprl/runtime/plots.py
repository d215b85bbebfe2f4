"""Training curves from metrics.jsonl as one PNG grid (matplotlib, Agg canvas: no display needed).

Standard panels: train reward, held-out accuracy (or held-out reward, for images), KL, entropy,
response length, clip fractions.
Panels whose keys never appear are skipped; if none of the standard keys appear, every numeric key
present gets its own panel. Train points are drawn as a line (plus a moving average when there are many),
eval points as markers. The PNG is written to a temporary file and renamed into place, so a reader
never sees a half-written image.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# (panel title, metric keys drawn in it)
STANDARD_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train reward", ("reward/mean",)),
    ("held-out accuracy", ("eval/accuracy",)),
    ("held-out reward", ("eval/reward",)),  # image / video runs (workloads/images/sampling.py)
    ("KL", ("kl",)),
    ("entropy", ("entropy",)),
    ("response length", ("response_length/mean",)),
    ("clip fraction", ("clip_frac_high", "clip_frac_low")),
)
_NOT_METRICS = ("step", "split", "time")
Series = dict[tuple[str, str], tuple[list[int], list[float]]]  # (key, split) -> (steps, values)


def read_series(metrics_jsonl: Path) -> Series:
    """Every numeric metric per (key, split) in file order; null values and broken lines skipped."""
    series: Series = defaultdict(lambda: ([], []))
    path = Path(metrics_jsonl)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if not isinstance(record, dict) or "step" not in record:
            continue
        split = str(record.get("split", "train"))
        for key, value in record.items():
            if key in _NOT_METRICS or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if math.isfinite(value):
                steps, values = series[(key, split)]
                steps.append(int(record["step"]))
                values.append(float(value))
    return dict(series)


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (odd), shrinking at the ends; centred so a
    rising curve is not drawn late, as an exponential average would draw it."""
    half = window // 2
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i + half + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def choose_panels(
    series: Series, keys: list[str] | None = None
) -> list[tuple[str, tuple[str, ...]]]:
    """Panels to draw: one per requested key, else the standard ones that have data, else all."""
    present = {key for key, _ in series}
    if keys is not None:
        return [(k, (k,)) for k in keys if k in present]
    panels = [(t, ks) for t, ks in STANDARD_PANELS if any(k in present for k in ks)]
    return panels or [(k, (k,)) for k in sorted(present)]


def plot_curves(
    metrics_jsonl: Path | str, out_png: Path | str, keys: list[str] | None = None
) -> Path:
    """Draw the curves of `metrics_jsonl` into `out_png` (atomically); returns `out_png`."""
    out_png = Path(out_png)
    series = read_series(Path(metrics_jsonl))
    panels = choose_panels(series, keys)
    ncols = max(1, min(3, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    for i, (title, panel_keys) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw_panel(ax, series, panel_keys)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[1]) > 1:
            ax.legend(fontsize="small")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(out_png.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out_png)
    return out_png


def _draw_panel(ax, series: Series, panel_keys: tuple[str, ...]) -> None:
    for key in panel_keys:
        for (k, split), (steps, values) in series.items():
            if k != key:
                continue
            label = key if split == "train" else f"{key} ({split})"
            if split == "train" and len(values) >= 20:
                # noisy per-step values faint, their moving average on top so the trend reads
                (line,) = ax.plot(steps, values, alpha=0.3, linewidth=1)
                window = max(3, len(values) // 20) | 1
                ax.plot(steps, smooth(values, window), color=line.get_color(), label=label)
            elif split == "train":
                ax.plot(steps, values, marker="." if len(values) < 3 else None, label=label)
            else:
                ax.plot(steps, values, marker="o", linestyle="--", label=label)
