"""A weight-free, prompt-aware image reward for the synthetic-shapes demo: area in the prompt's colour.

`color_area(tolerance=0.25, target_column="target_rgb")` builds a batched reward
`fn(images, **columns) -> list[float]`: for each image, the mean over pixels of
exp(-(d / tolerance)^2), where d is the RGB Euclidean distance of the pixel to the sample's target
colour (column `target_rgb`, [r, g, b] in [0, 1], which the shapes task attaches to every prompt).
A pixel of exactly the target colour counts 1, one at distance `tolerance` counts 1/e, the
background of the shapes images (distance > 0.9 from every shape colour) counts ~0; so the reward
is a soft "fraction of the image drawn in the prompt's colour": it rises when the model draws the
prompt's colour and draws it larger. Real training images score about 0.04 to 0.3.

Images: Float[N, 3, H, W] in [0, 1], Float[N, 3, F, H, W] (video: averaged over frames too), or a
list of PIL images / Float[3, H, W] tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grouprl.envs.rewards.loading import RewardFn, column


def as_image_tensor(images: Any) -> Tensor:
    """Float[N, 3, ...] in [0, 1] from a tensor or a list of PIL images / [3, ...] tensors."""
    if isinstance(images, Tensor):
        out = images
    elif isinstance(images, Sequence) and all(isinstance(x, Tensor) for x in images):
        out = torch.stack(list(images))
    elif isinstance(images, Sequence):  # PIL images
        arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images]
        out = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # [N, 3, H, W]
    else:
        raise TypeError(f"images must be a tensor or a list of images, got {type(images).__name__}")
    if out.dim() < 4 or out.shape[1] != 3:
        raise ValueError(
            f"images must be [N, 3, H, W] (or [N, 3, F, H, W]), got {tuple(out.shape)}"
        )
    return out.float()


def color_area(tolerance: float = 0.25, target_column: str = "target_rgb") -> RewardFn:
    """Soft fraction of pixels in the sample's target colour (module docstring); needs the column
    `target_column` ([r, g, b] in [0, 1] per sample)."""
    if not tolerance > 0:
        raise ValueError(f"color_area: tolerance must be > 0, got {tolerance!r}")

    def color_area_reward(images: Any, **columns: Any) -> list[float | None]:
        x = as_image_tensor(images)  # [N, 3, ...]
        targets = column(columns, target_column, x.shape[0], "color_area")
        rgb = torch.tensor([list(map(float, t)) for t in targets], device=x.device)  # [N, 3]
        rgb = rgb.view(x.shape[0], 3, *([1] * (x.dim() - 2)))  # [N, 3, 1, ...]
        dist = (x - rgb).norm(dim=1)  # [N, ...]
        score = torch.exp(-((dist / tolerance) ** 2)).flatten(1).mean(1)  # [N]
        return score.tolist()

    return color_area_reward
