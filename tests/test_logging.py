import io
import json
import sys
import types

import numpy as np
import pytest
import torch
from rich.console import Console

import grouprl.runtime.logging as glog
from grouprl.runtime.logging import RunLogger, format_status, md_cell, to_float


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_floats_and_nan_to_null(tmp_path):
    with RunLogger(tmp_path, total_steps=10, console=False) as log:
        log.log(1, {"reward/mean": torch.tensor(0.5), "kl": float("nan"), "n": 3})
        log.log(2, {"entropy": np.float32(1.25), "x": float("-inf"), "ok": True})
        log.log(2, {"eval/accuracy": 0.75}, split="eval")
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 2]
    assert [r["split"] for r in rows] == ["train", "train", "eval"]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["kl"] is None and rows[0]["n"] == 3.0
    assert rows[1] == {**rows[1], "entropy": 1.25, "x": None, "ok": 1.0}
    assert all(isinstance(r["time"], float) for r in rows)


def test_bad_metrics_fail_loudly(tmp_path):
    with RunLogger(tmp_path, total_steps=3, console=False) as log:
        with pytest.raises(TypeError, match="'text'"):
            log.log(1, {"text": "hello"})
        with pytest.raises(TypeError, match="3 elements"):
            log.log(1, {"vec": torch.ones(3)})
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 1.0})
        with pytest.raises(ValueError, match="split"):
            log.log(1, {"a": 1.0}, split="test")
    assert to_float("k", np.int64(4)) == 4.0


def test_resume_appends_and_truncate_after(tmp_path):
    with RunLogger(tmp_path, total_steps=10, console=False) as log:
        for step in range(1, 6):
            log.log(step, {"reward/mean": step / 10})
        log.log_samples(4, [{"prompt": "p4", "completion": "c4"}])
        log.log_samples(5, [{"prompt": "p5", "completion": "c5"}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "split": "tr')  # a line cut by a crash
    with RunLogger(tmp_path, total_steps=10, console=False) as log:
        log.truncate_after(3)
        log.log(4, {"reward/mean": 0.99})
    rows = _lines(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
        (4, 0.99),
    ]
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert "p5" not in (tmp_path / "samples.md").read_text()


def test_samples_jsonl_and_markdown_escaping(tmp_path):
    long = "x" * 50
    with RunLogger(tmp_path, total_steps=2, console=False, max_cell_chars=20) as log:
        log.log_samples(
            1,
            [
                {
                    "prompt": "a | b\nsecond line",
                    "completion": "<b>\\frac{1}{2}</b>",
                    "reward/accuracy": 1.0,
                    "reward/format": float("nan"),
                    "answer": long,
                    "extra": torch.tensor([1, 2]),
                }
            ],
        )
        log.log_samples(2, [{"prompt": "newest", "completion": "c", "answer": "7"}])
    rows = _lines(tmp_path / "samples.jsonl")
    assert rows[0]["step"] == 1 and rows[0]["reward/format"] is None and rows[0]["extra"] == [1, 2]
    assert rows[1] == {"step": 2, "prompt": "newest", "completion": "c", "answer": "7"}
    md = (tmp_path / "samples.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    header = "| step | prompt | completion | reward/accuracy | reward/format | answer | extra |"
    assert table[0] == header
    assert table[2].startswith("| 2 | newest | c |")  # newest first
    row1 = table[3]
    assert row1.count("|") - row1.count("\\|") == 8  # 7 cells -> 8 unescaped separators
    assert "a \\| b<br>second line" in row1
    assert "&lt;b>\\frac{1}{2}&lt;/b>" in row1
    assert "| 1 | n/a |" in row1
    assert "x" * 20 + "… (+30 chars)" in row1 and "x" * 21 not in row1


def test_md_cell_values():
    assert md_cell(None) == "n/a"
    assert md_cell(0.123456) == "0.1235"
    assert md_cell(3) == "3"
    assert md_cell("a\r\nb") == "a<br>b"


def test_format_status():
    assert format_status({}) == ""
    latest = {"reward/mean": 0.52, "eval/accuracy": 0.61, "kl": 0.003, "entropy": 1.0}
    assert format_status(latest) == "reward 0.520 | acc 61.0% | kl 0.0030"
    assert format_status({"kl": None}) == "kl n/a"


def test_console_false_prints_nothing_but_print_works(tmp_path, capsys):
    with RunLogger(tmp_path, total_steps=3, console=False) as log:
        log.log(1, {"reward/mean": 0.5})
        log.print("hello")
    assert capsys.readouterr().out == "hello\n"


def test_non_tty_console_throttled_plain_lines(tmp_path, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(glog, "_make_console", lambda: Console(file=buf, force_terminal=False))
    with RunLogger(tmp_path, total_steps=3, console_interval_s=3600) as log:
        log.log(1, {"reward/mean": 0.5})  # first line is due
        log.log(2, {"reward/mean": 0.6})  # throttled
        log.log(2, {"eval/accuracy": 0.25}, split="eval")  # eval always shown
        log.log(3, {"reward/mean": 0.7})  # last step always shown
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/3 | reward 0.500 |")
    assert lines[1].startswith("step 2/3 | reward 0.600 | acc 25.0% |")
    assert lines[2].startswith("step 3/3 | reward 0.700 | acc 25.0% |")


def test_tty_progress_bar_shows_status(tmp_path, monkeypatch):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    monkeypatch.setattr(glog, "_make_console", lambda: console)
    with RunLogger(tmp_path, total_steps=4, run_name="demo") as log:
        log.log(1, {"reward/mean": 0.5, "kl": 0.01})
        log.log(1, {"eval/accuracy": 0.61}, split="eval")
        log.print("a message")
        task = log._progress.tasks[0]
        assert task.completed == 1 and task.total == 4
        assert task.fields["status"] == "reward 0.500 | acc 61.0% | kl 0.0100"
    out = buf.getvalue()
    assert "a message" in out and "demo" in out


def test_unknown_and_missing_backends(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="allowed"):
        RunLogger(tmp_path, total_steps=1, backends=["jsonl", "mlflow"], console=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="wandb"):
        RunLogger(tmp_path, total_steps=1, backends=["wandb"], console=False)


def test_wandb_backend_with_fake_module(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = {"wandb_project": "proj"}
    with RunLogger(tmp_path, 5, backends=["wandb"], console=False, config=cfg, run_name="r") as log:
        log.log(1, {"reward/mean": 0.5, "kl": float("nan")})
        log.log(1, {"accuracy": 0.5, "eval/loss": 1.0}, split="eval")
    init_kw = calls[0][1]
    assert (init_kw["project"], init_kw["name"], init_kw["id"]) == ("proj", "r", "abc")
    assert calls[1] == ("log", {"reward/mean": 0.5}, 1)
    assert calls[2] == ("log", {"eval/accuracy": 0.5, "eval/loss": 1.0}, 1)
    assert calls[3] == ("finish",)
    assert (tmp_path / "wandb_id.txt").read_text().strip() == "abc"
    assert (tmp_path / "metrics.jsonl").exists()  # jsonl is always written


def test_tensorboard_backend(tmp_path):
    pytest.importorskip("tensorboard")
    with RunLogger(tmp_path, 3, backends=["jsonl", "tensorboard"], console=False) as log:
        log.log(1, {"reward/mean": 0.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_tags_with_fake_writer(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, log_dir):
            scalars.append(("dir", log_dir))

        def add_scalar(self, tag, value, global_step):
            scalars.append((tag, value, global_step))

        def flush(self):
            pass

        def close(self):
            scalars.append(("closed",))

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    with RunLogger(tmp_path, 3, backends=["tensorboard"], console=False) as log:
        log.log(2, {"kl": 0.1, "entropy": float("inf")})
        log.log(2, {"loss": 0.25, "eval/accuracy": 0.5}, split="eval")
    assert scalars == [
        ("dir", str(tmp_path / "tensorboard")),
        ("kl", 0.1, 2),
        ("eval/loss", 0.25, 2),
        ("eval/accuracy", 0.5, 2),
        ("closed",),
    ]


def test_append_after_cut_line_stays_valid(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "split": "train", "time": 0.0}\n{"step": 2, "spl'
    )
    with RunLogger(tmp_path, total_steps=3, console=False) as log:
        log.log(2, {"accuracy": 0.5}, split="eval")
        assert log.latest == {"eval/accuracy": 0.5}  # eval keys get their prefix for the status
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["accuracy"] == 0.5
