"""One forward of a vision-language model with explicit positions, on a prompt or after a cache.

Sampling (engines/fast.py) and scoring (logprobs.py) both run each distinct prompt, with its
images, ONCE and continue its G completions from the expanded key / value cache. For that the
positions of every token must be known without the model's own bookkeeping (Qwen2-VL keeps its
rope offsets as state between generate steps, sized for one batch), so this module computes them:

- mrope models (Qwen2-VL / Qwen2.5-VL: the inner model has `get_rope_index`): the prompt's
  [3, B, P] temporal / height / width positions from the model's own `get_rope_index` (pads 0),
  and every generated token continues on all three axes from the prompt's largest position + 1;
- other models (LLaVA ...): 1-D positions counting the real tokens of each row (left padding
  never shifts them).

The forward is the inner model's (`model.model`: embeddings, vision tower and projector, image
features scattered into the image tokens, the decoder), so LoRA layers that peft injected run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.policies.text.engines.base import unwrap_peft


def inner_model(model: Any) -> Any:
    """The transformers VLM's base model (vision tower + projector + decoder, no LM head)."""
    return unwrap_peft(model).model


def uses_mrope(model: Any) -> bool:
    return hasattr(inner_model(model), "get_rope_index")


def prompt_positions(model: Any, ids: Tensor, mask: Tensor, vision: dict[str, Tensor]) -> tuple:
    """Positions of left-padded prompts ids, mask [B, P] -> (position_ids [3, B, P] (mrope) or
    [B, P], next [B]: the position of each row's first generated token)."""
    mask = mask.long()
    if not uses_mrope(model):
        return (mask.cumsum(1) - 1).clamp(min=0), mask.sum(1)  # [B, P], [B]
    cfg = unwrap_peft(model).config
    types = (ids == cfg.image_token_id).int()  # [B, P] 1 = image token (mm_token_type_ids)
    video = getattr(cfg, "video_token_id", None)
    if video is not None:
        types = types + 2 * (ids == video).int()
    extra = {"image_grid_thw": vision["image_grid_thw"]} if "image_grid_thw" in vision else {}
    pos, _ = inner_model(model).get_rope_index(
        ids, mm_token_type_ids=types, attention_mask=mask, **extra
    )  # [3, B, P]
    nxt = pos.masked_fill(~mask.bool()[None], -1).amax(dim=(0, 2)) + 1  # [B]
    return pos, nxt


def continue_positions(model: Any, start: Tensor, length: int) -> Tensor:
    """Positions of `length` generated tokens after prompts whose next position is start [n]:
    [3, n, length] (mrope: text tokens share one position on all axes) or [n, length]."""
    pos = start[:, None] + torch.arange(length, device=start.device)  # [n, length]
    return pos[None].expand(3, -1, -1) if uses_mrope(model) else pos


def run(
    model: Any,
    ids: Tensor,
    mask: Tensor,
    positions: Tensor,
    cache: Any = None,
    vision: dict[str, Tensor] | None = None,
) -> Tensor:
    """Hidden states [n, L, H] of ids [n, L]; mask [n, columns in the cache + L]; vision: the
    images of these rows' prompts (prompt passes only)."""
    out = inner_model(model)(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=positions,
        past_key_values=cache,
        use_cache=cache is not None,
        **(vision or {}),
    )
    return out.last_hidden_state
