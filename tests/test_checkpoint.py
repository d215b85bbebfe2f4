import json
import os
import random

import numpy as np
import pytest
import torch

from grouprl.runtime import checkpoint as ck
from grouprl.runtime.checkpoint import (
    CheckpointManager,
    NonFiniteCheckpointError,
    capture_rng,
    restore_rng,
)


def _writer(value: float):
    def save_model(d):
        torch.save({"w": torch.full((3,), value)}, d / "weights.pt")

    return save_model


def _save(mgr, step, value=1.0, **kw):
    return mgr.save(step, save_model=_writer(value), state={"step": step, "pos": 10 * step}, **kw)


def test_save_layout_and_load(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = _save(mgr, 7)
    assert path == tmp_path / "checkpoints" / "step-00000007"
    assert sorted(os.listdir(path)) == [
        "manifest.json", "model", "trainer_state.json", "trainer_state.safetensors",
    ]  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7
    assert set(manifest["files"]) == {
        "model/weights.pt", "trainer_state.json", "trainer_state.safetensors",
    }  # fmt: skip
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000007"
    state = CheckpointManager.load(path)
    assert state["step"] == 7 and state["pos"] == 70 and "rng" in state
    assert torch.equal(
        torch.load(path / "model" / "weights.pt", weights_only=True)["w"], torch.ones(3)
    )
    assert mgr.latest() == path


def test_keep_last_prunes_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000003", "step-00000004"]
    keep_all = CheckpointManager(tmp_path / "b", keep_last=None)
    for step in (1, 2, 3):
        _save(keep_all, step)
    assert [p.name for p in keep_all.complete()] == [f"step-0000000{i}" for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_crash_inside_save_model_keeps_previous(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 1)

    def boom(d):
        (d / "half.bin").write_bytes(b"x" * 10)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        mgr.save(2, save_model=boom, state={"step": 2})
    assert mgr.latest() == good
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", "step-00000001"]


def test_crash_at_rename_keeps_previous(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 1)

    def failing_replace(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(ck.os, "replace", failing_replace)
    with pytest.raises(OSError, match="power cut"):
        _save(mgr, 2)
    monkeypatch.undo()
    assert mgr.latest() == good
    assert not list(mgr.dir.glob(".tmp-*"))


def test_crash_after_rename_before_pointer_finds_new(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)
    real_replace = os.replace

    def replace_then_die(src, dst):
        if str(dst).endswith("latest"):
            raise OSError("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace_then_die)
    with pytest.raises(OSError, match="killed"):
        _save(mgr, 2)
    monkeypatch.undo()
    # the pointer still names step 1, but the scan finds the complete step 2
    assert (mgr.dir / "latest").read_text().strip() == "step-00000001"
    assert CheckpointManager(tmp_path).latest().name == "step-00000002"


def test_leftover_tmp_dirs_cleaned_and_ignored(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)
    debris = mgr.dir / ".tmp-step-00000002"
    (debris / "model").mkdir(parents=True)
    (debris / "trainer_state.json").write_bytes(b"partial")
    assert mgr.latest().name == "step-00000001"  # ignored even before cleaning
    CheckpointManager(tmp_path)
    assert not debris.exists()


def test_corrupt_or_missing_manifest_ignored(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=None)
    p1, p2, p3 = (_save(mgr, s) for s in (1, 2, 3))
    (p3 / "manifest.json").unlink()  # crash before the manifest
    (p2 / "manifest.json").write_text("{not json")  # corrupt
    assert mgr.latest() == p1
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager.load(p3)
    # a manifest naming another step, or a truncated file, is not trusted either
    m = json.loads((p1 / "manifest.json").read_text())
    (p1 / "manifest.json").write_text(json.dumps({**m, "step": 9}))
    assert mgr.latest() is None
    (p1 / "manifest.json").write_text(json.dumps(m))
    assert mgr.latest() == p1
    (p1 / "model" / "weights.pt").write_bytes(b"short")
    assert mgr.latest() is None


def test_non_finite_refused_and_nothing_written(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 1, check_finite=[torch.ones(2)])
    bad = [("layer.weight", torch.ones(2)), ("layer.bias", torch.tensor([0.0, float("nan")]))]
    with pytest.raises(NonFiniteCheckpointError, match="layer.bias"):
        _save(mgr, 2, check_finite=bad)
    with pytest.raises(NonFiniteCheckpointError, match="tensor #1"):
        _save(mgr, 2, check_finite=[torch.ones(1), torch.tensor([float("inf")])])
    assert sorted(p.name for p in mgr.dir.iterdir()) == ["latest", good.name]


def test_resave_same_step_replaces(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 5, value=1.0)
    path = _save(mgr, 5, value=2.0)
    assert torch.equal(
        torch.load(path / "model" / "weights.pt", weights_only=True)["w"], torch.full((3,), 2.0)
    )
    assert not list(mgr.dir.glob(".tmp-*"))


def test_rng_key_reserved(tmp_path):
    with pytest.raises(ValueError, match="rng"):
        CheckpointManager(tmp_path).save(1, save_model=_writer(1.0), state={"rng": 1})


def _draw():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def test_rng_round_trip_reproduces_numbers(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    snapshot = capture_rng()
    expected = _draw()
    assert _draw() != expected  # the generators moved on
    restore_rng(snapshot)
    assert _draw() == expected
    # through a checkpoint on disk as well
    mgr = CheckpointManager(tmp_path)
    path = _save(mgr, 1)
    after_save = _draw()
    _draw()
    restore_rng(CheckpointManager.load(path))
    assert _draw() == after_save
    with pytest.raises(KeyError, match="RNG"):
        restore_rng({"step": 3})
