"""scripts/gpu_check.sh --tiny: the GPU check's driver (benchmarks/gpu_check.py) end to end on CPU,
grouprl's side always, TRL's where TRL is importable (it is never a grouprl dependency)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_check(tmp_path: Path, *args: str) -> tuple[dict, str]:
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1", "GPU_CHECK_THREADS": "1"}
    out = tmp_path / "out"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--out", str(out),
           "--model-dir", str(tmp_path / "model"), *args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "gpu_check.md").read_text()
    assert md.split("\n\n", 1)[1].strip() in proc.stdout  # the table printed is the one written
    return json.loads((out / "gpu_check.json").read_text()), md


def check_side(result: dict, summary: dict, max_new: int = 8, samples: int = 2 * 4) -> None:
    assert summary["timed_steps"] == 1
    assert summary["completion_len"] == max_new  # exactly max_new_tokens: EOS never ends one
    assert summary["generated_tokens_per_s"] * summary["s_per_step"] == pytest.approx(
        max_new * samples
    )
    assert 0 < summary["generate_s"] < summary["s_per_step"]
    assert summary["update_s"] == pytest.approx(summary["s_per_step"] - summary["generate_s"],
                                                abs=0.05 * summary["s_per_step"])  # fmt: skip
    assert summary["peak_mib"] > 100


def test_tiny_grouprl(tmp_path):
    result, md = run_check(tmp_path, "--frameworks", "grouprl")
    check_side(result["grouprl"], result["summary"]["grouprl"])
    assert result["grouprl"]["engine"] == "fast"
    assert "| grouprl " in md and "| trl " not in md
    assert result["summary"]["grouprl"]["mfu"] is None  # CPU: no peak FLOP/s, no MFU


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")
def test_tiny_grouprl_beside_trl(tmp_path):
    result, md = run_check(tmp_path)
    for side in ("grouprl", "trl"):
        check_side(result[side], result["summary"][side])
    assert result["trl"]["trl"].startswith("1.16")
    assert "| grouprl/TRL " in md
