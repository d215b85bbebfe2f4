"""An OpenCLIP checkpoint (HPSv2 / HPSv2.1's `HPS_v2*_compressed.pt`) as a transformers CLIPModel.

HPSv2 (arXiv:2306.09341) is OpenCLIP's ViT-H-14 fine-tuned on human preferences; its released
files are OpenCLIP state dicts pickled by torch.save. OpenCLIP cannot be imported beside this
project's CPU torch (it needs torchvision) and pickle has no place on a load path, so the
checkpoint is converted ONCE, explicitly (`grouprl convert hpsv2 --checkpoint F --out DIR`), into a
folder transformers loads (config.json + model.safetensors, the CLIP processor files copied from
`--processor`); the `hpsv2` reward then reads only that folder.

Reading the checkpoint: released.py (`torch.load(weights_only=True)`, torch's restricted
unpickler: a file that asks for anything but tensors, e.g. a __reduce__ payload, is refused).

The mapping, per OpenCLIP's VisionTransformer / TextTransformer (the same architecture as
transformers' CLIP: pre-LN blocks, a class token, causal text attention, the text pooled at the
end-of-text token, which OpenCLIP finds as the largest id and transformers as the first EOS id:
the same position for tokenised text):
  visual.conv1 -> vision_model.embeddings.patch_embedding; visual.class_embedding / positional_
  embedding -> embeddings; visual.ln_pre / ln_post -> pre_layrnorm / post_layernorm;
  visual.proj [W, D] -> visual_projection.weight [D, W] (transposed); token_embedding /
  positional_embedding -> text_model.embeddings; ln_final -> final_layer_norm; text_projection
  [W, D] -> text_projection.weight (transposed); each block: ln_1 / ln_2 -> layer_norm1 / 2,
  attn.in_proj_weight / bias [3W, W] split into q / k / v_proj, attn.out_proj -> out_proj,
  mlp.c_fc / c_proj -> mlp.fc1 / fc2; logit_scale as it is.
Sizes are read off the tensors; the head counts cannot be (OpenCLIP's ViT-H-14: 16 and 16, the
defaults) and the activation is GELU (HPSv2 builds ViT-H-14 without quick_gelu).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from grouprl.envs.rewards.released import read_checkpoint

PROCESSOR_FILES = (
    "preprocessor_config.json", "processor_config.json", "tokenizer.json",
    "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
)  # fmt: skip


def _blocks(state: dict[str, Tensor], prefix: str) -> int:
    ids = {int(m.group(1)) for k in state if (m := re.match(rf"{prefix}(\d+)\.", k))}
    if not ids:
        raise ValueError(f"no transformer blocks under {prefix!r}: not an OpenCLIP CLIP state dict")
    return max(ids) + 1


def _layers(state: dict[str, Tensor], src: str, dst: str, n: int) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for i in range(n):
        s, d = f"{src}{i}.", f"{dst}{i}."
        for a, b in (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("attn.out_proj",
                     "self_attn.out_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):  # fmt: skip
            out[f"{d}{b}.weight"] = state[f"{s}{a}.weight"]
            out[f"{d}{b}.bias"] = state[f"{s}{a}.bias"]
        w = state[f"{s}attn.in_proj_weight"].chunk(3)  # [3W, W] -> q, k, v [W, W]
        b = state[f"{s}attn.in_proj_bias"].chunk(3)
        for name, wi, bi in zip(("q_proj", "k_proj", "v_proj"), w, b):
            out[f"{d}self_attn.{name}.weight"] = wi
            out[f"{d}self_attn.{name}.bias"] = bi
    return out


def openclip_to_clip(
    state: dict[str, Tensor], vision_heads: int = 16, text_heads: int = 16
) -> tuple[Any, dict[str, Tensor]]:
    """(transformers CLIPConfig, CLIPModel state dict) of an OpenCLIP CLIP state dict."""
    from transformers import CLIPConfig

    v_width, _, patch, _ = state["visual.conv1.weight"].shape  # [W, 3, p, p]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    vocab, t_width = state["token_embedding.weight"].shape
    v_layers = _blocks(state, "visual.transformer.resblocks.")
    t_layers = _blocks(state, "transformer.resblocks.")
    config = CLIPConfig(
        projection_dim=state["visual.proj"].shape[1],
        logit_scale_init_value=float(state["logit_scale"]),
        vision_config=dict(
            hidden_size=v_width, num_hidden_layers=v_layers, num_attention_heads=vision_heads,
            intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            patch_size=patch, image_size=grid * patch, hidden_act="gelu", layer_norm_eps=1e-5,
        ),
        text_config=dict(
            vocab_size=vocab, hidden_size=t_width, num_hidden_layers=t_layers,
            num_attention_heads=text_heads,
            intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            max_position_embeddings=state["positional_embedding"].shape[0], hidden_act="gelu",
            layer_norm_eps=1e-5, bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=1,
        ),
    )  # fmt: skip
    out = {
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].t(),  # [D, W]
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "text_model.final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].t(),  # [D, W]
        "logit_scale": state["logit_scale"].reshape(()),
        **_layers(state, "visual.transformer.resblocks.", "vision_model.encoder.layers.", v_layers),
        **_layers(state, "transformer.resblocks.", "text_model.encoder.layers.", t_layers),
    }
    return config, {k: v.contiguous() for k, v in out.items()}


def convert_openclip(
    checkpoint: str | Path,
    out: str | Path,
    processor: str | Path | None = None,
    vision_heads: int = 16,
    text_heads: int = 16,
) -> Path:
    """Write the CLIPModel folder of an OpenCLIP checkpoint (weights loaded strictly: every key
    used, none missing), with the processor files of a local CLIP processor folder."""
    from transformers import CLIPModel

    state = read_checkpoint(checkpoint)
    config, weights = openclip_to_clip(state, vision_heads, text_heads)
    model = CLIPModel(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if processor is not None:
        src = Path(processor)
        if not any(
            (src / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")
        ):
            raise FileNotFoundError(
                f"{str(src)!r} has no preprocessor_config.json or processor_config.json (a CLIP "
                "processor folder)"
            )
        for name in PROCESSOR_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
    (out / "converted_from.json").write_text(
        json.dumps({"checkpoint": str(checkpoint), "format": "openclip"}, indent=2)
    )
    return out
