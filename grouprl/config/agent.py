"""The `agent:` section (workload agent only): episode limits, credit assignment, env execution and tools."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grouprl.config.section import Section
from grouprl.objectives.gigpo import ADV_EPS, GAMMA, NORM, OMEGA


class AgentConfig(Section):
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
    gamma: float = Field(GAMMA, ge=0, le=1, description="Discount for turn / step returns.")
    omega: float = Field(OMEGA, ge=0, description="GiGPO weight of the step advantage.")
    norm: Literal["mean_std_norm", "mean_norm"] = Field(
        NORM, description="GiGPO/turn normalisation: divide by the std or not."
    )
    adv_eps: float = Field(
        ADV_EPS, ge=0, description="Added to the std in episode/step advantages."
    )
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
