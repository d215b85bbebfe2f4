"""Conditioning for flow policies: cached prompt embeddings and class labels.

`PromptEncoder` wraps the text side of a diffusers pipeline (its tokenizers and text encoders; the
denoiser and VAE may be None) and calls that pipeline's own `encode_prompt`, so embeddings match
what the pipeline computes (SD3: CLIP-L + CLIP-G + T5; FLUX: CLIP pooled + T5; Wan: UMT5; SD 1.x:
CLIP; SDXL: the penultimate hidden states of CLIP-L and CLIP-G concatenated and CLIP-G's pooled
projection; SANA: Gemma 2 with the pipeline's complex human instruction (its __call__ default)
and attention mask; Qwen-Image: Qwen2.5-VL over the pipeline's prompt template, its prefix tokens
dropped, with a mask). The encoder is chosen by the pipeline's class (pipelines.SUPPORTED_PIPELINES).
The negative prompt goes through the pipeline's own negative branch where it differs from the
positive one: SDXL's force_zeros_for_empty_prompt (an empty negative prompt is zero embeddings, as
the pipeline's default call), SANA's negative without the instruction. SDXL's micro-conditioning
time ids (original size, crop top-left, target size: the pipeline's defaults (H, W), (0, 0),
(H, W) for the policy's image size) join every row. Rows of different text lengths (Qwen-Image)
are zero-padded to the longest, mask 0, as the pipeline pads a batch. Each distinct prompt is encoded once and kept (on CPU) in a cache; the negative prompt of
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
from grouprl.policies.flow.pipelines import (
    MODEL_INDEX,
    SUPPORTED_PIPELINES,
    local_model_index,
)
from grouprl.policies.flow.types import FlowCondition, pad_cat


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


def _sdxl(pipe, prompts, max_len, negative: str | None = None) -> dict[str, Tensor]:
    """StableDiffusionXLPipeline.encode_prompt; with `negative` its unconditional branch (an empty
    negative prompt passes None, so force_zeros_for_empty_prompt applies as in a default call)."""
    if negative is None:
        pe, _, pooled, _ = pipe.encode_prompt(prompts, device=pipe._execution_device,
                                              num_images_per_prompt=1,
                                              do_classifier_free_guidance=False)  # fmt: skip
        return {"prompt_embeds": pe, "text_embeds": pooled}
    _, npe, _, npooled = pipe.encode_prompt(
        prompts, device=pipe._execution_device, num_images_per_prompt=1,
        do_classifier_free_guidance=True, negative_prompt=negative or None,
    )  # fmt: skip
    return {"prompt_embeds": npe, "text_embeds": npooled}


def _sana_instruction(pipe) -> list[str] | None:
    """SanaPipeline.__call__'s complex_human_instruction default (encode_prompt's is None)."""
    import inspect

    return inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default


def _sana(pipe, prompts, max_len, negative: str | None = None) -> dict[str, Tensor]:
    """SanaPipeline.encode_prompt with its __call__ defaults; with `negative` its negative branch
    (no instruction), which the pipeline computes with do_classifier_free_guidance."""
    kw = {} if max_len is None else {"max_sequence_length": max_len}
    cfg = negative is not None
    pe, mask, npe, nmask = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=cfg, negative_prompt=negative or "",
        complex_human_instruction=_sana_instruction(pipe), **kw,
    )  # fmt: skip
    if cfg:
        return {"prompt_embeds": npe, "prompt_attention_mask": nmask}
    return {"prompt_embeds": pe, "prompt_attention_mask": mask}


def _qwenimage(pipe, prompts, max_len) -> dict[str, Tensor]:
    """QwenImagePipeline.encode_prompt: one call per prompt, so each keeps its own length (the
    pipeline pads a batch to its longest; rows are padded again when stacked) and mask (the
    pipeline returns None for an all-ones mask)."""
    kw = {} if max_len is None else {"max_sequence_length": max_len}
    rows = []
    for p in prompts:
        pe, mask = pipe.encode_prompt([p], device=pipe._execution_device, **kw)  # [1, L, D]
        if mask is None:
            mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)  # [1, L]
        rows.append({"prompt_embeds": pe, "prompt_embeds_mask": mask})
    return {k: pad_cat([r[k] for r in rows], True, k) for k in rows[0]}


def _sdxl_time_ids(pipe, image_size: tuple[int, int]) -> dict[str, Tensor]:
    """StableDiffusionXLPipeline._get_add_time_ids' list for its default call: original size and
    target size (H, W), crop top-left (0, 0). (Its width check needs the UNet: models.py does it.)"""
    h, w = image_size
    return {"time_ids": torch.tensor([h, w, 0, 0, h, w], dtype=torch.float32)}  # [6]


ENCODERS: dict[str, Callable[[Any, list[str], int | None], dict[str, Tensor]]] = {
    "sd3": _sd3,
    "flux": _flux,
    "flux_kontext": _flux,  # FluxKontextPipeline.encode_prompt: FluxPipeline's
    "wan": _wan,
    "wan_expand": _wan,
    "unet": _unet,
    "sdxl": _sdxl,
    "sana": _sana,
    "qwenimage": _qwenimage,
}
# encoders whose negative prompt takes the pipeline's own unconditional branch: fn(pipe, [prompt],
# max_len, negative=prompt)
NEGATIVE_BRANCH = {"sdxl", "sana"}
# per-image conditioning that is not text: fn(pipe, image_size) -> one row of tensors
IMAGE_CONDITIONS: dict[str, Callable[[Any, tuple[int, int]], dict[str, Tensor]]] = {
    "sdxl": _sdxl_time_ids,
}
# the denoiser components the text side never loads (Wan 2.2 A14B: both experts)
_NO_DENOISER = {"sd3": ("transformer",), "flux": ("transformer",),
                "flux_kontext": ("transformer",), "wan": ("transformer", "transformer_2"),
                "wan_expand": ("transformer",), "unet": ("unet",)}  # fmt: skip


def encoder_of(pipeline: Any, family: str | None) -> str:
    """The ENCODERS entry of a pipeline: its class's (SUPPORTED_PIPELINES), else `family`'s."""
    support = SUPPORTED_PIPELINES.get(type(pipeline).__name__)
    key = support.encoder if support is not None else family
    if key not in ENCODERS:
        raise ValueError(
            f"no prompt encoder for a {type(pipeline).__name__} (family {family!r}); allowed "
            f"families: {sorted(ENCODERS)}"
        )
    return key


class PromptEncoder:
    """Prompt -> FlowCondition with a per-prompt cache (see the module docstring).

    pipeline: a diffusers pipeline holding the text encoders and tokenizers; its class picks the
    encoder (`family` names it for a pipeline class outside SUPPORTED_PIPELINES).
    negative_prompt: the unconditional prompt of classifier-free guidance.
    max_sequence_length: text length (None: the pipeline's default; SD 1.x / SDXL: unused).
    image_size: (height, width) in pixels, for per-image conditioning (SDXL's time ids).
    """

    def __init__(
        self,
        pipeline: Any,
        family: str | None = None,
        *,
        negative_prompt: str = "",
        max_sequence_length: int | None = None,
        image_size: tuple[int, int] | None = None,
    ) -> None:
        self.encoder = encoder_of(pipeline, family)
        self.pipeline, self.family = pipeline, family
        self.negative_prompt, self.max_sequence_length = negative_prompt, max_sequence_length
        self.cache: dict[str, dict[str, Tensor]] = {}  # prompt -> {key: [...]} on CPU, no batch dim
        self.negative: dict[str, Tensor] | None = None  # the negative branch (NEGATIVE_BRANCH)
        self.calls = 0  # text-encoder batches run (tests check the cache with it)
        self.image: dict[str, Tensor] = {}
        if self.encoder in IMAGE_CONDITIONS:
            if image_size is None:
                raise ValueError(
                    f"a {type(pipeline).__name__} is conditioned on the image size as well: "
                    "pass image_size=(height, width)"
                )
            self.image = IMAGE_CONDITIONS[self.encoder](pipeline, tuple(image_size))

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        family: str | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> PromptEncoder:
        """Load only the text encoders and tokenizers of a pipeline (hub id or local folder): the
        class its model_index.json names (else `family`'s pipeline)."""
        import diffusers

        index = _model_index(name_or_path)
        name = index.get("_class_name")
        if name not in SUPPORTED_PIPELINES:
            if family not in ENCODERS or FAMILIES.get(family) is None:
                raise ValueError(
                    f"no prompt encoder for {name or str(name_or_path)!r} (family {family!r}); "
                    f"supported pipelines: {', '.join(sorted(SUPPORTED_PIPELINES))}"
                )
            name = FAMILIES[family].pipeline
        pipe_cls = getattr(diffusers, name)
        text = ("text_encoder", "tokenizer", "scheduler")
        skip = {k: None for k, v in index.items()
                if not k.startswith(("_", *text)) and isinstance(v, list)}  # fmt: skip
        if not index and family in _NO_DENOISER:
            skip = {**dict.fromkeys(_NO_DENOISER[family]), "vae": None}
        if "requires_safety_checker" in index or (not index and family == "unet"):
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

    @staticmethod
    def _rows(out: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        n = len(next(iter(out.values())))
        # masks stay integers (the pipelines' dtype); embeddings are cached in float32
        return [{k: (v[i].detach().float() if v.is_floating_point() else v[i].detach()).cpu()
                 for k, v in out.items()} for i in range(n)]  # fmt: skip

    @torch.no_grad()
    def _encode_missing(self, prompts: list[str]) -> None:
        branch = self.encoder in NEGATIVE_BRANCH
        if branch and self.negative is None:
            out = ENCODERS[self.encoder](
                self.pipeline,
                [self.negative_prompt],
                self.max_sequence_length,
                negative=self.negative_prompt,
            )
            self.negative = self._rows(out)[0]  # fmt: skip
            self.calls += 1
        wanted = prompts if branch else [*prompts, self.negative_prompt]
        missing = list(dict.fromkeys(p for p in wanted if p not in self.cache))
        if not missing:
            return
        out = ENCODERS[self.encoder](self.pipeline, missing, self.max_sequence_length)
        self.calls += 1
        for p, row in zip(missing, self._rows(out), strict=True):
            self.cache[p] = row

    def __call__(self, prompts: list[str], *, device: torch.device | str = "cpu") -> FlowCondition:
        """One row per prompt (embeds) and the negative prompt's embeddings (one row)."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a non-empty list of strings")
        self._encode_missing(prompts)
        negative = self.negative if self.encoder in NEGATIVE_BRANCH else None
        rows = [*(self.cache[p] for p in prompts), negative or self.cache[self.negative_prompt]]
        rows = [{**r, **self.image} for r in rows]
        masked = any(k.endswith("_mask") for k in rows[0])
        both = {k: pad_cat([r[k][None] for r in rows], masked, k) for k in rows[0]}  # [B + 1, ...]
        pos = {k: v[:-1].to(device) for k, v in both.items()}
        neg = {k: v[-1:].to(device) for k, v in both.items()}
        return FlowCondition(pos, neg)


def _model_index(name_or_path: str) -> dict[str, Any]:
    """A pipeline's model_index.json ({} when there is none to read)."""
    import json
    from pathlib import Path

    path = local_model_index(str(name_or_path))
    if path is None and not Path(str(name_or_path)).exists():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(name_or_path), MODEL_INDEX))
        except Exception:  # not reachable: from_pretrained below says why
            return {}
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def class_condition(labels: Tensor | list[int], null_label: int | None = None) -> FlowCondition:
    """Conditioning for a class-conditional velocity module: embeds {"class_labels": Long[B]} and,
    with a null_label (the "no class" id the model was trained with), the negative branch for CFG."""
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)  # [B]
    neg = None if null_label is None else {"class_labels": torch.full_like(labels, null_label)}
    return FlowCondition({"class_labels": labels}, neg)
