"""Per-sample seeded sampling (rollout.seeding = "per_sample"): each completion draws its tokens from
its own generator, seeded from (run seed, group id, index in the group).

Why: with torch's global RNG, what a sample becomes depends on everything else in the batch and on
everything else that used the RNG before. Under several processes (grouprl.runtime.distributed.dist) the same
group would then come out differently depending on which process draws it, and a background
generation thread (grouprl.runtime.async_rollout) would race the trainer for the RNG. With one generator
per sample, a group's completions are a function of its id and the weights only: the same for any
process count, batch split or thread.

How (HF engine): `SeededChoice` runs after the warpers and the log-prob recorder. It draws the next
token of each row by inverse-CDF sampling from softmax(processed scores) with one uniform from the
row's own CPU torch.Generator, then masks every other token, and generation runs greedily, so the
argmax returns the drawn token and the global RNG is never touched. The recorder, placed before it,
keeps the log-prob under the processed (temperature / top-k / top-p) distribution, as in the
unseeded path. The draw is exact ancestral sampling; it is a different random stream from torch's
multinomial, so seeded and global runs sample different (equally distributed) completions.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.generation import LogitsProcessor


class SeededChoice(LogitsProcessor):
    """Chooses each row's next token with that row's own generator (see module docstring).

    seeds: one int per row of the generate call. Returns scores that are 0 at the chosen token and
    -inf elsewhere, so greedy decoding picks it.
    """

    def __init__(self, seeds: list[int]) -> None:
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(
                f"SeededChoice: {scores.shape[0]} rows but {len(self.generators)} seeds"
            )
        probs = torch.softmax(scores.float(), dim=-1)  # [B, V]
        cdf = probs.cumsum(-1)  # [B, V]
        u = torch.cat([torch.rand(1, generator=g) for g in self.generators])  # [B] in [0, 1)
        target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
        # right=True: the first token whose cdf exceeds the target, so zero-mass tokens never win
        choice = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)  # [B, 1]
        out = torch.full_like(scores, -float("inf"))  # [B, V]
        return out.scatter_(1, choice, 0.0)  # [B, V]
