"""The sweep's checks of the diffusers pipelines grouprl replicates (grouprl.replicas.REPLICAS).

Every replica whose folder is a diffusers pipeline (it has model_index.json; the reward models
among the replicas are not) is checked, so pipelines added to the registry are picked up:

  build           the replica builds and DiffusionPipeline.from_pretrained loads it
  sample_logprob  grouprl's image policy from a config on the folder (model.type unet where the
                  pipeline has a unet, else flow; full fine-tuning; 16 x 16, 3 steps, 5 frames
                  for a 3-D denoiser): one group of 2 sampled, its per-step log-probs finite, one
                  backward with finite gradients
  reload          the policy's save_pretrained folder (LoRA merged) loads with DiffusionPipeline.from_pretrained
                  as the same pipeline class with the same denoiser weights
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from grouprl.replicas.sweep.checks import CheckFailed, reason_of

DIFFUSION_CHECKS = ("build", "sample_logprob", "reload")


NOT_A_PIPELINE = "not a diffusers pipeline (no model_index.json)"


def pipeline_replicas() -> list[str]:
    """The replica names outside the text and vision registries: the diffusion module's pipelines
    and reward models (the reward models' folders have no model_index.json; check_pipeline
    reports them as NOT_A_PIPELINE and the sweep leaves them out)."""
    from grouprl.replicas import REPLICAS
    from grouprl.replicas.text import TEXT_REPLICAS
    from grouprl.replicas.vision import VISION_REPLICAS

    return sorted(set(REPLICAS) - set(TEXT_REPLICAS) - set(VISION_REPLICAS))


def _denoiser(folder: Path) -> tuple[str, str]:
    """(component name, class name) of the pipeline's denoiser, from model_index.json."""
    index = json.loads((folder / "model_index.json").read_text())
    for name in ("transformer", "unet"):
        if isinstance(index.get(name), list) and index[name][1]:
            return name, index[name][1]
    raise CheckFailed(f"model_index.json names no transformer or unet: {sorted(index)}")


def _image_conditioned(folder: Path) -> bool:
    """The pipeline class conditions every step on a reference image (FLUX.1 Kontext), read
    from grouprl's table of supported pipelines."""
    from grouprl.policies.flow.models import IMAGE_CONDITIONED
    from grouprl.policies.flow.pipelines import SUPPORTED_PIPELINES

    index = json.loads((folder / "model_index.json").read_text())
    support = SUPPORTED_PIPELINES.get(index.get("_class_name"))
    return support is not None and support.family in IMAGE_CONDITIONED


def _side(pipe: Any, denoiser: str) -> int:
    """Image side in pixels that gives the denoiser a latent of at least 2 patches a side: the
    VAE's downsampling (SANA's DC-AE 32x, Wan 2.2 TI2V's 16x, the KL VAEs' 8x) read from the
    pipeline, times the denoiser's patch size."""
    from grouprl.policies.flow.models import vae_scale

    spatial = vae_scale(getattr(pipe, "vae", None))[0]
    patch = getattr(getattr(pipe, denoiser).config, "patch_size", 1) or 1
    patch = max(patch) if isinstance(patch, list | tuple) else int(patch)
    return max(16, spatial * patch * 2)


def _config(folder: Path, out: Path, denoiser: str, cls_name: str, side: int = 16) -> Any:
    from grouprl.config.loading import validate

    video = "3D" in cls_name
    unet = denoiser == "unet"
    condition = {"condition": "prompt_image"} if _image_conditioned(folder) else {}
    return validate({
        "run": {"name": "sweep", "output_dir": str(out), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"type": "unet" if unet else "flow", "name_or_path": str(folder),
                  "max_sequence_length": 8, **condition},
        "task": {"name": "image_prompts", "options": {"source": "shapes", "n_eval": 2}},
        "rewards": [{"name": "color_area"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2},
        "algorithm": {"preset": "ddpo" if unet else "flow_grpo", "kl_coef": 0.0},
        "diffusion": {"height": side, "width": side, "rollout_steps": 3, "eval_steps": 3,
                      "guidance_scale": 1.0, "num_frames": 5 if video else 1},
        "train": {"steps": 1, "lr": 1e-3},
    })  # fmt: skip


def check_pipeline(name: str, *, results: dict | None = None) -> dict[str, dict]:
    """{check: {"status", "reason"}} of one pipeline replica (results: filled check by check)."""
    from diffusers import DiffusionPipeline

    from grouprl.replicas import build_replica
    from grouprl.workloads.images.policy import build_flow_policy

    results = {} if results is None else results
    tmp = Path(tempfile.mkdtemp(prefix=f"sweep-{name}-"))
    try:
        folder = build_replica(name, tmp / "replica")
        if not (folder / "model_index.json").is_file():
            for c in DIFFUSION_CHECKS:
                results[c] = {"status": "skip", "reason": NOT_A_PIPELINE}
            return results
        original = DiffusionPipeline.from_pretrained(folder)
        denoiser, cls_name = _denoiser(folder)
        results["build"] = {"status": "pass", "reason": f"{type(original).__name__}, {cls_name}"}
    except Exception as e:
        results["build"] = {"status": "fail", "reason": reason_of(e)}
        for c in DIFFUSION_CHECKS[1:]:
            results[c] = {"status": "skip", "reason": "the pipeline did not build"}
        return results
    try:
        torch.manual_seed(0)
        config = _config(folder, tmp / "run", denoiser, cls_name, _side(original, denoiser))
        policy = build_flow_policy(config, "cpu")
        cond: Any = ["a red square"]
        if _image_conditioned(folder):  # a reference image to edit (a gray square)
            from PIL import Image

            cond = policy.with_reference_images(
                policy.encode(cond), [Image.new("RGB", (16, 16), (128, 128, 128))]
            )
        rollout = policy.sample(cond, 2, generator=torch.Generator().manual_seed(0))
        out = policy.log_probs(rollout.actions)
        logp = out.logp  # [n, K]
        if not logp.isfinite().all():
            raise CheckFailed("non-finite per-step log-probs")
        logp.sum().backward()
        grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
        if not grads or not all(g.isfinite().all() for g in grads):
            raise CheckFailed("no gradient, or a non-finite one, from the log-probs")
        results["sample_logprob"] = {
            "status": "pass",
            "reason": f"logp {tuple(logp.shape)}, {len(grads)} grads finite",
        }
    except Exception as e:
        results["sample_logprob"] = {"status": "fail", "reason": reason_of(e)}
        results["reload"] = {"status": "skip", "reason": "no policy to save"}
        return results
    try:
        saved = policy.save_pretrained(tmp / "saved", merge_lora=True)  # a complete pipeline
        pipe = DiffusionPipeline.from_pretrained(saved)
        if type(pipe) is not type(original):
            raise CheckFailed(f"reloads as {type(pipe).__name__}, not {type(original).__name__}")
        live = policy.model.state_dict()
        loaded = getattr(pipe, denoiser).state_dict()
        diff = [k for k, v in loaded.items() if k in live and not torch.equal(live[k].float(),
                                                                             v.float())]  # fmt: skip
        if diff:
            raise CheckFailed(f"{len(diff)} denoiser tensors differ after reload, e.g. {diff[0]}")
        results["reload"] = {"status": "pass", "reason": type(pipe).__name__}
    except Exception as e:
        results["reload"] = {"status": "fail", "reason": reason_of(e)}
    return results
