import json

import pytest

from grouprl.runtime.plots import choose_panels, plot_curves, read_series, smooth

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _records(n):
    out = []
    for s in range(1, n + 1):
        out.append(
            {
                "step": s,
                "split": "train",
                "time": float(s),
                "reward/mean": s / n,
                "kl": None if s == 2 else 0.01 * s,
                "entropy": 1.0,
                "response_length/mean": 10.0 + s,
                "clip_frac_high": 0.1,
                "clip_frac_low": 0.0,
            }
        )
        if s % 5 == 0:
            out.append({"step": s, "split": "eval", "time": float(s), "eval/accuracy": s / 100})
    return out


def test_read_series_skips_nulls_and_broken_lines(tmp_path):
    path = _write(tmp_path / "m.jsonl", _records(5), tail='{"step": 6, "rew')
    series = read_series(path)
    assert series[("reward/mean", "train")] == ([1, 2, 3, 4, 5], [0.2, 0.4, 0.6, 0.8, 1.0])
    assert series[("kl", "train")][0] == [1, 3, 4, 5]  # the null at step 2 is a gap
    assert series[("eval/accuracy", "eval")] == ([5], [0.05])
    assert ("time", "train") not in series and ("step", "train") not in series


def test_smooth_hand_computed():
    assert smooth([], 3) == []
    assert smooth([1.0, 3.0, 5.0, 10.0], 3) == [2.0, 3.0, 6.0, 7.5]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]


def test_choose_panels():
    series = {("reward/mean", "train"): ([1], [0.5]), ("clip_frac_low", "train"): ([1], [0.0])}
    assert [t for t, _ in choose_panels(series)] == ["train reward", "clip fraction"]
    other = {("loss", "train"): ([1], [1.0]), ("acc", "eval"): ([1], [0.5])}
    assert [t for t, _ in choose_panels(other)] == ["acc", "loss"]  # no standard key: all present
    assert choose_panels(series, keys=["clip_frac_low", "missing"]) == [
        ("clip_frac_low", ("clip_frac_low",))
    ]


@pytest.mark.parametrize("n", [1, 4, 30])
def test_plot_curves_writes_png(tmp_path, n):
    path = _write(tmp_path / "metrics.jsonl", _records(n))
    out = plot_curves(path, tmp_path / "plots" / "curves.png")
    assert out.read_bytes()[:8] == PNG
    assert not list(out.parent.glob("*.tmp"))


def test_plot_curves_one_line_no_eval_and_empty(tmp_path):
    one = _write(tmp_path / "one.jsonl", [{"step": 0, "split": "train", "reward/mean": 0.1}])
    assert plot_curves(one, tmp_path / "one.png").read_bytes()[:8] == PNG
    empty = _write(tmp_path / "empty.jsonl", [])
    assert plot_curves(empty, tmp_path / "empty.png").read_bytes()[:8] == PNG
    custom = plot_curves(_write(tmp_path / "c.jsonl", _records(3)), tmp_path / "c.png", keys=["kl"])
    assert custom.read_bytes()[:8] == PNG
