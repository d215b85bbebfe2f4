"""The `rollout:` section: generation engine, batch shape, sampling and the vLLM options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grouprl.config.budget import BudgetConfig, NoBudget
from grouprl.config.hooks import HookConfig
from grouprl.config.section import Section
from grouprl.config.tree import NoTree, TreeConfig


class VLLMConfig(Section):
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
    push_check: Literal["error", "warn", "off"] = Field(
        "error",
        description="After the run's first weight push: the engine's log-probs on a fixed probe "
        "must match the trainer's (1e-3 nats float32, 2.5e-2 bfloat16); error stops the run "
        "naming the gap, warn logs it, off skips it.",
    )


class VLLMServerConfig(Section):
    """rollout.engine 'vllm_server': a `grouprl vllm-serve` process shared by 1..N trainer processes
    (see grouprl/policies/text/engines/server/)."""

    url: str = Field("http://127.0.0.1:8000", description="The server's base URL.")
    timeout_s: float = Field(
        600.0, gt=0, description="Seconds a generate call may take (other trainers share it)."
    )
    connect_timeout_s: float = Field(
        30.0, gt=0, description="Seconds for short calls (info, announcing a weight push)."
    )
    weight_timeout_s: float = Field(
        600.0, gt=0,
        description="Seconds a weight push may take: forming the channel, each broadcast, the "
        "server's load.",
    )  # fmt: skip
    channel_host: str = Field(
        "127.0.0.1",
        description="Address the trainer's main process serves the weight channel's store on "
        "(the server's workers must reach it).",
    )
    channel_port: int = Field(0, ge=0, le=65535, description="Its port (0: a free one).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Weight channel backend: auto (nccl with CUDA, else gloo)."
    )
    push_check: Literal["error", "warn", "off"] = Field(
        "error",
        description="After the run's first weight push: the engine's log-probs on a fixed probe "
        "must match the trainer's (1e-3 nats float32, 2.5e-2 bfloat16); error stops the run "
        "naming the gap, warn logs it, off skips it.",
    )


class RolloutConfig(Section):
    engine: Literal["fast", "hf", "vllm", "vllm_server"] = Field(
        "fast",
        description="Generation backend: fast (grouprl's decode loop on the trained model: prompt "
        "prefilled once per group, exact sampling log-probs), hf (transformers generate, same "
        "distribution), vllm (in-process) or vllm_server (a `grouprl vllm-serve` process, "
        "rollout.server).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vllm engine options.")
    server: VLLMServerConfig = Field(
        default_factory=VLLMServerConfig, description="vllm_server engine options."
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) per optimizer step.")
    group_size: int = Field(8, ge=1, description="G: completions sampled per prompt.")
    budget: BudgetConfig = Field(
        default_factory=NoBudget,
        description="Rollout budget from each prompt's pass history: {type: none | greso | "
        "allocate | greso_allocate, ...} (grouprl/config/budget.py; text workload only).",
    )
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
        "runs reproduce). Images / video: each group is drawn alone from torch's RNG seeded by "
        "(run.seed, group id), restored after.",
    )
    old_logp: Literal["recompute", "engine"] = Field(
        "recompute",
        description="recompute: score the batch with the trainer before updating (PPO's pi_old); "
        "engine: trust the engine's sampling log-probs.",
    )
    logp_gap_check: Literal["error", "warn"] = Field(
        "error",
        description="On the first step of a run (and of a resume) the engine's sampling log-probs "
        "are compared with the trainer's for the same tokens: a mean gap over the bound of "
        "model.dtype (float32 1e-3, bfloat16 / float16 0.05 nats) stops the run naming the gap and "
        "its likely causes (error) or is printed as a warning (warn); "
        "grouprl/runtime/logp_gap.py.",
    )
    tree: TreeConfig = Field(
        default_factory=NoTree,
        description="Sample each group as a tree: {type: fixed, branching: [b1, ...], branch_at: "
        "[t1, ...]} forks every node into b children at the given completion offsets (images: "
        "denoising step indices, grouprl/policies/flow/fork.py); the group size is the product "
        "of branching (grouprl/rollouts/fork.py).",
    )
    hooks: list[HookConfig] = Field(
        default_factory=list,
        description="What to do with groups that carry no signal, in order: {type: hint, ...} "
        "re-samples an all-fail group with a hint, {type: replay, ...} mixes in the prompt's past "
        "successes (grouprl/config/hooks.py, grouprl/rollouts/hooks/).",
    )

    @model_validator(mode="after")
    def _server_options_need_the_server(self) -> RolloutConfig:
        # compared with the defaults, not model_fields_set: a resolved config spells them all out
        if self.engine != "vllm_server" and self.server != VLLMServerConfig():
            raise ValueError(
                f"rollout.server is set (not its defaults) but rollout.engine is {self.engine!r}; its options apply "
                "to rollout.engine 'vllm_server' only"
            )
        return self
