"""The run directory's state: claiming it, saving checkpoints, resuming from them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from grouprl.checkpoint import CheckpointManager, restore_rng
from grouprl.config import Config
from grouprl.policies.flow_weights import OLD  # state_dict prefix of old / EMA weights


def claim_run_dir(cfg: Config) -> None:
    """Refuse to mix two runs in one directory unless resuming or explicitly overwriting."""
    run_dir = cfg.run_dir
    if cfg.run.resume or not (run_dir / "metrics.jsonl").exists():
        return
    if not cfg.run.overwrite:
        raise ValueError(
            f"run directory {str(run_dir)!r} already holds a run; set run.resume=true to continue "
            "it, run.overwrite=true to start afresh, or choose another run.name"
        )
    for name in ("metrics.jsonl", "samples.jsonl", "samples.md", "curves.png"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def save_checkpoint(
    ckpts, step, policy, optimizer, scheduler, sampler, before, after=None, scaler=None
) -> None:
    """Checkpoint `step`; `after` (the final evaluation) only in a finished run's last one.
    scaler: the float16 loss scaler (policies/precision.py), saved as plain numbers."""
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


def resume_from(
    path: Path, policy, optimizer, scheduler, sampler, scaler=None
) -> tuple[int, dict | None, dict | None]:
    """Load checkpoint `path` into the objects; returns (step, eval before, eval after or None)."""
    state = CheckpointManager.load(path)
    if state.get("adapter") is not None:
        policy.load_state_dict(state["adapter"])
    else:
        policy.load_saved_weights(path / "model")
        if state.get("old_weights"):
            own = {k: v for k, v in policy.state_dict().items() if not k.startswith(OLD)}
            policy.load_state_dict({**own, **state["old_weights"]})
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    if scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    restore_rng(state)
    return int(state["step"]), state.get("eval_before"), state.get("eval_after")
