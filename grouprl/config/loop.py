"""The config's sections of the training loop: curriculum, agent episodes, optimisation,
evaluation and checkpoints (the others are in config_sections.py; grouprl.config.loading assembles both).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grouprl.config.sections import _Section


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
    env_execution: Literal["sequential", "threads", "processes"] = Field(
        "sequential",
        description="How the live episodes' env steps run each turn: one after another, in a "
        "thread pool (envs that wait: sandboxed tools, remote sims), or each env in its own "
        "process driven by the pool (CPU-bound envs). See grouprl/envs/vector.py.",
    )
    env_workers: int = Field(8, ge=1, description="Threads of the threads / processes modes.")
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the agent may call, as 'package.module:function' or "
        "'path/to/file.py:function' (resolved from the working directory too): typed functions "
        "with Google-style docstrings (their JSON schemas are passed to the chat template). A turn "
        "with tool calls runs them all, in order, and their results come back as `tool` messages; "
        "a turn without calls goes to the env.",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How tool calls are written: hermes (<tool_call> JSON, Qwen), llama3_json "
        '({"name", "parameters"} JSON, Llama 3.x), mistral ([TOOL_CALLS] [...]); auto: read off '
        "the chat template (hermes when it shows none).",
    )
    env_step_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Deadline of one env reset / step; set, each env runs in its own process "
        "(killed at the deadline). A step that raises or hangs ends its episode with an error.",
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


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Evaluate every k steps (0: only before and after).")
    max_examples: int | None = Field(None, ge=1, description="Held-out examples used.")
    pass_k: int = Field(0, ge=0, description="Also report pass@k with k samples (0: off).")
    batch_size: int = Field(256, ge=1, description="Prompts per generation batch.")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every k steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
