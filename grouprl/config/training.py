"""The `train:` section: optimizer, schedule, micro-batches, async rollouts, non-finite guard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grouprl.config.section import Section


class TrainConfig(Section):
    steps: int = Field(100, ge=1, description="Optimizer steps (one rollout batch each).")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up updates.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warm-up: keep the lr, or decay it to 0 at the last update."
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping (None: off).")
    micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per forward/backward (gradient accumulation)."
    )
    async_mode: Literal["off", "one_step_off"] = Field(
        "off",
        description="one_step_off: a background thread samples step k+1 with a snapshot of the "
        "weights while step k updates (grouprl/runtime/async_rollout.py); old_logp is the sampling "
        "weights' score.",
    )
    async_worker: Literal["thread", "process"] = Field(
        "thread",
        description="one_step_off: sample in a thread, or in a forked process (CPU only; for "
        "machines where threads of one process do not compute in parallel, see benchmarks).",
    )
    async_staleness: int = Field(
        1,
        ge=0,
        le=1,
        description="one_step_off: steps the sampling weights may lag (1: generation overlaps the "
        "update; 0: no overlap, the synchronous loop's samples, for checks).",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="A NaN/inf loss or gradient skips that update; this many steps in a row with "
        "a skipped update stop the run.",
    )
    disable_dropout: bool = Field(
        True,
        description="Set every dropout of the trained model to p=0 (LoRA's too, with a warning "
        "when model.lora.dropout > 0), so the trainer's log-probs match the sampler's "
        "(grouprl/policies/dropout.py). false keeps the model's dropout.",
    )
