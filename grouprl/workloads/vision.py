"""Vision-language: images (and text) in the prompt, G text completions, rewards on the text.

A vision-language model (transformers image-text-to-text: Qwen2-VL / Qwen2.5-VL, LLaVA ...) is a
causal LM whose prompt also carries images, so this workload is the text workload's step with
another policy: collect = rollouts/single_turn.py (the policy renders the messages' image items
through its processor; the batch carries the vision inputs, `TokenBatch.vision`), prepare and the
token loss = workloads/tokens.py, evaluation = greedy accuracy and pass@k (workloads/text.py).
What differs is only what is logged: prompts are written with each image as "<image WxH>", and
the first evaluation rows' images are saved under <run_dir>/images/ and shown in samples.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

import grouprl.policies.vision.judge  # noqa: F401  (registers the vlm_judge reward)
from grouprl.envs.tasks.multimodal import prompt_for_log, prompt_images
from grouprl.policies.vision.policy import VisionLMPolicy
from grouprl.rollouts.chat_probe import set_chat_fallback
from grouprl.rollouts.single_turn import collect
from grouprl.runtime.build import build_rewards
from grouprl.runtime.reward_guard import drain_reward_metrics
from grouprl.runtime.throughput import StepWork
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, Parts, register
from grouprl.workloads.text import accuracy_key, evaluate, sampling_params, step_mismatch
from grouprl.workloads.tokens import prepare, token_micro_loss

# rollout.engine -> the policy's engine: the fast one over the policy's own model, or vLLM with
# multimodal inputs (imported lazily: it imports vllm)
VISION_ENGINES = {
    "fast": lambda cfg, device: "fast",
    "vllm": lambda cfg, device: _vllm_engine(cfg, device),
}


def _vllm_engine(cfg: Any, device: torch.device) -> Any:
    from grouprl.policies.vision.engines.vllm import engine_from_config

    return engine_from_config(cfg, device)


def vision_policy(cfg: Any, device: torch.device) -> VisionLMPolicy:
    """model: (type vlm) -> VisionLMPolicy, its engine from rollout.engine."""
    m = cfg.model
    if cfg.rollout.engine not in VISION_ENGINES:
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r} does not sample from vision-language models; "
            f"workload vlm samples with one of {sorted(VISION_ENGINES)}"
        )
    from grouprl.policies.support import check_model_support  # a hub id's config.json

    check_model_support(m, uses_vllm=cfg.rollout.engine.startswith("vllm"), at_load=True)
    policy = VisionLMPolicy.from_pretrained(
        m.name_or_path,
        dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        lora=m.lora.model_dump() if m.lora else None,
        vision_tower=m.vision_tower,
        gradient_checkpointing=m.gradient_checkpointing,
        logprob_chunk_size=m.logprob_chunk_size,
        logprob_path=m.logprob_path,
        need_reference=cfg.algorithm.kl_coef > 0,
        engine=VISION_ENGINES[cfg.rollout.engine](cfg, device),
    )
    set_chat_fallback(policy.tokenizer, m.chat_fallback)  # what a template lacking a role gets
    return policy.to(device)


@register
class VisionLanguageWorkload:
    """See the module docstring."""

    name: ClassVar[str] = "vlm"
    capabilities: ClassVar[Capabilities] = Capabilities(per_sample_seeding=True)
    settings: ClassVar[None] = None

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy, self.dist = parts.cfg, parts.policy, parts.dist
        self.reward_fns = parts.reward_fns  # name -> batched function
        self.params = sampling_params(parts.cfg)

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> VisionLMPolicy:
        return vision_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        return build_rewards(cfg, task, required=True)

    def max_len(self) -> int:
        return self.cfg.rollout.max_new_tokens  # one completion

    def collect(
        self, policy: Any, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        cfg, first_errors = self.cfg, {}
        seed = cfg.run.seed if cfg.rollout.seeding == "per_sample" else None
        rollout, errors = collect(
            policy, examples, cfg.rollout.group_size, self.params, self.reward_fns,
            first_group_id=first_group_id, fail_fast=cfg.run.fail_fast, seed=seed,
            first_errors=first_errors,
        )  # fmt: skip
        rollout.info["prompt"] = [prompt_for_log(p) for p in rollout.info["prompt"]]
        return Collected(rollout, len(rollout), errors, first_errors)

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        return rollout, {}

    def step_work(self, rollout: Rollout) -> StepWork:
        return StepWork(
            params=None,
            why="a vision-language policy's image encoder FLOPs per image are not counted (only a causal LM's 2 N per token is)",
        )

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return prepare(self.cfg, scorer, rollout, weights)

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return token_micro_loss(self.cfg, self.policy, sub, counts, single_pass=single_pass)

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return step_mismatch(self.cfg, rollout)

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        e = self.cfg.eval
        metrics, rows = evaluate(
            self.policy, examples, self.reward_fns, self.params,
            batch_size=e.batch_size, pass_k=e.pass_k, dist=self.dist,
            seed=self.cfg.run.seed if self.cfg.rollout.seeding == "per_sample" else None,
        )  # fmt: skip
        metrics.update(self.dist.sum_counts(drain_reward_metrics(self.reward_fns)))
        return metrics, [self._log_row(row, step, i) for i, row in enumerate(rows)]

    def accuracy_key(self) -> str:
        return accuracy_key(self.reward_fns)

    def _log_row(self, row: dict, step: int, index: int) -> dict:
        """An evaluation row for samples.jsonl / samples.md: the prompt as text, its images saved
        as <run_dir>/images/eval-STEP-INDEX-K.png and linked from the markdown cell."""
        images = prompt_images(row["prompt"])
        links = []
        folder = Path(self.cfg.run_dir) / "images"
        for k, image in enumerate(images):
            name = f"eval-{step:08d}-{index}-{k}.png"
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / name)
            links.append(f"![image {k}](images/{name})")
        return {**row, "prompt": prompt_for_log(row["prompt"]), "images": " ".join(links)}
