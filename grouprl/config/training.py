"""The `train:` section: optimizer, schedule, micro-batches, async rollouts, non-finite guard."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
    async_mode: Literal["off", "one_step_off", "bounded"] = Field(
        "off",
        description="one_step_off: a background thread samples step k+1 with a snapshot of the "
        "weights while step k updates (grouprl/runtime/async_rollout.py); old_logp is the sampling "
        "weights' score. bounded: a producer thread samples continuously into a bounded queue, "
        "samples more than train.max_staleness versions old are dropped or down-weighted, "
        "old_logp is the trainer's (proximal) score, engine_logp the behaviour "
        "(grouprl/runtime/bounded_async.py).",
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
    max_staleness: int = Field(
        1,
        ge=0,
        description="bounded: k, the most weight versions a trained token may lag the weights it "
        "is trained with (0: the synchronous run's samples, through the producer).",
    )
    stale_policy: Literal["drop", "downweight"] = Field(
        "drop",
        description="bounded: a sample with a token more than max_staleness versions old is "
        "dropped (counted in async/dropped_samples), or each such token's loss is multiplied by "
        "stale_decay ** (its staleness - max_staleness).",
    )
    stale_decay: float = Field(
        0.5,
        gt=0,
        le=1,
        description="bounded + downweight: the loss weight factor per version beyond "
        "max_staleness.",
    )
    async_prefetch: int | None = Field(
        None,
        ge=0,
        description="bounded: batches the producer may sample ahead of the trainer's demand "
        "(None: max_staleness, so no sample exceeds the bound; more trades drops / down-weights "
        "for throughput).",
    )
    partial_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="bounded: generate in chunks of this many tokens; newer weights published "
        "between chunks continue the unfinished completions (partial rollouts; each token keeps "
        "its log-prob and weight version). None: whole completions with one version.",
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

    @model_validator(mode="after")
    def _bounded_options(self) -> TrainConfig:
        """The bounded-async options apply only to async_mode bounded: one set to another value
        than its default under another mode is an error, not ignored (a resolved config, which
        writes every default, still loads)."""
        own = ("max_staleness", "stale_policy", "stale_decay", "async_prefetch",
               "partial_chunk_tokens")  # fmt: skip
        fields = type(self).model_fields

        def changed(name: str) -> bool:
            return getattr(self, name) != fields[name].default

        if self.async_mode != "bounded":
            given = [k for k in own if changed(k)]
            if given:
                raise ValueError(
                    f"train.{', train.'.join(given)} apply(ies) only to train.async_mode bounded, "
                    f"but async_mode is {self.async_mode!r}"
                )
        elif changed("stale_decay") and self.stale_policy != "downweight":
            raise ValueError("train.stale_decay applies only to train.stale_policy downweight")
        elif changed("async_staleness"):
            raise ValueError(
                "train.async_staleness is one_step_off's; async_mode bounded uses "
                "train.max_staleness"
            )
        return self
