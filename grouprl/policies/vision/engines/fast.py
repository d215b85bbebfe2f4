"""The vision-language fast engine: each group's prompt and images prefilled once, then our decode.

The text FastEngine's loop (policies/text/engines/fast.py `decode`: the same warpers, the
two-level inverse-CDF sampler, per-row seeded generators, EOS / stop strings, finished rows
dropped) over a decoder whose prefill runs the vision tower: the distinct prompts of a chunk are
left padded into one batch with their images (vision inputs concatenated in row order), the
model's own forward scatters the image features into the image tokens, and the key / value cache
is then expanded to the G rows of each group. Positions are explicit (forward.py), so the
model's generate-time state is never used. The cache is transformers' DynamicCache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from grouprl.policies.text.engines.base import (
    GenerationOutput,
    SamplingParams,
    check_generate_args,
    eos_ids,
    unwrap_peft,
)
from grouprl.policies.text.engines.fast import decode
from grouprl.policies.text.head import output_head
from grouprl.policies.vision.engines.base import runs
from grouprl.policies.vision.forward import (
    continue_positions,
    inner_model,
    prompt_positions,
    run,
)
from grouprl.policies.vision.processing import VisionPrompt, cat_vision


class VisionDecoder:
    """Decode state of one batch: prefill(prompts) / select(rows) / step(tokens), each returning
    next-token logits [n, V] (the KVDecoder calls of the text engine, with images)."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        # the model's own head function after its inner model (head.py: soft-capping, scaling ...)
        self.head = output_head(unwrap_peft(model), inner_model(model))
        self.cache = DynamicCache(config=unwrap_peft(model).config.get_text_config())
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [n, columns] 1 = a real token
        self.next = torch.zeros(0, dtype=torch.long)  # [n] position of the next token

    def prefill(self, prompts: list[VisionPrompt]) -> Tensor:
        device = next(self.model.parameters()).device
        B, P = len(prompts), max(len(p.token_ids) for p in prompts)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)  # [B, P] left padded
        mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
        for i, p in enumerate(prompts):
            ids[i, P - len(p.token_ids) :] = torch.tensor(p.token_ids)
            mask[i, P - len(p.token_ids) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        vision = {k: v.to(device) for k, v in cat_vision([p.vision for p in prompts]).items()}
        positions, self.next = prompt_positions(self.model, ids, mask, vision)
        self.mask = mask
        hidden = run(self.model, ids, mask, positions, self.cache, vision)  # [B, P, H]
        return self.head(hidden[:, -1])  # [B, V]

    def select(self, rows: Tensor) -> None:
        self.cache.reorder_cache(rows)
        self.mask, self.next = self.mask[rows], self.next[rows]

    def step(self, tokens: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], 1)  # [n, L+1]
        positions = continue_positions(self.model, self.next, 1)  # [3, n, 1] or [n, 1]
        hidden = run(self.model, tokens[:, None], self.mask, positions, self.cache)  # [n, 1, H]
        self.next = self.next + 1
        return self.head(hidden[:, -1])  # [n, V]


class VisionFastEngine:
    """Samples from the trainer's own (possibly peft-wrapped) VLM; nothing to copy after an
    update. batch_size: completions per decode batch (None: all at once); banned: token ids
    never sampled (the image / video placeholders)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int | None = None,
        banned: list[int] | None = None,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"VisionFastEngine: batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.banned = list(banned or [])
        self.eos_ids = eos_ids(unwrap_peft(model), tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def load_weights(self, weights: Any) -> None:
        """No-op: this engine runs the trainer's model object itself (always current weights)."""

    def generate(
        self,
        prompts: list[VisionPrompt],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt; consecutive copies of a prompt object share one prefill.
        seeds: one per prompt (per-row generators, engines/seeded.py); None: the global RNG."""
        check_generate_args("VisionFastEngine", [p.token_ids for p in prompts], seeds)
        out = GenerationOutput([], [], [])
        step = self.batch_size or max(len(prompts), 1)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(prompts), step):
                    chunk = prompts[start : start + step]
                    uniq, counts = runs(chunk)
                    decoder = VisionDecoder(self.model, self.pad_id)
                    logits = decoder.prefill(uniq)  # [B, V]: once per group
                    rows = torch.repeat_interleave(
                        torch.arange(len(uniq), device=logits.device),
                        torch.tensor(counts, device=logits.device),
                    )  # [n]
                    decoder.select(rows)  # the shared prompt's K/V, G copies
                    part = decode(
                        decoder, logits[rows], params, greedy,
                        None if seeds is None else seeds[start : start + step],
                        self.eos_ids, self.pad_id, self.tokenizer, self.banned,
                    )  # fmt: skip
                    out.completion_ids += part.completion_ids
                    out.logprobs += part.logprobs
                    out.truncated += part.truncated
        finally:
            self.model.train(was_training)
        return out
