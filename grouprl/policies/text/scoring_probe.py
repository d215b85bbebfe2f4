"""The load-time probe: grouprl's scoring path against the model's own forward, on one short batch.

When a policy is built, its scoring path (fast / plain: the decoder run by grouprl, then the
model's head function, head.py) scores a short batch of three rows, two that share a prompt (so
the fast path's shared prompt cache runs too) and one left padded (so a family whose positions do
not follow grouprl's convention shows its gap, positions.py), and the same tokens are scored by
log_softmax(model(...).logits), the family's own forward. The largest gap over the real tokens
is compared with a bound for the compute dtype. Measured gaps (fast / plain paths; the text
replicas qwen2.5, qwen3, llama3, mistral, gpt2 and Gemma 2 / Cohere / Granite built from their
config classes with real-size logits, |z| up to ~40; float32 master weights under autocast and
pure low-precision weights as under LoRA; the VLM replicas qwen2-vl, qwen2.5-vl, llava in
each dtype, whose largest gap is 4.9e-4):

  dtype     largest measured   bound   (the bare LM head, the old code, on Gemma 2 / Cohere /
  float32   7.6e-6             1e-4     Granite: 10 / 560 / 310 nats in every dtype)
  bfloat16  0.031              0.1
  float16   0.023              0.1

The low-precision gaps come from the shared-prompt cache path rounding differently from one
full forward (the plain path measures 0 .. 4e-6); the bounds leave about 3x headroom over them
and stay far below what a skipped head post-processing costs.

The text policy then either keeps its path (the gap is within the bound) or, when the gap is
larger or the head function cannot be derived, falls back to the "forward" path (logprobs.py:
the model's full forward per chunk of rows, exact by construction) and announces it once; the
VLM policy refuses, naming the model class and the gap. The chosen head path is reported in a
one-line note the training loop prints.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.text.head import HeadUnavailable, output_head
from grouprl.policies.text.positions import left_aligned
from grouprl.types import TokenBatch

# largest |scoring - forward| log-prob gap on the probe batch accepted, per compute dtype
PROBE_BOUNDS: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 0.1,
    torch.float16: 0.1,
}
PROMPT_TOKENS, COMPLETION_TOKENS, PROMPT_PADS = 5, 4, 2


@dataclass(frozen=True)
class ProbeResult:
    """path: the log-prob path to use; gap: the probe's largest log-prob gap of the requested
    path (None: it could not run); bound: the dtype's bound; note: the line to log."""

    path: str
    gap: float | None
    bound: float
    note: str


def probe_batch(vocab_size: int, avoid: list[int] | None = None, vision: Any = None) -> TokenBatch:
    """Three rows: two share a prompt of PROMPT_TOKENS tokens (the fast path's shared prompt
    cache runs), the third has a prompt PROMPT_PADS tokens shorter, left padded (a family whose
    positions do not follow grouprl's convention differs there, positions.py); completions of
    COMPLETION_TOKENS, COMPLETION_TOKENS - 1 and COMPLETION_TOKENS tokens (right padded). Token
    ids drawn with a fixed seed, never one of `avoid` (a VLM's image placeholders), pads
    included. vision: the rows' vision dict (a VLM: {})."""
    gen = torch.Generator().manual_seed(0)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    if avoid:
        allowed[torch.tensor(avoid, dtype=torch.long)] = False
    pool = allowed.nonzero()[:, 0]  # [V']
    draw = pool[torch.randint(len(pool), (PROMPT_TOKENS + 3 * COMPLETION_TOKENS,), generator=gen)]
    prompt = draw[:PROMPT_TOKENS].repeat(3, 1)  # [3, P]
    p_mask = torch.ones_like(prompt, dtype=torch.bool)  # [3, P]
    p_mask[2, :PROMPT_PADS] = False  # the third row's prompt is left padded
    completion = draw[PROMPT_TOKENS:].view(3, COMPLETION_TOKENS)  # [3, T]
    c_mask = torch.ones(3, COMPLETION_TOKENS, dtype=torch.bool)
    c_mask[1, -1] = False  # the second row is one token shorter
    return TokenBatch(
        prompt_ids=prompt,
        prompt_mask=p_mask,
        completion_ids=completion.masked_fill(~c_mask, int(pool[0])),
        completion_mask=c_mask,
        truncated=torch.zeros(3, dtype=torch.bool),
        vision=None if vision is None else [vision, vision, vision],
    )


def forward_logprobs(model: Any, batch: TokenBatch, banned: list[int] | None = None) -> Tensor:
    """log_softmax(model(...).logits) of the completion tokens, [N, T] (masked slots 0): the
    family's own forward on [prompt | completion] rows left-aligned (padding moved to the right,
    positions.py), so the model's default positions are the real ones whatever its convention.
    banned: token ids out of the action space (logit -inf, as the VLM policy scores)."""
    device = next(model.parameters()).device
    T = batch.completion_ids.shape[1]
    ids, mask, first = left_aligned(batch, device)  # [N, P+T] x2, [N]
    logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
    cols = first[:, None] + torch.arange(T, device=device)  # [N, T]
    logits = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1])).float()
    # [N, T, V]
    if banned:
        logits[..., torch.tensor(banned, device=device)] = float("-inf")
    logp = torch.log_softmax(logits, -1)  # [N, T, V]
    y = batch.completion_ids.to(device)  # [N, T]
    out = logp.gather(-1, y[..., None])[..., 0]  # [N, T]
    return out.masked_fill(~batch.completion_mask.to(device), 0.0)


def probe_gap(
    score: Callable[[TokenBatch], Tensor],
    model: Any,
    batch: TokenBatch,
    banned: list[int] | None = None,
) -> float:
    """Largest |score(batch) - forward_logprobs| over the real completion tokens."""
    with torch.no_grad():
        ours = score(batch).float()  # [N, T]
        ref = forward_logprobs(model, batch, banned)  # [N, T]
    return float((ours.to(ref.device) - ref).abs().max())


def choose_text_path(
    model: Any, path: str, dtype: torch.dtype, device: Any, context: Any
) -> ProbeResult:
    """The text policy's probe: keep `path` (fast | plain) when it reproduces the forward within
    PROBE_BOUNDS[dtype], else fall back to "forward" (warned once). model: the transformers model
    (peft unwrapped); context(): the compute-dtype context the policy scores under."""
    from grouprl.policies.text.logprobs import completion_logprobs

    bound = PROBE_BOUNDS.get(dtype, PROBE_BOUNDS[torch.float32])
    name = type(model).__name__
    if path == "forward":
        return ProbeResult(path, None, bound, f"{name}: log-probs from the model's full forward")
    try:
        head = output_head(model)
    except HeadUnavailable as e:
        note = (
            f"{name}: its head function cannot be derived ({e}); log-probs come from the model's "
            "full forward (model.logprob_path 'forward' fallback, slower)"
        )
        warnings.warn(note, stacklevel=3)
        return ProbeResult("forward", None, bound, note)
    vocab = model.config.get_text_config().vocab_size
    batch = probe_batch(vocab)

    def score(b: TokenBatch) -> Tensor:
        return completion_logprobs(model, b, with_entropy=False, path=path)[0]

    was_training = model.training
    model.eval()  # no dropout in either pass
    try:
        with context():
            gap = probe_gap(score, model, batch)
    finally:
        model.train(was_training)
    if gap <= bound:
        return ProbeResult(
            path, gap, bound,
            f"log-prob head path: {head.describe()}; {path} path matches the model's forward "
            f"(gap {gap:.2g} <= {bound:g} for {_dtype_name(dtype)})",
        )  # fmt: skip
    note = (
        f"{name}: the {path} scoring path differs from the model's own forward by {gap:.3g} nats "
        f"(bound {bound:g} for {_dtype_name(dtype)}; head path: {head.kind}); log-probs come from "
        "the model's full forward instead (the 'forward' path: exact, slower)"
    )
    warnings.warn(note, stacklevel=3)
    return ProbeResult("forward", gap, bound, note)


def check_vision_path(
    model: Any, path: str, dtype: torch.dtype, context: Any, banned: list[int]
) -> ProbeResult:
    """The VLM policy's probe (a text-only probe batch, the image placeholders banned as the
    policy scores): `path` when it reproduces the forward within PROBE_BOUNDS[dtype]; otherwise
    a ValueError naming the model class and the gap (there is no full-forward fallback for a
    VLM). model: the policy's model (peft-wrapped or not)."""
    from grouprl.policies.text.engines.base import unwrap_peft
    from grouprl.policies.vision.forward import inner_model
    from grouprl.policies.vision.logprobs import vision_completion_logprobs

    hf = unwrap_peft(model)
    bound = PROBE_BOUNDS.get(dtype, PROBE_BOUNDS[torch.float32])
    name = type(hf).__name__
    try:
        head = output_head(hf, inner_model(model))
    except HeadUnavailable as e:
        raise ValueError(
            f"{name}: grouprl cannot score this vision-language model through its own head "
            f"path ({e}); this model class is not supported"
        ) from None
    batch = probe_batch(hf.config.get_text_config().vocab_size, avoid=banned, vision={})

    def score(b: TokenBatch) -> Tensor:
        return vision_completion_logprobs(
            model, b, with_entropy=False, path=path, banned=banned
        )[0]  # fmt: skip

    was_training = model.training
    model.eval()
    try:
        with context():
            gap = probe_gap(score, hf, batch, banned)
    finally:
        model.train(was_training)
    if gap > bound:
        raise ValueError(
            f"{name}: grouprl's {path} scoring path differs from the model's own forward by "
            f"{gap:.3g} nats (bound {bound:g} for {_dtype_name(dtype)}; head path: {head.kind}); "
            "this model class is not supported (model.logprob_path 'plain' or another "
            "model.dtype may help)"
        )
    return ProbeResult(
        path, gap, bound,
        f"log-prob head path: {head.describe()}; {path} path matches the model's forward "
        f"(gap {gap:.2g} <= {bound:g} for {_dtype_name(dtype)})",
    )  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
