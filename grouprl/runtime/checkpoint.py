"""Crash-safe, resumable checkpoints.

Layout under run_dir/checkpoints/:
  step-00000100/model/               whatever `save_model` wrote (HF save_pretrained layout)
  step-00000100/trainer_state.safetensors + trainer_state.json
                                     the caller's `state` (optimizer, scheduler, step, data position)
                                     plus the RNG states under the key "rng": tensors as
                                     safetensors, the rest as JSON (grouprl/runtime/trainer_state.py)
  step-00000100/manifest.json        {"format", "step", "time", "files": {relpath: size},
                                     "sha256": {relpath: hex digest}}, written LAST
  latest                             the name of the newest checkpoint (for people and tools)

How a crash can never leave a half checkpoint behind: everything is written into `.tmp-step-...`,
fsynced, and only then renamed to `step-...` in one atomic `os.replace`. A checkpoint counts as
complete only if its manifest parses, names its own step, and every listed file exists with the
listed size. `latest()` scans for that rather than trusting the `latest` pointer, which a crash can
leave one step behind. Leftover `.tmp-*` directories are deleted when a manager is created.

Damage after the fact (a disk error, a copy cut short, a file edited by hand) is caught by the
checksums: `latest(verify=True)`, which resumes use, re-hashes the newest checkpoint's files and,
when one does not match (or is truncated, or missing), warns, renames that checkpoint to
`corrupt-step-...` (kept for a person to inspect, ignored from then on) and tries the previous one.
Manifests of format 1 (sizes only, no checksums) are still accepted.

No pickle is ever loaded: a run directory may come from someone else, and the checksums do not
help against that (whoever writes a file writes its manifest too). Checkpoints of older grouprl
versions hold `trainer_state.pt`, a pickle; resuming one is refused with a message saying so
(the file is never opened).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grouprl.runtime.trainer_state import JSON_FILE, TENSORS_FILE, read_state, write_state

MANIFEST = "manifest.json"
STATE_FILES = (TENSORS_FILE, JSON_FILE)
LEGACY_STATE_FILE = "trainer_state.pt"  # a pickle (grouprl before the safetensors + JSON state)
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class NonFiniteCheckpointError(ValueError):
    """Raised by `save` when a tensor to be saved holds NaN/inf; nothing was written."""


class LegacyCheckpointError(ValueError):
    """A checkpoint whose trainer state is a pickle (trainer_state.pt): refused, never opened."""


def capture_rng() -> dict[str, Any]:
    """The state of every RNG that affects training: python, numpy, torch CPU and CUDA."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(state: dict[str, Any]) -> None:
    """Restore RNGs from `capture_rng()` output, or from a loaded checkpoint state (its "rng")."""
    rng = state.get("rng", state)
    if "python" not in rng or "torch" not in rng:
        raise KeyError(f"no RNG state found (keys: {sorted(state)}); expected capture_rng() output")
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        if len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
        else:  # resuming on another GPU count is legitimate; only exact replay is lost
            warnings.warn(
                f"checkpoint has CUDA RNG states for {len(rng['cuda'])} devices, this machine has "
                f"{torch.cuda.device_count()}; CUDA RNG not restored",
                stacklevel=2,
            )


def check_all_finite(tensors: Iterable[Tensor | tuple[str, Tensor]]) -> None:
    """Raise NonFiniteCheckpointError naming the first tensor with NaN/inf.

    Accepts plain tensors or (name, tensor) pairs such as `model.named_parameters()`."""
    for i, item in enumerate(tensors):
        name, t = item if isinstance(item, tuple) else (f"tensor #{i}", item)
        if t.is_floating_point() or t.is_complex():
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad:
                raise NonFiniteCheckpointError(
                    f"refusing to save a checkpoint: {name} {tuple(t.shape)} has {bad} NaN/inf "
                    "values (the previous checkpoint is untouched)"
                )


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksum_problem(ckpt: Path) -> str | None:
    """Why checkpoint `ckpt` cannot be trusted (incomplete, or a file whose sha256 differs from the
    manifest's), or None when it is intact. Reads every file: use it on resume, not on every save."""
    if not _manifest_ok(ckpt):
        return f"incomplete (missing / invalid {MANIFEST}, or a file missing or of the wrong size)"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
        for rel, expected in manifest.get("sha256", {}).items():
            if _sha256(ckpt / rel) != expected:
                return f"checksum mismatch in {rel}"
    except (OSError, ValueError, AttributeError) as exc:
        return f"unreadable ({exc})"
    return None


def _manifest_ok(ckpt: Path) -> bool:
    """True if `ckpt` is a complete checkpoint: valid manifest, own step, all files intact."""
    m = _STEP_DIR.match(ckpt.name)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if m is None or int(manifest["step"]) != int(m.group(1)):
            return False
        if not (all(f in files for f in STATE_FILES) or LEGACY_STATE_FILE in files):
            return False
        return all((ckpt / rel).stat().st_size == int(size) for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def newest_intact(run_dir: Path | str) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under run_dir/checkpoints whose files match their checksums (None if
    there is none), and one note per newer checkpoint that does not. Reads only: unlike
    CheckpointManager (which clears debris and sets damaged checkpoints aside), nothing in the
    run directory changes, for reading someone else's run (`grouprl eval`)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return None, []
    found = [p for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    found.sort(key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)
    notes = []
    for ckpt in found:  # newest first
        problem = checksum_problem(ckpt)
        if problem is None:
            return ckpt, notes
        notes.append(f"checkpoint {ckpt.name} is damaged ({problem}); skipped")
    return None, notes


class CheckpointManager:
    """Saves, finds and loads checkpoints under run_dir/checkpoints, keeping the newest `keep_last`
    complete ones (None keeps all)."""

    def __init__(self, run_dir: Path | str, keep_last: int | None = 2) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        self.dir = Path(run_dir) / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.rejected: list[str] = []  # what latest(verify=True) found damaged, for the run's log
        for leftover in self.dir.glob(".tmp-*"):  # debris of a crash mid-save or mid-prune
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def complete(self) -> list[Path]:
        """All complete checkpoints, oldest first."""
        found = [p for p in self.dir.iterdir() if p.is_dir() and _manifest_ok(p)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self, verify: bool = False) -> Path | None:
        """The newest complete checkpoint, or None (found by scanning; `latest` is only a hint).

        verify=True also checks the checksums, newest first: a damaged checkpoint is reported with
        a warning (and in `self.rejected`), renamed to corrupt-step-..., and the previous one tried.
        """
        if not verify:
            done = self.complete()
            return done[-1] if done else None
        found = [p for p in self.dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        found.sort(key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)
        for ckpt in found:  # newest first
            problem = checksum_problem(ckpt)
            if problem is None:
                return ckpt
            aside = self.dir / f"corrupt-{ckpt.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(ckpt, aside)
            note = (
                f"checkpoint {ckpt.name} is damaged: {problem}; moved to {aside.name}, "
                "falling back to the previous one (if any)"
            )
            self.rejected.append(note)
            warnings.warn(note, stacklevel=2)
        return None

    def save(
        self,
        step: int,
        *,
        save_model: Callable[[Path], None],
        state: dict[str, Any],
        check_finite: Iterable[Tensor | tuple[str, Tensor]] | None = None,
    ) -> Path:
        """Write checkpoint `step` atomically and return its directory.

        save_model(dir) writes the weights into dir (created empty beforehand); `state` holds
        tensors, numbers, strings, None, lists, tuples, dicts and numeric numpy values only (see
        grouprl/runtime/trainer_state.py; anything else raises before writing) and must not use the key "rng" (the RNG states are stored there). If
        `check_finite` holds a NaN/inf tensor, NonFiniteCheckpointError is raised before anything
        is written. If anything fails midway the temporary directory is removed and the error
        re-raised; the previous checkpoints are untouched.
        """
        if check_finite is not None:
            check_all_finite(check_finite)
        if "rng" in state:
            raise ValueError('state must not contain the key "rng": save() stores RNG states there')
        name = f"step-{int(step):08d}"
        tmp, final = self.dir / f".tmp-{name}", self.dir / name
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            (tmp / MODEL_DIR).mkdir(parents=True)
            save_model(tmp / MODEL_DIR)
            write_state({**state, "rng": capture_rng()}, tmp)
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            for p in files:
                _fsync_file(p)
            manifest = {
                "format": 2,
                "step": int(step),
                "time": time.time(),
                "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files},
                "sha256": {str(p.relative_to(tmp)): _sha256(p) for p in files},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
            _fsync_file(tmp / MANIFEST)
            for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
                _fsync_dir(d)
            if final.exists():  # re-saving a step (e.g. after a rewind): move the old one aside
                os.replace(final, self.dir / f".tmp-old-{name}")
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(self.dir / f".tmp-old-{name}", ignore_errors=True)
        self._write_pointer(name)
        self._prune()
        return final

    def _write_pointer(self, name: str) -> None:
        tmp = self.dir / ".tmp-latest"
        tmp.write_text(name + "\n", encoding="utf-8")
        _fsync_file(tmp)
        os.replace(tmp, self.dir / "latest")
        _fsync_dir(self.dir)

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for old in self.complete()[: -self.keep_last]:
            # rename first so a crash mid-delete never leaves a half-deleted `step-*` directory
            doomed = self.dir / f".tmp-delete-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def load(path: Path | str) -> dict[str, Any]:
        """The trainer state of checkpoint `path` (a `step-*` directory), including "rng".

        The model weights are in path / MODEL_DIR for the policy to load. Only safetensors and
        JSON are read: nothing in a checkpoint can run code. A checkpoint of an older grouprl
        (trainer_state.pt, a pickle) raises LegacyCheckpointError without the file being opened.
        """
        path = Path(path)
        if not _manifest_ok(path):
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (missing/invalid {MANIFEST} or files)"
            )
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
        if not all(f in files for f in STATE_FILES):
            raise LegacyCheckpointError(
                f"checkpoint {str(path)!r} stores its trainer state in {LEGACY_STATE_FILE}, a pickle "
                "written by an older grouprl; grouprl no longer loads pickles (unpickling a file "
                "runs whatever code its author put in it, and a run directory may come from "
                "someone else). The file was not opened. Resume this run with the grouprl version "
                "that wrote it, or start afresh (run.overwrite=true, or another run.name); the "
                f"weights in {str(path / MODEL_DIR)!r} are safetensors and can seed a new run "
                "(model.name_or_path)"
            )
        return read_state(path)
