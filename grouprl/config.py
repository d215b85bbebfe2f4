"""Typed run configuration: YAML file + dotted CLI overrides -> validated `Config`.

One pydantic model per component, a docstring (description) per field; unknown keys fail with the
nearest valid key, wrong values with the allowed ones; incompatible settings fail or warn with why.
The `algorithm.preset` named in objectives.presets fills every algorithm field the user left unset.
"""

from __future__ import annotations

import difflib
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from grouprl.objectives.presets import preset_settings


class ConfigError(ValueError):
    """A config problem, with a message a person can act on."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    name: str = Field("run", description="Run name; the run directory is output_dir/name.")
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for python, numpy and torch RNGs.")
    resume: bool = Field(False, description="Continue from the last complete checkpoint.")
    overwrite: bool = Field(False, description="Start afresh in a run directory that has a run.")
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="Where to train.")
    num_threads: int | None = Field(None, description="torch CPU threads (None: torch default).")
    log_backends: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"], description="Metric sinks besides metrics.jsonl."
    )
    console: bool = Field(True, description="Show the progress bar and status lines.")
    fail_fast: bool = Field(False, description="Re-raise reward-function errors instead of NaN.")


class LoRAConfig(_Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that get adapters.",
    )


class ModelConfig(_Section):
    type: Literal["causal_lm"] = Field("causal_lm", description="Policy kind.")
    name_or_path: str = Field(..., description="Hub id or local save_pretrained folder.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype."
    )
    lora: LoRAConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="Rows per LM-head chunk when scoring (None: policy default)."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub.")


class TaskConfig(_Section):
    name: str = Field(..., description="Task registry name: arithmetic, countdown, math.")
    options: dict[str, Any] = Field(default_factory=dict, description="Task factory options.")


class RewardConfig(_Section):
    name: str = Field(
        ...,
        description="Built-in reward name or 'module:function' / 'file.py:fn'; a name of one of "
        "the task's rewards (e.g. accuracy) without options means the task's own function.",
    )
    weight: float = Field(1.0, description="Weight in the combined reward.")
    options: dict[str, Any] = Field(default_factory=dict, description="Reward factory options.")


class RolloutConfig(_Section):
    engine: Literal["hf"] = Field("hf", description="Generation backend.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) per optimizer step.")
    group_size: int = Field(8, ge=1, description="G: completions sampled per prompt.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion (L_max).")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    old_logp: Literal["recompute", "engine"] = Field(
        "recompute",
        description="recompute: score the batch with the trainer before updating (PPO's pi_old); "
        "engine: trust the engine's sampling log-probs.",
    )


Advantage = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "tpo"
]
Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "delta_l"
]
Correction = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class AlgorithmConfig(_Section):
    preset: str = Field("grpo", description="objectives.presets name; fills fields left unset.")
    advantage: Advantage = Field("grpo", description="Advantage estimator.")
    scale: Literal["group", "batch", "none"] = Field("group", description="Std scaling.")
    adv_eps: float = Field(1e-4, ge=0, description="Added to the std before dividing.")
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How several rewards combine (GDPO = normalize_then_sum)."
    )
    ratio_level: Literal["token", "sequence", "geometric"] = Field("token", description="Ratio.")
    surrogate: Literal["clip", "cispo", "sapo", "reinforce", "clip_cov", "kl_cov", "pmd", "tpo"] = (
        Field("clip", description="Policy-gradient surrogate.")
    )
    pg_coef: float = Field(1.0, ge=0, description="Weight of the policy-gradient term (0: none).")
    eps_low: float = Field(0.2, ge=0, description="Lower clip range (1 - eps_low).")
    eps_high: float = Field(0.2, ge=0, description="Upper clip range (1 + eps_high).")
    dual_clip_c: float | None = Field(None, gt=1, description="Dual-clip bound for A < 0.")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for A > 0.")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for A <= 0.")
    clip_cov_ratio: float = Field(2e-4, ge=0, le=1, description="Clip-Cov token fraction.")
    clip_cov_lb: float = Field(1.0, description="Clip-Cov covariance lower bound.")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov covariance upper bound.")
    kl_cov_ratio: float = Field(2e-4, ge=0, le=1, description="KL-Cov token fraction.")
    kl_cov_coef: float = Field(1.0, ge=0, description="KL-Cov penalty coefficient.")
    pmd_tau: float = Field(0.01, gt=0, description="PMD-mean temperature tau (arXiv 2602.05933).")
    tpo_eta: float = Field(1.0, gt=0, description="TPO target temperature eta (arXiv 2604.06159).")
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
    entropy_coef: float = Field(0.0, description="loss -= coef * entropy (positive raises H).")
    top_entropy_quantile: float = Field(1.0, gt=0, le=1, description="Train top-q entropy tokens.")
    engine_correction: Correction = Field("none", description="Trainer/engine mismatch weights.")
    engine_correction_max: float = Field(2.0, gt=0, description="Upper IS-weight threshold.")
    engine_correction_min: float = Field(0.0, ge=0, description="Lower IS-weight threshold.")
    dynamic_sampling: Literal["off", "zero_variance"] = Field("off", description="DAPO filter.")
    max_sampling_rounds: int = Field(3, ge=1, description="Generation rounds per step at most.")
    overlong_shaping: Literal["off", "soft"] = Field("off", description="DAPO overlong penalty.")
    overlong_buffer_frac: float = Field(0.2, gt=0, le=1, description="L_cache / L_max.")
    overlong_factor: float = Field(1.0, ge=0, description="Overlong penalty at L_max.")
    epochs: int = Field(1, ge=1, description="mu: passes over each batch.")
    minibatches: int = Field(1, ge=1, description="Optimizer updates per epoch.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            preset = data.get("preset", "grpo")
            data = {**preset_settings(preset), **data, "preset": preset}
        return data


class CurriculumConfig(_Section):
    type: Literal["none", "dump"] = Field(
        "none", description="none: uniform prompts; dump: UCB over data sources (arXiv 2504.09710)."
    )
    source_column: str = Field("source", description="Example column naming its data source.")
    window: int = Field(300, ge=1, description="DUMP: |advantage| values kept per source.")
    c: float = Field(1.0, ge=0, description="DUMP: UCB exploration coefficient.")
    temperature: float = Field(0.1, gt=0, description="DUMP: softmax temperature over sources.")


class AgentConfig(_Section):
    """Multi-turn episodes (task.name = env): limits and credit assignment."""

    max_turns: int = Field(8, ge=1, description="Assistant turns per episode at most.")
    max_turn_tokens: int = Field(32, ge=1, description="Tokens per assistant turn at most.")
    max_total_tokens: int = Field(
        1024, ge=1, description="Context budget (prompt + all turns); overflow ends the episode."
    )
    invalid_penalty: float = Field(0.1, ge=0, description="Subtracted for an unparsable action.")
    credit: Literal["trajectory", "turn", "gigpo"] = Field(
        "trajectory",
        description="trajectory: episode return for every turn; turn: discounted per-turn "
        "returns; gigpo: episode + step advantages from anchor states (arXiv 2505.10978).",
    )
    gamma: float = Field(0.95, ge=0, le=1, description="Discount for turn / step returns.")
    omega: float = Field(1.0, ge=0, description="GiGPO weight of the step advantage.")
    norm: Literal["mean_std_norm", "mean_norm"] = Field(
        "mean_std_norm", description="GiGPO/turn normalisation: divide by the std or not."
    )
    adv_eps: float = Field(1e-6, ge=0, description="Added to the std in episode/step advantages.")
    keep_top_groups: float = Field(
        1.0, gt=0, le=1, description="StarPO-S: train only this fraction of groups, by reward std."
    )


class TrainConfig(_Section):
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


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Evaluate every k steps (0: only before and after).")
    max_examples: int | None = Field(None, ge=1, description="Held-out examples used.")
    pass_k: int = Field(0, ge=0, description="Also report pass@k with k samples (0: off).")
    batch_size: int = Field(256, ge=1, description="Prompts per generation batch.")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every k steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    task: TaskConfig
    rewards: list[RewardConfig] = Field(default_factory=list, description="Empty: task defaults.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset_sections(cls, data: Any) -> Any:
        """Preset settings for other sections ("rollout.group_size") fill fields left unset."""
        if not isinstance(data, dict):
            return data
        algo = data.get("algorithm") or {}
        if not isinstance(algo, dict):
            return data
        data = dict(data)
        for key, value in preset_settings(algo.get("preset", "grpo"), sections=True).items():
            section, field = key.split(".", 1)
            current = data.get(section) or {}
            if isinstance(current, dict) and field not in current:
                data[section] = {**current, field: value}
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        check_combinations(self)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


_GROUP_BASELINES = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"}


def check_combinations(cfg: Config) -> None:
    """Errors for settings that cannot work together, warnings for ones that rarely make sense."""
    a, r = cfg.algorithm, cfg.rollout
    if r.group_size == 1 and a.advantage in _GROUP_BASELINES:
        raise ValueError(
            f"rollout.group_size=1 with advantage={a.advantage!r}: every estimator here compares a "
            "sample with its own group, so a group of one has advantage 0 and nothing is learned; "
            "use group_size >= 2"
        )
    n = r.prompts_per_step * r.group_size
    if n % a.minibatches:
        raise ValueError(
            f"algorithm.minibatches={a.minibatches} must divide the batch of "
            f"prompts_per_step * group_size = {n} samples"
        )
    if a.ratio_level == "sequence" and a.aggregation in ("token_mean", "seq_mean_token_sum",
                                                         "seq_mean_token_sum_norm"):  # fmt: skip
        warnings.warn(
            f"ratio_level='sequence' (GSPO) with aggregation={a.aggregation!r}: the sequence ratio "
            "is one number per sequence, and token-sum style aggregation weights it by length; "
            "GSPO uses seq_mean_token_mean",
            stacklevel=2,
        )
    if a.surrogate == "sapo" and a.aggregation != "seq_mean_token_mean":
        warnings.warn("SAPO is defined with seq_mean_token_mean aggregation", stacklevel=2)
    if a.reward_aggregation == "normalize_then_sum" and (a.advantage, a.scale) != ("grpo", "group"):
        raise ValueError(
            "reward_aggregation='normalize_then_sum' (GDPO) defines the whole advantage; it needs "
            f"advantage='grpo' and scale='group', got {a.advantage!r} / {a.scale!r}"
        )
    if a.advantage == "dr_grpo" and a.scale != "none":
        warnings.warn(
            "advantage='dr_grpo' never divides by the std; `scale` is ignored", stacklevel=2
        )


# ---- loading ----------------------------------------------------------------------------------


class _YAML12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans: only true/false, so option values such as `off` or
    `on` stay strings (PyYAML follows YAML 1.1, where off/on/yes/no are booleans)."""


_YAML12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YAML12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YAML12Loader)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like dotted.key=value")
    key, value = item.split("=", 1)
    return key.strip().split("."), _load_yaml(value) if value != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set dotted keys (e.g. algorithm.preset=dapo, train.lr=1e-4) in the raw YAML mapping."""
    for item in overrides:
        path, value = _parse_override(item)
        node = raw
        for part in path[:-1]:
            if not isinstance(node.setdefault(part, {}), dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = node[part]
        node[path[-1]] = value
    return raw


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (to suggest the nearest valid key)."""
    model: Any = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        ann = field.annotation
        args = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
        candidates = [ann, *args]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if model is None:
            return None
    return model


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            valid = list(owner.model_fields) if owner else []
            near = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            lines.append(f"unknown key {where!r}{hint} (valid keys here: {', '.join(valid)})")
        elif e["type"] == "missing":
            lines.append(f"missing required key {where!r}")
        elif e["type"] == "value_error":  # our own validators: the message says it all
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(raw: dict) -> Config:
    """Raw mapping -> Config, turning pydantic's errors into one readable ConfigError."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    except ValueError as err:  # a preset name or a combination check
        raise ConfigError(f"invalid config: {err}") from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start empty with path None) and apply dotted overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        raw = _load_yaml(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return validate(apply_overrides(raw, list(overrides)))


def save_resolved(cfg: Config, path: Path) -> None:
    """Write the fully resolved config (every default and preset value spelled out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)
