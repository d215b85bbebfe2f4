"""Builders for image / video policies: the `model:` and `diffusion:` sections -> a FlowPolicy (flow
rules for model.type flow, DDIM rules for model.type unet).

The pipeline class a folder's model_index.json names must be one of
policies/flow/pipelines.SUPPORTED_PIPELINES, which decides the denoiser family and the prompt
encoder; any other is refused by name while the config is validated (a hub id: once its
model_index.json is downloaded, before any model loads).

model.type "flow":
- a diffusers pipeline folder or hub id (SD3, FLUX, Wan, SANA, Qwen-Image): the denoiser named in model_index.json
  ("transformer"), its VAE, its scheduler config as shipped (SD3 FlowMatchEuler shift 3, FLUX's
  dynamic shifting from the image size, Wan's UniPC flow_shift; an explicit diffusion.shift
  replaces the shift, turns dynamic shifting off, and says so in a warning) and a
  PromptEncoder over the pipeline's own text encoders (each prompt encoded once, cached);
- a user velocity module "package.module:Class" / "file.py:Class" (called `model(x, sigma, **cond)`,
  see policies/flow/models.py): weights from model.weights (Class.from_pretrained, or *.safetensors
  into Class(**module_options)), pixel space (no VAE), latent shape (in_channels, height, width);
  conditioning by class label (model.condition) or by prompt embeddings the caller supplies.
- a two-expert pipeline (Wan 2.2 A14B: model_index.json names transformer_2 and sets
  boundary_ratio): both experts in one DenoiserExperts (policies/flow/experts.py) switched by the
  pipeline's rule; model.experts picks which train, diffusion.guidance_scale_2 the low-noise
  expert's guidance (WanPipeline's guidance_scale_2); a pipeline with expand_timesteps (Wan 2.2
  TI2V-5B) takes the "wan_expand" family (per-token timesteps);
- FluxKontextPipeline (FLUX.1 Kontext): the "flux_kontext" family, conditioned on each example's
  reference image (model.condition prompt_image, the `image` column); a pipeline's family is read
  from its class (policies/flow/pipelines.SUPPORTED_PIPELINES).
model.type "unet": an SD 1.x or SDXL pipeline folder or hub id: UNet2DConditionModel + VAE + CLIP
text encoder(s), sampled with DDIM (eta = diffusion.eta) built from the pipeline's own scheduler
config (SD 1.5's PNDM, SDXL's EulerDiscrete: their betas, steps_offset and timestep spacing), as
DDPO does; SDXL's pooled embedding and micro-conditioning time ids for (diffusion.height, width)
come with the prompt encoder.
model.dtype is the compute dtype (policies/precision.py): trainable weights stay float32.

Choices: full fine-tuning keeps a frozen reference copy only when a KL is on, made here before any
checkpoint is loaded (so a resumed run keeps the initial model as its reference); LoRA settings
without target_modules take the family's attention projections. The sampler "ode" (likelihood-free
objectives) builds the policy with "flow_sde" as its stochastic sampler, which those rollouts never
use (they sample every step deterministically, workloads/images/sampling.py).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch

from grouprl.config.diffusion import NOISE_FIELD  # the diffusion: field of each sampler's noise
from grouprl.runtime.user_inputs import import_user_module

_MODULE_SPEC = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


def is_module_spec(name: str) -> bool:
    """True for "package.module:Class" / "path/file.py:Class" (not a hub id or a folder)."""
    return bool(_MODULE_SPEC.match(name)) and not Path(name).exists()


def load_velocity_module(m: Any) -> torch.nn.Module:
    """The user's velocity module: its class from model.name_or_path, weights from model.weights."""
    spec = _MODULE_SPEC.match(m.name_or_path)
    module = import_user_module(spec["module"], f"model.name_or_path={m.name_or_path!r}")
    cls = getattr(module, spec["attr"], None)
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(f"model.name_or_path={m.name_or_path!r} must name a torch nn.Module class")
    if m.weights is None:
        return cls(**m.module_options)
    folder = Path(m.weights)
    if not folder.is_dir():
        raise FileNotFoundError(f"model.weights={m.weights!r} is not a folder")
    if hasattr(cls, "from_pretrained") and (folder / "config.json").exists():
        if m.module_options:
            raise ValueError("model.module_options: the weights folder's config.json sets them")
        return cls.from_pretrained(folder)
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"model.weights={m.weights!r}: expected one *.safetensors file")
    model = cls(**m.module_options)
    model.load_state_dict(load_file(str(files[0])))
    return model


def check_image_model(m: Any) -> None:
    """Config-time check of model.name_or_path (policies/flow/pipelines.check_pipeline): a
    pipeline class grouprl does not train is refused by name before anything loads."""
    from grouprl.policies.flow.pipelines import check_pipeline

    if m.type == "flow" and is_module_spec(m.name_or_path):
        return
    check_pipeline(m.name_or_path, m.type)


def _component(spec: dict, name: str) -> bool:
    """model_index.json names a component `name` that the folder has (not [null, null])."""
    value = spec.get(name)
    return isinstance(value, list) and len(value) == 2 and value[1] is not None


def _pipeline_parts(m: Any) -> tuple[Any, Any, dict, Any, dict]:
    """Denoiser (two experts: a DenoiserExperts), VAE and scheduler config of a diffusers pipeline
    folder / hub id; its entry of SUPPORTED_PIPELINES (refused before any model loads when there
    is none); its pipeline config (model_index.json)."""
    import diffusers
    from huggingface_hub import hf_hub_download

    from grouprl.policies.flow.pipelines import check_index, read_model_index

    root = Path(m.name_or_path)
    index = root / "model_index.json" if root.is_dir() else None
    if index is None:
        index = Path(hf_hub_download(m.name_or_path, "model_index.json"))
    spec = read_model_index(index, m.name_or_path)
    support = check_index(spec, m.name_or_path, m.type)
    denoiser = support.denoiser
    if denoiser not in spec:
        raise ValueError(
            f"model.name_or_path={m.name_or_path!r}: model_index.json has no {denoiser!r} "
            f"(components: {sorted(k for k in spec if not k.startswith('_'))}); model.type "
            f"{'flow needs a transformer' if denoiser == 'transformer' else 'unet needs a unet'}"
        )
    dtype = getattr(torch, m.dtype)

    def load(name: str) -> Any:
        return getattr(diffusers, spec[name][1]).from_pretrained(
            m.name_or_path, subfolder=name, torch_dtype=dtype
        )

    net = load(denoiser)
    vae = None
    if spec.get("vae", [None, None])[1] is not None:
        vae = getattr(diffusers, spec["vae"][1]).from_pretrained(
            m.name_or_path, subfolder="vae", torch_dtype=dtype
        )
    sched_cls = getattr(diffusers, spec["scheduler"][1])
    sched = dict(sched_cls.load_config(m.name_or_path, subfolder="scheduler"))
    sched["_class_name"] = spec["scheduler"][1]  # the class model_index.json names
    second = f"{denoiser}_2"
    if _component(spec, second):  # Wan 2.2 A14B: the low-noise expert
        from grouprl.policies.flow.experts import EXPERT_CHOICES, DenoiserExperts, check_boundary

        check_boundary(spec.get("boundary_ratio"), (denoiser, second))
        net = DenoiserExperts(
            {denoiser: net, second: load(second)}, boundary_ratio=spec["boundary_ratio"],
            num_train_timesteps=int(sched.get("num_train_timesteps", 1000)),
            trained=EXPERT_CHOICES[m.experts],
        )  # fmt: skip
    return net, vae, sched, support, spec


def _lora(cfg: Any) -> dict | None:
    lora = cfg.model.lora
    if lora is None:
        return None
    out = lora.model_dump()
    if "target_modules" not in lora.model_fields_set:  # the family's attention projections
        out.pop("target_modules")
    return out


def _steps(d: Any) -> dict:
    """diffusion.train_steps ({type, knobs of that type}) -> StepSelectionSettings' keywords."""
    settings = d.train_steps.model_dump()
    return {"name": settings.pop("type"), **settings}


def build_flow_policy(cfg: Any, device: torch.device) -> Any:
    """FlowPolicy with flow rules (model.type flow) or DDIM rules (unet) from the config."""
    from grouprl.policies.flow.experts import DenoiserExperts
    from grouprl.policies.flow.models import FAMILIES
    from grouprl.policies.flow.policy import FlowPolicy, PromptEncoder, latent_shape_for
    from grouprl.policies.flow.unet import ddim_config, ddim_policy

    m, d = cfg.model, cfg.diffusion
    sampler = "flow_sde" if d.sampler == "ode" else d.sampler
    if (m.type == "unet") != (sampler == "ddim"):
        raise ValueError(
            f"model.type={m.type!r} with diffusion.sampler={d.sampler!r}: the DDIM sampler is for "
            "model.type unet (epsilon prediction), the flow samplers for model.type flow"
        )
    common = dict(
        lora=_lora(cfg), sampler=sampler, noise_level=getattr(d, NOISE_FIELD[sampler]),
        rollout_steps=d.rollout_steps, eval_steps=d.eval_steps, guidance_scale=d.guidance_scale,
        train_cfg=d.train_guidance, steps=_steps(d), pixel_range=m.pixel_range,
        initial_noise="shared" if d.shared_noise == "group" else "independent",
        compute_dtype=m.dtype, gradient_checkpointing=m.gradient_checkpointing,
        guidance_scale_2=d.guidance_scale_2,
    )  # fmt: skip
    if "sigma_spacing" in d.model_fields_set:  # otherwise the family's own (FLUX: linear)
        if m.type == "unet":
            raise ValueError(
                "diffusion.sigma_spacing is a flow-matching setting; model.type unet samples "
                "with DDIM timesteps (remove diffusion.sigma_spacing)"
            )
        common["sigma_spacing"] = d.sigma_spacing
    if m.type == "flow" and is_module_spec(m.name_or_path):
        _check_condition(m, None)
        if d.num_frames != 1:
            raise ValueError("a user velocity module is an image model: diffusion.num_frames = 1")
        net, dtype = load_velocity_module(m), getattr(torch, m.dtype)
        if next(iter(net.parameters())).dtype != dtype:
            net = net.to(dtype)
        channels = getattr(getattr(net, "config", None), "in_channels", 3)
        sched = {} if d.shift is None else _override_shift({}, d.shift)
        policy = FlowPolicy(net, latent_shape=(channels, d.height, d.width), family="module",
                            scheduler_config=sched, **common)  # fmt: skip
    else:
        net, vae, sched, support, spec = _pipeline_parts(m)
        source = m.name_or_path  # full fine-tunes save a whole pipeline folder from it
        cls_name = type(net).__name__
        family = _pipeline_family(spec) or support.family
        video = FAMILIES[family].video
        if d.num_frames != 1 and not video:
            raise ValueError(
                f"diffusion.num_frames={d.num_frames} needs a video model; {cls_name} draws images"
            )
        frames = d.num_frames if video else None
        _check_condition(m, family)
        shape = latent_shape_for(net, vae, d.height, d.width, frames, family=family)
        encoder = PromptEncoder.from_pretrained(
            m.name_or_path, family, dtype=getattr(torch, m.dtype),
            negative_prompt=m.negative_prompt, max_sequence_length=m.max_sequence_length,
            image_size=(d.height, d.width),
        )  # fmt: skip
        if m.type == "unet":
            if d.shift is not None:
                raise ValueError(
                    "diffusion.shift is a flow-matching setting; model.type unet "
                    "samples with its pipeline's DDPM betas (remove diffusion.shift)"
                )
            policy = ddim_policy(net, latent_shape=shape, vae=vae, prompt_encoder=encoder,
                                 scheduler_config=ddim_config(sched), pipeline_source=source,
                                 family=support.family, **common)  # fmt: skip
        else:
            if d.shift is not None:
                sched = _override_shift(sched, d.shift)
            policy = FlowPolicy(net, latent_shape=shape, vae=vae, prompt_encoder=encoder,
                                scheduler_config=sched, pipeline_source=source,
                                family=family, **common)  # fmt: skip
    if m.experts != "both" and not isinstance(policy.model, DenoiserExperts):
        raise ValueError(
            f"model.experts={m.experts!r}: {m.name_or_path!r} has one denoiser (no transformer_2 "
            "and boundary_ratio in model_index.json); remove model.experts"
        )
    if cfg.algorithm.kl_coef > 0 and policy.lora is None:
        # the frozen reference copy is made now, before a checkpoint is loaded into the policy,
        # so a resumed run keeps the initial model as its reference (FlowPolicy makes it lazily)
        with policy.reference():
            pass
    return policy.to(device)


def _override_shift(sched: dict, shift: float) -> dict:
    """diffusion.shift applied to the scheduler config; what it changed is said (a warning)."""
    from grouprl.policies.flow.schedule import override_shift

    out, note = override_shift(sched, shift)
    warnings.warn(note, stacklevel=2)
    return out


def _pipeline_family(spec: dict) -> str | None:
    """The family a pipeline config asks for beyond its denoiser's class: FluxKontextPipeline's
    reference image, WanPipeline's expand_timesteps (Wan 2.2 TI2V-5B: timesteps per token);
    None: the denoiser class's family."""
    return "wan_expand" if spec.get("expand_timesteps") else None


def _check_condition(m: Any, family: str | None) -> None:
    """model.condition prompt_image exactly for an image-conditioned pipeline."""
    from grouprl.policies.flow.models import IMAGE_CONDITIONED

    takes_image = family in IMAGE_CONDITIONED
    if takes_image and m.condition != "prompt_image":
        raise ValueError(
            f"model.name_or_path={m.name_or_path!r} is image-conditioned (FLUX.1 Kontext): every "
            f"step sees a reference image; set model.condition: prompt_image (examples with an "
            f"`image` column), got {m.condition!r}"
        )
    if m.condition == "prompt_image" and not takes_image:
        raise ValueError(
            f"model.condition='prompt_image' needs an image-conditioned pipeline "
            f"(FluxKontextPipeline); {m.name_or_path!r} is not one: use model.condition: prompt"
        )
