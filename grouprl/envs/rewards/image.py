"""Weight-free image rewards (JPEG size, colour target) and the image-input conventions of every
image reward.

Each public reward name is a factory: options in, a batched reward function
`fn(images, prompts=None, **columns) -> list[float | None]` out, called once per batch like the text
rewards (see `loading`). Columns a reward does not use are ignored.

Images (`as_frames` turns any of these into one Float[F, 3, H, W] tensor in [0, 1] per sample):
  - a tensor Float[N, 3, H, W] in [0, 1] (what a VAE decode + (x / 2 + 0.5).clamp(0, 1) gives);
  - a video tensor Float[N, 3, F, H, W]: every reward scores each frame and averages over frames;
  - a list with one entry per sample: a PIL image, a Float[3, H, W] / Float[3, F, H, W] tensor, an
    HWC numpy array (uint8 0..255 or float in [0, 1]), or a list of PIL images (the frames of one
    video). `score_completions` hands a batch tensor over as such a list, so both paths meet here.
  uint8 sources are read as k / 255, so a PIL image and the tensor of its pixel values score the same.
  Float values outside [0, 1] by more than 1/255 are an error (a [-1, 1] image passed by mistake);
  smaller overshoot is clamped. A sample with a non-finite value gets None (no reward), not an error.

Rewards:
  - jpeg_incompressibility: size in kB (1 kB = 1000 bytes) of the image saved by PIL as JPEG at
    `quality` (95), as DDPO, arXiv 2305.13301 (ddpo-pytorch / flow_grpo `jpeg_incompressibility`).
  - jpeg_compressibility: minus that size. Deviation: flow_grpo divides it by 500; here the config's
    reward `weight` does any rescaling (weight 0.002 reproduces flow_grpo's scale).
    Pixels are quantised as round(255 x) before encoding, as the references do.
  - color_target: 1 - |m - t|_2 / sqrt(3), in [0, 1], where m is the mean RGB over all pixels (and
    frames) and t the target RGB in [0, 1]^3; with a scalar target b it is 1 - |Y - b| with the
    mean BT.601 luma Y = 0.299 R + 0.587 G + 0.114 B (a brightness target). The target is an option
    (`target`) or a per-sample column (`target_column`, e.g. from the prompt's metadata). A target is
    3 numbers in [0, 1], a number in [0, 1], or a colour string PIL knows ("red", "#ff8000").
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageColor
from torch import Tensor

from grouprl.envs.rewards.loading import RewardFn, column

RANGE_TOL = 1.0 / 255  # float pixels may overshoot [0, 1] by this much (then clamped)
LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601 weights of R, G, B

# ---------------------------------------------------------------- inputs


def _from_pil(img: Image.Image) -> Tensor:
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)  # [H, W, 3]
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255  # [3, H, W]


def _from_numpy(arr: np.ndarray, i: int) -> Tensor:
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise ValueError(f"image {i}: a numpy image must be HWC with 3 channels, got {arr.shape}")
    t = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)  # [3, H, W]
    return t.float() / 255 if arr.dtype == np.uint8 else t.float()


def _sample_frames(x: Any, i: int) -> Tensor:
    """One sample -> Float[F, 3, H, W] (not yet range-checked)."""
    if isinstance(x, Image.Image):
        return _from_pil(x)[None]  # [1, 3, H, W]
    if isinstance(x, np.ndarray):
        return _from_numpy(x, i)[None]  # [1, 3, H, W]
    if isinstance(x, list | tuple) and x and all(isinstance(f, Image.Image) for f in x):
        return torch.stack([_from_pil(f) for f in x])  # [F, 3, H, W]
    if isinstance(x, Tensor):
        if x.dtype == torch.uint8:
            x = x.float() / 255
        if x.dim() == 3 and x.shape[0] == 3:
            return x.float()[None]  # [1, 3, H, W]
        if x.dim() == 4 and x.shape[0] == 3:
            return x.float().transpose(0, 1)  # [3, F, H, W] -> [F, 3, H, W]
        raise ValueError(
            f"image {i}: a tensor sample must be [3, H, W] or [3, F, H, W] (video), "
            f"got shape {tuple(x.shape)}"
        )
    raise TypeError(
        f"image {i}: expected a PIL image, a tensor, an HWC numpy array or a list of PIL frames, "
        f"got {type(x).__name__}"
    )


def _check_range(frames: Tensor, i: int) -> Tensor:
    finite = frames[torch.isfinite(frames)]  # [k]
    if finite.numel() and (finite.min() < -RANGE_TOL or finite.max() > 1 + RANGE_TOL):
        raise ValueError(
            f"image {i}: pixel values must lie in [0, 1], got min {finite.min().item():.4g} and "
            f"max {finite.max().item():.4g} (a [-1, 1] decode needs (x / 2 + 0.5).clamp(0, 1))"
        )
    return frames.clamp(0, 1)  # NaN stays NaN


def as_frames(images: Any) -> list[Tensor]:
    """Images in any accepted form (module docstring) -> one Float[F, 3, H, W] in [0, 1] per sample.

    Tensors stay on their device. F = 1 for still images.
    """
    if isinstance(images, Tensor):
        if images.dim() == 4 and images.shape[1] == 3:
            samples: Sequence[Any] = list(images)  # N x [3, H, W]
        elif images.dim() == 5 and images.shape[1] == 3:
            samples = list(images)  # N x [3, F, H, W]
        else:
            raise ValueError(
                "images must be Float[N, 3, H, W] or video Float[N, 3, F, H, W] in [0, 1], "
                f"got shape {tuple(images.shape)}"
            )
    elif isinstance(images, list | tuple):
        samples = images
    else:
        raise TypeError(
            f"images must be a tensor or a list of samples, got {type(images).__name__}"
        )
    return [_check_range(_sample_frames(x, i), i) for i, x in enumerate(samples)]


def is_finite(frames: Tensor) -> bool:
    """Whether every pixel of a sample is finite (a sample with NaN / inf gets no reward)."""
    return bool(torch.isfinite(frames).all())


# ---------------------------------------------------------------- JPEG size (DDPO)


def to_uint8_hwc(frame: Tensor) -> np.ndarray:
    """Float[3, H, W] in [0, 1] -> uint8 [H, W, 3] with round(255 x), as the references quantise."""
    return (frame * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()


def jpeg_size_kb(frame: Tensor, quality: int = 95) -> float:
    """Size in kB (1000 bytes) of a Float[3, H, W] frame saved by PIL as JPEG at `quality`."""
    buffer = io.BytesIO()
    Image.fromarray(to_uint8_hwc(frame)).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


def _check_quality(quality: int) -> None:
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"jpeg reward: quality must be an integer in [1, 100], got {quality!r}")


def jpeg_incompressibility(quality: int = 95) -> RewardFn:
    """Reward = JPEG size in kB at `quality` (mean over frames for video); higher = less compressible."""
    _check_quality(quality)

    def jpeg_incompressibility(images: Any, prompts: Any = None, **columns: Any) -> list:
        out: list[float | None] = []
        for frames in as_frames(images):
            if not is_finite(frames):
                out.append(None)
                continue
            out.append(sum(jpeg_size_kb(f, quality) for f in frames) / len(frames))
        return out

    return jpeg_incompressibility


def jpeg_compressibility(quality: int = 95) -> RewardFn:
    """Reward = minus the JPEG size in kB (DDPO's compressibility task); higher = more compressible."""
    size = jpeg_incompressibility(quality)

    def jpeg_compressibility(images: Any, prompts: Any = None, **columns: Any) -> list:
        return [None if s is None else -s for s in size(images)]

    return jpeg_compressibility


# ---------------------------------------------------------------- colour / brightness target


def parse_target(value: Any, where: str) -> Tensor:
    """A colour target -> Float[3] (RGB in [0, 1]) or Float[1] (brightness in [0, 1])."""
    if isinstance(value, str):
        try:
            rgb = ImageColor.getrgb(value)
        except ValueError as exc:
            raise ValueError(f"{where}: unknown colour {value!r} ({exc})") from None
        return torch.tensor(rgb[:3], dtype=torch.float64) / 255  # [3]
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list | tuple) or len(value) not in (1, 3):
        raise ValueError(
            f"{where}: a target is 3 numbers (RGB) or 1 number (brightness) in [0, 1], or a "
            f"colour name; got {value!r}"
        )
    t = torch.tensor([float(v) for v in value], dtype=torch.float64)  # [3] or [1]
    if not torch.isfinite(t).all() or (t < 0).any() or (t > 1).any():
        raise ValueError(f"{where}: target values must lie in [0, 1] (not 0..255), got {value!r}")
    return t


def color_distance_reward(frames: Tensor, target: Tensor) -> float:
    """1 - |mean RGB - t| / sqrt(3) for an RGB target, 1 - |mean luma - b| for a brightness target."""
    mean_rgb = frames.double().mean(dim=(0, 2, 3)).cpu()  # [3] over frames and pixels
    if target.numel() == 1:
        luma = (mean_rgb * torch.tensor(LUMA, dtype=torch.float64)).sum()  # []
        return float(1 - (luma - target[0]).abs())
    return float(1 - torch.linalg.vector_norm(mean_rgb - target) / math.sqrt(3))


def color_target(target: Any = None, target_column: str | None = None) -> RewardFn:
    """Closeness of the mean colour (or brightness) to a target, in [0, 1] (module docstring).

    Give exactly one of `target` (for every sample) or `target_column` (per-sample targets; a None
    entry gives that sample no reward).
    """
    if (target is None) == (target_column is None):
        raise ValueError(
            "color_target needs exactly one of `target` (e.g. [1.0, 0.0, 0.0], 0.5 or 'red') "
            f"or `target_column` (a column name); got target={target!r}, "
            f"target_column={target_column!r}"
        )
    fixed = parse_target(target, "color_target option `target`") if target is not None else None

    def color_target(images: Any, prompts: Any = None, **columns: Any) -> list:
        samples = as_frames(images)
        if fixed is not None:
            targets: Sequence[Any] = [fixed] * len(samples)
        else:
            targets = column(columns, target_column, len(samples), "color_target")
        out: list[float | None] = []
        for i, (frames, t) in enumerate(zip(samples, targets)):
            if t is None or not is_finite(frames):
                out.append(None)
                continue
            if t is not fixed:
                t = parse_target(t, f"color_target column {target_column!r}, sample {i}")
            out.append(color_distance_reward(frames, t))
        return out

    return color_target
