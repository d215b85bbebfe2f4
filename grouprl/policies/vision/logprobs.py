"""Exact per-token log-probs of a VLM's completions, each group's prompt and images encoded once.

The rows of a TokenBatch from the VLM policy carry their prompt's vision inputs
(`TokenBatch.vision`, one dict per row; the G rows of a group hold the same dict object). Paths:

- "fast" (default): the distinct prompts (consecutive rows with the same vision object and the
  same prompt tokens) run once through the vision tower and the decoder with gradient, their
  key / value cache is expanded to the G rows (index_select: its backward sums the G rows'
  gradients into the shared prompt and image features), the completions run on top of it and the
  LM head goes through the text path's head (fused, real tokens only). Under gradient
  checkpointing in training mode transformers drops the cache, so there the plain path runs.
- "plain": every row as [prompt | completion] in one pass, its images encoded once per ROW
  (the reference the tests compare the fast path with; values and gradients agree to float
  round-off).

Positions are explicit (forward.py), so left padding and mrope never depend on model state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from grouprl.policies.text.engines.base import unwrap_peft
from grouprl.policies.text.fast_logprobs import head_logprobs
from grouprl.policies.text.head import output_head
from grouprl.policies.vision.forward import (
    continue_positions,
    inner_model,
    prompt_positions,
    run,
)
from grouprl.policies.vision.processing import cat_vision
from grouprl.types import TokenBatch


def prompt_runs(batch: TokenBatch) -> Tensor:
    """Index of each row's run of consecutive rows sharing vision inputs and prompt: [N] long."""
    v = batch.vision
    ids, mask = batch.prompt_ids, batch.prompt_mask
    same = (ids[1:] == ids[:-1]).all(1) & (mask[1:] == mask[:-1]).all(1)  # [N-1]
    same &= torch.tensor([v[i + 1] is v[i] for i in range(len(v) - 1)], dtype=torch.bool)
    new = torch.cat([torch.ones(1, dtype=torch.long), (~same).long()])  # [N]
    return new.cumsum(0) - 1  # [N]


def _to(vision: dict[str, Tensor], device: Any) -> dict[str, Tensor]:
    return {k: t.to(device) for k, t in vision.items()}


def _shared_hidden(model: Any, batch: TokenBatch, runs: Tensor, device: Any) -> Tensor:
    """Each distinct prompt with its images once; its cache expanded; then the completions."""
    first = torch.ones(len(runs), dtype=torch.bool)
    first[1:] = runs[1:] != runs[:-1]  # [N] first row of each run
    p_ids = batch.prompt_ids[first].to(device)  # [B, P]
    p_mask = batch.prompt_mask[first].to(device).long()  # [B, P]
    vision = _to(cat_vision([v for v, f in zip(batch.vision, first.tolist()) if f]), device)
    positions, nxt = prompt_positions(model, p_ids, p_mask, vision)  # [(3,) B, P], [B]
    cache = DynamicCache(config=unwrap_peft(model).config.get_text_config())
    h_prompt = run(model, p_ids, p_mask, positions, cache, vision)[:, -1]  # [B, H]
    rows = runs.to(device)  # [N]
    h_first = h_prompt.index_select(0, rows)[:, None]  # [N, 1, H]: predicts completion token 0
    T = batch.completion_ids.shape[1]
    if T == 1:
        return h_first
    cache.reorder_cache(rows)  # [N, kv, P, d] per layer, differentiable
    c_ids = batch.completion_ids[:, :-1].to(device)  # [N, T-1]: the last token predicts nothing
    mask = torch.cat([batch.prompt_mask, batch.completion_mask[:, :-1]], 1).to(device)
    pos = continue_positions(model, nxt.index_select(0, rows), T - 1)  # [(3,) N, T-1]
    h_rest = run(model, c_ids, mask, pos, cache)  # [N, T-1, H]
    return torch.cat([h_first, h_rest], 1)  # [N, T, H]


def _plain_hidden(model: Any, batch: TokenBatch, device: Any) -> Tensor:
    """Every row as [prompt | completion], its images once per row."""
    P = batch.prompt_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)[:, :-1].to(device)  # [N, L]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)[:, :-1].to(device)
    vision = _to(cat_vision(batch.vision), device)
    p_pos, nxt = prompt_positions(model, ids[:, :P], mask[:, :P], vision)
    c_pos = continue_positions(model, nxt, ids.shape[1] - P)  # [(3,) N, T-1]
    positions = torch.cat([p_pos, c_pos], -1)  # [(3,) N, P+T-1]
    return run(model, ids, mask, positions, None, vision)[:, P - 1 :]  # [N, T, H]


def vision_completion_logprobs(
    model: Any,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    path: str = "fast",
    banned: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logp [N, T] and entropy [N, T] | None of the completion tokens; masked slots 0. banned:
    token ids out of the action space (the image placeholders the engines never sample)."""
    if path not in ("fast", "plain"):
        raise ValueError(f"unknown log-prob path {path!r}; choose from ['fast', 'plain']")
    if batch.vision is None or len(batch.vision) != len(batch.prompt_ids):
        raise ValueError("a VLM's TokenBatch carries one vision dict per row (TokenBatch.vision)")
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if P < 1 or T < 1:
        raise ValueError(f"log-probs need >= 1 prompt and completion column, got P={P}, T={T}")
    device = next(model.parameters()).device
    hf = unwrap_peft(model)
    checkpointing = getattr(hf, "is_gradient_checkpointing", False) and hf.training
    if path == "fast" and not checkpointing:
        hidden = _shared_hidden(model, batch, prompt_runs(batch), device)
    else:
        hidden = _plain_hidden(model, batch, device)
    return head_logprobs(
        hf, hidden, batch, temperature=temperature, chunk_size=chunk_size,
        with_entropy=with_entropy, entropy_grad=entropy_grad, banned=banned,
        head=output_head(hf, inner_model(model)),  # the forward's own head after its inner model
    )  # fmt: skip
