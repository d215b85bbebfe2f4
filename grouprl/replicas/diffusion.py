"""Tiny random-weight replicas of the image / video model families the shipped configs name.

Each builder writes, in code and with nothing downloaded, a diffusers pipeline folder laid out as
the hub download is (model_index.json, scheduler/, text_encoder*/, tokenizer*/, transformer/ or
unet/, vae/, ...), with the real component classes, the real scheduler config and the real VAE
factors; only widths, depths and vocabularies are shrunk (each folder is well under 5 MB and
builds in a few seconds). Weights are random (seeded, so a folder is the same on every build).

  sd3.5-medium    stabilityai/stable-diffusion-3.5-medium (StableDiffusion3Pipeline):
                  SD3Transformer2DModel (patch 2, 16 latent channels, qk_norm rms_norm, dual
                  attention in the first layers as SD3.5's MMDiT-X), AutoencoderKL (16 latent
                  channels, scaling_factor 1.5305, shift_factor 0.0609, no quant convs, 4 levels:
                  vae_scale_factor 8), FlowMatchEulerDiscreteScheduler (1000 steps, shift 3.0),
                  CLIPTextModelWithProjection x2 (CLIP-L: quick_gelu; CLIP-G: gelu) with CLIPTokenizer
                  files (vocab.json / merges.txt, CLIP-G's pad token "!"), T5EncoderModel (gated-gelu,
                  32 / 128 relative-attention buckets) + T5TokenizerFast (sentencepiece unigram,
                  100 extra ids, model_max_length 512). Pooled projections = CLIP-L + CLIP-G widths;
                  joint attention = T5 width, wider than both CLIPs (the pipeline pads them).
  flux.1-dev      black-forest-labs/FLUX.1-dev (FluxPipeline): FluxTransformer2DModel
                  (in_channels 64 = 16 latent channels in 2x2 patches, guidance_embeds True, RoPE
                  axes summing to the head width), AutoencoderKL (scaling_factor 0.3611,
                  shift_factor 0.1159, no quant convs), FlowMatchEulerDiscreteScheduler with
                  use_dynamic_shifting True, base_shift 0.5, max_shift 1.15, base_image_seq_len 256,
                  max_image_seq_len 4096, shift 3.0; CLIPTextModel (CLIP-L) + CLIPTokenizer,
                  T5EncoderModel + T5TokenizerFast.
  flux.1-schnell  black-forest-labs/FLUX.1-schnell: as FLUX.1-dev with guidance_embeds False and
                  the scheduler's use_dynamic_shifting False, shift 1.0.
  wan2.1-t2v      Wan-AI/Wan2.1-T2V-1.3B-Diffusers (WanPipeline): WanTransformer3DModel (patch
                  (1, 2, 2), cross_attn_norm, qk_norm rms_norm_across_heads, eps 1e-6),
                  AutoencoderKLWan (z_dim 16, temporal downsampling [False, True, True]: 4x in time,
                  8x in space; Wan's latents_mean / latents_std), UniPCMultistepScheduler
                  (prediction_type flow_prediction, use_flow_sigmas True, flow_shift 3.0, solver_order
                  2, bh2, linspace spacing, final_sigmas_type zero), UMT5EncoderModel + T5TokenizerFast.
  wan2.2-t2v-a14b Wan-AI/Wan2.2-T2V-A14B-Diffusers (WanPipeline with two experts): `transformer`
                  (high noise) and `transformer_2` (low noise), two WanTransformer3DModel of one
                  config (in_channels 16, as Wan 2.1 14B's blocks) with different weights;
                  model_index.json boundary_ratio 0.875 (Wan 2.2's t2v-A14B switch point) and
                  expand_timesteps false; Wan 2.1's VAE (z_dim 16, 8x / 4x) and the UniPC flow
                  scheduler and UMT5 text side of wan2.1-t2v.
  wan2.2-ti2v-5b  Wan-AI/Wan2.2-TI2V-5B-Diffusers (WanPipeline, one transformer): in_channels 48,
                  model_index.json expand_timesteps true (timesteps per latent token), boundary_ratio
                  null; the Wan 2.2 VAE: AutoencoderKLWan z_dim 48, is_residual, patch_size 2
                  (in / out channels 12), scale_factor_spatial 16, scale_factor_temporal 4, the
                  real 48-channel latents_mean / latents_std; UniPC flow scheduler with flow_shift
                  5.0 (Wan 2.2 TI2V's sample_shift).
  flux.1-kontext-dev  black-forest-labs/FLUX.1-Kontext-dev (FluxKontextPipeline): the FLUX.1-dev
                  components and scheduler under the Kontext pipeline class (the reference image's
                  latents join the sequence at run time; nothing in the folder differs but the
                  class, as on the hub).
  sd1.5           stable-diffusion-v1-5/stable-diffusion-v1-5 (StableDiffusionPipeline):
                  UNet2DConditionModel (3 CrossAttnDownBlock2D + DownBlock2D, UpBlock2D + 3
                  CrossAttnUpBlock2D, 4 latent channels), AutoencoderKL (scaling_factor 0.18215, quant
                  convs, vae_scale_factor 8), PNDMScheduler (scaled_linear betas 0.00085 - 0.012,
                  skip_prk_steps True, set_alpha_to_one False, steps_offset 1), CLIPTextModel
                  (quick_gelu) + CLIPTokenizer, StableDiffusionSafetyChecker + CLIPImageProcessor
                  (224 crop, bicubic, CLIP mean / std), requires_safety_checker True.
  sdxl            stabilityai/stable-diffusion-xl-base-1.0 (StableDiffusionXLPipeline):
                  UNet2DConditionModel (DownBlock2D + 2 CrossAttnDownBlock2D and the mirror ups,
                  linear projections, transformer depth growing with the level as [1, 2, 10]
                  (here [1, 1, 2]), addition_embed_type "text_time": 6 micro-conditioning time ids
                  x addition_time_embed_dim + CLIP-G's projection_dim =
                  projection_class_embeddings_input_dim, cross_attention_dim = CLIP-L + CLIP-G
                  widths), CLIPTextModel (CLIP-L, quick_gelu) + CLIPTextModelWithProjection
                  (CLIP-G, gelu, its own projection_dim), CLIPTokenizer x2 (CLIP-G's pad "!"),
                  AutoencoderKL (scaling_factor 0.13025, force_upcast), EulerDiscreteScheduler
                  (scaled_linear 0.00085 - 0.012, epsilon, leading spacing, steps_offset 1),
                  force_zeros_for_empty_prompt True, add_watermarker null (as the hub's
                  model_index.json).
  sana-1.6b       Efficient-Large-Model/Sana_1600M_1024px_diffusers (SanaPipeline):
                  SanaTransformer2DModel (32 latent channels, patch 1, linear self-attention and
                  cross-attention heads of their own, mlp_ratio 2.5, no elementwise-affine norms,
                  timestep_scale 1), AutoencoderDC as dc-ae-f32c32-sana-1.0 (6 levels: 32x spatial
                  compression, ResBlock x3 then EfficientViTBlock x3 with multiscale 5, conv
                  down / interpolate up, batch-norm / relu then rms-norm / silu decoder levels,
                  scaling_factor 0.41407), Gemma2Model (gemma-2-2b-it's kind: soft-capping 30 / 50,
                  gelu_pytorch_tanh, sliding window, query_pre_attn_scalar = head_dim) with
                  GemmaTokenizerFast (pad 0, eos 1, bos 2, unk 3, mask 4, 256 byte-fallback pieces,
                  "▁"-joined BPE, BOS added, right padding), DPMSolverMultistepScheduler in flow
                  mode (dpmsolver++, order 2, midpoint, flow_prediction, use_flow_sigmas,
                  flow_shift 3.0).
  qwen-image      Qwen/Qwen-Image (QwenImagePipeline): QwenImageTransformer2DModel (2x2 patches:
                  in_channels 64 = 16 latent channels x 4, joint_attention_dim = the text encoder
                  width, RoPE axes summing to the head width), AutoencoderKLQwenImage (Wan's causal
                  VAE kind: z_dim 16, temporal downsampling [False, True, True], 8x spatial,
                  Qwen-Image's latents_mean / latents_std), FlowMatchEulerDiscreteScheduler
                  (dynamic shifting 0.5 -> 0.9 over 256 -> 8192 tokens, exponential time shift,
                  shift_terminal 0.02), Qwen2_5_VLForConditionalGeneration (Qwen2.5-VL-7B-Instruct's
                  kind: replicas.vision's Qwen2.5-VL settings, untied head) + Qwen2Tokenizer (Qwen's
                  pre-tokenizer and added tokens, vocab.json / merges.txt), all bfloat16 as the hub
                  folder. The tokenizer's merges are learned with the pipeline's system prompt, so
                  the prompt template's prefix is the 34 tokens the pipeline drops
                  (prompt_template_encode_start_idx), one per word as with Qwen's vocabulary.
  pickscore       yuvalkirstain/PickScore_v1 with the processor of laion/CLIP-ViT-H-14 (one folder
                  for both, the `pickscore` reward's `model` and `processor`): CLIPModel (gelu,
                  patch 14 at 224, logit_scale 4.6052 as PickScore's trained value), CLIPProcessor
                  (CLIPImageProcessor 224, CLIPTokenizer with pad "!").
  clip-vit-large-patch14  openai/clip-vit-large-patch14 (the `clip_score` reward's default):
                  CLIPModel (quick_gelu, patch 14 at 224, logit_scale 2.6592), CLIPProcessor.

Deviations, all of size: 2 transformer / text-encoder / UNet-level layers (FLUX: one double and one single
block), widths of 32-96, byte-level BPE vocabularies of ~600 tokens trained with `tokenizers`, a
sentencepiece unigram of a few hundred pieces trained with `sentencepiece` for T5 / UMT5 (UMT5's
real vocabulary is multilingual, 256k pieces), and VAEs of 8 channels per level. model_index.json
names the tokenizer classes as the hub folders do (T5TokenizerFast; transformers 5 makes it the
same class as T5Tokenizer). SANA's Gemma vocabulary is ~750 pieces (real 256k) and its DC-AE has
widths 8 - 32 (the last level a multiple of the 32 latent channels, which its shortcuts need); the
SDXL and SANA folders are float32 (the SDXL hub folder's main weights are; SANA's ships float16 /
bfloat16 variants).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grouprl.replicas.bpe import write_clip_bpe

SEED = 0
CLIP_MERGES = 300  # learned merges of the tiny CLIP vocabularies
T5_PIECES = 400  # sentencepiece vocabulary of the tiny T5 / UMT5 tokenizers (before extra ids)

# captions: the replicas' tokenizers learn their merges / pieces from these (and every ASCII
# character is in them, so ordinary prompts tokenize without unknown pieces)
CORPUS = [
    "a red bicycle leaning against a brick wall", "two cups of coffee on a wooden table",
    "a lighthouse on a cliff at sunset", "a corgi wearing sunglasses on the beach",
    "a bowl of ramen with a soft-boiled egg", "an astronaut riding a horse on the moon",
    "a watercolor painting of a fox in a snowy forest", "a cat, a dog, a horse and a rabbit",
    "an owl, a turtle, a fox and a goat in a green field", "a red circle next to a blue square",
    "a yellow triangle above a green circle", "a photo of a city street at night, neon lights",
    "A Portrait Of An Old Man, 85mm, f/1.8, Studio Lighting; highly detailed (8k) #art @home",
    "close-up of 3 apples & 2 pears: 50% off! [sale] {fresh} <new> 'ripe' \"sweet\" ~ $9.99 * 4",
    "0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz !#$%&()*+,-./:;<=>?@[]^_`{|}~",
    "a video of waves crashing on rocks, slow motion, cinematic",
]  # fmt: skip


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    """build() under torch seed `seed`, leaving the global RNG as it was; eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


# ---- tokenizers ---------------------------------------------------------------------------------


def clip_tokenizer(pad_token: str = "<|endoftext|>") -> Any:
    """CLIPTokenizer from CLIP-layout vocab.json / merges.txt (bpe.write_clip_bpe), 77 tokens."""
    import tempfile

    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_clip_bpe(tmp, CORPUS * 4, CLIP_MERGES)
        # from_pretrained reads the two files (the constructor's vocab_file is not read in
        # transformers 5)
        tok = CLIPTokenizer.from_pretrained(tmp, pad_token=pad_token, model_max_length=77)
        tok._grouprl_files = {n: Path(tmp, n).read_bytes() for n in ("vocab.json", "merges.txt")}
    return tok


def _spiece_model(byte_fallback: bool = False) -> bytes:
    """A sentencepiece unigram model with T5's settings (pad 0, eos 1, unk 2, no bos, NFKC)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 8), model_writer=out, vocab_size=T5_PIECES,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
        byte_fallback=byte_fallback, hard_vocab_limit=False, normalization_rule_name="nmt_nfkc",
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    return out.getvalue()


def t5_tokenizer(byte_fallback: bool = False) -> Any:
    """T5TokenizerFast over a tiny sentencepiece unigram model, 100 extra ids, 512 tokens."""
    import tempfile

    from transformers import T5TokenizerFast

    spiece = _spiece_model(byte_fallback)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "spiece.model").write_bytes(spiece)
        tok = T5TokenizerFast.from_pretrained(tmp, extra_ids=100, model_max_length=512)
    tok._grouprl_files = {"spiece.model": spiece}  # saved beside tokenizer.json, as on the hub
    return tok


# ---- text encoders ------------------------------------------------------------------------------


def _clip_text_config(tok: Any, hidden: int, act: str, projection: int | None = None) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, hidden_act=act,
        projection_dim=projection or hidden, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip


def clip_text_encoder(tok: Any, hidden: int, act: str, *, projection: bool, seed: int) -> Any:
    """CLIPTextModelWithProjection (SD3) or CLIPTextModel (FLUX, SD 1.5) sized to `tok`."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return _seeded(seed, lambda: cls(_clip_text_config(tok, hidden, act)))


def t5_encoder(tok: Any, d_model: int, *, umt5: bool, seed: int) -> Any:
    """T5EncoderModel (T5 v1.1 XXL's kind: gated-gelu, no tied head) or UMT5EncoderModel (Wan)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    kw = dict(
        vocab_size=len(tok), d_model=d_model, d_ff=2 * d_model, d_kv=16, num_layers=2,
        num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.1,
    )  # fmt: skip
    if umt5:
        return _seeded(seed, lambda: UMT5EncoderModel(UMT5Config(**kw)))
    return _seeded(seed, lambda: T5EncoderModel(T5Config(**kw)))


# ---- VAEs ---------------------------------------------------------------------------------------


def kl_vae(latent_channels: int, seed: int, **factors: Any) -> Any:
    """AutoencoderKL with 4 levels (vae_scale_factor 8, as the real ones) of 8 channels."""
    from diffusers import AutoencoderKL

    blocks = 4
    return _seeded(seed, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks, block_out_channels=(8,) * blocks,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, sample_size=64,
        **factors,
    ))  # fmt: skip


SD3_VAE = {"scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False,
           "use_post_quant_conv": False}  # fmt: skip
FLUX_VAE = {"scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
            "use_post_quant_conv": False}  # fmt: skip
SD15_VAE = {"scaling_factor": 0.18215}


# ---- saving -------------------------------------------------------------------------------------


def _save(pipe: Any, folder: Path, tokenizer_classes: dict[str, str]) -> Path:
    """save_pretrained, then the hub's names for the tokenizer classes and CLIP's vocab files."""
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, cls in tokenizer_classes.items():
        index[name] = ["transformers", cls]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for name in tokenizer_classes:
        tok = getattr(pipe, name)
        for fname, data in getattr(tok, "_grouprl_files", {}).items():
            (folder / name / fname).write_bytes(data)  # vocab.json / merges.txt, spiece.model
    return folder


# ---- the families -------------------------------------------------------------------------------


def build_sd35_medium(folder: str | Path) -> Path:
    """SD3.5 Medium replica (module docstring)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    tok_l, tok_g, tok_t5 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()
    clip_l, clip_g, t5_dim = 32, 48, 96  # real: 768, 1280, 4096
    transformer = _seeded(SEED, lambda: SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=t5_dim,
        caption_projection_dim=32, pooled_projection_dim=clip_l + clip_g, pos_embed_max_size=32,
        qk_norm="rms_norm", dual_attention_layers=(0,),
    ))  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=kl_vae(16, SEED + 1, **SD3_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        tokenizer=tok_l, text_encoder=clip_text_encoder(tok_l, clip_l, "quick_gelu",
                                                        projection=True, seed=SEED + 2),
        tokenizer_2=tok_g, text_encoder_2=clip_text_encoder(tok_g, clip_g, "gelu",
                                                            projection=True, seed=SEED + 3),
        tokenizer_3=tok_t5, text_encoder_3=t5_encoder(tok_t5, t5_dim, umt5=False, seed=SEED + 4),
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer",
                                      "tokenizer_3": "T5TokenizerFast"})  # fmt: skip


FLUX_DEV_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}  # fmt: skip
FLUX_SCHNELL_SCHEDULER = {**FLUX_DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


def _flux(folder: str | Path, guidance_embeds: bool, scheduler: dict) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tok_l, tok_t5 = clip_tokenizer(), t5_tokenizer()
    clip_l, t5_dim = 32, 96  # real: 768, 4096
    transformer = _seeded(SEED, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=t5_dim, pooled_projection_dim=clip_l,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
    ))  # fmt: skip
    pipe = FluxPipeline(
        transformer=transformer, vae=kl_vae(16, SEED + 1, **FLUX_VAE),
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        tokenizer=tok_l, text_encoder=clip_text_encoder(tok_l, clip_l, "quick_gelu",
                                                        projection=False, seed=SEED + 2),
        tokenizer_2=tok_t5, text_encoder_2=t5_encoder(tok_t5, t5_dim, umt5=False, seed=SEED + 3),
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "CLIPTokenizer",
                                      "tokenizer_2": "T5TokenizerFast"})  # fmt: skip


def build_flux_dev(folder: str | Path) -> Path:
    """FLUX.1-dev replica (module docstring)."""
    return _flux(folder, True, FLUX_DEV_SCHEDULER)


def build_flux_schnell(folder: str | Path) -> Path:
    """FLUX.1-schnell replica (module docstring)."""
    return _flux(folder, False, FLUX_SCHNELL_SCHEDULER)


WAN_SCHEDULER = {
    "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
    "lower_order_final": True, "timestep_spacing": "linspace", "final_sigmas_type": "zero",
    "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear", "steps_offset": 0,
}  # fmt: skip


def build_wan21_t2v(folder: str | Path) -> Path:
    """Wan 2.1 T2V 1.3B replica (module docstring)."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    tok = t5_tokenizer()
    t5_dim = 96  # real: 4096
    transformer = _seeded(SEED, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=t5_dim, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
    ))  # fmt: skip
    vae = _seeded(SEED + 1, lambda: AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ))  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tok, text_encoder=t5_encoder(tok, t5_dim, umt5=True, seed=SEED + 2),
        transformer=transformer, vae=vae, scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER),
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "T5TokenizerFast"})


def _wan_transformer(in_channels: int, seed: int) -> Any:
    from diffusers import WanTransformer3DModel

    return _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=in_channels, out_channels=in_channels, text_dim=96, freq_dim=256, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=32,
    ))  # fmt: skip


def build_wan22_t2v_a14b(folder: str | Path) -> Path:
    """Wan 2.2 T2V A14B replica: two experts and the boundary (module docstring)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    tok = t5_tokenizer()
    vae = _seeded(SEED + 1, lambda: AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ))  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tok, text_encoder=t5_encoder(tok, 96, umt5=True, seed=SEED + 2),
        transformer=_wan_transformer(16, SEED), transformer_2=_wan_transformer(16, SEED + 5),
        vae=vae, scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER), boundary_ratio=0.875,
        expand_timesteps=False,
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "T5TokenizerFast"})


# Wan 2.2's VAE (z_dim 48) per-channel latent statistics, as its vae/config.json
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip


def build_wan22_ti2v_5b(folder: str | Path) -> Path:
    """Wan 2.2 TI2V 5B replica: 48-channel latents, expanded timesteps (module docstring)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    tok = t5_tokenizer()
    vae = _seeded(SEED + 1, lambda: AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD,
    ))  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tok, text_encoder=t5_encoder(tok, 96, umt5=True, seed=SEED + 2),
        transformer=_wan_transformer(48, SEED), vae=vae,
        scheduler=UniPCMultistepScheduler(**{**WAN_SCHEDULER, "flow_shift": 5.0}),
        expand_timesteps=True,
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "T5TokenizerFast"})


def build_flux_kontext_dev(folder: str | Path) -> Path:
    """FLUX.1 Kontext [dev] replica (module docstring): FLUX.1-dev's parts, Kontext's class."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    path = _flux(folder, True, FLUX_DEV_SCHEDULER)
    pipe = FluxPipeline.from_pretrained(path)
    kontext = FluxKontextPipeline(**pipe.components)
    return _save(kontext, Path(folder), {"tokenizer": "CLIPTokenizer",
                                         "tokenizer_2": "T5TokenizerFast"})  # fmt: skip


SD15_SCHEDULER = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "skip_prk_steps": True, "set_alpha_to_one": False,
    "steps_offset": 1, "trained_betas": None,
}  # fmt: skip


def clip_image_processor(size: int = 224) -> Any:
    """CLIPImageProcessor with CLIP's settings: shortest edge and centre crop `size`, bicubic,
    OpenAI CLIP mean / std, rescale 1/255."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": size}, resample=3, do_center_crop=True,
        crop_size={"height": size, "width": size}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True,
    )  # fmt: skip


def _clip_config(tok: Any, hidden: int, act: str, logit_scale: float) -> Any:
    from transformers import CLIPConfig, CLIPVisionConfig

    vision = CLIPVisionConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, image_size=224, patch_size=14, hidden_act=act, projection_dim=hidden,
    )  # fmt: skip
    return CLIPConfig(
        text_config=_clip_text_config(tok, hidden, act).to_dict(),
        vision_config=vision.to_dict(), projection_dim=hidden, logit_scale_init_value=logit_scale,
    )  # fmt: skip


def build_sd15(folder: str | Path) -> Path:
    """Stable Diffusion 1.5 replica (module docstring)."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

    tok = clip_tokenizer()
    hidden = 32  # real: 768
    unet = _seeded(SEED, lambda: UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16, 16, 16), norm_num_groups=4, cross_attention_dim=hidden,
        attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    ))  # fmt: skip
    checker = _seeded(SEED + 3, lambda: StableDiffusionSafetyChecker(
        _clip_config(tok, hidden, "quick_gelu", 2.6592)
    ))  # fmt: skip
    pipe = StableDiffusionPipeline(
        vae=kl_vae(4, SEED + 1, **SD15_VAE), unet=unet,
        text_encoder=clip_text_encoder(tok, hidden, "quick_gelu", projection=False, seed=SEED + 2),
        tokenizer=tok, scheduler=PNDMScheduler(**SD15_SCHEDULER), safety_checker=checker,
        feature_extractor=clip_image_processor(), requires_safety_checker=True,
    )  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "CLIPTokenizer"})


def _clip_model(folder: str | Path, act: str, pad: str, logit_scale: float, seed: int) -> Path:
    from transformers import CLIPModel, CLIPProcessor

    folder = Path(folder)
    tok = clip_tokenizer(pad_token=pad)
    model = _seeded(seed, lambda: CLIPModel(_clip_config(tok, 32, act, logit_scale)))
    model.save_pretrained(folder)
    CLIPProcessor(image_processor=clip_image_processor(), tokenizer=tok).save_pretrained(folder)
    for fname, data in tok._grouprl_files.items():
        (folder / fname).write_bytes(data)
    return folder


def build_pickscore(folder: str | Path) -> Path:
    """PickScore_v1 (CLIP-H/14) with the laion CLIP-ViT-H-14 processor (module docstring)."""
    return _clip_model(folder, "gelu", "!", 4.6052, SEED + 10)


def build_clip_large(folder: str | Path) -> Path:
    """openai/clip-vit-large-patch14 (module docstring)."""
    return _clip_model(folder, "quick_gelu", "<|endoftext|>", 2.6592, SEED + 11)


DIFFUSION_REPLICAS: dict[str, Callable[[str | Path], Path]] = {
    "sd3.5-medium": build_sd35_medium,
    "flux.1-dev": build_flux_dev,
    "flux.1-schnell": build_flux_schnell,
    "wan2.1-t2v": build_wan21_t2v,
    "wan2.2-t2v-a14b": build_wan22_t2v_a14b,
    "wan2.2-ti2v-5b": build_wan22_ti2v_5b,
    "flux.1-kontext-dev": build_flux_kontext_dev,
    "sd1.5": build_sd15,
    "pickscore": build_pickscore,
    "clip-vit-large-patch14": build_clip_large,
}


# ---- SDXL, SANA, Qwen-Image (appended: their own builders) ---------------------------------------

SDXL_SCHEDULER = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "interpolation_type": "linear",
    "timestep_spacing": "leading", "steps_offset": 1, "use_karras_sigmas": False,
    "trained_betas": None,
}  # fmt: skip  # stable-diffusion-xl-base-1.0's EulerDiscreteScheduler
SDXL_VAE = {"scaling_factor": 0.13025, "force_upcast": True}
SDXL_TIME_EMBED = 8  # addition_time_embed_dim (real: 256)


def build_sdxl(folder: str | Path) -> Path:
    """Stable Diffusion XL base 1.0 replica (module docstring)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tok_l, tok_g = clip_tokenizer(), clip_tokenizer(pad_token="!")
    clip_l, clip_g, proj_g = 32, 48, 40  # real: 768, 1280 and CLIP-G's projection_dim 1280
    enc_l = clip_text_encoder(tok_l, clip_l, "quick_gelu", projection=False, seed=SEED + 2)
    enc_g = _seeded(SEED + 3, lambda: __import__("transformers").CLIPTextModelWithProjection(
        _clip_text_config(tok_g, clip_g, "gelu", projection=proj_g)))  # fmt: skip
    unet = _seeded(SEED, lambda: UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4),
        use_linear_projection=True, cross_attention_dim=clip_l + clip_g,
        addition_embed_type="text_time", addition_time_embed_dim=SDXL_TIME_EMBED,
        projection_class_embeddings_input_dim=6 * SDXL_TIME_EMBED + proj_g,
    ))  # fmt: skip
    pipe = StableDiffusionXLPipeline(
        vae=kl_vae(4, SEED + 1, **SDXL_VAE), text_encoder=enc_l, text_encoder_2=enc_g,
        tokenizer=tok_l, tokenizer_2=tok_g, unet=unet,
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER), force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )  # fmt: skip
    out = _save(pipe, Path(folder), {"tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer"})
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text())
    index["add_watermarker"] = None  # the hub folder's value (None: on when the package is there)
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # ids 0-4, as Gemma 2's


def gemma_tokenizer() -> Any:
    """GemmaTokenizerFast with Gemma 2's layout: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, the
    256 byte-fallback pieces <0x00>..<0xFF>, then BPE pieces over "▁"-joined words (learned here
    from CORPUS); BOS added, no EOS."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizerFast

    specials = GEMMA_SPECIALS + [f"<0x{i:02X}>" for i in range(256)]
    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 500, special_tokens=specials,
                                  show_progress=False)  # fmt: skip
    bpe.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return GemmaTokenizerFast(
        vocab=model["vocab"],
        merges=merges,
        model_max_length=8192,
        padding_side="right",
        add_bos_token=True,
        add_eos_token=False,
    )


SANA_SCHEDULER = {
    "num_train_timesteps": 1000, "algorithm_type": "dpmsolver++", "solver_order": 2,
    "solver_type": "midpoint", "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "flow_shift": 3.0, "final_sigmas_type": "zero", "lower_order_final": True,
    "timestep_spacing": "linspace", "beta_start": 0.0001, "beta_end": 0.02,
    "beta_schedule": "linear", "steps_offset": 0,
}  # fmt: skip  # Sana_1600M_1024px_diffusers' DPMSolverMultistepScheduler (flow mode)


def build_sana(folder: str | Path) -> Path:
    """SANA 1.6B 1024px replica (module docstring)."""
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    tok = gemma_tokenizer()
    gemma = 32  # real: 2304 (gemma-2-2b-it)
    text = _seeded(SEED + 2, lambda: Gemma2Model(Gemma2Config(
        vocab_size=len(tok), hidden_size=gemma, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh", sliding_window=16, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )))  # fmt: skip
    transformer = _seeded(SEED, lambda: SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
        caption_channels=gemma, mlp_ratio=2.5, sample_size=32, patch_size=1,
        norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None,
    ))  # fmt: skip
    # dc-ae-f32c32: 6 levels (32x spatial compression), 32 latent channels; the shortcuts into and
    # out of the latent need the last level's width to be a multiple of the latent channels
    levels, widths = 6, (8, 8, 8, 16, 32, 32)  # real: 128, 256, 512, 512, 1024, 1024
    vae = _seeded(SEED + 1, lambda: AutoencoderDC(
        in_channels=3, latent_channels=32, attention_head_dim=8,
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        encoder_block_out_channels=widths, decoder_block_out_channels=widths,
        encoder_layers_per_block=(1,) * levels, decoder_layers_per_block=(1,) * levels,
        encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3,
        decoder_act_fns=("relu",) * 3 + ("silu",) * 3, scaling_factor=0.41407,
    ))  # fmt: skip
    pipe = SanaPipeline(tokenizer=tok, text_encoder=text, vae=vae, transformer=transformer,
                        scheduler=DPMSolverMultistepScheduler(**SANA_SCHEDULER))  # fmt: skip
    return _save(pipe, Path(folder), {"tokenizer": "GemmaTokenizerFast"})


QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
    "shift_terminal": 0.02, "time_shift_type": "exponential", "invert_sigmas": False,
    "stochastic_sampling": False, "use_karras_sigmas": False, "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}  # fmt: skip  # Qwen/Qwen-Image's FlowMatchEulerDiscreteScheduler


# the system part of QwenImagePipeline.prompt_template_encode: the pipeline drops its first 34
# tokens (prompt_template_encode_start_idx), one per word as Qwen's tokenizer splits it
QWEN_IMAGE_SYSTEM = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:"
)


def qwen_image_tokenizer() -> tuple[Any, dict, list]:
    """Qwen2Tokenizer as Qwen2.5-VL's (replicas.text.qwen_tokenizer: byte-level BPE with Qwen's
    pre-tokenizer, NFC, the Qwen2-VL added tokens in order, ChatML template), its merges learned
    from CORPUS and the pipeline's system prompt, so that the prompt template's prefix splits into
    the 34 tokens the pipeline drops, one per word as with the real vocabulary."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from grouprl.replicas.chat_templates import QWEN2_VL
    from grouprl.replicas.text import BPE_VOCAB, QWEN_REGEX, split_byte_level
    from grouprl.replicas.vision import QWEN2_VL_ADDED

    bpe = Tokenizer(models.BPE())
    bpe.normalizer, bpe.pre_tokenizer = normalizers.NFC(), split_byte_level(QWEN_REGEX)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    roles = ["system\n", "user\n", "assistant\n"]  # the ChatML role names, whole words
    bpe.train_from_iterator(CORPUS * 4 + ([QWEN_IMAGE_SYSTEM, *roles]) * 8, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", errors="replace", model_max_length=131072,
        split_special_tokens=False, clean_up_tokenization_spaces=False,
    )  # fmt: skip
    added = QWEN2_VL_ADDED
    tok.add_tokens([AddedToken(t, special=sp, normalized=False) for t, sp in added],
                   special_tokens=False)  # fmt: skip
    tok.add_special_tokens({"additional_special_tokens": [t for t, sp in added if sp][1:]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN2_VL
    return tok, vocab, merges


def qwen2_5_vl_text_encoder(tok: Any, seed: int) -> Any:
    """Qwen2_5_VLForConditionalGeneration as Qwen2.5-VL-7B-Instruct's kind (replicas.vision's
    Qwen2.5-VL settings: mrope sections, window-attention tower, tied embeddings; bfloat16), sized
    to `tok` with replicas.text's tiny decoder."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from grouprl.replicas.text import TINY_DECODER

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                      "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>")}  # fmt: skip
    eot, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
    head_dim = TINY_DECODER["hidden_size"] // TINY_DECODER["num_attention_heads"]
    text = dict(
        vocab_size=len(tok), max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
        use_sliding_window=False, sliding_window=32768, max_window_layers=2, attention_dropout=0.0,
        bos_token_id=eot, eos_token_id=eos, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
        **TINY_DECODER,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=172, num_heads=2, hidden_act="silu",
        in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        tokens_per_second=2, window_size=112, fullatt_block_indexes=[1],
        out_hidden_size=TINY_DECODER["hidden_size"],
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=eot, eos_token_id=eos,
        tie_word_embeddings=False,
    )  # fmt: skip
    return _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(cfg)).to(torch.bfloat16)


def build_qwen_image(folder: str | Path) -> Path:
    """Qwen-Image replica (module docstring)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    tok, vocab, merges = qwen_image_tokenizer()
    text = qwen2_5_vl_text_encoder(tok, SEED + 2)
    width = text.config.text_config.hidden_size  # real: 3584 (Qwen2.5-VL-7B-Instruct)
    transformer = _seeded(SEED, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=width, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ))  # fmt: skip
    vae = _seeded(SEED + 1, lambda: AutoencoderKLQwenImage(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ))  # fmt: skip
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae.to(torch.bfloat16), text_encoder=text, tokenizer=tok,
        transformer=transformer.to(torch.bfloat16),
    )  # fmt: skip
    folder = Path(folder)
    _save(pipe, folder, {"tokenizer": "Qwen2Tokenizer"})
    from grouprl.replicas.text import write_vocab_files

    write_vocab_files(folder / "tokenizer", vocab, merges)  # vocab.json / merges.txt, as the hub's
    return folder


DIFFUSION_REPLICAS.update({
    "sdxl": build_sdxl,
    "sana-1.6b": build_sana,
    "qwen-image": build_qwen_image,
})  # fmt: skip
