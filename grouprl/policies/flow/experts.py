"""Two-expert denoisers (Wan 2.2 A14B): a high-noise `transformer` and a low-noise `transformer_2`
that take turns along one denoising chain, as one module a flow policy samples, scores and trains.

The switch rule is WanPipeline's (diffusers 0.42, pipelines/wan/pipeline_wan.py): with the
pipeline config's `boundary_ratio` (registered by `WanPipeline.__init__`, stored in
model_index.json) the boundary timestep is boundary_ratio * scheduler.num_train_timesteps; a step
whose scheduler timestep t satisfies t >= boundary runs `transformer` with `guidance_scale`, any
other step runs `transformer_2` with `guidance_scale_2` (None: guidance_scale). The scheduler's
timesteps are integers (UniPC's flow timesteps are int64(sigma * T)), so the rule here compares
floor(sigma * T) computed in float64 with the boundary.

`DenoiserExperts` holds the experts under their pipeline folder names, high-noise first, so its
parameter names ("experts.transformer.<...>", "experts.transformer_2.<...>") say which expert a
weight belongs to, and everything a policy does over its model (LoRA bypass for the reference, a
frozen reference copy, the "old" weights, DDP, checkpoints) covers both experts. Which experts
train is a choice (EXPERT_CHOICES): an expert that does not train is frozen (no adapter, no
gradient) and still samples its steps.

Each sampled step records which expert produced it (FlowBatch.expert, Long[N, K]) and re-scoring
uses that expert, so a step's log-prob always comes from the network that generated it. A scoring
pass whose steps all belong to one expert (a step window, a subset of steps) adds a zero that
depends on the other trained expert's weights (`unused_zero`), so every trainable parameter gets a
gradient (zeros) and DDP, which expects one for each, does not stall or fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

HIGH, LOW = "transformer", "transformer_2"  # WanPipeline's component (and folder) names

ExpertChoice = Literal["both", "high_noise", "low_noise"]
EXPERT_CHOICES: dict[str, tuple[str, ...]] = {
    "both": (HIGH, LOW),
    "high_noise": (HIGH,),  # transformer_2 frozen
    "low_noise": (LOW,),  # transformer frozen
}


class DenoiserExperts(torch.nn.Module):
    """Experts {folder name: denoiser}, high-noise first, and the switch point (module doc).

    boundary_ratio: the pipeline config's value; num_train_timesteps: the scheduler's.
    trained: the folder names whose weights train (the others are frozen here, now).
    """

    def __init__(
        self,
        experts: dict[str, torch.nn.Module],
        *,
        boundary_ratio: float,
        num_train_timesteps: int,
        trained: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__()
        if len(experts) != 2:
            raise ValueError(f"DenoiserExperts takes two experts, got {sorted(experts)}")
        if not 0 < boundary_ratio < 1:
            raise ValueError(f"boundary_ratio must lie in (0, 1), got {boundary_ratio!r}")
        self.experts = torch.nn.ModuleDict(experts)
        self.names = tuple(experts)
        self.boundary_ratio, self.num_train_timesteps = float(boundary_ratio), num_train_timesteps
        self.trained = self.names if trained is None else tuple(trained)
        if unknown := set(self.trained) - set(self.names):
            raise ValueError(f"trained experts {sorted(unknown)} are not among {self.names}")
        for name in set(self.names) - set(self.trained):
            self.experts[name].requires_grad_(False)

    @property
    def boundary_timestep(self) -> float:
        return self.boundary_ratio * self.num_train_timesteps

    def expert(self, index: int) -> torch.nn.Module:
        return self.experts[self.names[index]]

    def trained_modules(self) -> list[torch.nn.Module]:
        return [self.experts[n] for n in self.trained]

    def expert_index(self, sigmas: Tensor) -> Tensor:
        """Long[...] 0 (high-noise expert) where the scheduler timestep floor(sigma * T) reaches
        the boundary, 1 elsewhere (WanPipeline's rule)."""
        t = torch.floor(sigmas.double() * self.num_train_timesteps)  # [...] integer timesteps
        return (t < self.boundary_timestep).long()

    def route(self, index: Tensor, call: Callable[[torch.nn.Module, Tensor | None], Tensor],
              ) -> Tensor:  # fmt: skip
        """call(expert, rows) for each expert in index (Long[B]); rows None means all B rows,
        else Bool[B]. The outputs are put back in row order: [B, ...]."""
        used = sorted(set(index.tolist()))
        if len(used) == 1:  # the usual case: one expert for the whole batch at this step
            return call(self.expert(used[0]), None)
        out: Tensor | None = None
        for e in used:
            rows = index == e  # [B]
            part = call(self.expert(e), rows)  # [b_e, ...]
            if out is None:
                out = part.new_zeros(len(index), *part.shape[1:])  # [B, ...]
            out[rows] = part
        assert out is not None
        return out


def unused_zero(model: DenoiserExperts, used: set[int]) -> Tensor:
    """0-d zero tied to the trainable weights of the experts not in `used` (module docstring)."""
    params = [p for i, name in enumerate(model.names) if i not in used
              for p in model.experts[name].parameters() if p.requires_grad]  # fmt: skip
    if not params:
        return torch.zeros(())
    return sum(p.sum() for p in params) * 0.0


def lora_file(name: str) -> str:
    """The LoRA file of expert `name`: diffusers' default file for the high-noise transformer (what
    `pipe.load_lora_weights(dir)` reads), a named one beside it for transformer_2 (read with
    `weight_name=` and `load_into_transformer_2=True`)."""
    from grouprl.policies.flow.lora import LORA_FILE

    return LORA_FILE if name == HIGH else LORA_FILE.replace(".safetensors", f"_{name}.safetensors")


def check_boundary(boundary_ratio: float | None, names: tuple[str, ...]) -> None:
    """A two-expert pipeline needs its switch point: an error naming the pipeline config key."""
    if boundary_ratio is None or not math.isfinite(boundary_ratio):
        raise ValueError(
            f"the pipeline has the experts {list(names)} but model_index.json sets no "
            "boundary_ratio (WanPipeline's switch point): add it to the pipeline config"
        )
