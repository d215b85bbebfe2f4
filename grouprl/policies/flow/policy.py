"""The flow-matching policy: a diffusers flow transformer (SD3, FLUX, Wan video) or any velocity
module, sampled with a stochastic step per denoising step so that each step is an action with a
Gaussian log-prob (Flow-GRPO arXiv 2505.05470; DanceGRPO arXiv 2505.07818; MixGRPO arXiv
2507.21802; Flow-GRPO-Fast). The objectives are the shared ones: this policy hands back logp [n, K]
and a mask, and `kl` replaces the token KL by the Gaussian mean-space KL.

Public API (everything a loop or a user touches):
  FlowPolicy(model, *, latent_shape, scheduler_config=None, vae=None, family=None,
             prompt_encoder=None, lora=None, sampler="flow_sde", noise_level=0.7,
             rollout_steps=10, eval_steps=40, guidance_scale=1.0, embedded_guidance=3.5,
             train_cfg="same", steps=None, initial_noise="independent", kl_form="flow_grpo",
             pixel_range="zero_one", sigma_spacing=None, compute_dtype=None,
             gradient_checkpointing=False, pipeline_source=None)
  .encode(prompts) -> FlowCondition                     cached text embeddings (needs prompt_encoder)
  .sample(cond | prompts, group_size, *, steps=None, mode="rollout"|"eval", generator=None,
          group_ids=None, optimizer_step=0, guidance_scale=None, chunk_size=None,
          store_means=False) -> Rollout                 actions=FlowBatch, old_logp [N, K], mask
  .log_probs(batch, *, steps=None, **ignored) -> PolicyOutput  logp [n, K]; extras mean [n, K, ...],
                                                        std [n, K], kl_var [n, K]
  .reference() -> context yielding .log_probs(batch) (no grad): LoRA off, or a lazy frozen copy
  .kl(out, ref_out) -> [n, K];  .reference_kl(batch, out) -> [n, K]
  .decode(latents) -> images Float[N, 3, H, W] (video [N, 3, F, H, W]) in [0, 1]
  .forward_noising(x0, t, noise, cond, which="current"|"old"|"ref", guidance_scale=1.0) -> v
  .update_old(decay) / .old_weights() context           the "old" weights of DiffusionNFT / AWM
  .trainable_parameters() .train() .eval() .to() .state_dict() .load_state_dict()
  .save_pretrained(dir, merge_lora=False) .load_saved_weights(dir)
  latent_shape_for(model, vae, height, width, num_frames=None, family=None) -> tuple

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
  model is then saved as a complete pipeline folder (flow_pipeline_folder.py).
- The reference (a frozen copy made on first use, or the adapter bypassed under LoRA) and the
  "old" weights of DiffusionNFT / AWM: flow_weights.py. Sampling: flow_sampling.py; the schedule,
  one step and the KL variance: flow_step_rules.py; forward noising: flow_noising.py.
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
from grouprl.policies.flow.gaussian import gaussian_mean_kl
from grouprl.policies.flow.models import (
    DECODERS,
    decoder_of,
    family_of,
    latent_shape_for,  # re-exported (public API)
    predict,
)
from grouprl.policies.flow.noising import forward_noising
from grouprl.policies.flow.pipeline_folder import complete_pipeline
from grouprl.policies.flow.sampling import sample_groups
from grouprl.policies.flow.schedule import (
    StepSelectionSettings,
)
from grouprl.policies.flow.step_rules import FlowStepRules
from grouprl.policies.flow.steps import score_chain
from grouprl.policies.flow.text_encoders import PromptEncoder
from grouprl.policies.flow.types import FlowBatch, FlowCondition, check_choice
from grouprl.policies.flow.weights import FlowWeights, enable_gradient_checkpointing
from grouprl.policies.precision import as_dtype, compute, compute_dtype_of
from grouprl.types import PolicyOutput, Rollout

TrainCFG = Literal["same", "none"]
KLForm = Literal["flow_grpo", "exact"]
__all__ = ["FlowBatch", "FlowCondition", "FlowPolicy", "PromptEncoder", "latent_shape_for"]


class _Scorer:
    def __init__(self, policy: FlowPolicy, model: Any) -> None:
        self._policy, self._model = policy, model

    @torch.no_grad()
    def log_probs(self, batch: FlowBatch, steps: list[int] | None = None, **ignored: Any):
        return self._policy._score(self._model, batch, steps)


class FlowPolicy(FlowStepRules):
    """Samples groups of denoising trajectories and scores their per-step log-probs (module doc)."""

    sampler_names = ("flow_sde", "dance_sde", "cps", "ode")

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        latent_shape: tuple[int, ...],
        scheduler_config: dict | None = None,
        vae: torch.nn.Module | None = None,
        family: str | None = None,
        prompt_encoder: PromptEncoder | None = None,
        lora: Any = None,
        sampler: str = "flow_sde",
        noise_level: float = 0.7,
        rollout_steps: int = 10,
        eval_steps: int = 40,
        guidance_scale: float = 1.0,
        embedded_guidance: float = 3.5,
        train_cfg: TrainCFG = "same",
        steps: StepSelectionSettings | dict | None = None,
        initial_noise: Literal["independent", "shared"] = "independent",
        kl_form: KLForm = "flow_grpo",
        pixel_range: Literal["zero_one", "minus_one_one"] = "zero_one",
        sigma_spacing: Literal["scheduler", "linear"] | None = None,
        compute_dtype: torch.dtype | str | None = None,
        gradient_checkpointing: bool = False,
        pipeline_source: str | None = None,
    ) -> None:
        self.family = family_of(model, family)
        # the dtype it was loaded in; read before the trainable weights become float32 below
        self.compute_dtype = (
            compute_dtype_of(model) if compute_dtype is None else as_dtype(compute_dtype)
        )
        self.pipeline_source = pipeline_source
        if sampler not in self.sampler_names:
            raise ValueError(f"sampler must be one of {list(self.sampler_names)}, got {sampler!r}")
        check_choice("train_cfg", train_cfg, ("same", "none"))
        check_choice("kl_form", kl_form, ("flow_grpo", "exact"))
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
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.model, self.vae, self.prompt_encoder = model, vae, prompt_encoder
        self.decoder = decoder_of(vae)
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.scheduler_config = dict(scheduler_config or {})
        self.sampler, self.noise_level = sampler, float(noise_level)
        self.rollout_steps, self.eval_steps = rollout_steps, eval_steps
        self.guidance_scale, self.embedded_guidance = (
            float(guidance_scale),
            float(embedded_guidance),
        )
        self.train_cfg, self.kl_form, self.pixel_range = train_cfg, kl_form, pixel_range
        self.steps = (
            steps
            if isinstance(steps, StepSelectionSettings)
            else StepSelectionSettings(**(steps or {}))
        )
        self.initial_noise = initial_noise
        self.sigma_spacing = sigma_spacing or self.family.sigma_spacing
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

    def _predict(self, model, x, cols, k, cond: FlowCondition, gscale: Tensor) -> Tensor:
        emb = torch.full_like(gscale, self.embedded_guidance)  # [B] FLUX guidance embedding
        with compute(self.compute_dtype, x.device):
            return predict(
                self.family, model, x, sigma=cols["sigmas"][:, k], timestep=cols["timesteps"][:, k],
                cond=cond.embeds, negative=cond.negative, guidance_scale=gscale, guidance=emb,
                dtype=self.compute_dtype,
            )  # fmt: skip  # [B, *latent] float32

    def sample(self, cond: FlowCondition | list[str], group_size: int, **options: Any) -> Rollout:
        """group_size trajectories per condition row (consecutive rows); rewards are left empty.
        Options (steps, mode, generator, group_ids, optimizer_step, guidance_scale, chunk_size,
        store_means): flow_sampling.sample_groups."""
        return sample_groups(self, cond, group_size, **options)

    # ---- scoring ------------------------------------------------------------------------------

    def log_probs(
        self, batch: FlowBatch, *, steps: list[int] | None = None, **ignored: Any
    ) -> PolicyOutput:
        """Differentiable logp [n, K] of the stored transitions (0 at untrained steps) and extras
        mean [n, K, *latent], std [n, K], kl_var [n, K]. steps: score only these step indices
        (the others stay 0) to bound activation memory."""
        return self._score(self.model, batch, steps)

    def _score(self, model: Any, batch: FlowBatch, steps: list[int] | None) -> PolicyOutput:
        ones = torch.ones_like(batch.guidance_scale)  # [n]
        gscale = batch.guidance_scale if self.train_cfg == "same" else ones  # [n]
        logp, mean, std = score_chain(
            partial(self._predict, model), self._step, batch, gscale, steps
        )
        extras = {"mean": mean, "std": std, "kl_var": self._kl_var(batch, std)}
        return PolicyOutput(logp=logp, entropy=None, extras=extras)

    @contextlib.contextmanager
    def reference(self) -> Iterator[_Scorer]:
        """Scores under the frozen reference: the adapter bypassed (LoRA) or a frozen copy."""
        with self.weights.reference_model() as model:
            yield _Scorer(self, model)

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
        `guidance_scale`: flow_noising.forward_noising."""
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

    def _save_scheduler(self, directory: Path) -> set[str]:
        """Write scheduler/ (the class the config names, with any shift override applied)."""
        import diffusers

        from grouprl.policies.flow.schedule import scheduler_class

        cls = getattr(diffusers, scheduler_class(self.scheduler_config))  # Wan: UniPC
        cls.from_config(self.scheduler_config).save_config(directory / "scheduler")
        return {"scheduler"}

    def save_pretrained(self, directory: str | Path, *, merge_lora: bool = False) -> Path:
        """A diffusers layout: <folder>/ (transformer or unet: config + merged safetensors; under
        LoRA only with merge_lora), scheduler/, pytorch_lora_weights.safetensors under LoRA (what
        `pipe.load_lora_weights(directory)` reads) and grouprl_flow.json (family, latent shape).
        A full model built from a pipeline (pipeline_source) is saved as a complete pipeline
        folder: model_index.json and every other component (flow_pipeline_folder.py)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.weights.save(directory, merge_lora)
        written = self._save_scheduler(directory)
        if self.pipeline_source is not None and (self.lora is None or merge_lora):
            # a full model: a whole pipeline folder that DiffusionPipeline.from_pretrained loads
            complete_pipeline(self.pipeline_source, directory, {self.family.folder, *written})
        meta = {"family": self.family.name, "latent_shape": list(self.latent_shape),
                "lora": None if self.lora is None else asdict(self.lora)}  # fmt: skip
        (directory / "grouprl_flow.json").write_text(json.dumps(meta, indent=2))
        return directory

    def load_saved_weights(self, directory: str | Path) -> None:
        """Load what save_pretrained wrote: the LoRA file (LoRA) or the full model folder."""
        self.weights.load(Path(directory))
