"""The `algorithm:` section: advantages, ratio, surrogate (a typed `algorithm.surrogate`), KL,
entropy, engine correction, dynamic sampling, epochs. `algorithm.preset` fills what is left unset.

A preset's `surrogate` mapping fills the keys missing from the config's own surrogate when the
config names no surrogate type or the preset's; a config naming another type keeps its own
surrogate whole (the preset's knobs belong to a different family).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grouprl.config.distill import DistillConfig
from grouprl.config.migration import migrate_algorithm
from grouprl.config.presets import preset_settings
from grouprl.config.section import Section
from grouprl.config.surrogates import ClipSurrogate, SurrogateConfig

Advantage = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "tpo"
]
Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "delta_l"
]
Correction = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class AlgorithmConfig(Section):
    preset: str = Field("grpo", description="config.presets name; fills fields left unset.")
    advantage: Advantage = Field("grpo", description="Advantage estimator.")
    scale: Literal["group", "batch", "none"] = Field("group", description="Std scaling.")
    adv_eps: float = Field(1e-4, ge=0, description="Added to the std before dividing.")
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How several rewards combine (GDPO = normalize_then_sum)."
    )
    ratio_level: Literal["token", "sequence", "geometric"] = Field("token", description="Ratio.")
    surrogate: SurrogateConfig = Field(
        default_factory=ClipSurrogate,
        description="Policy-gradient surrogate and its knobs: {type: clip | cispo | sapo | "
        "reinforce | clip_cov | kl_cov | pmd | tpo, ...} (grouprl/config/surrogates.py).",
    )
    pg_coef: float = Field(1.0, ge=0, description="Weight of the policy-gradient term (0: none).")
    distill: DistillConfig | None = Field(
        None,
        description="On-policy distillation from a teacher as a loss term: {teacher, source, "
        "estimator, coef, chunk_size} (grouprl/config/distill.py); None: off.",
    )
    aggregation: Aggregation = Field("seq_mean_token_mean", description="Loss aggregation.")
    delta_l_alpha: float = Field(
        0.75, ge=0, description="Delta-L length exponent (arXiv 2509.07558)."
    )
    token_scale: Literal["none", "prefix_share"] = Field(
        "none", description="prefix_share: lambda-GRPO 1/k token scales (arXiv 2509.21154)."
    )
    egsw: Literal["off", "sequence", "token"] = Field(
        "off", description="Entropy-guided weights over the group (arXiv 2503.22456)."
    )
    egsw_alpha: float = Field(
        0.1, description="EGSW entropy coefficient alpha; the paper's value is unconfirmed."
    )
    egsw_temperature: float = Field(
        1.0, gt=0, description="EGSW softmax temperature P; the paper's value is unconfirmed."
    )
    kl_coef: float = Field(0.0, ge=0, description="KL-to-reference coefficient (0: no reference).")
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+"] = Field("k3", description="KL estimator.")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL as loss term or in reward.")
    kl_weighting: Literal["none", "importance"] = Field(
        "none",
        description="importance: the per-token KL loss times the ratio pi_theta/pi_old (token or "
        "sequence level, as ratio_level; TRL's use_bias_correction_kl). Needs kl_mode loss.",
    )
    entropy_coef: float = Field(0.0, description="loss -= coef * entropy (positive raises H).")
    top_entropy_quantile: float = Field(1.0, gt=0, le=1, description="Train top-q entropy tokens.")
    engine_correction: Correction = Field("none", description="Trainer/engine mismatch weights.")
    engine_correction_max: float = Field(2.0, gt=0, description="Upper IS-weight threshold.")
    engine_correction_min: float = Field(0.0, ge=0, description="Lower IS-weight threshold.")
    dynamic_sampling: Literal["off", "zero_variance"] = Field("off", description="DAPO filter.")
    max_sampling_rounds: int = Field(3, ge=1, description="Generation rounds per step at most.")
    tree_advantage: Literal[
        "leaf_group", "segment", "treerpo", "tempo", "tree_grpo", "treerl", "branch_grpo"
    ] = Field(
        "leaf_group",
        description="With rollout.tree: per-token (per-step for images) advantages from the tree "
        "(objectives/tree.py); leaf_group: `advantage` over the leaves as a flat group; "
        "branch_grpo: node values standardised per depth (BranchGRPO).",
    )
    tree_scales: Literal["none", "shared_segment"] = Field(
        "none",
        description="With rollout.tree: shared_segment scales each token by 1/(leaves through its "
        "segment), so a shared segment counts once.",
    )
    resample_size: Literal["full", "needed"] = Field(
        "full",
        description="Prompts of each later dynamic-sampling round: full (prompts_per_step, as "
        "DAPO) or needed (the missing groups / the share kept so far, as GRESO's adaptive batch).",
    )
    overlong_shaping: Literal["off", "soft"] = Field("off", description="DAPO overlong penalty.")
    overlong_buffer_frac: float = Field(0.2, gt=0, le=1, description="L_cache / L_max.")
    overlong_factor: float = Field(1.0, ge=0, description="Overlong penalty at L_max.")
    epochs: int = Field(1, ge=1, description="mu: passes over each batch.")
    minibatches: int = Field(1, ge=1, description="Optimizer updates per epoch.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        data = migrate_algorithm(data)  # older flat surrogate keys, with a warning
        if isinstance(data, dict):
            preset = data.get("preset", "grpo")
            settings = preset_settings(preset)
            surrogate = merge_surrogate(settings.pop("surrogate", None), data.get("surrogate"))
            distill = merge_distill(settings.pop("distill", None), data.get("distill"))
            data = {**settings, **data, "preset": preset}
            if surrogate is not None:
                data["surrogate"] = surrogate
            if distill is not None:
                data["distill"] = distill
        return data


def merge_surrogate(preset: Any, mine: Any) -> Any:
    """The preset's surrogate mapping under the config's: the config's keys win; a config naming
    another surrogate type keeps its own mapping whole."""
    if isinstance(mine, dict) and "type" not in mine and not isinstance(preset, dict):
        return {"type": "clip", **mine}  # the field's default family
    if not isinstance(preset, dict):
        return mine
    if mine is None:
        return dict(preset)
    if not isinstance(mine, dict) or mine.get("type", preset.get("type")) != preset.get("type"):
        return mine
    return {**preset, **mine}


def merge_distill(preset: Any, mine: Any) -> Any:
    """The preset's distill mapping (estimator, coef: never a teacher) under the config's: the
    config's keys win; a preset with distillation and a config without a teacher fails at
    validation, naming algorithm.distill.teacher."""
    if not isinstance(preset, dict):
        return mine
    if mine is None:
        mine = {}
    if not isinstance(mine, dict):
        return mine  # a typed DistillConfig given from Python, or a wrong value: validated as is
    merged = {**preset, **mine}
    if "teacher" not in merged:
        raise ValueError(
            "algorithm.distill.teacher is needed: the preset distils from a teacher, and a "
            "preset cannot name one; set algorithm.distill.teacher=<local model folder>"
        )
    return merged
