"""The check after a run's first weight push: the engine's log-probs on a fixed probe match the
trainer's within a per-dtype bound, else a loud error that names the gap and the parameters most
likely at fault.

Probe: PROBE_PROMPT_TOKENS token ids spread over the lower half of the vocabulary (the same every run), from which
the engine samples up to PROBE_NEW_TOKENS tokens at temperature 1 (seed 0, no top-k / top-p, so
its log-probs are of softmax(logits)); the trainer model scores the same tokens with its own
forward (`model(ids).logits`, so soft-capping and any other output processing are included).
One short request and one forward: cheap enough for every run. It works with any engine that has
the text-engine `generate` contract (the in-process VLLMEngine and the vllm_server client).

Bounds (max |engine - trainer| over the probe tokens, nats), per the trainer model's dtype:
float32 1e-3 (measured gaps on tiny replicas: ~5e-6), float16 1e-2, bfloat16 2.5e-2 (measured
0.006 on a tiny bf16 Qwen3-MoE; the MoE repack defect of vllm_push.py gave 0.039).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from grouprl.policies.text.engines.base import SamplingParams

BOUNDS = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2.5e-2}
PROBE_PROMPT_TOKENS = 8
PROBE_NEW_TOKENS = 8


class PushMismatch(RuntimeError):
    """The engine does not compute the trainer's log-probs after a weight push."""


def probe_prompt(vocab: int) -> list[int]:
    """PROBE_PROMPT_TOKENS ids spread over the lower half of [0, vocab), the same every run (added
    tokens such as image placeholders sit at the top of the vocabularies we know)."""
    half = max(vocab // 2, 1)
    return [(17 + 7919 * i) % half for i in range(PROBE_PROMPT_TOKENS)]


def model_dtype(model: Any) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@torch.no_grad()
def trainer_logprobs(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-probs of `completion` after `prompt` under the model's own forward: [T]."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)  # [1, P + T]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)  # [T, V]
    return logp.gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0].cpu()  # [T]


def check_push(
    engine: Any,
    model: Any,
    report: dict | None = None,
    aliases: dict | None = None,
    mode: str = "error",
) -> float:
    """Compare engine and trainer on the probe; returns the gap. Above the bound: PushMismatch
    (mode "error") or a logged warning ("warn"). report: the push's {"not_loaded": [...]}
    (vllm_push.load_into_vllm); aliases: the tied names of the push; both are named in the error
    as the likely causes."""
    dtype = model_dtype(model)
    bound = BOUNDS.get(dtype, BOUNDS[torch.bfloat16])
    prompt = probe_prompt(model.get_input_embeddings().weight.shape[0])
    was_training = model.training
    model.eval()  # dropout off: the engine has none
    try:
        out = engine.generate(
            [prompt], SamplingParams(temperature=1.0, max_new_tokens=PROBE_NEW_TOKENS), seeds=[0]
        )
        completion = list(out.completion_ids[0])
        engine_lp = torch.tensor(out.logprobs[0], dtype=torch.float32)  # [T]
        trainer_lp = trainer_logprobs(model, prompt, completion)  # [T]
    finally:
        model.train(was_training)
    diff = (engine_lp - trainer_lp).abs()  # [T]
    gap = float(diff.max())
    if gap <= bound:
        return gap
    causes = []
    not_loaded = (report or {}).get("not_loaded") or []
    if not_loaded:
        causes.append(f"vLLM parameters the push did not load: {not_loaded[:12]}")
    if aliases:
        causes.append(f"tied tensors (sent once under the first name): {aliases}")
    if not causes:
        causes.append(
            "every vLLM parameter was loaded: a weight vLLM post-processes differently after a "
            "reload (packed / repacked kernels), or an output path of the model the engine lacks"
        )
    error = PushMismatch(
        f"after the first weight push the engine's log-probs differ from the trainer's by up to "
        f"{gap:.4g} nats (bound {bound:g} for {str(dtype).removeprefix('torch.')}) on a "
        f"{len(prompt)}+{len(completion)}-token probe (first position off: "
        f"{int((diff > bound).nonzero()[0])}); likely at fault: {'; '.join(causes)}"
    )
    if mode == "warn":
        logging.getLogger(__name__).warning("%s", error)
        return gap
    raise error
