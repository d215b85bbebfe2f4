"""Conditioning for flow policies: cached prompt embeddings and class labels.

`PromptEncoder` wraps the text side of a diffusers pipeline (its tokenizers and text encoders; the
denoiser and VAE may be None) and calls that pipeline's own `encode_prompt`, so embeddings match
what the pipeline computes (SD3: CLIP-L + CLIP-G + T5; FLUX: CLIP pooled + T5; Wan: UMT5; SD 1.x:
CLIP). Each distinct prompt is encoded once and kept (on CPU) in a cache; the negative prompt of
classifier-free guidance (default "") is encoded once as well. The text encoders can come from a
hub id or a local pipeline folder (`PromptEncoder.from_pretrained`), or embeddings can be passed to
the policy directly as a FlowCondition, which skips text encoders altogether.

`class_condition` builds the conditioning of a class-conditional user velocity module
(embeds {"class_labels": Long[B]}, negative = a null class id for guidance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.flow.models import FAMILIES
from grouprl.policies.flow.types import FlowCondition


def _sd3(pipe, prompts, max_len) -> dict[str, Tensor]:
    kw = {} if max_len is None else {"max_sequence_length": max_len}
    pe, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, **kw
    )
    return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}


def _flux(pipe, prompts, max_len) -> dict[str, Tensor]:
    kw = {} if max_len is None else {"max_sequence_length": max_len}
    pe, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, **kw)
    return {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}


def _wan(pipe, prompts, max_len) -> dict[str, Tensor]:
    kw = {} if max_len is None else {"max_sequence_length": max_len}
    pe, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, **kw)
    return {"prompt_embeds": pe}


def _unet(pipe, prompts, max_len) -> dict[str, Tensor]:
    pe, _ = pipe.encode_prompt(prompts, pipe._execution_device, 1, False)
    return {"prompt_embeds": pe}


ENCODERS: dict[str, Callable[[Any, list[str], int | None], dict[str, Tensor]]] = {
    "sd3": _sd3,
    "flux": _flux,
    "flux_kontext": _flux,  # FluxKontextPipeline.encode_prompt: FluxPipeline's
    "wan": _wan,
    "wan_expand": _wan,
    "unet": _unet,
}
# the denoiser components the text side never loads (Wan 2.2 A14B: both experts)
_NO_DENOISER = {"sd3": ("transformer",), "flux": ("transformer",),
                "flux_kontext": ("transformer",), "wan": ("transformer", "transformer_2"),
                "wan_expand": ("transformer",), "unet": ("unet",)}  # fmt: skip


class PromptEncoder:
    """Prompt -> FlowCondition with a per-prompt cache (see the module docstring).

    pipeline: a diffusers pipeline of `family` holding the text encoders and tokenizers.
    negative_prompt: the unconditional prompt of classifier-free guidance.
    max_sequence_length: T5 length (None: the pipeline's default; SD 1.x: unused).
    """

    def __init__(
        self,
        pipeline: Any,
        family: str,
        *,
        negative_prompt: str = "",
        max_sequence_length: int | None = None,
    ) -> None:
        if family not in ENCODERS:
            raise ValueError(
                f"no prompt encoder for family {family!r}; allowed: {sorted(ENCODERS)}"
            )
        self.pipeline, self.family = pipeline, family
        self.negative_prompt, self.max_sequence_length = negative_prompt, max_sequence_length
        self.cache: dict[str, dict[str, Tensor]] = {}  # prompt -> {key: [...]} on CPU, no batch dim
        self.calls = 0  # text-encoder batches run (tests check the cache with it)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, family: str, *, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> PromptEncoder:
        """Load only the text encoders and tokenizers of a pipeline (hub id or local folder)."""
        import diffusers

        if family not in ENCODERS:
            raise ValueError(
                f"no prompt encoder for family {family!r}; allowed: {sorted(ENCODERS)}"
            )
        pipe_cls = getattr(diffusers, FAMILIES[family].pipeline)
        skip = {**dict.fromkeys(_NO_DENOISER[family]), "vae": None}
        if family == "unet":
            skip.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        try:
            pipe = pipe_cls.from_pretrained(name_or_path, dtype=dtype, **skip)
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"could not load the text encoders of a {pipe_cls.__name__} from "
                f"{str(name_or_path)!r} (a hub id or a pipeline folder was expected): {first}"
            ) from None
        return cls(pipe, family, **kwargs)

    @torch.no_grad()
    def _encode_missing(self, prompts: list[str]) -> None:
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        if not missing:
            return
        out = ENCODERS[self.family](self.pipeline, missing, self.max_sequence_length)
        self.calls += 1
        for i, p in enumerate(missing):
            self.cache[p] = {k: v[i].detach().float().cpu() for k, v in out.items()}

    def __call__(self, prompts: list[str], *, device: torch.device | str = "cpu") -> FlowCondition:
        """One row per prompt (embeds) and the negative prompt's embeddings (one row)."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a non-empty list of strings")
        self._encode_missing([*prompts, self.negative_prompt])
        keys = self.cache[prompts[0]].keys()
        pos = {k: torch.stack([self.cache[p][k] for p in prompts]).to(device) for k in keys}
        neg = {k: self.cache[self.negative_prompt][k][None].to(device) for k in keys}
        return FlowCondition(pos, neg)


def class_condition(labels: Tensor | list[int], null_label: int | None = None) -> FlowCondition:
    """Conditioning for a class-conditional velocity module: embeds {"class_labels": Long[B]} and,
    with a null_label (the "no class" id the model was trained with), the negative branch for CFG."""
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)  # [B]
    neg = None if null_label is None else {"class_labels": torch.full_like(labels, null_label)}
    return FlowCondition({"class_labels": labels}, neg)
