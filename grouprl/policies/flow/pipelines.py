"""The diffusers pipelines grouprl trains: one table from the pipeline class a folder names
(model_index.json `_class_name`) to how grouprl runs it, and the check that refuses any other.

SUPPORTED_PIPELINES[class] = SupportedPipeline(family, model_type, denoiser, encoder):
- family: the models.FAMILIES entry that calls the denoiser (what it predicts, its conditioning
  keyword arguments, its latent layout);
- model_type: the config's model.type that runs it ("flow": flow-matching samplers, "unet": DDIM
  over an epsilon-prediction UNet, DDPO);
- denoiser: the model_index.json component trained ("transformer" or "unet");
- encoder: the text_encoders.ENCODERS entry that turns prompts into that conditioning through the
  pipeline's own encode_prompt.
What a pipeline's conditioning needs beyond that is read from its components' configs where it is
used (an SDXL UNet's addition_embed_type "text_time" and its time-embedding widths, a SANA
transformer's timestep_scale, a guidance-distilled transformer's guidance_embeds ...), never from
the class name.

`check_pipeline(name_or_path, model_type)` runs while the config is validated: a local folder's
model_index.json, or a hub id's once it is on disk (huggingface_hub's cache; the image builder
checks again right after downloading it, before any model loads), must name a class of the table
that model.type runs; anything else is refused with the class and the supported list. Importing
this module imports neither torch nor diffusers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_INDEX = "model_index.json"


@dataclass(frozen=True)
class SupportedPipeline:
    """How grouprl runs one diffusers pipeline class (module docstring)."""

    family: str
    model_type: str
    denoiser: str
    encoder: str


SUPPORTED_PIPELINES: dict[str, SupportedPipeline] = {
    "StableDiffusion3Pipeline": SupportedPipeline("sd3", "flow", "transformer", "sd3"),
    "FluxPipeline": SupportedPipeline("flux", "flow", "transformer", "flux"),
    "FluxKontextPipeline": SupportedPipeline("flux_kontext", "flow", "transformer", "flux_kontext"),
    "WanPipeline": SupportedPipeline("wan", "flow", "transformer", "wan"),
    "SanaPipeline": SupportedPipeline("sana", "flow", "transformer", "sana"),
    "QwenImagePipeline": SupportedPipeline("qwenimage", "flow", "transformer", "qwenimage"),
    "StableDiffusionPipeline": SupportedPipeline("unet", "unet", "unet", "unet"),
    "StableDiffusionXLPipeline": SupportedPipeline("unet", "unet", "unet", "sdxl"),
}


def supported_list(model_type: str | None = None) -> str:
    """The supported classes (of one model.type), for messages."""
    names = [k for k, v in SUPPORTED_PIPELINES.items() if model_type in (None, v.model_type)]
    return ", ".join(sorted(names))


def local_model_index(name_or_path: str) -> Path | None:
    """model_index.json of a local folder, or of a hub id already in huggingface_hub's cache (no
    network); None when neither has it yet."""
    root = Path(name_or_path)
    if root.is_dir():
        return root / MODEL_INDEX
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, MODEL_INDEX)
    except Exception:  # not a valid hub id (a typo'd path): the build says so when it loads
        return None
    return Path(found) if isinstance(found, str) else None


def read_model_index(path: Path, name_or_path: str) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(
            f"model.name_or_path={name_or_path!r} has no {MODEL_INDEX}: not a diffusers pipeline "
            f"folder (supported pipelines: {supported_list()})"
        )
    return json.loads(path.read_text())


def check_index(index: dict[str, Any], name_or_path: str, model_type: str) -> SupportedPipeline:
    """The table's entry for a pipeline's model_index.json, or a ValueError naming its class,
    model.type and what is supported."""
    cls = index.get("_class_name")
    support = SUPPORTED_PIPELINES.get(cls)
    if support is None:
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is a {cls} (model_index.json _class_name), "
            f"which grouprl does not train; supported pipelines: {supported_list()}"
        )
    if support.model_type != model_type:
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is a {cls}, which runs with model.type "
            f"{support.model_type!r}, not {model_type!r} (model.type {model_type!r} takes "
            f"{supported_list(model_type)})"
        )
    return support


def check_pipeline(name_or_path: str, model_type: str) -> SupportedPipeline | None:
    """check_index on the model_index.json available now (local_model_index); None when a hub
    id's is not downloaded yet (checked after the download, before any model loads)."""
    path = local_model_index(name_or_path)
    if path is None:
        return None
    return check_index(read_model_index(path, name_or_path), name_or_path, model_type)
