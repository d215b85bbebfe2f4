"""`algorithm.distill`: on-policy distillation from a frozen teacher as a loss term
(grouprl/objectives/distill.py; the `opd` preset). Absent (None): no teacher, no term."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grouprl.config.section import Section


class DistillConfig(Section):
    teacher: str = Field(
        description="Local model folder of the teacher (save_pretrained layout); its tokenizer's "
        "vocabulary must be the student's. Required: no preset can name it."
    )
    source: Literal["model", "engine"] = Field(
        "model",
        description="model: the teacher loaded as a second frozen causal LM in model.dtype; "
        "engine: its log-probs of the sampled tokens served by a vLLM engine (prompt log-probs).",
    )
    estimator: Literal["k1", "k3", "full"] = Field(
        "k1",
        description="Per-token reverse KL(student || teacher): k1 (score-function gradient, "
        "-(ls - lt) as advantage), k3 (GRPO's KL form), full (exact over the vocabulary).",
    )
    coef: float = Field(1.0, gt=0, description="Weight of the distillation term in the loss.")
    chunk_size: int | None = Field(
        None, ge=1, description="Positions per chunk of the full-vocabulary KL (None: automatic)."
    )

    @model_validator(mode="after")
    def _engine_cannot_give_full(self) -> DistillConfig:
        if self.source == "engine" and self.estimator == "full":
            raise ValueError(
                "algorithm.distill.estimator='full' needs the teacher's whole distribution at "
                "every position, but algorithm.distill.source='engine' serves only the log-probs "
                "of the sampled tokens; use source 'model' or estimator k1 / k3"
            )
        return self
