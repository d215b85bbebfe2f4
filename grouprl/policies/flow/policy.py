"""The flow-matching policy: a diffusers flow transformer (SD3, FLUX, Wan video) or any velocity
module, sampled with a stochastic step per denoising step so that each step is an action with a
Gaussian log-prob (Flow-GRPO arXiv 2505.05470; DanceGRPO arXiv 2505.07818; MixGRPO arXiv
2507.21802; Flow-GRPO-Fast). The objectives are the shared ones: this policy hands back logp [n, K]
and a mask, and `kl` replaces the token KL by the Gaussian mean-space KL.

Public API (everything a loop or a user touches):
  FlowPolicy(model, *, latent_shape, rules=None, vae=None, family=None, prompt_encoder=None,
             lora=None, rollout_steps=10, eval_steps=40, guidance_scale=1.0,
             embedded_guidance=3.5, train_cfg="same", steps=None, initial_noise="independent",
             pixel_range="zero_one", compute_dtype=None, gradient_checkpointing=False,
             pipeline_source=None, guidance_scale_2=None,
             scheduler_config=None, sampler=None, noise_level=None, kl_form=None,
             sigma_spacing=None)   the last five build the default rules (rules=None only)
  .rules                                                the step rules (rules.py): set_timesteps,
                                                        step, kl_var; FlowMatchRules or DDIMRules
  .encode(prompts) -> FlowCondition                     cached text embeddings (needs prompt_encoder)
  .with_reference_images(cond, images) -> FlowCondition  adds the reference images' latents
                                                        (FLUX.1 Kontext: cond["image_latents"])
  .sample(cond | prompts, group_size, *, steps=None, mode="rollout"|"eval", generator=None,
          group_ids=None, optimizer_step=0, guidance_scale=None, chunk_size=None,
          store_means=False) -> Rollout                 actions=FlowBatch, old_logp [N, K], mask
  .log_probs(batch, *, steps=None, **ignored) -> PolicyOutput  logp [n, K]; extras mean [n, K, ...],
                                                        std [n, K], kl_var [n, K]
  .score_with(model, batch, steps) -> PolicyOutput      the same under other weights (no grad)
  .predict(model, x, cols, k, cond, gscale) -> [B, *latent]  one denoiser call (CFG, dtypes)
  .scoring_module() / .with_scoring_module(m)           several processes (DDP): wrapped.py
  .reference() -> context yielding .log_probs(batch) (no grad): LoRA off, or a lazy frozen copy
  .kl(out, ref_out) -> [n, K];  .reference_kl(batch, out) -> [n, K]
  .decode(latents) -> images Float[N, 3, H, W] (video [N, 3, F, H, W]) in [0, 1]
  .forward_noising(x0, t, noise, cond, which="current"|"old"|"ref", guidance_scale=1.0) -> v
  .update_old(decay) / .old_weights() context           the "old" weights of DiffusionNFT / AWM
  .trainable_parameters() .train() .eval() .to() .state_dict() .load_state_dict()
  .save_pretrained(dir, merge_lora=False) .load_saved_weights(dir)
  latent_shape_for(model, vae, height, width, num_frames=None, family=None) -> tuple

Composition: the denoiser family (models.py: how to call SD3 / FLUX / Wan / SANA / Qwen-Image /
a UNet / a user module) and the step rules (rules.py: the schedule and the step) are separate choices. DDIM over an
SD 1.x UNet is `FlowPolicy(unet, family="unet", rules=DDIMRules(...))` (unet.ddim_policy builds it
with DDPO's defaults); any object with the StepRules methods can be passed as `rules`.

Choices and deviations:
- Exact re-scoring: log_probs runs the same forward (same dtype casts, same CFG batching) on the
  stored x_k and scores the stored x_{k+1} with the same fp32 sampler, so on the rollout's batch
  the ratio is exactly 1. A step is recomputed for all rows of the batch when any row trains it
  (no per-row subsetting), which keeps the batch composition of the rollout.
- train_cfg "same" recomputes the guided prediction with the rollout's per-sample guidance scale;
  "none" uses the conditional branch only (Flow-GRPO's no-CFG training). With "none" and a rollout
  guidance > 1 the stored old_logp is not the trained policy's: recompute it (rollout.old_logp).
- Precision (policies/precision.py): compute_dtype (None: the dtype most of the model's weights are
  stored in) is the autocast dtype of every denoiser and VAE call, and the dtype inputs are cast to;
  the trainable weights (full model or LoRA adapters) are float32 master weights whatever it is.
- gradient_checkpointing turns on diffusers' own block checkpointing of the denoiser (an error for
  a model without it). pipeline_source: the pipeline folder / hub id the model came from; a full
  model is then saved as a complete pipeline folder (pipeline_folder.py).
- Two experts (Wan 2.2 A14B, experts.py): `model` is a DenoiserExperts; each step runs the expert
  WanPipeline's switch rule picks from its sigma, with guidance_scale (high-noise expert) or
  guidance_scale_2 (low-noise expert; None: guidance_scale), the batch records the expert per step
  (FlowBatch.expert) and re-scoring calls that expert. The experts' LoRA / full weights, the
  reference and the old weights are the container's, so they cover both experts.
- The reference (a frozen copy made on first use, or the adapter bypassed under LoRA) and the
  "old" weights of DiffusionNFT / AWM: weights.py. Sampling: sampling.py; the schedule, one step
  and the KL variance: rules.py; forward noising (velocity rules only): noising.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from grouprl.policies.flow import lora as flow_lora
from grouprl.policies.flow.experts import DenoiserExperts, unused_zero
from grouprl.policies.flow.gaussian import gaussian_mean_kl
from grouprl.policies.flow.models import (
    DECODERS,
    IMAGE_CONDITIONED,
    decoder_of,
    encode_kl,
    family_of,
    latent_shape_for,  # re-exported (public API)
    predict,
    vae_scale,
)
from grouprl.policies.flow.noising import forward_noising
from grouprl.policies.flow.pipeline_folder import complete_pipeline
from grouprl.policies.flow.rules import (
    DDIMRules,
    FlowMatchRules,
    StepRules,
    image_seq_len,
)
from grouprl.policies.flow.sampling import sample_groups
from grouprl.policies.flow.schedule import StepSelectionSettings
from grouprl.policies.flow.steps import score_chain
from grouprl.policies.flow.text_encoders import PromptEncoder
from grouprl.policies.flow.types import FlowBatch, FlowCondition, check_choice
from grouprl.policies.flow.weights import FlowWeights, enable_gradient_checkpointing
from grouprl.policies.flow.wrapped import FlowScoringModule, WrappedFlowPolicy
from grouprl.policies.precision import as_dtype, compute, compute_dtype_of
from grouprl.types import PolicyOutput, Rollout

TrainCFG = Literal["same", "none"]
KLForm = Literal["flow_grpo", "exact"]
__all__ = ["FlowBatch", "FlowCondition", "FlowPolicy", "PromptEncoder", "latent_shape_for"]


class ReferenceScorer:
    """The policy's scoring under other (reference) weights: `.model` and no-grad `.log_probs`."""

    def __init__(self, policy: FlowPolicy, model: Any) -> None:
        self.policy, self.model = policy, model

    @torch.no_grad()
    def log_probs(self, batch: FlowBatch, steps: list[int] | None = None, **ignored: Any):
        return self.policy.score_with(self.model, batch, steps)


class FlowPolicy:
    """Samples groups of denoising trajectories and scores their per-step log-probs (module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        latent_shape: tuple[int, ...],
        rules: StepRules | None = None,
        vae: torch.nn.Module | None = None,
        family: str | None = None,
        prompt_encoder: PromptEncoder | None = None,
        lora: Any = None,
        rollout_steps: int = 10,
        eval_steps: int = 40,
        guidance_scale: float = 1.0,
        embedded_guidance: float = 3.5,
        train_cfg: TrainCFG = "same",
        steps: StepSelectionSettings | dict | None = None,
        initial_noise: Literal["independent", "shared"] = "independent",
        pixel_range: Literal["zero_one", "minus_one_one"] = "zero_one",
        compute_dtype: torch.dtype | str | None = None,
        gradient_checkpointing: bool = False,
        pipeline_source: str | None = None,
        guidance_scale_2: float | None = None,
        scheduler_config: dict | None = None,
        sampler: str | None = None,
        noise_level: float | None = None,
        kl_form: KLForm | None = None,
        sigma_spacing: Literal["scheduler", "linear"] | None = None,
    ) -> None:
        self.family = family_of(model, family)
        # the dtype it was loaded in; read before the trainable weights become float32 below
        self.compute_dtype = (
            compute_dtype_of(model) if compute_dtype is None else as_dtype(compute_dtype)
        )
        self.pipeline_source = pipeline_source
        check_choice("train_cfg", train_cfg, ("same", "none"))
        check_choice("initial_noise", initial_noise, ("independent", "shared"))
        if len(latent_shape) != (4 if self.family.video else 3) and self.family.name != "module":
            raise ValueError(
                f"latent_shape {tuple(latent_shape)} does not fit family {self.family.name!r}"
            )
        if min(rollout_steps, eval_steps) < 1:
            raise ValueError(
                f"rollout_steps and eval_steps must be >= 1, got {rollout_steps}, {eval_steps}"
            )
        self.lora = flow_lora.flow_lora_settings(lora, self.family)
        self.weights = FlowWeights(model, self.family, self.lora)  # trainable: float32 masters
        self.lora_targets = self.weights.lora_targets  # None without LoRA
        if gradient_checkpointing:
            for net in model.experts.values() if isinstance(model, DenoiserExperts) else [model]:
                enable_gradient_checkpointing(net)
        self.model, self.vae, self.prompt_encoder = model, vae, prompt_encoder
        self.decoder = decoder_of(vae)
        self.latent_shape = tuple(int(s) for s in latent_shape)
        if rules is None:
            rules = default_rules(
                self.family, model, self.latent_shape, scheduler_config=scheduler_config,
                sampler=sampler, noise_level=noise_level, kl_form=kl_form,
                sigma_spacing=sigma_spacing,
            )  # fmt: skip
        else:
            given = {"scheduler_config": scheduler_config, "sampler": sampler,
                     "noise_level": noise_level, "kl_form": kl_form,
                     "sigma_spacing": sigma_spacing}  # fmt: skip
            if any(v is not None for v in given.values()):
                raise ValueError(
                    f"{sorted(k for k, v in given.items() if v is not None)} build the default "
                    "rules: with rules=... set them on the rules object"
                )
        if (self.family.name == "unet") != (rules.prediction == "epsilon"):
            raise ValueError(
                f"family {self.family.name!r} with {type(rules).__name__} "
                f"(prediction {rules.prediction!r}): a UNet predicts epsilon and takes DDIMRules, "
                "the flow families predict velocity and take FlowMatchRules"
            )
        self.rules = rules
        self.rollout_steps, self.eval_steps = rollout_steps, eval_steps
        self.guidance_scale, self.embedded_guidance = (
            float(guidance_scale),
            float(embedded_guidance),
        )
        if guidance_scale_2 is not None and not isinstance(model, DenoiserExperts):
            raise ValueError(
                "guidance_scale_2 (diffusion.guidance_scale_2) is the low-noise expert's guidance "
                "scale: this model has one denoiser; remove it (it is for two-expert pipelines "
                "such as Wan 2.2 A14B)"
            )
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)
        self.train_cfg, self.pixel_range = train_cfg, pixel_range
        self.steps = (
            steps
            if isinstance(steps, StepSelectionSettings)
            else StepSelectionSettings(**(steps or {}))
        )
        self.initial_noise = initial_noise
        if vae is not None:
            vae.requires_grad_(False).eval()

    # ---- conditioning and sampling ------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return next(iter(self.model.parameters())).device

    def encode(self, prompts: list[str]) -> FlowCondition:
        if self.prompt_encoder is None:
            raise ValueError(
                "this policy has no prompt_encoder: pass a FlowCondition of embeddings"
            )
        return self.prompt_encoder(prompts, device=self.device)

    def with_reference_images(self, cond: FlowCondition, images: list[Any]) -> FlowCondition:
        """cond plus "image_latents" [B, C, h, w] in both branches: each PIL image resized to the
        generated size by the pipeline's own VaeImageProcessor (FluxKontextPipeline with
        _auto_resize off and an image of that size: resize, [-1, 1]) and encoded by encode_kl.
        FluxKontextPipeline's true CFG keeps the reference in its negative branch as well."""
        if self.family.name not in IMAGE_CONDITIONED:
            raise ValueError(
                f"family {self.family.name!r} takes no reference image; image-conditioned "
                f"families: {list(IMAGE_CONDITIONED)}"
            )
        if len(images) != len(cond):
            raise ValueError(f"{len(images)} reference images for {len(cond)} condition rows")
        from diffusers.image_processor import VaeImageProcessor

        spatial = vae_scale(self.vae)[0]
        height, width = self.latent_shape[-2] * spatial, self.latent_shape[-1] * spatial
        pixels = VaeImageProcessor(vae_scale_factor=spatial * 2).preprocess(
            images, height, width
        )  # [B, 3, H, W] in [-1, 1]
        with compute(compute_dtype_of(self.vae), self.device):
            latents = encode_kl(self.vae, pixels.to(self.device))  # [B, C, h, w]
        embeds = {**cond.embeds, "image_latents": latents}
        negative = None if cond.negative is None else {**cond.negative, "image_latents": latents}
        return FlowCondition(embeds, negative)

    def predict(self, model, x, cols, k, cond: FlowCondition, gscale: Tensor) -> Tensor:
        """The denoiser `model` (this policy's, or its reference / old copy) at x [B, *latent],
        slot k of the schedule columns cols [B, K+1], with guidance scales gscale [B] (two
        experts: [B, 2], one per expert, or [B] for both). Two experts: the expert of cols["expert"]
        [B, K] when given (a stored step), else the one the switch rule picks from the sigma."""
        sigma, timestep = cols["sigmas"][:, k], cols["timesteps"][:, k]  # [B] each
        if not isinstance(model, DenoiserExperts):
            return self._predict_one(model, x, sigma, timestep, cond, gscale)
        if "expert" in cols:
            idx = cols["expert"][:, k]  # [B]
        else:
            idx = model.expert_index(sigma)  # [B]
        gs = gscale if gscale.dim() == 1 else gscale.gather(1, idx[:, None])[:, 0]  # [B]

        def call(net: Any, rows: Tensor | None) -> Tensor:
            if rows is None:
                return self._predict_one(net, x, sigma, timestep, cond, gs)
            return self._predict_one(net, x[rows], sigma[rows], timestep[rows],
                                     _cond_rows(cond, rows), gs[rows])  # fmt: skip

        return model.route(idx, call)  # [B, *latent] float32

    def _predict_one(self, net, x, sigma, timestep, cond: FlowCondition, gscale) -> Tensor:
        emb = torch.full_like(gscale, self.embedded_guidance)  # [B] FLUX guidance embedding
        with compute(self.compute_dtype, x.device):
            return predict(
                self.family, net, x, sigma=sigma, timestep=timestep, cond=cond.embeds,
                negative=cond.negative, guidance_scale=gscale, guidance=emb,
                dtype=self.compute_dtype,
            )  # fmt: skip  # [B, *latent] float32

    def schedule_columns(self, num_steps: int, n: int) -> dict[str, Tensor]:
        """The rules' schedule for num_steps as per-row columns [n, K+1] on the policy's device;
        two experts add "expert" [n, K], the expert that runs each step (WanPipeline's rule)."""
        sched = self.rules.set_timesteps(num_steps)
        cols = {k: v.to(self.device)[None].expand(n, -1).contiguous()
                for k, v in sched.items() if v is not None}  # fmt: skip
        if isinstance(self.model, DenoiserExperts):
            cols["expert"] = self.model.expert_index(cols["sigmas"][:, :-1])  # [n, K]
        return cols

    def guidance_columns(self, n: int, scale: float) -> Tensor:
        """Per-row guidance scales: [n]; two experts [n, 2] (scale for the high-noise expert,
        guidance_scale_2 or else the same scale for the low-noise one, as WanPipeline)."""
        gs = torch.full((n,), float(scale), device=self.device)  # [n]
        if not isinstance(self.model, DenoiserExperts):
            return gs
        low = scale if self.guidance_scale_2 is None else self.guidance_scale_2
        return torch.stack([gs, torch.full_like(gs, low)], 1)  # [n, 2]

    def sample(self, cond: FlowCondition | list[str], group_size: int, **options: Any) -> Rollout:
        """group_size trajectories per condition row (consecutive rows); rewards are left empty.
        Options (steps, mode, generator, group_ids, optimizer_step, guidance_scale, chunk_size,
        store_means): sampling.sample_groups."""
        return sample_groups(self, cond, group_size, **options)

    def scoring_module(self, path: str | None = None) -> torch.nn.Module:
        """The module several processes wrap (DDP): its forward scores stored chains
        (wrapped.py). path: the log-prob path a sharded backend asks for; flows train under DDP
        only, so any is refused."""
        if path is not None:
            raise ValueError(
                "image / video policies train under several processes with DDP only "
                "(configs/accelerate/ddp.yaml); FSDP2 and DeepSpeed are not supported for them"
            )
        return FlowScoringModule(self)

    def with_scoring_module(self, module: Any) -> WrappedFlowPolicy:
        """This policy as the loop sees it once `module` (from scoring_module) is wrapped."""
        return WrappedFlowPolicy(self, module)

    # ---- scoring ------------------------------------------------------------------------------

    def log_probs(
        self, batch: FlowBatch, *, steps: list[int] | None = None, **ignored: Any
    ) -> PolicyOutput:
        """Differentiable logp [n, K] of the stored transitions (0 at untrained steps) and extras
        mean [n, K, *latent], std [n, K], kl_var [n, K]. steps: score only these step indices
        (the others stay 0) to bound activation memory."""
        return self.score_with(self.model, batch, steps)

    def score_with(self, model: Any, batch: FlowBatch, steps: list[int] | None) -> PolicyOutput:
        """log_probs of the stored transitions under the denoiser `model` (module doc)."""
        if batch.sampler != self.rules.sampler:
            raise ValueError(
                f"the batch was sampled with {batch.sampler!r}; this policy's rules step with "
                f"{self.rules.sampler!r}"
            )
        ones = torch.ones_like(batch.guidance_scale)  # [n]
        gscale = batch.guidance_scale if self.train_cfg == "same" else ones  # [n]
        logp, mean, std = score_chain(
            partial(self.predict, model), self.rules.step, batch, gscale, steps
        )
        if isinstance(model, DenoiserExperts) and torch.is_grad_enabled():
            # the experts this pass scored with; the others' trainable weights join with a zero
            scored = batch.train_mask.any(0)  # [K]
            if steps is not None:
                scored &= torch.isin(torch.arange(len(scored), device=scored.device),
                                     torch.as_tensor(steps, device=scored.device))  # fmt: skip
            used = set(batch.expert[:, scored].unique().tolist())
            logp = logp + unused_zero(model, used).to(logp.device)  # [n, K]
        extras = {"mean": mean, "std": std, "kl_var": self.rules.kl_var(batch, std)}
        return PolicyOutput(logp=logp, entropy=None, extras=extras)

    @contextlib.contextmanager
    def reference(self) -> Iterator[ReferenceScorer]:
        """Scores under the frozen reference: the adapter bypassed (LoRA) or a frozen copy."""
        with self.weights.reference_model() as model:
            yield ReferenceScorer(self, model)

    def kl(self, out: PolicyOutput, ref_out: PolicyOutput) -> Tensor:
        """Mean-space Gaussian KL [n, K] (0 at unscored steps), see kl_form."""
        return gaussian_mean_kl(out.extras["mean"], ref_out.extras["mean"], out.extras["kl_var"])

    def reference_kl(
        self, batch: FlowBatch, out: PolicyOutput, steps: list[int] | None = None
    ) -> Tensor:
        """kl(out, reference scores of the same batch) in one call; [n, K]."""
        with self.reference() as ref:
            ref_out = ref.log_probs(batch, steps=steps)
        return self.kl(out, ref_out)

    # ---- decoding and the forward process -----------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: Tensor, chunk_size: int | None = None) -> Tensor:
        """Images in [0, 1]: Float[N, 3, H, W] (video Float[N, 3, F, H, W]) from final latents."""
        chunk = chunk_size or max(len(latents), 1)
        vae_dtype = torch.float32 if self.vae is None else compute_dtype_of(self.vae)
        with compute(vae_dtype, latents.device):
            parts = [DECODERS[self.decoder](self.vae, latents[i : i + chunk], self.pixel_range)
                     for i in range(0, len(latents), chunk)]  # fmt: skip
        return torch.cat(parts)

    def forward_noising(self, x0: Tensor, t: Tensor, noise: Tensor, cond: FlowCondition,
                        **options: Any) -> Tensor:  # fmt: skip
        """Velocity at x_t = (1 - t) x0 + t noise; options `which` ("current" | "old" | "ref") and
        `guidance_scale`: noising.forward_noising. Velocity rules only (DiffusionNFT / AWM)."""
        if self.rules.prediction != "velocity":
            raise ValueError(
                "forward_noising (DiffusionNFT / AWM) needs a flow-matching policy; the DDIM UNet "
                "policy predicts epsilon: use FlowPolicy with a flow transformer"
            )
        return forward_noising(self, x0, t, noise, cond, **options)

    def update_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * current (the first call copies the current weights)."""
        self.weights.update_old(decay)

    def old_weights(self) -> contextlib.AbstractContextManager[None]:
        """Context: the old weights swapped into the trainable parameters (restored on exit)."""
        return self.weights.old_weights()

    # ---- parameters and checkpoints -----------------------------------------------------------

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.weights.trainable().values())

    def train(self, mode: bool = True) -> FlowPolicy:
        self.model.train(mode)
        return self

    def eval(self) -> FlowPolicy:
        return self.train(False)

    def to(self, device: torch.device | str) -> FlowPolicy:
        """Move the denoiser (and reference / old copies), the VAE and the text encoders."""
        self.weights.to(device)
        if self.vae is not None:
            self.vae.to(device)
        if self.prompt_encoder is not None:
            self.prompt_encoder.pipeline.to(device)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """Full weights, or the adapter weights under LoRA; plus "old::<name>" once old exists."""
        return self.weights.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.weights.load_state_dict(state)

    def save_pretrained(self, directory: str | Path, *, merge_lora: bool = False) -> Path:
        """A diffusers layout: <folder>/ (transformer or unet: config + merged safetensors; under
        LoRA only with merge_lora), scheduler/, pytorch_lora_weights.safetensors under LoRA (what
        `pipe.load_lora_weights(directory)` reads) and grouprl_flow.json (family, latent shape).
        A full model built from a pipeline (pipeline_source) is saved as a complete pipeline
        folder: model_index.json and every other component (pipeline_folder.py)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        folders = self.weights.save(directory, merge_lora)
        from_pipeline = self.pipeline_source is not None and self.lora is None
        written = self.rules.save_scheduler(directory, from_pipeline)
        if self.pipeline_source is not None and (self.lora is None or merge_lora):
            # a full model: a whole pipeline folder that DiffusionPipeline.from_pretrained loads
            complete_pipeline(self.pipeline_source, directory, {*folders, *written})
        meta = {"family": self.family.name, "latent_shape": list(self.latent_shape),
                "lora": None if self.lora is None else asdict(self.lora)}  # fmt: skip
        if isinstance(self.model, DenoiserExperts):
            meta["experts"] = {"names": list(self.model.names), "trained": list(self.model.trained),
                               "boundary_ratio": self.model.boundary_ratio}  # fmt: skip
        (directory / "grouprl_flow.json").write_text(json.dumps(meta, indent=2))
        return directory

    def load_saved_weights(self, directory: str | Path) -> None:
        """Load what save_pretrained wrote: the LoRA file (LoRA) or the full model folder."""
        self.weights.load(Path(directory))


def default_rules(
    family: Any, model: Any, latent_shape: tuple[int, ...], *, scheduler_config: dict | None,
    sampler: str | None, noise_level: float | None, kl_form: str | None,
    sigma_spacing: str | None,
) -> StepRules:  # fmt: skip
    """The rules FlowPolicy builds when given none: DDIMRules for a UNet (sampler "ddim", eta 1,
    DDPO's scheduler, the exact KL), FlowMatchRules otherwise (flow_sde 0.7, flow_grpo KL, the
    family's sigma spacing)."""
    if family.name == "unet":
        if sampler not in (None, "ddim") or kl_form not in (None, "exact") or sigma_spacing:
            raise ValueError(
                f"the UNet samples with DDIM: sampler 'ddim', kl_form 'exact' and no sigma_spacing,"
                f" got sampler={sampler!r}, kl_form={kl_form!r}, sigma_spacing={sigma_spacing!r}"
            )
        return DDIMRules(scheduler_config, 1.0 if noise_level is None else noise_level)
    return FlowMatchRules(
        scheduler_config, sampler or "flow_sde", 0.7 if noise_level is None else noise_level,
        sigma_spacing=sigma_spacing or family.sigma_spacing, kl_form=kl_form or "flow_grpo",
        image_seq_len=image_seq_len(family, model, latent_shape),
    )  # fmt: skip


def _cond_rows(cond: FlowCondition, rows: Tensor) -> FlowCondition:
    """The rows Bool[B] of a condition; a one-row negative (shared by every row) stays as is."""
    n = len(cond)

    def take(v: Tensor) -> Tensor:
        return v if v.shape[0] == 1 and n != 1 else v[rows]

    neg = None if cond.negative is None else {k: take(v) for k, v in cond.negative.items()}
    return FlowCondition({k: v[rows] for k, v in cond.embeds.items()}, neg)
