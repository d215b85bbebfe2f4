"""Tiny random-weight replicas of the vision-language (image-text-to-text) families.

Each builder writes, in code and with no download, a folder laid out as the hub download of the
real Instruct model: config.json (the real architecture class, the vision tower's settings, the
image / vision token ids, mrope), generation_config.json, model.safetensors, the tokenizer files of
the text replica of the same family (replicas/text.py: the family's tokenizer class, its special
tokens in the real order), preprocessor_config.json (the real image processor and its settings)
and chat_template.json (the processor's chat template, as these hub folders ship it; the same
template is in tokenizer_config.json). Only sizes are shrunk: a 2-layer vision tower of width 64
and the text replicas' 2-layer decoder of width 64.

  qwen2-vl  Qwen2VLForConditionalGeneration as Qwen2-VL-2B-Instruct: patch 14, temporal patch 2,
            2x2 spatial merge, mrope with the real section proportions (16:24:24 of the rotary
            half, here 4:6:6 of head_dim 32 / 2), tied embeddings, Qwen2VLImageProcessor with the
            real min / max pixels and CLIP mean / std, ChatML with <|vision_start|><|image_pad|>
            <|vision_end|> for each image item (chat_templates.QWEN2_VL).

  qwen2.5-vl  Qwen2_5_VLForConditionalGeneration as Qwen2.5-VL-3B-Instruct: the same tokenizer,
            image processor settings and chat template as qwen2-vl (the hub folder's
            chat_template.json is Qwen2-VL's), a vision tower with window attention (112 px
            windows, full attention in the last block, as in the last of every 8 of the real
            32), RMSNorm and a SwiGLU MLP, out_hidden_size = the decoder width, generation
            config with temperature 0.1 and repetition penalty 1.05.
  llava     LlavaForConditionalGeneration as llava-hf/llava-1.5-7b-hf: a CLIPVisionModel tower
            (quick_gelu, pre-LayerNorm), a 2-layer GELU projector, a Llama decoder (no grouped
            query attention, untied head, rope theta 1e4), float16 as the real folder; Llama 2's
            sentencepiece-style tokenizer (<unk> 0, <s> 1, </s> 2, byte fallback, BOS added) with
            <image> and <pad> appended and the embedding padded to a multiple of 64;
            CLIPImageProcessor (shortest edge + centre crop, CLIP mean / std), the
            LlavaProcessor's processor_config.json (patch 14, one CLS token); LLaVA-1.5's
            "USER: <image>\\n... ASSISTANT:" template (chat_templates.LLAVA15). Each <image> stands
            for image_seq_length = (image_size / patch)^2 features (CLS dropped, layer -2;
            the tower has 3 layers so that layer -2 is a transformer layer).

Deviations (all of size, none of kind): tiny vocabulary and widths; LLaVA's image side is 56 px
(16 image tokens) instead of 336 px (576); no video processor config
(Qwen2VLVideoProcessor needs torchvision, which this project cannot install beside its torch;
the image path is unchanged, and video inputs are not used by grouprl).

`VISION_REPLICAS` maps each family to its builder `fn(out_dir) -> out_dir` (replicas/__init__.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grouprl.replicas.chat_templates import LLAVA15, QWEN2_VL
from grouprl.replicas.text import (
    BPE_VOCAB,
    QWEN25_ADDED,
    SEED,
    TINY_DECODER,
    _train_bpe,
    qwen_tokenizer,
    save_replica,
    write_vocab_files,
)

# Qwen2-VL's tokenizer has Qwen2.5's added tokens up to <|video_pad|> (the tool-call and
# fill-in-the-middle markers came with Qwen2.5)
QWEN2_VL_ADDED = QWEN25_ADDED[: [t for t, _ in QWEN25_ADDED].index("<|video_pad|>") + 1]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _write_processor_files(out: Path, image_processor: dict, template: str) -> None:
    """preprocessor_config.json and chat_template.json as the hub folders of these models have
    them; the template also stays in tokenizer_config.json (the tokenizer's own)."""
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))


def build_qwen2_vl(
    out: Path | str, *, text_sizes: dict | None = None, vision_sizes: dict | None = None
) -> Path:
    """Qwen2-VL-2B-Instruct (Qwen2VLForConditionalGeneration, ChatML with image items).
    text_sizes / vision_sizes: other widths and depths for the text decoder / vision tower (the
    VLM demo's model is this replica, grown), e.g. {"hidden_size": 128, "num_hidden_layers": 4};
    the vision tower's output width follows the decoder's."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(QWEN2_VL_ADDED, QWEN2_VL)
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in QWEN2_VL_ADDED}
    eot, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    sizes = {**TINY_DECODER, **(text_sizes or {})}
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]  # 32 in the replica
    text = dict(
        vocab_size=len(tok), max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
        use_sliding_window=False, sliding_window=32768, max_window_layers=2, attention_dropout=0.0,
        bos_token_id=eot, eos_token_id=eos, tie_word_embeddings=True,
        # mrope: temporal / height / width sections of the rotary half (real 16, 24, 24 of 64)
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
        **sizes,
    )  # fmt: skip
    vision = {
        **dict(depth=2, embed_dim=64, hidden_act="quick_gelu", mlp_ratio=2, num_heads=2,
               in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        **(vision_sizes or {}),
        "hidden_size": sizes["hidden_size"],
    }  # fmt: skip
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=eot, eos_token_id=eos,
        tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(cfg)
    gen = dict(
        bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True,
        temperature=0.01, top_p=0.001, top_k=1,
    )  # fmt: skip  # Qwen2-VL-2B-Instruct's generation_config
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    _write_processor_files(
        out,
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "min_pixels": 56 * 56,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },  # fmt: skip
        QWEN2_VL,
    )
    return out


def build_qwen2_5_vl(
    out: Path | str, *, text_sizes: dict | None = None, vision_sizes: dict | None = None
) -> Path:
    """Qwen2.5-VL-3B-Instruct (Qwen2_5_VLForConditionalGeneration, window-attention tower).
    The Qwen2-VL layout with the Qwen2.5-VL vision tower: window attention with full attention in
    the last block of each group, RMSNorm, SwiGLU MLP, its own output width `out_hidden_size` =
    the decoder's width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out = Path(out)
    tok, vocab, merges = qwen_tokenizer(QWEN2_VL_ADDED, QWEN2_VL)
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in QWEN2_VL_ADDED}
    eot, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    sizes = {**TINY_DECODER, **(text_sizes or {})}
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]  # 32 in the replica
    text = dict(
        vocab_size=len(tok), max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
        use_sliding_window=False, sliding_window=32768, max_window_layers=2, attention_dropout=0.0,
        bos_token_id=eot, eos_token_id=eos, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
        **sizes,
    )  # fmt: skip
    # real: depth 32, width 1280, SwiGLU 3420, 16 heads, full attention in blocks 7, 15, 23, 31
    # (the last of each 8), window 112 px = 4x4 merged patches
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=172, num_heads=2, hidden_act="silu",
        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        tokens_per_second=2, window_size=112, fullatt_block_indexes=[1], **(vision_sizes or {}),
        out_hidden_size=sizes["hidden_size"],
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=eot, eos_token_id=eos,
        tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    gen = dict(
        bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True,
        temperature=0.1, top_p=0.001, top_k=1, repetition_penalty=1.05,
    )  # fmt: skip  # Qwen2.5-VL-3B-Instruct's generation_config
    save_replica(model, tok, gen, out, torch.bfloat16)
    write_vocab_files(out, vocab, merges)
    _write_processor_files(
        out,
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "min_pixels": 56 * 56,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
        },  # fmt: skip
        QWEN2_VL,
    )
    return out


def _llama2_tokenizer() -> Any:
    """LLaVA-1.5's tokenizer (Vicuna's, i.e. Llama 2's): sentencepiece-style BPE with byte
    fallback; <unk> 0, <s> 1, </s> 2, the 256 byte tokens, the learned pieces; then LLaVA's
    additions <image> and <pad> (ids 32000 / 32001 in the real one), BOS added, EOS not."""
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import LlamaTokenizer

    learned, merges = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        BPE_VOCAB,
        byte_level=False,
    )
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    tok = LlamaTokenizer(
        vocab=vocab, merges=merges, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        add_bos_token=True, add_eos_token=False, legacy=False,
        model_max_length=1000000000000000019884624838656,
    )  # fmt: skip
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.chat_template = LLAVA15
    return tok


def build_llava(
    out: Path | str, *, text_sizes: dict | None = None, vision_sizes: dict | None = None
) -> Path:
    """llava-hf/llava-1.5-7b-hf (LlavaForConditionalGeneration, CLIP tower + Llama decoder).
    As the real one: a CLIP ViT-L/14-336 tower, a 2-layer GELU projector, the Vicuna-7B Llama
    decoder; each <image> is expanded to the image's patch count (the CLS feature dropped:
    vision_feature_select_strategy "default"; features of the layer before last:
    vision_feature_layer -2); float16 as the real folder."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out = Path(out)
    tok = _llama2_tokenizer()
    image_size, patch = 56, 14  # real 336 / 14 -> 576 image tokens; here 16
    vocab_size = -(-len(tok) // 64) * 64  # the real embedding is padded to 32064 (a multiple of 64)
    image_id, pad_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<pad>")
    text = dict(
        vocab_size=vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **{**TINY_DECODER, "num_key_value_heads": TINY_DECODER["num_attention_heads"]},
        **(text_sizes or {}),
    )  # fmt: skip  # Llama 2 has no grouped-query attention at 7B
    vision = dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
        image_size=image_size, patch_size=patch, projection_dim=64, hidden_act="quick_gelu",
        layer_norm_eps=1e-5, vocab_size=32000, **(vision_sizes or {}),
    )  # fmt: skip  # real: width 1024, 24 layers, 16 heads, projection 768
    cfg = LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=image_id,
        image_seq_length=(image_size // patch) ** 2, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        tie_word_embeddings=False, dtype="float16",
    )  # fmt: skip
    cfg.pad_token_id = pad_id
    cfg.text_config.model_type = "llama"
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(cfg)
    gen = dict(bos_token_id=1, eos_token_id=2, pad_token_id=pad_id)
    save_replica(model, tok, gen, out, torch.float16, "LlamaTokenizer")
    crop = {"height": image_size, "width": image_size}
    _write_processor_files(
        out,
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": image_size},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": crop,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },  # fmt: skip
        LLAVA15,
    )
    # the processor's own settings (LlavaProcessor: 16 + 1 CLS - 1 dropped = 16 <image> tokens)
    processor = {
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
        "patch_size": patch,
        "processor_class": "LlavaProcessor",
        "vision_feature_select_strategy": "default",
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return out


VISION_REPLICAS: dict[str, Callable[[Path | str], Path]] = {
    "qwen2-vl": build_qwen2_vl,
    "qwen2.5-vl": build_qwen2_5_vl,
    "llava": build_llava,
}
