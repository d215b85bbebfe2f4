"""CLIP loading, pixel preprocessing and embeddings for the CLIP-based image rewards
(`image_models.py`), on transformers' `CLIPModel` / `CLIPProcessor`.

Loading: `model` / `processor` are hub ids or local directories, both through `from_pretrained`
(`processor` defaults to `model`). Each (model, processor, device, dtype) loads once per process and
is shared by every reward that names it (`load_clip`). `device` None picks the current CUDA device,
else the CPU.

Preprocessing (`PREPROCESS`, chosen by the rewards' `preprocess` option):
  - "tensor": float tensors throughout: resize with the processor's resample filter (antialiased;
    shortest edge or fixed size, with transformers' rounding), centre crop, normalise with the
    processor's mean / std. Deviation: this skips the uint8 / PIL round trip of the references;
    torch's bicubic on floats differs from PIL's on uint8 by about 1/255 per pixel.
  - "processor": quantise to uint8 PIL images and run the model's own image processor (exactly what
    the reference implementations feed the model; slower).
Embeddings come back L2-normalised, float32, on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from grouprl.envs.rewards.image import to_uint8_hwc

Dtype = Literal["float32", "bfloat16", "float16"]
Preprocess = Literal["tensor", "processor"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL resample codes torch can reproduce


@dataclass
class Clip:
    """A loaded CLIP model with its tokenizer and image processor (shared, read-only)."""

    model: Any  # transformers CLIPModel, eval mode, no grad
    tokenizer: Any
    image_processor: Any
    device: torch.device
    dtype: torch.dtype
    max_length: int  # text tokens kept (the tokenizer's and the position table's limit)


def resolve_device(device: str | None) -> str:
    if device is None:
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return str(torch.device(device))


def _canonical(name_or_path: str) -> str:
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def load_clip(
    model: str, processor: str | None = None, *, device: str | None = None, dtype: Dtype = "float32"
) -> Clip:
    """The CLIP model `model` (hub id or local dir) with `processor`'s tokenizer / image processor,
    loaded once per process per (model, processor, device, dtype)."""
    if dtype not in DTYPES:
        raise ValueError(f"CLIP reward: unknown dtype {dtype!r}; allowed: {list(DTYPES)}")
    proc = _canonical(processor or model)
    return _load_clip(_canonical(model), proc, resolve_device(device), dtype)


@functools.cache
def _load_clip(model: str, processor: str, device: str, dtype: str) -> Clip:
    from transformers import CLIPModel, CLIPProcessor

    try:
        net = CLIPModel.from_pretrained(model, dtype=DTYPES[dtype])
        proc = CLIPProcessor.from_pretrained(processor)
    except OSError as exc:
        exc.add_note(
            f"CLIP reward: cannot load model {model!r} / processor {processor!r} "
            "(a hub id or a local directory saved with save_pretrained)"
        )
        raise
    net = net.to(device).eval().requires_grad_(False)
    limit = min(proc.tokenizer.model_max_length, net.config.text_config.max_position_embeddings)
    return Clip(
        net, proc.tokenizer, proc.image_processor, torch.device(device), DTYPES[dtype], limit
    )


# ---------------------------------------------------------------- pixels


def _field(obj: Any, key: str) -> Any:
    """`obj[key]` for a dict, `obj.key` for transformers' SizeDict; None when absent."""
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _resize_to(h: int, w: int, size: Any) -> tuple[int, int]:
    """Output (height, width) with transformers' rule (int truncation of the long edge)."""
    if _field(size, "shortest_edge"):
        s = int(_field(size, "shortest_edge"))
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(s * long / short)
        return (new_long, s) if w <= h else (s, new_long)
    if _field(size, "height") and _field(size, "width"):
        return int(_field(size, "height")), int(_field(size, "width"))
    raise ValueError(
        f"CLIP reward: image processor size {size!r} is not supported by "
        "preprocess 'tensor'; use preprocess 'processor'"
    )


def pixels_tensor(frames: Tensor, ip: Any) -> Tensor:
    """Float[M, 3, H, W] in [0, 1] -> CLIP pixel_values Float[M, 3, h, w], all in torch."""
    if ip.do_rescale and abs(float(ip.rescale_factor) - 1 / 255) > 1e-9:
        raise ValueError(
            f"CLIP reward: rescale_factor {ip.rescale_factor} is not 1/255; "
            "use preprocess 'processor'"
        )
    x = frames.float()  # [M, 3, H, W]
    if ip.do_resize:
        mode = RESAMPLE.get(int(ip.resample))
        if mode is None:
            raise ValueError(
                f"CLIP reward: resample {ip.resample!r} has no torch equivalent; "
                "use preprocess 'processor'"
            )
        out = _resize_to(x.shape[-2], x.shape[-1], ip.size)
        if out != tuple(x.shape[-2:]):
            smooth = {} if mode == "nearest" else {"antialias": True, "align_corners": False}
            x = F.interpolate(x, size=out, mode=mode, **smooth).clamp(0, 1)  # [M, 3, h', w']
    if ip.do_center_crop:
        ch, cw = int(_field(ip.crop_size, "height")), int(_field(ip.crop_size, "width"))
        h, w = x.shape[-2:]
        if ch > h or cw > w:
            raise ValueError(
                f"CLIP reward: crop {ch}x{cw} is larger than the resized image "
                f"{h}x{w}; use preprocess 'processor'"
            )
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[..., top : top + ch, left : left + cw]  # [M, 3, ch, cw]
    if ip.do_normalize:
        mean = torch.tensor(ip.image_mean, dtype=x.dtype, device=x.device)[:, None, None]  # [3,1,1]
        std = torch.tensor(ip.image_std, dtype=x.dtype, device=x.device)[:, None, None]  # [3,1,1]
        x = (x - mean) / std  # [M, 3, h, w]
    return x


def pixels_processor(frames: Tensor, ip: Any) -> Tensor:
    """Float[M, 3, H, W] -> uint8 PIL images -> the image processor's pixel_values [M, 3, h, w]."""
    pils = [Image.fromarray(to_uint8_hwc(f)) for f in frames]
    return ip(images=pils, return_tensors="pt")["pixel_values"]


PREPROCESS = {"tensor": pixels_tensor, "processor": pixels_processor}


def _pixels(samples: list[Tensor], ip: Any, preprocess: str) -> Tensor:
    """Every frame of every sample, preprocessed: Float[sum F, 3, h, w] (sample order kept)."""
    fn = PREPROCESS[preprocess]
    if len({tuple(s.shape[1:]) for s in samples}) == 1:  # one resize call for the whole batch
        return fn(torch.cat(samples), ip)
    return torch.cat([fn(s, ip) for s in samples])


# ---------------------------------------------------------------- embeddings


def _features(out: Any) -> Tensor:
    # transformers 5 returns a model output whose pooler_output is the projected embedding
    return out.pooler_output if hasattr(out, "pooler_output") else out


@torch.no_grad()
def image_embeddings(clip: Clip, pixels: Tensor, batch_size: int) -> Tensor:
    """pixel_values Float[M, 3, h, w] -> unit-norm image embeddings Float[M, D] (float32, on CPU)."""
    chunks = []
    for i in range(0, pixels.shape[0], batch_size):
        px = pixels[i : i + batch_size].to(clip.device, clip.dtype)  # [b, 3, h, w]
        e = _features(clip.model.get_image_features(pixel_values=px)).float()  # [b, D]
        chunks.append(F.normalize(e, dim=-1).cpu())  # [b, D]
    return torch.cat(chunks)  # [M, D]


@torch.no_grad()
def text_embeddings(clip: Clip, prompts: list[str], batch_size: int) -> Tensor:
    """Prompts -> unit-norm text embeddings Float[P, D] (float32, on CPU); long prompts truncated."""
    chunks = []
    for i in range(0, len(prompts), batch_size):
        tok = clip.tokenizer(
            prompts[i : i + batch_size],
            padding=True,
            truncation=True,
            max_length=clip.max_length,
            return_tensors="pt",
        )
        e = _features(
            clip.model.get_text_features(
                input_ids=tok["input_ids"].to(clip.device),  # [b, L]
                attention_mask=tok["attention_mask"].to(clip.device),  # [b, L]
            )
        ).float()  # [b, D]
        chunks.append(F.normalize(e, dim=-1).cpu())  # [b, D]
    return torch.cat(chunks)  # [P, D]


def sample_embeddings(clip: Clip, samples: list[Tensor], preprocess: str, batch_size: int) -> list:
    """One Float[F, D] of unit-norm frame embeddings per sample."""
    emb = image_embeddings(clip, _pixels(samples, clip.image_processor, preprocess), batch_size)
    return list(torch.split(emb, [s.shape[0] for s in samples]))  # N x [F, D]
