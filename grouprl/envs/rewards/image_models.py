"""Model-based image rewards on CLIP: CLIP score, PickScore, HPSv2, the LAION aesthetic predictor.

- clip_score: `scale` * cos(image embedding, text embedding) of a transformers `CLIPModel`. scale 100
  (default) is the CLIPScore of torchmetrics without its clamp at 0; Hessel et al. (arXiv 2104.08718)
  use 2.5 * max(cos, 0); scale 1 gives the raw cosine. Default model: openai/clip-vit-large-patch14
  (flow_grpo's clipscore).
- pickscore: PickScore (Pick-a-Pic, arXiv 2305.01569): logit_scale.exp() * cos with the
  yuvalkirstain/PickScore_v1 weights (a CLIP-H/14) and the processor of
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K. Deviation: flow_grpo divides it by 26 and DanceGRPO uses
  the raw cosine; here the value is PickScore's own and the config's reward `weight` rescales.
- hpsv2: HPSv2 / HPSv2.1 (arXiv:2306.09341): cos(image embedding, text embedding) of OpenCLIP
  ViT-H-14 fine-tuned on human preferences, HPSv2's own score (the diagonal of image_features @
  text_features.T of normalised features: a cosine, at most 1), read from the folder
  `grouprl convert hpsv2` writes from the released checkpoint (openclip_convert.py: no OpenCLIP,
  no pickle at load). Deviation: the prompt is tokenised by transformers' CLIP tokenizer (the same
  BPE vocabulary and 77 tokens as OpenCLIP's; OpenCLIP also runs ftfy's text fixes).
- aesthetic: the LAION aesthetic predictor (improved-aesthetic-predictor): the L2-normalised image
  embedding of CLIP ViT-L/14 through LAION's MLP head (`aesthetic_head.py`), whose weights come from a
  local .pth / .safetensors file such as sac+logos+ava1-l14-linearMSE.pth (never downloaded here).

Options shared by the three: `model` / `processor` (hub id or local directory, loaded once per
process, see `clip.py`), `preprocess` ("tensor": resize / crop / normalise in torch, no PIL round
trip; "processor": the model's own image processor on uint8 PIL images, as the references), a
`batch_size` of frames per forward pass, `device` (None = current CUDA device, else CPU), `dtype`.

Images: see `image.py` (float NCHW in [0, 1], video NCFHW, PIL ...). Video frames are scored one by
one and averaged. Per sample, a missing prompt (None) or a non-finite pixel gives None (no reward).
Prompts repeated within a batch (a group) are encoded once.
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.envs.rewards.aesthetic_head import AestheticHead, load_aesthetic_head
from grouprl.envs.rewards.clip import (
    PREPROCESS,
    Clip,
    Dtype,
    Preprocess,
    load_clip,
    sample_embeddings,
    text_embeddings,
)
from grouprl.envs.rewards.image import as_frames, is_finite
from grouprl.envs.rewards.loading import RewardFn, column

# ---------------------------------------------------------------- rewards


def _check(preprocess: str, batch_size: int) -> None:
    if preprocess not in PREPROCESS:
        raise ValueError(f"unknown preprocess {preprocess!r}; allowed: {list(PREPROCESS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


def _similarity_reward(
    name: str, clip: Clip, multiplier: float, preprocess: str, batch_size: int
) -> RewardFn:
    """multiplier * cos(image, prompt), mean over frames; None without prompt or finite pixels."""

    def similarity(images: Any, prompts: Any = None, **columns: Any) -> list:
        samples = as_frames(images)
        n = len(samples)
        if prompts is None:
            raise ValueError(f"reward {name!r} needs `prompts` (one text per image)")
        texts = column({"prompts": prompts}, "prompts", n, name)
        for i, t in enumerate(texts):
            if t is not None and not isinstance(t, str):
                raise TypeError(f"reward {name!r}: prompt {i} is {type(t).__name__}, not str")
        ok = [i for i in range(n) if texts[i] is not None and is_finite(samples[i])]
        out: list[float | None] = [None] * n
        if not ok:
            return out
        img = sample_embeddings(clip, [samples[i] for i in ok], preprocess, batch_size)
        unique = list(dict.fromkeys(texts[i] for i in ok))  # each prompt encoded once per call
        txt = text_embeddings(clip, unique, batch_size)  # [P, D]
        row = {p: j for j, p in enumerate(unique)}
        for i, e in zip(ok, img):
            cos = e @ txt[row[texts[i]]]  # [F]
            out[i] = float(multiplier * cos.double().mean())
        return out

    similarity.__name__ = name
    return similarity


def clip_score(
    model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None,
    scale: float = 100.0,
    preprocess: Preprocess = "tensor",
    batch_size: int = 32,
    device: str | None = None,
    dtype: Dtype = "float32",
) -> RewardFn:
    """scale * cosine similarity of CLIP image and prompt embeddings (module docstring)."""
    _check(preprocess, batch_size)
    clip = load_clip(model, processor, device=device, dtype=dtype)
    return _similarity_reward("clip_score", clip, float(scale), preprocess, batch_size)


def pickscore(
    model: str = "yuvalkirstain/PickScore_v1",
    processor: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    preprocess: Preprocess = "tensor",
    batch_size: int = 32,
    device: str | None = None,
    dtype: Dtype = "float32",
) -> RewardFn:
    """PickScore: logit_scale.exp() * cosine of image and prompt embeddings (module docstring)."""
    _check(preprocess, batch_size)
    clip = load_clip(model, processor, device=device, dtype=dtype)
    scale = float(clip.model.logit_scale.detach().float().exp())
    return _similarity_reward("pickscore", clip, scale, preprocess, batch_size)


def hpsv2(
    model: str,
    processor: str | None = None,
    preprocess: Preprocess = "tensor",
    batch_size: int = 32,
    device: str | None = None,
    dtype: Dtype = "float32",
) -> RewardFn:
    """HPSv2: cosine of image and prompt embeddings of a converted HPSv2 folder (module docstring).

    model: the folder `grouprl convert hpsv2` wrote; processor: its processor files if elsewhere.
    """
    _check(preprocess, batch_size)
    clip = load_clip(model, processor, device=device, dtype=dtype)
    return _similarity_reward("hpsv2", clip, 1.0, preprocess, batch_size)


def aesthetic(
    head: str | None = None,
    model: str = "openai/clip-vit-large-patch14",
    processor: str | None = None,
    preprocess: Preprocess = "tensor",
    batch_size: int = 32,
    device: str | None = None,
    dtype: Dtype = "float32",
) -> RewardFn:
    """LAION aesthetic score: MLP head on the unit-norm CLIP image embedding, mean over frames."""
    if head is None:
        raise ValueError(
            "reward 'aesthetic' needs the option `head`: a local .pth / .safetensors file of "
            "LAION's aesthetic MLP (e.g. sac+logos+ava1-l14-linearMSE.pth from "
            "christophschuhmann/improved-aesthetic-predictor)"
        )
    _check(preprocess, batch_size)
    clip = load_clip(model, processor, device=device, dtype=dtype)
    mlp: AestheticHead = load_aesthetic_head(head)
    dim = clip.model.config.projection_dim
    if mlp.input_size != dim:
        raise ValueError(
            f"aesthetic head {head!r} takes {mlp.input_size}-d embeddings but CLIP "
            f"{model!r} makes {dim}-d ones (the LAION heads need ViT-L/14: 768)"
        )

    @torch.no_grad()
    def aesthetic(images: Any, prompts: Any = None, **columns: Any) -> list:
        samples = as_frames(images)
        ok = [i for i, s in enumerate(samples) if is_finite(s)]
        out: list[float | None] = [None] * len(samples)
        if not ok:
            return out
        emb = sample_embeddings(clip, [samples[i] for i in ok], preprocess, batch_size)
        for i, e in zip(ok, emb):  # e: [F, D] unit-norm frame embeddings
            out[i] = float(mlp(e).double().mean())  # [F] -> mean over frames
        return out

    return aesthetic
