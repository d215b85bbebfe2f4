"""The sweep's optional vLLM check (`--vllm`): engine log-probs after a weight push match the
trainer's.

Where vLLM's ModelRegistry lists the architecture (causal LMs only; a VLM's engine takes images
this check does not send): the tiny model's initial folder (the policy's save_pretrained) is
loaded by grouprl's VLLMEngine (vllm_setup.build_llm, float32), the policy takes one GRPO step
(checks.check_train_step), its weights are pushed (VLLMEngine.load_weights: the merged LoRA
weights under the original names), and VLLMEngine.score of the sweep rows is compared with the
policy's log-probs: |diff| <= VLLM_TOL. Slow (an engine per architecture): meant for a handful
(`--only`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

VLLM_TOL = 1e-3


class NotApplicable(Exception):
    """The check does not apply to this architecture (recorded as skip, with the reason)."""


def supported_by_vllm(architecture: str) -> bool:
    from vllm import ModelRegistry

    return architecture in set(ModelRegistry.get_supported_archs())


def check_vllm(kind: str, model_type: str) -> str:
    from transformers.models.auto import modeling_auto

    from grouprl.policies.text.engines.vllm import VLLMEngine
    from grouprl.policies.text.engines.vllm_setup import VLLMSettings, build_llm
    from grouprl.replicas.sweep.checks import (
        CheckFailed,
        build,
        make_policy,
        max_gap,
        policy_logprobs,
        sweep_batch,
    )

    if kind != "causal_lm":
        raise NotApplicable("not checked: the VLM engine path takes images, this check sends none")
    arch = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if not supported_by_vllm(arch):
        raise NotApplicable(f"vLLM's ModelRegistry does not list {arch}")
    model = build(kind, model_type)
    batch = sweep_batch(model, vision=False)
    policy = make_policy(kind, model)
    from grouprl.replicas.sweep.checks import check_train_step

    with tempfile.TemporaryDirectory(prefix="sweep-vllm-") as tmp:
        folder = policy.save_pretrained(Path(tmp) / "initial")
        llm = build_llm(VLLMSettings(model=str(folder), dtype="float32", max_model_len=64))
        engine = VLLMEngine(llm, [policy.tokenizer.eos_token_id])
        check_train_step(policy, batch)
        engine.load_weights(policy.model)
        prompts = [p[m].tolist() for p, m in zip(batch.prompt_ids, batch.prompt_mask)]
        completions = [c[m].tolist() for c, m in zip(batch.completion_ids, batch.completion_mask)]
        scored = engine.score(prompts, completions)
    got = torch.zeros(batch.completion_ids.shape)  # [N, T]
    for row, values in enumerate(scored):
        got[row, : len(values)] = torch.tensor(values)
    with torch.no_grad():
        want = policy_logprobs(policy, batch)  # [N, T]
    gap = max_gap(got, want, batch.completion_mask)
    if not gap <= VLLM_TOL:
        raise CheckFailed(f"vLLM's log-probs after the push differ by {gap:.1e} (tol 1e-3)")
    return f"max |diff| {gap:.1e} after a push"
