"""`image_reward`: ImageReward (Xu et al., arXiv:2304.05977), from a folder `grouprl convert
image_reward` writes.

ImageReward scores a (prompt, image) pair with BLIP: the image through BLIP's ViT (ViT-L/16 at
224 px: the sequence of patch features after the final LayerNorm), the prompt (BERT-uncased
tokens, padded / truncated to 35) through BLIP's text encoder, a BERT whose every layer also
cross-attends to the image features; the [CLS] state of its last layer goes through a 5-layer
linear MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1, dropouts only in training, no activations) and the
result is standardised with ImageReward's constants: (r - 0.16717362830052426) /
1.0333394966054072. Images: resize the shorter side to 224 (bicubic), centre crop 224, CLIP's mean /
std (ImageReward's transform; here transformers' CLIPImageProcessor with those settings, on the
uint8 image).

The released `ImageReward.pt` is a pickled state dict of the original BLIP modules. Conversion,
once and explicitly (released.py reads it with torch.load(weights_only=True)), maps:
  blip.visual_encoder.{patch_embed.proj, cls_token, pos_embed, blocks.i.{norm1, attn.qkv,
  attn.proj, norm2, mlp.fc1, mlp.fc2}, norm} -> transformers BlipVisionModel {embeddings.
  patch_embedding, class_embedding, position_embedding, encoder.layers.i.{layer_norm1,
  self_attn.qkv, self_attn.projection, layer_norm2, mlp.fc1, mlp.fc2}, post_layernorm}
  (the same fused q/k/v layout); blip.text_encoder.* -> BlipTextModel (the same BERT names,
  built with cross-attention layers); mlp.layers.{0,2,4,6,7} -> reward_head.safetensors.
The folder: vision/ and text/ (save_pretrained), reward_head.safetensors, image_reward.json (the
constants), preprocessor_config.json, and the tokenizer files copied from `--tokenizer` (BLIP's
bert-base-uncased with its added [DEC] / [ENC] tokens). Keys of the checkpoint this reward never
uses (e.g. BLIP's projection heads) are listed and left out; a key it needs that is missing is an
error. Deviation: none in the computation; LayerNorm eps as BLIP builds them (1e-6 vision, 1e-12
text).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from grouprl.envs.rewards.clip import DTYPES, Dtype, resolve_device
from grouprl.envs.rewards.image import as_frames, is_finite, to_uint8_hwc
from grouprl.envs.rewards.loading import RewardFn, column
from grouprl.envs.rewards.released import read_checkpoint

MEAN, STD = 0.16717362830052426, 1.0333394966054072
MAX_LENGTH = 35
HEAD = (0, 2, 4, 6, 7)  # the Linear layers of ImageReward's MLP (1, 3, 5 are dropouts)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")  # fmt: skip
VISION_NAMES = (("norm1", "layer_norm1"), ("attn.qkv", "self_attn.qkv"),
                ("attn.proj", "self_attn.projection"), ("norm2", "layer_norm2"),
                ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"))  # fmt: skip


def _count(state: dict[str, Tensor], prefix: str) -> int:
    ids = {int(m.group(1)) for k in state if (m := re.match(rf"{re.escape(prefix)}(\d+)\.", k))}
    if not ids:
        raise ValueError(f"no layers under {prefix!r}: not an ImageReward (BLIP) state dict")
    return max(ids) + 1


def convert_image_reward(
    checkpoint: str | Path,
    out: str | Path,
    tokenizer: str | Path,
    vision_heads: int = 16,
    text_heads: int = 12,
) -> Path:
    """Write the image_reward folder of an ImageReward checkpoint (module docstring)."""
    from safetensors.torch import save_file
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    state = read_checkpoint(checkpoint)
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    width, _, patch, _ = state[f"{v}patch_embed.proj.weight"].shape  # [W, 3, p, p]
    positions = state[f"{v}pos_embed"].shape[1]  # 1 + (image / patch)^2
    v_layers, t_layers = _count(state, f"{v}blocks."), _count(state, f"{t}encoder.layer.")
    vocab, hidden = state[f"{t}embeddings.word_embeddings.weight"].shape
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=width, intermediate_size=state[f"{v}blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=v_layers, num_attention_heads=vision_heads, patch_size=patch,
        image_size=round((positions - 1) ** 0.5) * patch, hidden_act="gelu", layer_norm_eps=1e-6,
    ))  # fmt: skip
    text = BlipTextModel(BlipTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=t_layers,
        num_attention_heads=text_heads,
        intermediate_size=state[f"{t}encoder.layer.0.intermediate.dense.weight"].shape[0],
        max_position_embeddings=state[f"{t}embeddings.position_embeddings.weight"].shape[0],
        encoder_hidden_size=width, is_decoder=True,  # builds the cross-attention layers
        hidden_act="gelu", layer_norm_eps=1e-12,
    ), add_pooling_layer=False)  # fmt: skip
    v_state = {
        "embeddings.patch_embedding.weight": state[f"{v}patch_embed.proj.weight"],
        "embeddings.patch_embedding.bias": state[f"{v}patch_embed.proj.bias"],
        "embeddings.class_embedding": state[f"{v}cls_token"],
        "embeddings.position_embedding": state[f"{v}pos_embed"],
        "post_layernorm.weight": state[f"{v}norm.weight"],
        "post_layernorm.bias": state[f"{v}norm.bias"],
    }
    for i in range(v_layers):
        for a, b in VISION_NAMES:
            for kind in ("weight", "bias"):
                v_state[f"encoder.layers.{i}.{b}.{kind}"] = state[f"{v}blocks.{i}.{a}.{kind}"]
    t_state = {k[len(t) :]: x for k, x in state.items() if k.startswith(t)}
    t_state.pop("embeddings.position_ids", None)  # a buffer, rebuilt by the model
    for model, weights, name in ((vision, v_state, "vision"), (text, t_state, "text")):
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"ImageReward {name} tower: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    head = {f"l{j}.{kind}": state[f"mlp.layers.{i}.{kind}"].contiguous()
            for j, i in enumerate(HEAD) for kind in ("weight", "bias")}  # fmt: skip
    used = {k for k in state if k.startswith((v, t, "mlp."))}
    ignored = sorted(set(state) - used)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vision.save_pretrained(out / "vision", safe_serialization=True)
    text.save_pretrained(out / "text", safe_serialization=True)
    save_file(head, str(out / "reward_head.safetensors"))
    (out / "image_reward.json").write_text(json.dumps(
        {"mean": MEAN, "std": STD, "max_length": MAX_LENGTH, "ignored_keys": ignored}, indent=2
    ))  # fmt: skip
    side = vision.config.image_size
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_resize": True,
        "size": {"shortest_edge": side}, "resample": 3, "do_center_crop": True,
        "crop_size": {"height": side, "width": side}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "do_convert_rgb": True,
    }, indent=2))  # fmt: skip
    src = Path(tokenizer)
    if not (src / "vocab.txt").is_file() and not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{str(src)!r} holds no BERT tokenizer (vocab.txt / tokenizer.json)"
        )
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


class _Head(torch.nn.Module):
    """ImageReward's MLP without its dropouts: five Linear layers, no activation between."""

    def __init__(self, weights: dict[str, Tensor]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for j in range(len(HEAD)):
            w, b = weights[f"l{j}.weight"], weights[f"l{j}.bias"]
            layer = torch.nn.Linear(w.shape[1], w.shape[0])
            layer.load_state_dict({"weight": w, "bias": b})
            self.layers.append(layer)

    def forward(self, x: Tensor) -> Tensor:  # [B, H] -> [B]
        for layer in self.layers:
            x = layer(x)
        return x[:, 0]


def image_reward(
    model: str,
    batch_size: int = 16,
    device: str | None = None,
    dtype: Dtype = "float32",
) -> RewardFn:
    """ImageReward of each (prompt, image), standardised as ImageReward reports it.

    model: the folder `grouprl convert image_reward` wrote.
    batch_size: images per forward pass.
    device: torch device (None: the current CUDA device, else the CPU).
    dtype: the towers' compute dtype (the head and the score stay float32)."""
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoTokenizer, BlipTextModel, BlipVisionModel

    folder = Path(model)
    if not (folder / "image_reward.json").is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not an image_reward folder (no image_reward.json): convert the "
            "released ImageReward.pt with `grouprl convert image_reward`"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    meta = json.loads((folder / "image_reward.json").read_text())
    dev, dt = torch.device(resolve_device(device)), DTYPES[dtype]
    vision = BlipVisionModel.from_pretrained(folder / "vision", dtype=dt).to(dev).eval()
    text = BlipTextModel.from_pretrained(folder / "text", dtype=dt).to(dev).eval()
    head = _Head(load_file(folder / "reward_head.safetensors")).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ip = AutoImageProcessor.from_pretrained(folder)

    @torch.no_grad()
    def score(images: Any, prompts: Any = None, **columns: Any) -> list[float | None]:
        samples = as_frames(images)  # per sample Float[F, 3, H, W] in [0, 1]
        n = len(samples)
        if prompts is None:
            raise ValueError("reward 'image_reward' needs `prompts` (one text per image)")
        texts = column({"prompts": prompts}, "prompts", n, "image_reward")
        rows = [(i, f) for i in range(n) if texts[i] is not None and is_finite(samples[i])
                for f in range(len(samples[i]))]  # fmt: skip  # one row per (sample, frame)
        sums: dict[int, list[float]] = {}
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            pil = [Image.fromarray(to_uint8_hwc(samples[i][f])) for i, f in chunk]
            pixels = ip(images=pil, return_tensors="pt")["pixel_values"].to(dev, dt)
            feats = vision(pixel_values=pixels).last_hidden_state  # [b, 1+P, W]
            enc = tok([texts[i] for i, _ in chunk], padding="max_length", truncation=True,
                      max_length=meta["max_length"], return_tensors="pt").to(dev)  # fmt: skip
            out = text(
                input_ids=enc.input_ids,
                attention_mask=enc.attention_mask,
                encoder_hidden_states=feats,
                encoder_attention_mask=torch.ones(feats.shape[:2], dtype=torch.long, device=dev),
                is_decoder=False,  # bidirectional self-attention, as BLIP's ITM encoder
            ).last_hidden_state[:, 0]  # [b, H]: the [CLS] state
            r = (head(out.float()) - meta["mean"]) / meta["std"]  # [b]
            for (i, _), value in zip(chunk, r.tolist()):
                sums.setdefault(i, []).append(value)
        return [sum(sums[i]) / len(sums[i]) if i in sums else None for i in range(n)]

    return score
