"""Files written by others (issue 15, "files from others"): run directories, checkpoints, configs and
logs are read without ever running code from them, and hostile or damaged ones fail fast with a
message that says why.

- checkpoints: no pickle is ever loaded (trainer state = safetensors + JSON); a malicious pickle
  planted anywhere in a run directory is never executed on resume;
- the trainer-state encoding round-trips every type a real state holds (int-keyed optimizer
  state, tuples of the RNG APIs, numpy's RNG array, NaN) and refuses anything else when saving.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
from tiny_runs import arithmetic_run

from grouprl.config.loading import validate
from grouprl.runtime.checkpoint import (
    CheckpointManager,
    LegacyCheckpointError,
    capture_rng,
    restore_rng,
)
from grouprl.runtime.trainer_state import (
    StateEncodingError,
    StateFileError,
    decode_state,
    encode_state,
    read_state,
    write_state,
)
from grouprl.train import train


class _Pwn:
    """Unpickling this runs `open(marker, "w").write(...)`: the attack a pickle file can carry."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _plant(path, marker) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": _Pwn(marker), "step": 1}, path)


def _rewrite_manifest(ckpt) -> None:
    """What an attacker who writes the files also does: a manifest that matches them."""
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {str(p.relative_to(ckpt)): p.stat().st_size for p in files}
    manifest["sha256"] = {
        str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _cfg(out_dir, model_dir, *overrides):
    return validate(arithmetic_run(out_dir, model_dir, *overrides, checkpoint={"every": 1}))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    """A finished 1-step run (checkpoint step-00000001); copied by each test, never changed."""
    out = tmp_path_factory.mktemp("finished")
    train(_cfg(out, tiny_model_dir))
    return out / "run"


def test_pickles_planted_in_a_run_directory_never_run_on_resume(
    finished_run, tmp_path, tiny_model_dir
):
    """Pickles under every name a torch / transformers / grouprl loader might open, with a manifest
    rewritten to match (the checksums cannot tell the attacker's files from ours): resume runs on,
    from the safetensors + JSON state, and no pickle is ever opened."""
    shutil.copytree(finished_run, tmp_path / "run")
    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    for rel in (
        "trainer_state.pt",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "model/pytorch_model.bin",
        "model/training_args.bin",
        "model/adapter_model.bin",
    ):
        _plant(ckpt / rel, marker)  # fmt: skip
    for rel in ("trainer_state.pt", "checkpoints/rng_state.pth", "state.pkl"):
        _plant(tmp_path / "run" / rel, marker)
    _rewrite_manifest(ckpt)
    assert CheckpointManager(tmp_path / "run").latest(verify=True) == ckpt  # looks intact
    train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=2"))
    assert not marker.exists(), "a planted pickle was executed"
    assert CheckpointManager(tmp_path / "run").latest().name == "step-00000002"


def test_an_old_pickle_checkpoint_is_refused_with_a_reason_and_never_opened(
    finished_run, tmp_path, tiny_model_dir
):
    """A checkpoint whose trainer state is only trainer_state.pt (older grouprl, or an attacker):
    resume stops with a message saying why, and the pickle is not executed."""
    shutil.copytree(finished_run, tmp_path / "run")
    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    (ckpt / "trainer_state.json").unlink()
    (ckpt / "trainer_state.safetensors").unlink()
    _plant(ckpt / "trainer_state.pt", marker)
    _rewrite_manifest(ckpt)
    with pytest.raises(LegacyCheckpointError, match=r"trainer_state\.pt, a pickle.*not opened"):
        train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=2"))
    assert not marker.exists()
    with pytest.raises(LegacyCheckpointError):
        CheckpointManager.load(ckpt)
    assert not marker.exists()


# ---- the trainer-state encoding ------------------------------------------------------------------


def test_trainer_state_round_trips_every_type_a_real_state_holds(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 0.5)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = {
        "step": 7,
        "optimizer": opt.state_dict(),  # int keys, 0-dim "step" tensors, tuple betas
        "scheduler": sched.state_dict(),
        "floats": [math.nan, math.inf, -math.inf, 0.1],
        "__odd_key": {"__tensor__": "not a tensor", 3: (1, (2, "x"))},
        "numpy": {"f": np.float64(0.25), "i": np.int64(-3), "a": np.arange(6).reshape(2, 3)},
        "none": None,
        "shared": [model.weight.data, model.weight.data],  # one storage, twice
        "rng": capture_rng(),
    }
    write_state(state, tmp_path)
    assert not any(b"\x80" == p.read_bytes()[:1] for p in tmp_path.iterdir())  # no pickle header
    back = read_state(tmp_path)
    assert back["step"] == 7 and back["none"] is None
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert sorted(back["optimizer"]["state"]) == [0, 1]
    for k, v in opt.state_dict()["state"][0].items():
        assert (
            torch.equal(back["optimizer"]["state"][0][k], v)
            and back["optimizer"]["state"][0][k].dtype == v.dtype
        )
    assert back["scheduler"] == sched.state_dict()
    assert math.isnan(back["floats"][0]) and back["floats"][1:] == [math.inf, -math.inf, 0.1]
    assert back["__odd_key"] == {"__tensor__": "not a tensor", 3: (1, (2, "x"))}
    assert type(back["numpy"]["f"]) is np.float64 and back["numpy"]["f"] == 0.25
    assert type(back["numpy"]["i"]) is np.int64
    assert np.array_equal(back["numpy"]["a"], np.arange(6).reshape(2, 3))
    assert torch.equal(back["shared"][1], model.weight.data)
    # the RNG states restore exactly (python's tuple, numpy's uint32 array, torch's byte tensor)
    expected = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    restore_rng(back)
    assert (random.random(), float(np.random.rand()), torch.rand(2).tolist()) == expected
    # the optimizer accepts the state back
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh.load_state_dict(back["optimizer"])


def test_trainer_state_refuses_objects_when_saving_and_junk_when_loading(tmp_path):
    with pytest.raises(StateEncodingError, match=r"state\.extra\[1\].*no pickle"):
        encode_state({"extra": [1, object()]})
    with pytest.raises(StateEncodingError, match="numpy"):
        encode_state({"a": np.array([object()], dtype=object)})
    with pytest.raises(StateFileError, match="missing"):
        decode_state({"__tensor__": "t9"}, {})
    with pytest.raises(StateFileError, match="dtype"):
        decode_state({"__ndarray__": {"dtype": "object", "shape": [1], "data": [1]}}, {})
    with pytest.raises(StateFileError, match="alone"):
        decode_state({"__tuple__": [], "x": 1}, {})


# ---- configs ---------------------------------------------------------------------------------

_ANCHORS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)  # *i stands for 9^9 = 387 million strings
_BOMB = (
    "model: {name_or_path: x}\ntask:\n  name: arithmetic\n  options:\n"
    + "".join(f"    {line}\n" for line in _ANCHORS.splitlines())
    + "rollout: {stop: *i}\n"  # the old loader hung here, validating / reporting the list
)


def _load_in_child(path, queue) -> None:
    from grouprl.config.loading import load_config

    try:
        load_config(path)
        queue.put("loaded")
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def test_yaml_alias_bomb_fails_fast_and_normal_anchors_still_work(tmp_path):
    import multiprocessing as mp
    import time

    from grouprl.config.loading import load_config

    assert len(_BOMB) < 1024
    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB)
    queue = mp.get_context("fork").SimpleQueue()
    child = mp.get_context("fork").Process(target=_load_in_child, args=(path, queue))
    start = time.monotonic()
    child.start()
    child.join(20)  # the old loader hangs here (validation walks 10^8 values)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung, "load_config did not return within 20 s"
    message = queue.get()
    assert message.startswith("ConfigError") and "alias" in message and "bomb.yaml" in message
    assert time.monotonic() - start < 10
    # a recursive anchor is refused too; ordinary anchors and merges load as before
    (tmp_path / "loop.yaml").write_text("a: &a [*a]\nmodel: {name_or_path: x}\n")
    with pytest.raises(Exception, match="alias|recursive|undefined"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "ok.yaml").write_text(
        "run: {name: &n myrun}\nmodel: {name_or_path: x}\n"
        "task: {name: arithmetic}\nrollout: {stop: [*n, *n]}\n"
    )
    cfg = load_config(tmp_path / "ok.yaml")
    assert cfg.rollout.stop == ["myrun", "myrun"]


def test_yaml_anchors_and_merge_keys_still_work(tmp_path):
    from grouprl.config.loading import load_yaml

    data = load_yaml("r: &r {a: 1, b: [1, 2]}\ns: {<<: *r, c: 3}\nt: [*r, *r]\n")
    assert data["s"] == {"a": 1, "b": [1, 2], "c": 3} and data["t"] == [data["r"], data["r"]]


@pytest.mark.parametrize(
    "name", ["..", "../elsewhere", "a/../../b", "/tmp/x", "~/x", "a\\..\\b", "", "a//b", "."]
)
def test_run_name_cannot_leave_output_dir(name):
    from grouprl.config.loading import ConfigError

    raw = {"run": {"name": name}, "model": {"name_or_path": "x"}, "task": {"name": "arithmetic"}}
    with pytest.raises(ConfigError, match=r"run\.name.*relative path inside run\.output_dir"):
        validate(raw)


def test_run_name_may_be_a_sub_folder(tmp_path):
    raw = {"run": {"name": "exp1/seed0", "output_dir": str(tmp_path)},
           "model": {"name_or_path": "x"}, "task": {"name": "arithmetic"}}  # fmt: skip
    assert validate(raw).run_dir == tmp_path / "exp1" / "seed0"


# ---- logs ------------------------------------------------------------------------------------


def test_resume_drops_a_torn_last_log_line_and_refuses_a_garbled_middle_one(
    finished_run, tmp_path, tiny_model_dir
):
    from grouprl.runtime.logging import LogFileError

    shutil.copytree(finished_run, tmp_path / "run")
    run_dir = tmp_path / "run"
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "split": "train", "loss": 0.5, "k": "\xe2\x82')  # cut mid-character
    with open(run_dir / "samples.jsonl", "ab") as f:
        f.write(b'{"step": 2, "prompt": "1+')  # cut mid-record
    with pytest.warns(UserWarning, match=r"torn last line of .*metrics\.jsonl line \d+"):
        train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=2"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows] == [(0, "eval"), (1, "train"), (1, "eval"),
                                                       (2, "train"), (2, "eval")]  # fmt: skip
    # a garbled line before the last one is no crash: an error naming file and line
    lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    lines.insert(2, b"\xff\xfe garbage")
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(LogFileError, match=r"metrics\.jsonl line 3.*only the last line"):
        train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=3"))


def test_resume_reads_the_run_config_with_the_alias_limit(finished_run, tmp_path, tiny_model_dir):
    """A run directory from someone else with an alias bomb as its config record: resume stops
    at once with the reason instead of hanging while comparing configs."""
    from grouprl.runtime.run_state import config_changes

    shutil.copytree(finished_run, tmp_path / "run")
    (tmp_path / "run" / "config.resolved.yaml").write_text(_BOMB)
    cfg = _cfg(tmp_path, tiny_model_dir, "run.resume=true")
    with pytest.raises(ValueError, match="alias"):
        config_changes(cfg)
