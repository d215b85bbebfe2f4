"""Mixed precision as the ecosystem does it (torch AMP, accelerate's `mixed_precision`, the diffusers
training scripts): the weights the optimizer updates are float32 ("master weights") whatever
`model.dtype` is, and the forward computes in the configured dtype.

- `master_weights(model)`: every parameter that requires grad is made float32 in place (full
  fine-tuning: the whole model; LoRA: the adapter weights only; the frozen base keeps its bf16 /
  fp16 storage). AdamW then keeps its moments in float32 too, so a 1e-6 update is not rounded away
  (bf16 has 8 mantissa bits: w + 1e-6 w == w) and Adam's eps 1e-8 does not underflow (fp16).
- `compute(dtype, device)`: a torch.autocast context in that dtype (a no-op for float32). Matmuls and
  convolutions run in the compute dtype with their weights cast on the fly, so a float32 parameter,
  a bf16 frozen one and a module diffusers keeps in float32 (`_keep_in_fp32_modules`: Wan's
  time embedder, norms and scale-shift table) all meet their input in one dtype.
- `compute_dtype_of(model)`: the dtype most of the model's weights are stored in (by element count),
  i.e. the dtype it was loaded in, not the dtype of its first parameter (Wan's first parameter is
  its float32 scale_shift_table while its convolutions are bf16).
- `LossScaler`: float16's dynamic loss scaling with torch.amp.GradScaler's semantics (scale the
  loss, unscale the gradients before clipping, skip the step on inf / NaN gradients and multiply the
  scale by 0.5, double it after `growth_interval` clean steps). Disabled (scale 1, never skips) for
  float32 and bfloat16, whose exponent range is float32's. `state_dict()` holds plain numbers only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def master_weights(model: torch.nn.Module) -> int:
    """Make every trainable parameter float32 in place; returns how many were cast."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            cast += 1
    return cast


def compute_dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of the model's parameter elements (float32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def compute(dtype: torch.dtype, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`'s type; nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for float16 (module docstring); a pass-through otherwise.

    The training loop calls scale(loss) before backward, unscale_(optimizer) before clipping,
    then either step(optimizer) (the gradients were finite) or skip() (they were not); update()
    runs in both cases inside step / skip.
    """

    def __init__(
        self,
        enabled: bool,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0  # clean steps since the last change of scale
        self.overflows = 0  # steps skipped for inf / NaN gradients in this run

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params: list[torch.nn.Parameter]) -> None:
        """Divide the gradients by the scale (in float32: the master weights' grads)."""
        if not self.enabled:
            return
        inv = 1.0 / self.scale
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(inv)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients were finite: take the optimizer step and maybe grow the scale."""
        optimizer.step()
        if self.enabled:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def skip(self) -> bool:
        """The gradients overflowed: shrink the scale. True when this is a scaling overflow (the
        loop skips the step without counting it as a non-finite failure), False when scaling is off."""
        if not self.enabled:
            return False
        self.scale *= self.backoff_factor
        self.growth_tracker = 0
        self.overflows += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers (JSON-serialisable): GradScaler's keys plus `enabled` and `overflows`."""
        return {
            "enabled": self.enabled, "scale": self.scale, "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker, "overflows": self.overflows,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if bool(state["enabled"]) != self.enabled:
            raise ValueError(
                f"the checkpoint's loss scaling is {'on' if state['enabled'] else 'off'}, this "
                f"run's is {'on' if self.enabled else 'off'} (model.dtype changed?)"
            )
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale in the checkpoint must be finite and > 0, got {scale}")
        self.scale, self.growth_tracker = scale, int(state["_growth_tracker"])
        self.overflows = int(state.get("overflows", 0))


def loss_scaler_for(dtype: str | torch.dtype) -> LossScaler:
    """Dynamic loss scaling for float16 compute; a pass-through for float32 and bfloat16."""
    return LossScaler(as_dtype(dtype) == torch.float16)
