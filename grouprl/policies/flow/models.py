"""How each denoiser family is called, and how latents become images: two small registries.

FAMILIES turns (latents, time, conditioning) into one network call and returns its prediction in
the latent layout (velocity for flow models, epsilon for the SD 1.x UNet):
- "sd3"    SD3Transformer2DModel: timestep = sigma * 1000, encoder_hidden_states = prompt_embeds,
           pooled_projections = pooled_prompt_embeds (the StableDiffusion3Pipeline call).
- "flux"   FluxTransformer2DModel: latents [B, C, H, W] are packed into 2x2 patches [B, HW/4, 4C]
           with image ids (0, row, col) and zero text ids, timestep = (sigma * 1000) / 1000, and the
           guidance embedding (a per-sample scale) when the config has guidance_embeds (FluxPipeline).
- "wan"    WanTransformer3DModel: 5-D video latents [B, C, F, H, W], timestep = sigma * 1000.
- "wan_expand"  the same transformer in a pipeline with `expand_timesteps` (Wan 2.2 TI2V-5B): the
           timestep goes in per latent token, [B, F * (H / p_h) * (W / p_w)] (WanPipeline's
           expanded timesteps; every token shares the step's time in text-to-video).
- "flux_kontext"  the FLUX transformer of FluxKontextPipeline (image-conditioned): the reference
           image's latents cond["image_latents"] [B, C, h, w] are packed the same way and joined
           after the generated latents' tokens, their ids (1, row, col) (the first id 1 tells them
           apart), and only the generated tokens' prediction is kept.
A two-expert denoiser (experts.DenoiserExperts, Wan 2.2 A14B) has its experts' family; the policy
calls one expert per step (policy.py).
- "module" any nn.Module velocity model: `model(x, sigma, **cond) -> v` with x [B, ...] in the
           model's dtype, sigma Float[B] in [0, 1] (1 = pure noise) and cond the conditioning tensors
           of the batch (e.g. class_labels Long[B] or prompt_embeds [B, L, D]); returns v ~ eps - x0
           of x's shape (a tensor, or an object with `.sample`).
- "unet"   UNet2DConditionModel (SD 1.x, SDXL; epsilon prediction): timestep = the integer DDPM
           step, encoder_hidden_states = prompt_embeds; a UNet whose config has addition_embed_type
           "text_time" (SDXL) also takes added_cond_kwargs {text_embeds: the pooled embedding
           [B, P], time_ids [B, n]} (StableDiffusionXLPipeline), their widths checked against
           addition_time_embed_dim and projection_class_embeddings_input_dim; any other
           addition_embed_type is refused by name.
- "sana"   SanaTransformer2DModel: timestep = sigma * 1000 * config.timestep_scale,
           encoder_hidden_states = the Gemma 2 embeddings with their encoder_attention_mask
           (SanaPipeline); a transformer with out_channels = 2 in_channels (learned sigma) keeps
           the first half, as the pipeline does.
- "qwenimage" QwenImageTransformer2DModel: latents packed into 2x2 patches as FLUX, img_shapes
           [(1, H/2, W/2)] per sample, timestep = sigma, encoder_hidden_states_mask = the text
           mask (diffusers 0.42 derives the text lengths from it: no txt_seq_lens argument), the
           guidance embedding when the config has guidance_embeds; classifier-free guidance is the
           pipeline's "true CFG" with its norm rescale (the guided velocity of each packed token
           rescaled to the conditional one's norm).
Conditioning keys (FlowCondition): prompt_embeds [B, L, D], pooled_prompt_embeds [B, P],
prompt_attention_mask / prompt_embeds_mask Long[B, L] (SANA / Qwen-Image), text_embeds [B, P] and
time_ids [B, 6] (SDXL), image_latents [B, C, h, w] (flux_kontext: the reference image, VAE-encoded by
encode_kl), or for "module" any keys the model accepts. Classifier-free guidance
batches [negative; positive] in one forward and returns uncond + scale (cond - uncond), as the
diffusers pipelines do (or the family's own `guide`).

DECODERS turn final latents into images in [0, 1] (Float[N, 3, H, W]; video Float[N, 3, F, H, W]):
"kl" AutoencoderKL (latents / scaling + shift), "wan" AutoencoderKLWan (latents * std + mean per
channel), "qwenimage" AutoencoderKLQwenImage (Wan's per-channel std / mean on a one-frame video,
frame 0 decoded), "dc" AutoencoderDC (SANA's deep-compression VAE: latents / scaling), "pixel"
identity for pixel-space models (`pixel_range` "zero_one" clamps, "minus_one_one" maps [-1, 1] to
[0, 1]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from grouprl.policies.precision import compute_dtype_of

PixelRange = Literal["zero_one", "minus_one_one"]


@dataclass(frozen=True)
class Family:
    """One denoiser family: its call, LoRA targets, diffusers pipeline and folder names."""

    name: str
    predict: Callable[..., Tensor]  # (model, x, *, sigma, timestep, cond, guidance) -> [B, ...]
    lora_targets: tuple[str, ...]  # peft target_modules (suffix match) of the attention projections
    pipeline: str | None  # diffusers pipeline class: text encoding and LoRA file format
    folder: str  # sub-folder of a diffusers layout ("transformer" / "unet") and LoRA key prefix
    video: bool = False
    sigma_spacing: Literal["scheduler", "linear"] = "scheduler"
    packed_2x2: bool = False  # latents enter as 2x2 patches: in_channels = 4 C, even sides
    # classifier-free guidance (uncond [B, ...], cond [B, ...], scale [B, 1, ...]) -> guided; None:
    # uncond + scale (cond - uncond)
    guide: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None


def _sample(out: Any) -> Tensor:
    return out.sample if hasattr(out, "sample") else out[0] if isinstance(out, tuple) else out


def _sd3(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    return model(
        hidden_states=x, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
        pooled_projections=cond["pooled_prompt_embeds"], return_dict=False,
    )[0]  # fmt: skip


def pack_flux(x: Tensor) -> Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2x2 patches in row-major order (FluxPipeline layout)."""
    b, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"FLUX latents need even height and width, got {h}x{w}")
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B, H/2, W/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_flux(x: Tensor, h: int, w: int) -> Tensor:
    """Inverse of pack_flux: [B, (H/2)(W/2), 4C] -> [B, C, H, W]."""
    b, _, c4 = x.shape
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [B, C, H/2, 2, W/2, 2]
    return x.reshape(b, c4 // 4, h, w)


def flux_image_ids(h: int, w: int, device, dtype) -> Tensor:
    """[(H/2)(W/2), 3] position ids (0, row, col) of the packed FLUX latent tokens."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h // 2, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device, dtype=dtype)[None, :]
    return ids.reshape(-1, 3)


def _flux_tokens(model, tokens, ids, *, timestep, cond, guidance) -> Tensor:
    """One FLUX transformer call on packed tokens [B, T, 4C] with their ids [T, 3]."""
    text = cond["prompt_embeds"]  # [B, L, D]
    g = None
    if getattr(model.config, "guidance_embeds", False):
        if guidance is None:
            raise ValueError("this FLUX transformer has guidance_embeds: pass a guidance scale")
        g = guidance.to(device=tokens.device, dtype=torch.float32)  # [B]
    return model(
        hidden_states=tokens, timestep=timestep / 1000, guidance=g,
        pooled_projections=cond["pooled_prompt_embeds"], encoder_hidden_states=text,
        txt_ids=torch.zeros(text.shape[1], 3, device=tokens.device, dtype=text.dtype),
        img_ids=ids, return_dict=False,
    )[0]  # fmt: skip  # [B, T, 4C]


def _flux(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    h, w = x.shape[-2:]
    ids = flux_image_ids(h, w, x.device, x.dtype)  # [HW/4, 3]
    out = _flux_tokens(model, pack_flux(x), ids, timestep=timestep, cond=cond, guidance=guidance)
    return unpack_flux(out, h, w)  # [B, C, H, W]


def _flux_kontext(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    h, w = x.shape[-2:]
    ref = cond["image_latents"].to(x.dtype)  # [B, C, h_r, w_r]
    ref_ids = flux_image_ids(*ref.shape[-2:], x.device, x.dtype)  # [h_r w_r / 4, 3]
    ref_ids[:, 0] = 1  # FluxKontextPipeline: the reference image's tokens
    tokens = torch.cat([pack_flux(x), pack_flux(ref)], 1)  # [B, HW/4 + h_r w_r / 4, 4C]
    ids = torch.cat([flux_image_ids(h, w, x.device, x.dtype), ref_ids])  # [T, 3]
    out = _flux_tokens(model, tokens, ids, timestep=timestep, cond=cond, guidance=guidance)
    return unpack_flux(out[:, : (h // 2) * (w // 2)], h, w)  # [B, C, H, W] generated tokens only


def _wan(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    if x.dim() != 5:
        raise ValueError(f"Wan latents must be [B, C, F, H, W], got {tuple(x.shape)}")
    return model(
        hidden_states=x, timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
        return_dict=False,
    )[0]  # fmt: skip


def _wan_expand(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    if x.dim() != 5:
        raise ValueError(f"Wan latents must be [B, C, F, H, W], got {tuple(x.shape)}")
    p_t, p_h, p_w = model.config.patch_size
    tokens = (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
    per_token = timestep[:, None].expand(-1, tokens)  # [B, tokens]
    return model(
        hidden_states=x, timestep=per_token, encoder_hidden_states=cond["prompt_embeds"],
        return_dict=False,
    )[0]  # fmt: skip


def _module(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    return _sample(model(x, sigma, **cond))


def _unet(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    return model(x, timestep, encoder_hidden_states=cond["prompt_embeds"],
                 added_cond_kwargs=unet_added_conditions(model.config, cond),
                 return_dict=False)[0]  # fmt: skip


def unet_added_conditions(config: Any, cond: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """The UNet's added_cond_kwargs, read from its config: none without addition_embed_type;
    "text_time" (SDXL) takes the pooled text embedding and the micro-conditioning time ids, whose
    widths must add up to projection_class_embeddings_input_dim (the pipeline's own check)."""
    kind = getattr(config, "addition_embed_type", None)
    if kind is None:
        return None
    if kind != "text_time":
        raise ValueError(
            f"a UNet2DConditionModel with addition_embed_type={kind!r} is not supported (the UNet "
            "families grouprl trains have none, SD 1.x, or 'text_time', SDXL)"
        )
    missing = [k for k in ("text_embeds", "time_ids") if k not in cond]
    if missing:
        raise ValueError(
            f"this UNet has addition_embed_type 'text_time' (SDXL): its conditioning needs "
            f"{missing} (a StableDiffusionXLPipeline's prompt encoder gives them), got "
            f"{sorted(cond)}"
        )
    text, ids = cond["text_embeds"], cond["time_ids"]  # [B, P], [B, n]
    width = config.addition_time_embed_dim * ids.shape[-1] + text.shape[-1]
    if width != config.projection_class_embeddings_input_dim:
        raise ValueError(
            f"the UNet expects added embeddings of width {config.projection_class_embeddings_input_dim}"
            f" (projection_class_embeddings_input_dim), the conditioning gives {width} = "
            f"addition_time_embed_dim {config.addition_time_embed_dim} x {ids.shape[-1]} time ids "
            f"+ pooled text width {text.shape[-1]}"
        )
    return {"text_embeds": text, "time_ids": ids}


def _sana(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    out = model(
        x, encoder_hidden_states=cond["prompt_embeds"],
        encoder_attention_mask=cond["prompt_attention_mask"],
        timestep=timestep * model.config.timestep_scale, return_dict=False,
    )[0]  # fmt: skip
    if model.config.out_channels == 2 * model.config.in_channels:  # learned sigma: drop it
        out = out.chunk(2, dim=1)[0]
    return out


def _qwenimage(model, x, *, sigma, timestep, cond, guidance) -> Tensor:
    h, w = x.shape[-2:]
    g = None
    if getattr(model.config, "guidance_embeds", False):
        if guidance is None:
            raise ValueError(
                "this Qwen-Image transformer has guidance_embeds: pass a guidance scale"
            )
        g = guidance.to(device=x.device, dtype=torch.float32)  # [B]
    out = model(
        hidden_states=pack_flux(x), timestep=timestep / 1000, guidance=g,
        encoder_hidden_states=cond["prompt_embeds"],
        encoder_hidden_states_mask=cond["prompt_embeds_mask"],
        img_shapes=[[(1, h // 2, w // 2)]] * x.shape[0], return_dict=False,
    )[0]  # fmt: skip  # [B, HW/4, 4C]
    return unpack_flux(out, h, w)


def _qwenimage_guide(uncond: Tensor, cond: Tensor, scale: Tensor) -> Tensor:
    """QwenImagePipeline's true CFG: the guided velocity of each packed 2x2 token rescaled to the
    norm of the conditional one (over its 4 C channels)."""
    h, w = cond.shape[-2:]
    guided = pack_flux(uncond + scale * (cond - uncond))  # [B, HW/4, 4C]
    ratio = pack_flux(cond).norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)
    return unpack_flux(guided * ratio, h, w)  # [B, C, H, W]


_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
_JOINT = (*_ATTN, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")  # Flow-GRPO's SD3 list

# fmt: off
FAMILIES: dict[str, Family] = {
    "sd3": Family("sd3", _sd3, _JOINT, "StableDiffusion3Pipeline", "transformer"),
    "flux": Family("flux", _flux, _JOINT, "FluxPipeline", "transformer", sigma_spacing="linear",
                   packed_2x2=True),
    "flux_kontext": Family("flux_kontext", _flux_kontext, _JOINT, "FluxKontextPipeline",
                           "transformer", sigma_spacing="linear", packed_2x2=True),
    "wan": Family("wan", _wan, _ATTN, "WanPipeline", "transformer", video=True),
    "wan_expand": Family("wan_expand", _wan_expand, _ATTN, "WanPipeline", "transformer",
                         video=True),
    "module": Family("module", _module, _ATTN, None, "transformer"),
    "unet": Family("unet", _unet, _ATTN, "StableDiffusionPipeline", "unet"),
    "sana": Family("sana", _sana, _ATTN, "SanaPipeline", "transformer"),
    "qwenimage": Family("qwenimage", _qwenimage, _JOINT, "QwenImagePipeline", "transformer",
                        sigma_spacing="linear", packed_2x2=True, guide=_qwenimage_guide),
}
# fmt: on

IMAGE_CONDITIONED = ("flux_kontext",)  # families that take cond["image_latents"] (a reference)

_BY_CLASS = {
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
    "WanTransformer3DModel": "wan",
    "UNet2DConditionModel": "unet",
    "SanaTransformer2DModel": "sana",
    "QwenImageTransformer2DModel": "qwenimage",
}


def family_of(model: Any, family: str | None = None) -> Family:
    """The Family named `family`, or the one of model's class (any other nn.Module: "module");
    a two-expert denoiser has its experts' family."""
    from grouprl.policies.flow.experts import DenoiserExperts

    if isinstance(model, DenoiserExperts):
        model = model.expert(0)
    if family is None:
        family = _BY_CLASS.get(type(model).__name__, "module")
        if family == "module" and not isinstance(model, torch.nn.Module):
            raise TypeError(f"the model must be a torch nn.Module, got {type(model).__name__}")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {sorted(FAMILIES)}")
    return FAMILIES[family]


def predict(
    fam: Family,
    model: Any,
    x: Tensor,
    *,
    sigma: Tensor,
    timestep: Tensor,
    cond: dict[str, Tensor],
    negative: dict[str, Tensor] | None,
    guidance_scale: Tensor,
    guidance: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The (guided) prediction Float32[B, ...] for latents x [B, ...] (any float dtype).

    sigma / timestep / guidance_scale: [B]. Rows with guidance_scale > 1 get classifier-free guidance
    from `negative` (required then); the whole batch takes one doubled forward when any row does.
    guidance: the FLUX guidance-embedding scale [B] (ignored by other families).
    dtype: the compute dtype the inputs are cast to (None: the dtype most of the model's weights
    are stored in, never merely its first parameter's: diffusers keeps some modules in float32).
    The caller runs this under policies.precision.compute(dtype) so that every module's weights
    meet their input in that dtype.
    """
    if dtype is None:
        dtype = compute_dtype_of(model)
    xin = x.to(dtype)  # [B, ...]
    cfg = bool((guidance_scale > 1).any())
    if not cfg:
        out = fam.predict(model, xin, sigma=sigma, timestep=timestep, cond=_cast(cond, dtype),
                          guidance=guidance)  # fmt: skip
        return out.float()  # [B, ...]
    if negative is None:
        raise ValueError(
            "guidance_scale > 1 needs negative (unconditional) embeddings in the condition"
        )
    both = {k: torch.cat([negative[k], cond[k]]) for k in cond}  # [2B, ...] each
    g2 = None if guidance is None else torch.cat([guidance, guidance])
    out = fam.predict(
        model, torch.cat([xin, xin]), sigma=torch.cat([sigma, sigma]),
        timestep=torch.cat([timestep, timestep]), cond=_cast(both, dtype), guidance=g2,
    ).float()  # fmt: skip  # [2B, ...]
    uncond, text = out.chunk(2)  # [B, ...] each
    scale = guidance_scale.float().view(-1, *([1] * (x.dim() - 1)))  # [B, 1, ...]
    if fam.guide is not None:  # the pipeline's own combination (Qwen-Image: norm rescale)
        return fam.guide(uncond, text, scale)  # [B, ...]
    return uncond + scale * (text - uncond)  # [B, ...]


def _cast(cond: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items()}


def latent_shape_for(model, vae, height: int, width: int, num_frames: int | None = None,
                     family: str | None = None) -> tuple[int, ...]:  # fmt: skip
    """(C, h, w) latents of an image (C, f, h, w for video) for a diffusers denoiser and VAE."""
    from grouprl.policies.flow.experts import DenoiserExperts

    fam = family_of(model, family)
    if isinstance(model, DenoiserExperts):
        model = model.expert(0)  # the experts share their latent layout
    spatial, temporal = vae_scale(vae)
    if fam.name == "module":
        raise ValueError(
            "latent_shape_for: pass latent_shape explicitly for a user velocity module"
        )
    channels = model.config.in_channels
    if fam.packed_2x2:  # FLUX / Qwen-Image pack 2x2 patches: in_channels = 4 C, even sides
        return channels // 4, 2 * (height // (spatial * 2)), 2 * (width // (spatial * 2))
    if fam.video:
        if num_frames is None:
            raise ValueError("latent_shape_for: a video model needs num_frames")
        return channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial
    return channels, height // spatial, width // spatial


# ---- encoding (reference images) ---------------------------------------------------------------


@torch.no_grad()
def encode_kl(vae: Any, pixels: Tensor) -> Tensor:
    """Latents [N, C, h, w] of images Float[N, 3, H, W] in [-1, 1] through an AutoencoderKL, as
    FluxKontextPipeline encodes its reference image: the posterior's mode (sample_mode "argmax"),
    then (z - shift_factor) * scaling_factor."""
    if vae is None or type(vae).__name__ != "AutoencoderKL":
        raise ValueError(
            f"reference images are encoded with an AutoencoderKL; this policy's VAE is "
            f"{type(vae).__name__}"
        )
    x = pixels.to(compute_dtype_of(vae))  # [N, 3, H, W]
    z = vae.encode(x).latent_dist.mode().float()  # [N, C, h, w]
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (z - shift) * vae.config.scaling_factor


# ---- decoding ----------------------------------------------------------------------------------


def _decode_kl(vae, z: Tensor, pixel_range: PixelRange) -> Tensor:
    scale, shift = vae.config.scaling_factor, getattr(vae.config, "shift_factor", None) or 0.0
    z = (z / scale + shift).to(compute_dtype_of(vae))  # [N, C, h, w]
    return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]


def _decode_wan(vae, z: Tensor, pixel_range: PixelRange) -> Tensor:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(shape)
    z = (z * std + mean).to(compute_dtype_of(vae))  # [N, C, f, h, w]
    return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)  # [N, 3, F, H, W]


def _decode_qwenimage(vae, z: Tensor, pixel_range: PixelRange) -> Tensor:
    # AutoencoderKLQwenImage is Wan's causal video VAE: an image is a one-frame video
    return _decode_wan(vae, z[:, :, None], pixel_range)[:, :, 0]  # [N, 3, H, W]


def _decode_dc(vae, z: Tensor, pixel_range: PixelRange) -> Tensor:
    z = (z / vae.config.scaling_factor).to(compute_dtype_of(vae))  # [N, C, h, w]
    return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]


def _decode_pixel(vae, z: Tensor, pixel_range: PixelRange) -> Tensor:
    if pixel_range == "zero_one":
        return z.float().clamp(0, 1)
    if pixel_range == "minus_one_one":
        return (z.float() / 2 + 0.5).clamp(0, 1)
    raise ValueError(f"pixel_range must be 'zero_one' or 'minus_one_one', got {pixel_range!r}")


DECODERS: dict[str, Callable[[Any, Tensor, PixelRange], Tensor]] = {
    "kl": _decode_kl,
    "wan": _decode_wan,
    "qwenimage": _decode_qwenimage,
    "dc": _decode_dc,
    "pixel": _decode_pixel,
}
_DECODER_OF = {
    "AutoencoderKL": "kl",
    "AutoencoderKLWan": "wan",
    "AutoencoderKLQwenImage": "qwenimage",
    "AutoencoderDC": "dc",
}


def decoder_of(vae: Any) -> str:
    """The DECODERS key for a VAE instance (None: "pixel")."""
    if vae is None:
        return "pixel"
    name = type(vae).__name__
    if name not in _DECODER_OF:
        raise ValueError(
            f"no decoder for a VAE of class {name}; supported: {', '.join(_DECODER_OF)} or None "
            "(pixel-space model)"
        )
    return _DECODER_OF[name]


def vae_scale(vae: Any) -> tuple[int, int]:
    """(spatial, temporal) down-sampling factors of a VAE (1, 1 for pixel space). AutoencoderKLWan
    states them in its config (WanPipeline reads scale_factor_spatial / _temporal): 8 and 4 for
    Wan 2.1's VAE, 16 and 4 for Wan 2.2's (z_dim 48, patch 2), which its down-sampling levels
    alone do not show."""
    if vae is None:
        return 1, 1
    if type(vae).__name__ == "AutoencoderKLWan":
        return int(vae.config.scale_factor_spatial), int(vae.config.scale_factor_temporal)
    if type(vae).__name__ == "AutoencoderKLQwenImage":  # images only (QwenImagePipeline's factor)
        return 2 ** len(vae.temperal_downsample), 1
    if type(vae).__name__ == "AutoencoderDC":  # SanaPipeline's vae_scale_factor
        return 2 ** (len(vae.config.encoder_block_out_channels) - 1), 1
    return 2 ** (len(vae.config.block_out_channels) - 1), 1
