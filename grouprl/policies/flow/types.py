"""The records of the flow / diffusion policies: FlowCondition (what a sample is conditioned on) and
FlowBatch (a Rollout's `actions`: the stored denoising trajectories). Both are batched along their
first axis, so `Rollout.select` picks rows of every tensor in them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class FlowCondition:
    """Conditioning of B samples.

    embeds:   dict of tensors batched on B, the conditional branch: "prompt_embeds" [B, L, D] and
              "pooled_prompt_embeds" [B, P] for text models, or any keys a user velocity module
              takes (e.g. "class_labels" Long[B]); a text mask ("..._mask" [B, L], SANA /
              Qwen-Image) lets rows of different lengths L be joined: `cat` zero-pads them to the
              longest (padding with mask 0, as the pipelines pad a batch)
    negative: the same keys for the unconditional branch of classifier-free guidance (empty prompt,
              negative prompt or null class), or None (guidance then needs guidance_scale <= 1)
    """

    embeds: dict[str, Tensor]
    negative: dict[str, Tensor] | None = None

    def __post_init__(self) -> None:
        if not self.embeds:
            raise ValueError("FlowCondition.embeds needs at least one tensor")
        sizes = {k: int(v.shape[0]) for k, v in self.embeds.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"FlowCondition tensors must share their first (batch) dim, got {sizes}"
            )
        if self.negative is not None:
            if set(self.negative) != set(self.embeds):
                raise ValueError(
                    f"negative keys {sorted(self.negative)} differ from embeds keys "
                    f"{sorted(self.embeds)}"
                )
            for k, v in self.negative.items():
                if v.shape[1:] != self.embeds[k].shape[1:] or v.shape[0] not in (1, len(self)):
                    raise ValueError(
                        f"negative[{k!r}] must be [1 or {len(self)}, {list(self.embeds[k].shape[1:])}]"
                        f", got {list(v.shape)}"
                    )

    def __len__(self) -> int:
        return int(next(iter(self.embeds.values())).shape[0])

    def repeat(self, group_size: int) -> FlowCondition:
        """Each row repeated group_size times (consecutive); a one-row negative is first broadcast
        to every row, so the result always has one negative row per sample."""
        b = len(self)

        def rows(v: Tensor) -> Tensor:
            v = v.expand(b, *v.shape[1:]) if v.shape[0] == 1 else v  # [B, ...]
            return v.repeat_interleave(group_size, 0)  # [B * G, ...]

        neg = None if self.negative is None else {k: rows(v) for k, v in self.negative.items()}
        return FlowCondition({k: rows(v) for k, v in self.embeds.items()}, neg)

    def to(self, device: torch.device | str) -> FlowCondition:
        neg = None if self.negative is None else {k: v.to(device) for k, v in self.negative.items()}
        return FlowCondition({k: v.to(device) for k, v in self.embeds.items()}, neg)

    @classmethod
    def cat(cls, parts: list[FlowCondition]) -> FlowCondition:
        keys = set(parts[0].embeds)
        if any(set(p.embeds) != keys or (p.negative is None) != (parts[0].negative is None)
               for p in parts):  # fmt: skip
            raise ValueError("FlowCondition.cat needs the same keys (and negatives) in every part")
        full = [p.repeat(1) for p in parts]  # negatives expanded to one row per sample
        masked = any(k.endswith("_mask") for k in keys)
        neg = None
        if parts[0].negative is not None:
            neg = {k: pad_cat([p.negative[k] for p in full], masked, k) for k in keys}
        return cls({k: pad_cat([p.embeds[k] for p in full], masked, k) for k in keys}, neg)


def pad_cat(tensors: list[Tensor], masked: bool, key: str = "embeds") -> Tensor:
    """torch.cat along rows [B_i, L_i, ...] -> [sum B_i, max L_i, ...]: rows shorter along dim 1
    are zero-padded at the end, which only a condition with a text mask allows (mask 0 there)."""
    if all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return torch.cat(tensors)
    if not masked or any(t.dim() < 2 or t.shape[2:] != tensors[0].shape[2:] for t in tensors):
        raise ValueError(
            f"FlowCondition rows of {key!r} differ in shape {[tuple(t.shape) for t in tensors]}; "
            "only text of different lengths with its mask can be joined (zero-padded)"
        )
    longest = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, longest - t.shape[1]))
              for t in tensors]  # fmt: skip  # [B_i, longest, ...] each
    return torch.cat(padded)


@dataclass
class FlowBatch:
    """N stored denoising trajectories of K steps (the Rollout's `actions` for flow policies).

    latents:       Float[N, K+1, *latent]  x at every step, index 0 = the initial noise, K = final
                   (latent = [C, H, W] for images, [C, F, H, W] for video), float32
    sigmas:        Float[N, K+1]  flow-matching sigma of each latents slot (1 -> 0); the DDIM policy
                   stores sqrt(1 - alpha_bar_t) (the noise share of x_t) here
    timesteps:     Float[N, K+1]  the network's time input at each slot (scheduler timesteps)
    cond:          FlowCondition with N rows (one per sample, negatives expanded)
    guidance_scale: Float[N]  classifier-free guidance scale used at rollout (1 = none); a
                   two-expert policy keeps one per expert, Float[N, 2] (guidance_scale_2 second)
    train_mask:    Bool[N, K]  steps that are scored and trained (Rollout.mask)
    stochastic:    Bool[N, K]  steps taken with the SDE (the others with the deterministic step)
    alphas:        Float[N, K+1] | None  DDIM only: alpha_bar at each slot
    old_mean:      Float[N, K, *latent] | None  the sampler means at rollout (GRPO-Guard needs them;
                   stored when sample(..., store_means=True))
    ref_mean:      Float[N, K, *latent] | None  the reference's step means (the KL), filled once
                   per rollout by workloads/images/loss.prepare when a KL is on
    expert:        Long[N, K] | None  a two-expert policy: the expert that drew each step (0 the
                   high-noise `transformer`, 1 the low-noise `transformer_2`); re-scoring uses it
    sampler / noise_level: the stochastic sampler and its parameter (noise_level, or eta) used
    """

    latents: Tensor
    sigmas: Tensor
    timesteps: Tensor
    cond: FlowCondition
    guidance_scale: Tensor
    train_mask: Tensor
    stochastic: Tensor
    alphas: Tensor | None = None
    old_mean: Tensor | None = None
    ref_mean: Tensor | None = None
    expert: Tensor | None = None
    sampler: str = "flow_sde"
    noise_level: float = 0.7

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:  # K
        return int(self.train_mask.shape[1])

    @property
    def final(self) -> Tensor:  # Float[N, *latent] the clean latents
        return self.latents[:, -1]

    @property
    def lengths(self) -> Tensor:  # Long[N] trained steps per sample (the text batch's "length")
        return self.train_mask.sum(-1)

    @property
    def truncated(self) -> Tensor:  # Bool[N] all False (a trajectory always runs its K steps)
        return torch.zeros(len(self), dtype=torch.bool, device=self.latents.device)

    def to(self, device: torch.device | str) -> FlowBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor | FlowCondition)
        }
        return replace(self, **moved)

    def select(self, idx: Tensor) -> FlowBatch:
        """Rows idx (Long[M]) of every batched tensor (and of the condition)."""
        n = len(self)

        def rows(v: Any) -> Any:
            return v[idx] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n else v

        cond = self.cond
        neg = None if cond.negative is None else {k: rows(v) for k, v in cond.negative.items()}
        picked = {f.name: rows(getattr(self, f.name)) for f in fields(self) if f.name != "cond"}
        return replace(self, **picked, cond=FlowCondition({k: rows(v) for k, v in
                                                           cond.embeds.items()}, neg))  # fmt: skip

    @classmethod
    def cat(cls, parts: list[FlowBatch]) -> FlowBatch:
        """Join batches with the same K, sampler and noise level along N."""
        first = parts[0]
        if any((p.num_steps, p.sampler, p.noise_level) != (first.num_steps, first.sampler,
               first.noise_level) for p in parts):  # fmt: skip
            raise ValueError(
                "FlowBatch.cat needs the same number of steps, sampler and noise level"
            )
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "cond":
                out[f.name] = FlowCondition.cat(values)
            elif isinstance(values[0], Tensor):
                out[f.name] = torch.cat(values)
            elif values[0] is None:
                if any(v is not None for v in values):
                    raise ValueError(f"FlowBatch.cat: {f.name} is set in some parts only")
                out[f.name] = None
            else:
                out[f.name] = values[0]
        return cls(**out)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """A ValueError naming the allowed values when `value` is not one of them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
