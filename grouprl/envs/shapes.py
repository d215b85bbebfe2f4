"""Synthetic coloured shapes: small RGB images of one filled shape on a plain dark background.

A class is a (colour, shape) pair, e.g. class 0 = "red circle"; its prompt is "<colour> <shape>".
Every image is drawn on a 4x finer grid and average-pooled (anti-aliased edges), with a random
centre and size, so a class has real spread (the RL demo rewards one end of it: larger shapes).

    images, labels = sample_batch(64, generator=g)    # Float[64, 3, 16, 16] in [0, 1], Long[64]

Nothing here needs a download or a file; the data set is an infinite seeded stream.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.8, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.15),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (0.1, 0.1, 0.1)
SIZE = 16  # image side in pixels
RADIUS_RANGE = (2.5, 5.0)  # half-extent of a shape, in pixels
SUPERSAMPLE = 4
DATA_VERSION = 2  # bumped whenever the drawing changes: part of the pretraining cache key


def class_names() -> list[str]:
    """Prompts in class-id order: colour-major ("red circle", "red square", ... "yellow triangle")."""
    return [f"{c} {s}" for c in COLORS for s in SHAPES]


def class_of(prompt: str) -> int:
    """Class id of a prompt such as "red circle" (the error lists the known prompts)."""
    names = class_names()
    if prompt not in names:
        raise ValueError(f"unknown shapes prompt {prompt!r}; known prompts: {names}")
    return names.index(prompt)


def color_of(label: int) -> tuple[float, float, float]:
    """The RGB colour in [0, 1] of class `label`."""
    return list(COLORS.values())[label // len(SHAPES)]


def _masks(shape_ids: Tensor, cx: Tensor, cy: Tensor, radius: Tensor, size: int) -> Tensor:
    """Anti-aliased coverage in [0, 1] of each shape, Float[B, size, size]."""
    fine = size * SUPERSAMPLE
    coords = (torch.arange(fine, dtype=torch.float32) + 0.5) / SUPERSAMPLE  # [F] pixel units
    y = coords.view(1, fine, 1)  # [1, F, 1]
    x = coords.view(1, 1, fine)  # [1, 1, F]
    cx, cy, r = (v.view(-1, 1, 1) for v in (cx, cy, radius))  # [B, 1, 1]
    circle = (x - cx) ** 2 + (y - cy) ** 2 <= r**2  # [B, F, F]
    # a square of the same area as the circle: half side r * sqrt(pi) / 2
    half = r * math.sqrt(math.pi) / 2
    square = ((x - cx).abs() <= half) & ((y - cy).abs() <= half)  # [B, F, F]
    # an upward triangle inscribed in the circle: apex at cy - r, base at cy + r / 2
    top, bottom = cy - r, cy + r / 2
    frac = ((y - top) / (bottom - top)).clamp(min=0)  # [B, F, 1] 0 at the apex, 1 at the base
    triangle = (y >= top) & (y <= bottom) & ((x - cx).abs() <= frac * r * math.sqrt(3) / 2)
    kind = shape_ids.view(-1, 1, 1)  # [B, 1, 1]
    fine_mask = torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))
    pooled = torch.nn.functional.avg_pool2d(fine_mask.float().unsqueeze(1), SUPERSAMPLE)
    return pooled.squeeze(1)  # [B, size, size]


def render(labels: Tensor, cx: Tensor, cy: Tensor, radius: Tensor, size: int = SIZE) -> Tensor:
    """Images Float[B, 3, size, size] in [0, 1] of classes `labels` [B] at centres (cx, cy) [B]
    and half-extents `radius` [B] (pixel units; the circle's radius)."""
    labels = labels.long()
    shape_ids = labels % len(SHAPES)  # [B]
    colors = torch.tensor(list(COLORS.values()))[labels // len(SHAPES)]  # [B, 3]
    cover = _masks(shape_ids, cx.float(), cy.float(), radius.float(), size)  # [B, S, S]
    cover = cover.unsqueeze(1)  # [B, 1, S, S]
    bg = torch.tensor(BACKGROUND).view(1, 3, 1, 1)  # [1, 3, 1, 1]
    return bg * (1 - cover) + colors.view(-1, 3, 1, 1) * cover  # [B, 3, S, S]


def sample_batch(
    batch_size: int,
    *,
    generator: torch.Generator,
    labels: Tensor | None = None,
    size: int = SIZE,
) -> tuple[Tensor, Tensor]:
    """A random batch: images Float[B, 3, size, size] in [0, 1] and labels Long[B] (uniform over
    the classes unless given). Centres keep the whole shape inside the image."""
    n_classes = len(COLORS) * len(SHAPES)
    if labels is None:
        labels = torch.randint(0, n_classes, (batch_size,), generator=generator)  # [B]
    scale = size / SIZE
    lo, hi = RADIUS_RANGE
    radius = (lo + (hi - lo) * torch.rand(batch_size, generator=generator)) * scale  # [B]
    margin = radius + 1.0  # [B] a clear background pixel all around
    cx = margin + (size - 2 * margin) * torch.rand(batch_size, generator=generator)  # [B]
    cy = margin + (size - 2 * margin) * torch.rand(batch_size, generator=generator)  # [B]
    return render(labels, cx, cy, radius, size), labels


def colour_coverage(images: Tensor, labels: Tensor, tolerance: float = 0.25) -> Tensor:
    """Fraction of pixels within `tolerance` (RGB Euclidean distance) of each label's colour, Float[B].

    For a real image this is the shape's area fraction (about 0.08 to 0.3 at 16x16); a model that
    draws the wrong colour scores near 0."""
    target = torch.tensor([color_of(int(k)) for k in labels]).view(-1, 3, 1, 1)  # [B, 3, 1, 1]
    dist = (images.float() - target).norm(dim=1)  # [B, H, W]
    return (dist <= tolerance).float().flatten(1).mean(1)  # [B]
