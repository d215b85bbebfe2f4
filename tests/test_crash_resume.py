"""Crash-safe runs: SIGKILL at random points + resume reproduces an uninterrupted run exactly, and
damaged checkpoints (truncated, corrupted) are detected by their checksums and skipped.

The training runs in forked children (the parent has already imported torch and transformers, so
a child starts in milliseconds) on CPU, one thread, a tiny Qwen2. A child is killed with SIGKILL
(no cleanup, no finally blocks), either by the parent after a seeded random delay, or by itself at
a seeded random point: the n-th call of one of the functions a step goes through (sampling,
update, optimizer step, writing the model, writing the trainer state, the `latest` pointer,
pruning, logging, evaluation).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import traceback
import warnings

import pytest
import torch
from safetensors.torch import load_file

import grouprl.runtime.checkpoint as checkpoint_mod
import grouprl.train as train_mod
from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.runtime.checkpoint import CheckpointManager, checksum_problem
from grouprl.runtime.logging import RunLogger
from grouprl.runtime.throughput import wall_clock
from grouprl.workloads.text import TextWorkload

# (name, owner, attribute, kill before or after the real call)
KILL_POINTS = [
    ("sampling", train_mod, "rollout_step", "after"),
    ("update", train_mod, "update", "before"),
    ("optimizer step", torch.optim.AdamW, "step", "after"),
    ("model write", CausalLMPolicy, "save_pretrained", "after"),
    ("trainer state write", checkpoint_mod, "write_state", "after"),
    ("latest pointer", CheckpointManager, "_write_pointer", "before"),
    ("prune", CheckpointManager, "_prune", "before"),
    ("metrics line", RunLogger, "log", "after"),
    ("evaluation", TextWorkload, "evaluate", "before"),
]


def make_cfg(out_dir, model_dir, *overrides):
    raw = {
        "run": {"name": "run", "output_dir": str(out_dir), "seed": 3, "device": "cpu",
                "console": False, "resume": True},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": "length", "weight": 0.1}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 8, "lr": 1e-2},
        "eval": {"every": 3},
        "checkpoint": {"every": 1, "keep_last": 2},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def _arm(point: tuple | None) -> None:
    """In the child: SIGKILL this process at the n-th call of the named function."""
    if point is None:
        return
    (name, owner, attr, when), n = point
    real, calls = getattr(owner, attr), []

    def killing(*args, **kwargs):
        calls.append(1)
        if when == "before" and len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if when == "after" and len(calls) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, attr, killing)


def _child(cfg, point) -> None:
    try:
        _arm(point)
        warnings.simplefilter("ignore")
        train_mod.train(cfg)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_child(cfg, point=None, kill_after_s: float | None = None) -> int:
    """Train in a forked child; returns its exit code (-9: SIGKILLed)."""
    proc = mp.get_context("fork").Process(target=_child, args=(cfg, point))
    proc.start()
    proc.join(kill_after_s)
    if proc.is_alive():
        proc.kill()  # SIGKILL
    proc.join()
    return proc.exitcode


def final_state(run_dir):
    ckpt = CheckpointManager(run_dir).latest(verify=True)
    weights = load_file(ckpt / "model" / "model.safetensors")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not wall_clock(k)} for r in rows]
    return ckpt.name, weights, rows


def assert_same_run(a, b):
    (name_a, w_a, rows_a), (name_b, w_b, rows_b) = a, b
    assert name_a == name_b
    assert w_a.keys() == w_b.keys()
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k
    assert rows_a == rows_b


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, tiny_model_dir):
    """The uninterrupted run (in a child like the others), checkpoints 4 and 5 kept; read-only."""
    out = tmp_path_factory.mktemp("reference")
    assert run_child(make_cfg(out, tiny_model_dir)) == 0
    return out / "run"


@pytest.fixture(scope="module")
def reference(reference_dir):
    return final_state(reference_dir)


def test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run(
    reference, tmp_path, tiny_model_dir, reliability_counts
):
    rng = random.Random(20260509)
    # 6 distinct hook points, each at its 1st or 2nd call in that child, and 2 timer kills, in a
    # seeded random order; each child resumes from the newest checkpoint the last one left
    schedule = [(point, rng.randint(1, 2)) for point in rng.sample(KILL_POINTS, 6)]
    rng.shuffle(schedule)
    # the timers go last: where a timer lands depends on the machine's speed, and one that lands
    # late lets the run finish, after which no later kill can land (CI once saw 3 of 8 land)
    schedule += [rng.uniform(1.0, 3.0) for _ in range(2)]
    cfg = make_cfg(tmp_path, tiny_model_dir)
    ckpts = CheckpointManager(tmp_path / "run")
    killed, progress = [], []
    for kill in schedule:
        if isinstance(kill, float):
            code, what = run_child(cfg, kill_after_s=kill), (f"timer {kill:.2f} s", 0)
        else:
            code, what = run_child(cfg, point=kill), (kill[0][0], kill[1])
        assert code in (-signal.SIGKILL, 0), f"child failed ({code}) at {what}"
        killed.append((*what, code == -signal.SIGKILL))
        progress.append(ckpts.latest().name if ckpts.latest() else None)
    assert run_child(cfg) == 0  # the last resume runs to the end
    print("kills (point, n-th call, killed):", killed, "latest checkpoint after each:", progress)
    n_killed = sum(k for _, _, k in killed)
    reliability_counts["SIGKILLs during training, resumed exactly"] = n_killed
    n_hooks = sum(k for what, _, k in killed if not what.startswith("timer"))
    assert n_hooks >= 4, killed  # the hook kills do not depend on timing: not a vacuous test
    assert len(set(progress)) >= 2, progress  # kills landed at different stages of the run
    assert_same_run(final_state(tmp_path / "run"), reference)


# ---- damaged checkpoints --------------------------------------------------------------------------


def _flip_byte(path, offset=-20):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated model": lambda c: os.truncate(c / "model" / "model.safetensors", 100),
    "flipped byte in the model": lambda c: _flip_byte(c / "model" / "model.safetensors"),
    "flipped byte in the trainer state": lambda c: _flip_byte(c / "trainer_state.safetensors", 200),
    "flipped byte in the trainer state's JSON": lambda c: _flip_byte(c / "trainer_state.json", 30),
    "deleted trainer state": lambda c: (c / "trainer_state.json").unlink(),
    "garbled manifest": lambda c: (c / "manifest.json").write_text("{"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    damage, reference_dir, reference, tmp_path, tiny_model_dir, capsys
):
    """A finished run whose newest checkpoint is damaged: resume warns, moves it aside, resumes
    from the one before, redoes the last step, and ends exactly like the reference run."""
    shutil.copytree(reference_dir, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step-00000008"
    DAMAGE[damage](newest)
    assert checksum_problem(newest) is not None
    with pytest.warns(UserWarning, match="step-00000008 is damaged"):
        train_mod.train(make_cfg(tmp_path, tiny_model_dir))
    out = capsys.readouterr().out
    assert "step-00000008 is damaged" in out and "resumed from" in out and "step-00000007" in out
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names[0].startswith("corrupt-step-00000008-")  # kept aside for a person to inspect
    assert names[1:] == ["latest", "step-00000007", "step-00000008"]  # step 8 made again
    assert_same_run(final_state(tmp_path / "run"), reference)


def test_every_kept_checkpoint_damaged_means_no_checkpoint(tmp_path, reference_dir):
    """Both kept checkpoints damaged: two warnings, both moved aside, nothing to resume from (a
    resume then starts the run over, as test_train's resume-before-the-first-checkpoint does)."""
    shutil.copytree(reference_dir, tmp_path / "run")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    _flip_byte(ckpt_dir / "step-00000008" / "model" / "model.safetensors")
    (ckpt_dir / "step-00000007" / "trainer_state.safetensors").unlink()
    mgr = CheckpointManager(tmp_path / "run")
    with pytest.warns(UserWarning) as record:
        assert mgr.latest(verify=True) is None
    assert [str(w.message).split(":")[0] for w in record] == [
        "checkpoint step-00000008 is damaged", "checkpoint step-00000007 is damaged",
    ]  # fmt: skip
    assert "checksum mismatch in model/model.safetensors" in mgr.rejected[0]
    assert "incomplete" in mgr.rejected[1]
    assert mgr.latest(verify=True) is None and len(mgr.rejected) == 2  # moved aside: no new warning
    assert sorted(p.name[:21] for p in ckpt_dir.iterdir() if p.is_dir()) == [
        "corrupt-step-00000007", "corrupt-step-00000008",
    ]  # fmt: skip


# ---- the manifest itself -------------------------------------------------------------------------


def _save(mgr, step, payload=b"weights"):
    return mgr.save(step, save_model=lambda d: (d / "w.bin").write_bytes(payload), state={"s": 1})


def test_manifest_lists_a_sha256_per_file(tmp_path):
    import hashlib

    mgr = CheckpointManager(tmp_path)
    ckpt = _save(mgr, 1, b"abc")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == 2
    assert set(manifest["sha256"]) == set(manifest["files"]) == {
        "model/w.bin", "trainer_state.json", "trainer_state.safetensors",
    }  # fmt: skip
    assert manifest["sha256"]["model/w.bin"] == hashlib.sha256(b"abc").hexdigest()
    assert checksum_problem(ckpt) is None
    (ckpt / "model" / "w.bin").write_bytes(b"abd")  # same size: only the checksum sees it
    assert mgr.latest().name == "step-00000001"  # the cheap scan (size only) still lists it
    assert checksum_problem(ckpt) == "checksum mismatch in model/w.bin"


def test_format_1_manifests_without_checksums_are_still_accepted(tmp_path):
    mgr = CheckpointManager(tmp_path)
    ckpt = _save(mgr, 2)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["sha256"]
    manifest["format"] = 1
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert mgr.latest(verify=True) == ckpt and mgr.rejected == []


def test_verify_with_nothing_intact_returns_none(tmp_path):
    mgr = CheckpointManager(tmp_path)
    ckpt = _save(mgr, 1)
    (ckpt / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="step-00000001 is damaged: incomplete"):
        assert mgr.latest(verify=True) is None
    assert [p.name.startswith("corrupt-step-00000001-") for p in mgr.dir.iterdir()
            if p.is_dir()] == [True]  # fmt: skip
