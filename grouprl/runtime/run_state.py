"""The run directory's state: checking and claiming it, saving checkpoints, resuming from them.

The run directory is touched only after everything is built (train.py): `check_run_dir` runs
first and only reads (a run already there needs run.resume or run.overwrite; a resume with a
changed config is refused unless run.allow_config_change), then the task, rewards, model and
optimizer are built, and only then `claim_run_dir` deletes an old run (run.overwrite) and writes
config.yaml / config.resolved.yaml. A typo anywhere in the config therefore never costs a run.

Config changes on resume: the new resolved config is compared with the run's config.resolved.yaml
(or, for runs of older grouprl versions, its fully resolved config.yaml), key by dotted key.
Exempt (they may differ freely, and are still recorded): RESUME_EXEMPT, i.e. the per-invocation
flags, where the run directory sits (output_dir / name: a run may be moved or copied), the console
/ logging / thread / device settings that do not change what is computed, where a vllm_server
runs (rollout.server: a run resumes against a restarted server), and
train.steps (continuing a finished run for more steps; with a linear / cosine lr_schedule the
schedule's length follows train.steps, so the lr from the checkpoint on differs from the first
run's plan). Every change is printed and appended to config_changes.jsonl in the run directory.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from grouprl.config.loading import (
    ACTION_KEYS,
    Config,
    flatten,
    load_config,
    load_yaml,
    read_config,
    save_run_config,
    validate,
)
from grouprl.policies.base import OLD  # state_dict prefix of old / EMA weights
from grouprl.policies.lora_targets import write_targets
from grouprl.runtime.checkpoint import CheckpointManager, newest_intact, restore_rng
from grouprl.runtime.user_inputs import is_python_object, python_objects_in

RESUME_EXEMPT = frozenset({
    "run.resume", "run.overwrite", "run.allow_config_change", "run.console", "run.log_backends",
    "run.num_threads", "run.device", "run.output_dir", "run.name", "run.peak_flops", "train.steps",
    # where the vllm_server runs and how long to wait for it (a restarted server: a new url)
    "rollout.server.url", "rollout.server.timeout_s", "rollout.server.connect_timeout_s",
    "rollout.server.weight_timeout_s", "rollout.server.channel_host",
    "rollout.server.channel_port", "rollout.server.backend",
})  # fmt: skip
CHANGES_FILE = "config_changes.jsonl"


class ConfigChangedError(ValueError):
    """run.resume with a config that differs from the run's (run.allow_config_change=false)."""


def _holds_run(run_dir: Path) -> bool:
    """A run was started here: it logged, or it saved a checkpoint."""
    ckpts = run_dir / "checkpoints"
    return (run_dir / "metrics.jsonl").exists() or (
        ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())
    )


def check_run_dir(cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Refuse to mix two runs in one directory unless resuming or explicitly overwriting; on
    resume, the config changes {dotted key: (old, new)} (refused unless allowed or exempt).
    Reads only: nothing in the run directory is changed."""
    run_dir = cfg.run_dir
    if not _holds_run(run_dir):
        return {}
    if not cfg.run.resume:
        if not cfg.run.overwrite:
            raise ValueError(
                f"run directory {str(run_dir)!r} already holds a run; set run.resume=true to "
                "continue it, run.overwrite=true to start afresh, or choose another run.name"
            )
        return {}
    changes = config_changes(cfg)
    refused = {k: v for k, v in changes.items() if k not in RESUME_EXEMPT}
    if refused and not cfg.run.allow_config_change:
        raise ConfigChangedError(
            f"run.resume: the config differs from the one run {str(run_dir)!r} was started with "
            f"({_describe(refused)}); resume with the same config, set "
            "run.allow_config_change=true to continue with the new one (the changes are then "
            f"recorded in {CHANGES_FILE}), or start another run (run.name)"
        )
    return changes


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def config_changes(cfg: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (the run's value, this config's value)} for every differing key but the
    per-invocation flags (run.resume / overwrite / allow_config_change)."""
    run_dir = cfg.run_dir
    resolved, mine = run_dir / "config.resolved.yaml", run_dir / "config.yaml"
    try:
        if resolved.is_file():  # the record of every value the run used
            # the alias-limited loader: a run directory may come from someone else
            old_raw = load_yaml(resolved.read_text(encoding="utf-8"), str(resolved)) or {}
        elif mine.is_file():  # older runs: a resolved config.yaml; else what the user set
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                old_raw = load_config(mine).model_dump(mode="json")
        else:
            return {}
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"the run's config in {str(run_dir)!r} does not load ({exc}); cannot "
                         "compare it with this one for run.resume") from None  # fmt: skip
    old, new = flatten(old_raw), flatten(cfg.model_dump(mode="json"))
    missing = object()
    return {
        k: (old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k, missing) != new.get(k, missing) and k not in ACTION_KEYS
    }


def claim_run_dir(
    cfg: Config, changes: dict[str, tuple[Any, Any]], say=print, lora_targets=None
) -> None:
    """After everything is built: delete the old run (run.overwrite), record config changes
    (resume), write config.yaml and config.resolved.yaml; under LoRA, say the resolved targets
    once and write them to lora_targets.json (policies/lora_targets.py)."""
    run_dir = cfg.run_dir
    if not cfg.run.resume and cfg.run.overwrite and _holds_run(run_dir):
        for name in ("metrics.jsonl", "samples.jsonl", "samples.md", "curves.png", CHANGES_FILE):
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if changes:
        say(f"resuming with config changes: {_describe(changes)}")
        record = {"time": time.time(), "changes": {k: list(v) for k, v in changes.items()},
                  "exempt": sorted(set(changes) & RESUME_EXEMPT)}  # fmt: skip
        with open(run_dir / CHANGES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
    save_run_config(cfg, run_dir)
    if lora_targets is not None:
        say(lora_targets.describe())
        write_targets(lora_targets, run_dir)


def save_checkpoint(
    ckpts, step, policy, optimizer, scheduler, sampler, before, after=None, scaler=None, hooks=None
) -> None:
    """Checkpoint `step`; `after` (the final evaluation) only in a finished run's last one.
    scaler: the float16 loss scaler (policies/precision.py), saved as plain numbers; hooks: the
    rollout hooks (replay's buffer), saved as plain values."""
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "eval_before": before,
        "eval_after": after,
        # LoRA adapters are small and not recoverable from the merged save: keep them here too
        "adapter": policy.state_dict() if policy.lora is not None else None,
        # full fine-tuning: the model folder holds the trained weights only; a flow policy's
        # old / EMA weights (DiffusionNFT, AWM: keys "old::...") are kept here
        "old_weights": None if policy.lora is not None else _old_weights(policy),
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        "rollout_hooks": None if not hooks else hooks.state_dict(),
    }
    ckpts.save(
        step,
        save_model=policy.save_pretrained,
        state=state,
        # no NaN/inf may reach a checkpoint: the weights trained and the optimizer's moments
        check_finite=[*policy.trainable_parameters(), *_optimizer_tensors(optimizer)],
    )


def _old_weights(policy) -> dict[str, Any] | None:
    """The policy's old / EMA weights (flow policies with likelihood-free objectives), or None."""
    old = {k: v for k, v in policy.state_dict().items() if k.startswith(OLD)}
    return old or None


def _optimizer_tensors(optimizer) -> list[tuple[str, Any]]:
    """(name, tensor) of every tensor in the optimizer state, e.g. ("optimizer state 3/exp_avg", t)."""
    return [
        (f"optimizer state {index}/{key}", value)
        for index, slots in optimizer.state_dict()["state"].items()
        for key, value in slots.items()
        if isinstance(value, torch.Tensor)
    ]


def load_weights(path: Path, policy) -> dict[str, Any]:
    """The trained weights of checkpoint `path` into `policy` (LoRA: the adapters; else the model
    folder, plus a flow policy's old / EMA weights); returns the checkpoint's whole state."""
    state = CheckpointManager.load(path)
    if state.get("adapter") is not None:
        policy.load_state_dict(state["adapter"])
    else:
        policy.load_saved_weights(path / "model")
        if state.get("old_weights"):
            own = {k: v for k, v in policy.state_dict().items() if not k.startswith(OLD)}
            policy.load_state_dict({**own, **state["old_weights"]})
    return state


def resume_from(
    path: Path, policy, optimizer, scheduler, sampler, scaler=None, hooks=None
) -> tuple[int, dict | None, dict | None]:
    """Load checkpoint `path` into the objects; returns (step, eval before, eval after or None)."""
    state = load_weights(path, policy)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    if scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    if hooks and state.get("rollout_hooks") is not None:
        hooks.load_state_dict(state["rollout_hooks"])
    restore_rng(state)
    return int(state["step"]), state.get("eval_before"), state.get("eval_after")


def finished_run(run_dir: Path | str, overrides: list[str] = ()) -> tuple[Config, Path, list[str]]:
    """A run directory for evaluation (`grouprl eval RUN`): its config (config.yaml, what the run
    was started with, else config.resolved.yaml; plus `overrides`; run.output_dir / run.name
    follow where the folder is now), its newest intact checkpoint, and a note per damaged newer
    one. Reads only. A model given from Python (model.name_or_path "<python>:...") is read from
    the checkpoint's model folder (merged weights under LoRA); any other part given from Python
    (a dataset, a reward function, an env factory) is an error naming it: the run cannot be
    rebuilt from its files alone."""
    run_dir = Path(run_dir)
    path = next((run_dir / n for n in ("config.yaml", "config.resolved.yaml")
                 if (run_dir / n).is_file()), None)  # fmt: skip
    if path is None:
        raise FileNotFoundError(
            f"{str(run_dir)!r} holds no config.yaml or config.resolved.yaml: not a run directory"
        )
    ckpt, notes = newest_intact(run_dir)
    if ckpt is None:
        damaged = f" ({'; '.join(notes)})" if notes else ""
        raise FileNotFoundError(
            f"run {str(run_dir)!r} has no intact checkpoint{damaged}; its initial weights are "
            f"evaluated with `grouprl eval {path}`"
        )
    raw = read_config(path, overrides)
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    if is_python_object(model.get("name_or_path")):  # the trained weights are a model folder
        raw["model"] = {**model, "name_or_path": str(ckpt / "model"), "lora": None}
    objects = python_objects_in(raw)
    if objects:
        raise ValueError(
            f"run {str(run_dir)!r} was given parts as Python objects ("
            + ", ".join(f"{k}: {v}" for k, v in objects.items())
            + "), which its files do not hold; evaluate it from Python, giving the same objects "
            f"to grouprl.Trainer({str(path)!r}, ...)"
        )
    raw["run"] = {**(raw.get("run") or {}), "output_dir": str(run_dir.parent), "name": run_dir.name}
    return validate(raw), ckpt, notes
