"""A vision-language model's input side: chat messages with image items -> token ids + vision inputs.

transformers' own processors (Qwen2VLProcessor, LlavaProcessor ...) render the chat template,
run the image processor and expand each image placeholder token to the number of positions the
image fills. Some of them cannot be built on every install (Qwen2-VL's processor always builds its
video processor, which needs torchvision), so this module composes the same three parts itself
from the model folder: the tokenizer (and its chat template), the image processor
(AutoImageProcessor) and one expansion rule per family (IMAGE_TOKENS), checked against the model
(the features the vision tower returns must fill exactly the expanded tokens; a mismatch is an
error at the first forward in transformers itself).

A prompt is a string (text only) or chat messages whose "content" is a string or a list of items
{"type": "image", "image": PIL.Image} / {"type": "text", "text": str}, several images allowed,
in order (grouprl/envs/tasks/multimodal.py makes every dataset form into this one).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from grouprl.rollouts.chat_probe import adapt_messages


@dataclass(eq=False)
class VisionPrompt:
    """One encoded prompt: what the model reads.

    token_ids: the chat-templated prompt with each image's placeholder expanded to its tokens
    images:    the prompt's images, in order (RGB)
    vision:    the image processor's tensors for those images (e.g. pixel_values [patches, D] and
               image_grid_thw [n_images, 3] for Qwen2-VL; pixel_values [n_images, 3, H, W] for
               LLaVA); {} for a prompt without images
    """

    token_ids: list[int]
    images: list[Image.Image]
    vision: dict[str, Tensor]


def _merged_grid(processor: VisionProcessor, vision: dict[str, Tensor]) -> list[int]:
    """Qwen2-VL family: an image of t x h x w patches fills t*h*w / merge_size^2 tokens."""
    merge = int(getattr(processor.image_processor, "merge_size", 2))
    return [int(g.prod()) // merge**2 for g in vision["image_grid_thw"]]


def _patch_grid(processor: VisionProcessor, vision: dict[str, Tensor]) -> list[int]:
    """LLaVA family: one token per vision-tower patch, plus the CLS token when the features keep
    it (vision_feature_select_strategy "full"; "default" drops it)."""
    cfg = processor.config
    patch = cfg.vision_config.patch_size
    extra = 1 if getattr(cfg, "vision_feature_select_strategy", "default") == "full" else 0
    pixels = vision["pixel_values"]  # [n_images, 3, H, W]
    return [(pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) + extra] * len(pixels)


# config.model_type -> tokens each image fills, from the image processor's output
IMAGE_TOKENS: dict[str, Callable[[VisionProcessor, dict[str, Tensor]], list[int]]] = {
    "qwen2_vl": _merged_grid,
    "qwen2_5_vl": _merged_grid,
    "llava": _patch_grid,
}


def _image_items(content: Any) -> list[Image.Image]:
    if not isinstance(content, list):
        return []
    out = []
    for item in content:
        if isinstance(item, dict) and item.get("type") == "image":
            image = item.get("image")
            if not isinstance(image, Image.Image):
                raise TypeError(
                    "an image item of a VLM prompt must hold a loaded PIL image under 'image' "
                    f"(grouprl.envs.tasks.multimodal loads every dataset form), got "
                    f"{type(image).__name__}"
                )
            out.append(image.convert("RGB") if image.mode != "RGB" else image)
    return out


def _placeholders(messages: list[dict]) -> list[dict]:
    """The messages with each image item reduced to {"type": "image"}: what the template reads
    (the pixels never go through jinja)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image"} if isinstance(i, dict) and i.get("type") == "image" else i
                for i in content
            ]
        out.append({**m, "content": content})
    return out


def _chat_template(folder: Path) -> str | None:
    """The processor's chat template file of a hub folder (chat_template.jinja / .json)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


class VisionProcessor:
    """Tokenizer + image processor + the family's image-token rule (see the module docstring)."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any) -> None:
        kind = getattr(config, "model_type", None)
        if kind not in IMAGE_TOKENS:
            raise ValueError(
                f"vision-language model type {kind!r} is not supported yet; supported: "
                f"{sorted(IMAGE_TOKENS)} (a family needs its image-token rule in "
                "grouprl/policies/vision/processing.py IMAGE_TOKENS)"
            )
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise ValueError("VisionProcessor: tokenizer has neither a pad nor an EOS token")
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer, self.image_processor, self.config = tokenizer, image_processor, config
        self.image_token_id = int(
            getattr(config, "image_token_id", None) or config.image_token_index
        )
        self._count = IMAGE_TOKENS[kind]
        # tokens the model reads as image / video slots: never sampled, never scored (policy.py)
        video = getattr(config, "video_token_id", None)
        self.placeholder_ids = [self.image_token_id] + ([int(video)] if video is not None else [])

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, trust_remote_code: bool = False) -> Any:
        """Tokenizer, image processor and config of a hub id or a save_pretrained folder."""
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        kw = {"trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kw)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = _chat_template(Path(name_or_path))
        image_processor = AutoImageProcessor.from_pretrained(name_or_path, **kw)
        return cls(tokenizer, image_processor, AutoConfig.from_pretrained(name_or_path, **kw))

    def save_pretrained(self, directory: str | Path) -> None:
        """Tokenizer and image processor files, and the chat template as chat_template.json
        (where the hub folders of these models keep the processor's template)."""
        directory = Path(directory)
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        if self.tokenizer.chat_template:
            (directory / "chat_template.json").write_text(
                json.dumps({"chat_template": self.tokenizer.chat_template}, indent=2)
            )

    def encode(self, prompt: str | list[dict]) -> VisionPrompt:
        """One prompt -> VisionPrompt (chat messages get the generation prompt appended)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            return VisionPrompt(tok(prompt, add_special_tokens=False).input_ids, [], {})
        if not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise TypeError(
                f"a VLM prompt is a string or a list of chat messages, got {type(prompt).__name__}"
            )
        if not getattr(tok, "chat_template", None):
            raise ValueError("chat prompts need a chat template; this model folder has none")
        images = [im for m in prompt for im in _image_items(m.get("content"))]
        text = tok.apply_chat_template(  # system text folded where the template has no role
            _placeholders(adapt_messages(tok, prompt)), add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False).input_ids
        bos = tok.bos_token_id
        if bos is not None and ids[:1] != [bos] and tok("x").input_ids[:1] == [bos]:
            ids = [bos, *ids]  # as the model's processor tokenizes (LLaVA's template has no <s>)
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the chat template wrote {len(slots)} image placeholders for {len(images)} "
                "images: this template does not render image items"
            )
        if not images:
            return VisionPrompt(ids, [], {})
        vision = dict(self.image_processor(images=images, return_tensors="pt"))
        vision = {k: v for k, v in vision.items() if isinstance(v, Tensor)}
        counts = self._count(self, vision)
        out: list[int] = []
        start = 0
        for slot, n in zip(slots, counts):
            out += ids[start:slot] + [self.image_token_id] * n
            start = slot + 1
        out += ids[start:]
        return VisionPrompt(out, images, vision)


def cat_vision(dicts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The vision inputs of several prompts as one batch: each key's tensors concatenated along
    dim 0 in prompt order (how these models batch images: the features are scattered into the
    image tokens in reading order); prompts without images add nothing."""
    keys = {k for d in dicts for k in d}
    return {k: torch.cat([d[k] for d in dicts if k in d]) for k in sorted(keys)}
