"""The config's sections: one pydantic model per component, a description per field.

grouprl.config.loading assembles them into `Config` and owns loading, presets and combination checks.
Here: run, model, task, rewards, vLLM, rollout and algorithm; config_loop.py has the sections
of the training loop (curriculum, agent episodes, optimisation, evaluation, checkpoints).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grouprl.config.presets import preset_settings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    name: str = Field(
        "run",
        description="Run name; the run directory is output_dir/name (a relative path inside "
        "output_dir: sub/folders are fine, '..', '.', '~', absolute paths and backslashes not).",
    )
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for python, numpy and torch RNGs.")
    resume: bool = Field(False, description="Continue from the last complete checkpoint.")
    overwrite: bool = Field(
        False,
        description="Start afresh in a run directory that has a run (the old run is deleted only "
        "once the new config, task, rewards, model and optimizer are built).",
    )
    allow_config_change: bool = Field(
        False,
        description="Resume even though the config differs from the one the run was started with "
        "(the differences are printed and appended to config_changes.jsonl); false refuses. "
        "Always allowed: run.resume / overwrite / allow_config_change / output_dir / name / "
        "console / log_backends / num_threads / device and train.steps (run_state.RESUME_EXEMPT).",
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="Where to train.")
    num_threads: int | None = Field(None, description="torch CPU threads (None: torch default).")
    log_backends: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"], description="Metric sinks besides metrics.jsonl."
    )
    console: bool = Field(True, description="Show the progress bar and status lines.")
    fail_fast: bool = Field(
        False, description="Stop at a reward / env error or timeout instead of NaN / ending it."
    )

    @field_validator("name")
    @classmethod
    def _name_stays_inside_output_dir(cls, name: str) -> str:
        return check_run_name(name)


def check_run_name(name: str) -> str:
    """run.name as a path relative to run.output_dir that cannot leave it (ValueError otherwise)."""
    from pathlib import PurePosixPath, PureWindowsPath

    why = None
    parts = name.split("/")
    if not name.strip():
        why = "it is empty"
    elif "\\" in name or "\0" in name:
        why = "it holds a backslash or a NUL character"
    elif PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        why = "it is an absolute path"
    elif any(p in ("..", ".") for p in parts):
        why = "it has a '..' or '.' component"
    elif name.startswith("~"):
        why = "it starts with '~'"
    elif any(p == "" for p in parts):
        why = "it has an empty component ('//' or a trailing '/')"
    if why:
        raise ValueError(
            f"run.name={name!r} must be a relative path inside run.output_dir ({why}); the run "
            "directory is output_dir/name"
        )
    return name


class LoRAConfig(_Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that get adapters.",
    )


class ModelConfig(_Section):
    type: Literal["causal_lm", "flow", "unet"] = Field(
        "causal_lm",
        description="Policy kind: causal_lm (text), flow (a diffusers flow transformer pipeline: "
        "SD3 / FLUX / Wan, or a user velocity module), unet (SD 1.x UNet with DDIM, DDPO).",
    )
    name_or_path: str = Field(
        ...,
        description="Hub id or local save_pretrained folder (flow / unet: a diffusers pipeline "
        "folder or hub id; or a user velocity module class 'package.module:Class' / "
        "'file.py:Class').",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype (autocast) and the frozen weights' storage; trainable weights "
        "and optimizer state stay float32 (master weights); float16 adds dynamic loss scaling.",
    )
    lora: LoRAConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in backward (transformers' switch for causal_lm, "
        "diffusers' for the flow transformer / UNet; an error where the model has none).",
    )
    logprob_chunk_size: int | None = Field(
        None, ge=1, description="Rows per LM-head chunk when scoring (None: policy default)."
    )
    logprob_path: Literal["fast", "plain"] = Field(
        "fast",
        description="Scoring: fast (each group's prompt once, fused LM head over the real "
        "completion tokens) or plain (one [prompt | completion] pass); same numbers.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub.")
    # ---- flow / unet only (image and video policies; grouprl/policies/flow/build.py) ----
    weights: str | None = Field(
        None,
        description="User velocity module: folder of its weights (Class.from_pretrained(folder), or "
        "its *.safetensors loaded into Class(**module_options)); None: fresh weights.",
    )
    module_options: dict[str, Any] = Field(
        default_factory=dict, description="User velocity module: constructor keyword arguments."
    )
    condition: Literal["prompt", "class_label"] = Field(
        "prompt",
        description="prompt: text embeddings of the example's prompt (cached); class_label: the "
        "example's class_label column (class-conditional user modules).",
    )
    null_label: int | None = Field(
        None, ge=0, description="class_label: the model's 'no class' id (needed for CFG)."
    )
    pixel_range: Literal["zero_one", "minus_one_one"] = Field(
        "minus_one_one", description="A model without VAE works in pixels of this range."
    )
    negative_prompt: str = Field(
        "", description="Unconditional prompt of classifier-free guidance."
    )
    max_sequence_length: int | None = Field(
        None, ge=1, description="T5 prompt length (None: the pipeline's default)."
    )


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
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one sample's reward call; set, the function runs one sample at a "
        "time in a worker (grouprl.runtime.reward_guard) and a hanging / raising sample gets NaN.",
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="With timeout_s: 'process' (forked workers, killed at the deadline) or "
        "'thread' (for CUDA reward models; a late call is abandoned, not stopped).",
    )
    workers: int = Field(1, ge=1, description="With timeout_s: samples scored in parallel.")
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="A step where this reward fails on every sample prints a warning with its "
        "first error; after this many such steps in a row the run stops with an error.",
    )


class VLLMConfig(_Section):
    """rollout.engine 'vllm': the in-process vllm.LLM (see grouprl/policies/text/engines/vllm.py)."""

    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="Share of GPU memory vLLM takes (weights + KV cache)."
    )
    cpu_kvcache_gb: int = Field(1, ge=1, description="CPU builds: KV-cache GiB.")
    prefix_caching: Literal["on", "off"] = Field("on", description="Share cached prompt blocks.")
    enforce_eager: bool = Field(
        True, description="No torch.compile / CUDA graphs (fast start; False: faster GPU decode)."
    )
    sleep: Literal["off", "level1", "level2"] = Field(
        "off",
        description="GPU only: sleep between rollouts to free memory for training "
        "(level1 offloads weights to CPU, level2 drops them; both drop the KV cache).",
    )
    max_model_len: int | None = Field(None, ge=1, description="Context limit (None: model's).")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences per batch (None: vLLM's).")


class RolloutConfig(_Section):
    engine: Literal["fast", "hf", "vllm"] = Field(
        "fast",
        description="Generation backend: fast (grouprl's decode loop on the trained model: prompt "
        "prefilled once per group, exact sampling log-probs), hf (transformers generate, same "
        "distribution) or vllm (in-process).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vllm engine options.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) per optimizer step.")
    group_size: int = Field(8, ge=1, description="G: completions sampled per prompt.")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens (None: the model's context minus max_new_tokens, "
        "which also always bounds it); see prompt_overflow.",
    )
    prompt_overflow: Literal["filter", "truncate", "error"] = Field(
        "filter",
        description="A prompt over the limit: filter (left out, count warned), truncate (keep its "
        "last tokens, count warned) or error (naming the row); checked once before training.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    max_new_tokens: int = Field(64, ge=1, description="Longest completion (L_max).")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    seeding: Literal["global", "per_sample"] = Field(
        "global",
        description="global: torch's RNG; per_sample: each completion samples from its own "
        "generator seeded by (run.seed, group id, index; agents: and the turn), so samples do not "
        "depend on the process count, the batch split or other RNG use (multi-process and async "
        "runs reproduce). Text rollouts only (an error with model.type flow / unet).",
    )
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
    preset: str = Field("grpo", description="config.presets name; fills fields left unset.")
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
