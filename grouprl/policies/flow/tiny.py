"""Tiny random diffusers models, text encoders and tokenizers built in code (tests and demos).

Sizes follow diffusers' own pipeline tests (SD3, FLUX, SD 1.x, Wan; see shared/peers/diffusion.md),
so every model here runs a forward in milliseconds on a CPU. Nothing is downloaded: the CLIP and T5
tokenizers are built from an in-code vocabulary with the `tokenizers`-backed transformers classes
(one token per character; CLIP marks a word's last character with "</w>", T5 a word's first with
"\u2581"), and the text encoders get random weights from a config. Every builder takes a seed and
leaves the global RNG untouched.

  tiny_sd3_transformer / tiny_flux_transformer / tiny_wan_transformer / tiny_unet
  tiny_vae(latent_channels) (AutoencoderKL, one block: vae_scale_factor 1) / tiny_wan_vae
  tiny_clip_tokenizer / tiny_t5_tokenizer / tiny_clip_encoder / tiny_t5_encoder
  tiny_text_components(family) -> the text-encoder / tokenizer kwargs of that family's pipeline
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch

_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def tiny_sd3_transformer(seed: int = 0, sample_size: int = 32) -> Any:
    from diffusers import SD3Transformer2DModel

    return _seeded(seed, lambda: SD3Transformer2DModel(
        sample_size=sample_size, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4,
    ))  # fmt: skip


def tiny_flux_transformer(seed: int = 0, guidance_embeds: bool = False) -> Any:
    from diffusers import FluxTransformer2DModel

    return _seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8], guidance_embeds=guidance_embeds,
    ))  # fmt: skip


def tiny_wan_transformer(seed: int = 0) -> Any:
    from diffusers import WanTransformer3DModel

    return _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ))  # fmt: skip


def tiny_unet(seed: int = 0) -> Any:
    from diffusers import UNet2DConditionModel

    return _seeded(seed, lambda: UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=8,
        norm_num_groups=2,
    ))  # fmt: skip


def tiny_vae(latent_channels: int = 4, seed: int = 0, sd3_factors: bool = True) -> Any:
    """AutoencoderKL with one block (latents at the image resolution); SD3's shift/scale factors
    when sd3_factors, else SD 1.x's (scaling 0.18215, no shift)."""
    from diffusers import AutoencoderKL

    factors = (
        {"shift_factor": 0.0609, "scaling_factor": 1.5035, "use_quant_conv": False,
         "use_post_quant_conv": False}
        if sd3_factors else {"scaling_factor": 0.18215}
    )  # fmt: skip
    return _seeded(seed, lambda: AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=1, **factors,
    ))  # fmt: skip


def tiny_wan_vae(seed: int = 0) -> Any:
    from diffusers import AutoencoderKLWan

    return _seeded(seed, lambda: AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ))  # fmt: skip


# ---- tokenizers and text encoders --------------------------------------------------------------


def tiny_clip_tokenizer(max_length: int = 77) -> Any:
    """CLIP-style tokenizer: <|startoftext|> text <|endoftext|>, lower-cased like CLIP, one token per
    character (no merges), padded with <|endoftext|> to `max_length` by the pipelines."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        for piece in (c, c + "</w>"):
            vocab.setdefault(piece, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_t5_tokenizer() -> Any:
    """T5-style unigram tokenizer over single characters (ids: <pad> 0, </s> 1, <unk> 2)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in _CHARS] + [("\u2581" + c, -2.5) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_clip_encoder(
    tokenizer: Any, hidden_size: int = 32, projection_dim: int | None = 32, seed: int = 0
) -> Any:
    """CLIPTextModelWithProjection (projection_dim set) or CLIPTextModel, sized to `tokenizer`."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=37,
        num_attention_heads=4 if hidden_size % 4 == 0 else 2, num_hidden_layers=2,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=projection_dim or 32,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, hidden_act="gelu",
    )  # fmt: skip
    cls = CLIPTextModelWithProjection if projection_dim else CLIPTextModel
    return _seeded(seed, lambda: cls(config))


def tiny_t5_encoder(tokenizer: Any, d_model: int = 32, umt5: bool = False, seed: int = 0) -> Any:
    """T5EncoderModel (or UMT5EncoderModel for Wan) sized to `tokenizer`."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kwargs = dict(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_ff=37,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    if umt5:
        return _seeded(seed, lambda: UMT5EncoderModel(UMT5Config(**kwargs)))
    return _seeded(seed, lambda: T5EncoderModel(T5Config(**kwargs)))


def tiny_text_components(family: str, seed: int = 0) -> dict[str, Any]:
    """Text encoders and tokenizers of `family`'s diffusers pipeline, as constructor kwargs:
    sd3 (CLIP-L, CLIP-G with projection, T5), flux (CLIP, T5), wan (UMT5), unet (CLIP, hidden 8)."""
    clip, t5 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    if family == "sd3":
        return {
            "tokenizer": clip, "text_encoder": tiny_clip_encoder(clip, seed=seed),
            "tokenizer_2": tiny_clip_tokenizer(),
            "text_encoder_2": tiny_clip_encoder(clip, seed=seed + 1),
            "tokenizer_3": t5, "text_encoder_3": tiny_t5_encoder(t5, seed=seed + 2),
        }  # fmt: skip
    if family == "flux":
        return {
            "tokenizer": clip, "text_encoder": tiny_clip_encoder(clip, projection_dim=None, seed=seed),
            "tokenizer_2": t5, "text_encoder_2": tiny_t5_encoder(t5, seed=seed + 1),
        }  # fmt: skip
    if family == "wan":
        return {"tokenizer": t5, "text_encoder": tiny_t5_encoder(t5, umt5=True, seed=seed)}
    if family == "unet":
        encoder = tiny_clip_encoder(clip, hidden_size=8, projection_dim=None, seed=seed)
        return {"tokenizer": clip, "text_encoder": encoder}
    raise ValueError(f"unknown family {family!r}; allowed: ['flux', 'sd3', 'unet', 'wan']")
