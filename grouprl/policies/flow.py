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
             pixel_range="zero_one", sigma_spacing=None)
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
- kl_form "flow_grpo" divides by 2 g^2 (g^2 = std^2 / (sigma_k - sigma_{k+1}), Flow-GRPO's code and
  its beta); "exact" divides by 2 std^2.
- The reference under full fine-tuning is a frozen copy made on first use (only when a KL is on);
  under LoRA the same weights with the adapter bypassed.
- The old weights (forward_noising which="old") are a copy of the trainable weights swapped in for
  a no-grad forward; update_old(d) sets old <- d old + (1 - d) current (DiffusionNFT's EMA).
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

from grouprl.policies import flow_lora
from grouprl.policies.flow_math import gaussian_mean_kl
from grouprl.policies.flow_models import (
    DECODERS,
    decoder_of,
    family_of,
    latent_shape_for,  # re-exported (public API)
    predict,
)
from grouprl.policies.flow_schedule import (
    StepSelectionSettings,
    flow_sigmas,
    initial_noise,
    select_steps,
)
from grouprl.policies.flow_steps import bcast, run_chain, score_chain, where_rows
from grouprl.policies.flow_text import PromptEncoder
from grouprl.policies.flow_types import FlowBatch, FlowCondition
from grouprl.policies.flow_weights import FlowWeights
from grouprl.policies.samplers import SAMPLER_OPTIONS, SAMPLERS, StepOutput, ode
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


class FlowPolicy:
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
    ) -> None:
        self.family = family_of(model, family)
        if sampler not in self.sampler_names:
            raise ValueError(f"sampler must be one of {list(self.sampler_names)}, got {sampler!r}")
        _check_choice("train_cfg", train_cfg, ("same", "none"))
        _check_choice("kl_form", kl_form, ("flow_grpo", "exact"))
        _check_choice("initial_noise", initial_noise, ("independent", "shared"))
        if len(latent_shape) != (4 if self.family.video else 3) and self.family.name != "module":
            raise ValueError(
                f"latent_shape {tuple(latent_shape)} does not fit family {self.family.name!r}"
            )
        if min(rollout_steps, eval_steps) < 1:
            raise ValueError(
                f"rollout_steps and eval_steps must be >= 1, got {rollout_steps}, {eval_steps}"
            )
        self.lora = flow_lora.flow_lora_settings(lora, self.family)
        self.weights = FlowWeights(model, self.family, self.lora)
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

    # ---- schedule, one step, KL variance (the DDIM policy overrides these three) ---------------

    def _schedule(self, num_steps: int) -> dict[str, Tensor]:
        """Per-slot values [K+1]: sigmas and the network's timesteps (sigma * num_train_timesteps)."""
        seq = None
        if self.family.name == "flux":
            seq = (self.latent_shape[-2] // 2) * (self.latent_shape[-1] // 2)
        sigmas = flow_sigmas(self.scheduler_config, num_steps, image_seq_len=seq,
                             spacing=self.sigma_spacing)  # fmt: skip  # [K+1]
        scale = self.scheduler_config.get("num_train_timesteps", 1000)
        return {"sigmas": sigmas, "timesteps": sigmas * scale, "alphas": None}

    def _step(self, batch_cols: dict[str, Tensor], k: int, x: Tensor, pred: Tensor,
              stochastic: Tensor, sampler: str, noise_level: float,
              prev_sample: Tensor | None, generator) -> StepOutput:  # fmt: skip
        """x_k -> x_{k+1} for rows [B]: the sampler on stochastic rows, the ODE step elsewhere."""
        sig, nxt = batch_cols["sigmas"][:, k], batch_cols["sigmas"][:, k + 1]  # [B] each
        det = ode(x, pred, sig, nxt, prev_sample=prev_sample)
        if not bool(stochastic.any()):
            return det
        opts = {name: noise_level for name in SAMPLER_OPTIONS[sampler]}
        sde = SAMPLERS[sampler](
            x, pred, sig, nxt, prev_sample=prev_sample, generator=generator, **opts
        )
        return where_rows(stochastic, sde, det)

    def _kl_var(self, batch: FlowBatch, std: Tensor) -> Tensor:  # [n, K]
        if self.kl_form == "exact":
            return std**2
        gap = (batch.sigmas[:, :-1] - batch.sigmas[:, 1:]).float()  # [n, K]  sigma_k - sigma_{k+1}
        return std**2 / gap

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
        return predict(
            self.family, model, x, sigma=cols["sigmas"][:, k], timestep=cols["timesteps"][:, k],
            cond=cond.embeds, negative=cond.negative, guidance_scale=gscale, guidance=emb,
        )  # fmt: skip  # [B, *latent] float32

    @torch.no_grad()
    def sample(
        self,
        cond: FlowCondition | list[str],
        group_size: int,
        *,
        steps: int | None = None,
        mode: Literal["rollout", "eval"] = "rollout",
        generator: torch.Generator | None = None,
        group_ids: Tensor | list[int] | None = None,
        optimizer_step: int = 0,
        guidance_scale: float | None = None,
        chunk_size: int | None = None,
        store_means: bool = False,
    ) -> Rollout:
        """group_size trajectories per condition row (consecutive rows); rewards are left empty.

        mode "rollout": rollout_steps (or `steps`), step selection decides stochastic / trained
        steps. mode "eval": eval_steps, every step deterministic, nothing trained (mask all False).
        Sampler "ode" (DiffusionNFT / AWM rollouts): deterministic steps, mask all False.
        """
        _check_choice("mode", mode, ("rollout", "eval"))
        prompts = cond if isinstance(cond, list) else None
        cond = self.encode(cond) if isinstance(cond, list) else cond
        b, dev = len(cond), self.device
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        gids = (
            torch.arange(b) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
        )
        if gids.shape != (b,):
            raise ValueError(
                f"group_ids must have one id per condition row ({b}), got {tuple(gids.shape)}"
            )
        gids = gids.repeat_interleave(group_size)  # [N]
        n = len(gids)
        k_steps = steps or (self.rollout_steps if mode == "rollout" else self.eval_steps)
        sched = self._schedule(k_steps)
        cols = {
            k: v.to(dev)[None].expand(n, -1).contiguous() for k, v in sched.items() if v is not None
        }
        seed = int(torch.randint(2**62, (1,), generator=generator, device=_gen_device(generator)))
        if mode == "rollout" and self.sampler != "ode":
            sel = select_steps(self.steps, k_steps, gids, generator=torch.Generator().manual_seed(seed),
                               optimizer_step=optimizer_step)  # fmt: skip
            train, stochastic = sel.train.to(dev), sel.stochastic.to(dev)  # [N, K] each
        else:
            train = stochastic = torch.zeros(n, k_steps, dtype=torch.bool, device=dev)
        gs = self.guidance_scale if guidance_scale is None else float(guidance_scale)
        gscale = torch.full((n,), gs, device=dev)  # [N]
        cond_n = cond.repeat(group_size).to(dev)
        x = initial_noise(
            self.latent_shape, gids, self.initial_noise, generator=generator, device=dev
        )
        self.model.eval()
        latents, logp, means = run_chain(
            partial(self._predict, self.model), self._step, x, cols, cond_n, gscale, stochastic,
            train, sampler=self.sampler, noise_level=self.noise_level, generator=generator,
            chunk=chunk_size or n, store_means=store_means,
        )  # fmt: skip
        batch = FlowBatch(
            latents=latents, sigmas=cols["sigmas"], timesteps=cols["timesteps"], cond=cond_n,
            guidance_scale=gscale, train_mask=train, stochastic=stochastic,
            alphas=cols.get("alphas"), old_mean=means, sampler=self.sampler,
            noise_level=self.noise_level,
        )  # fmt: skip
        info = (
            {} if prompts is None else {"prompt": [p for p in prompts for _ in range(group_size)]}
        )
        return Rollout(group_ids=gids, rewards={}, actions=batch, old_logp=logp, mask=train.clone(),
                       info=info)  # fmt: skip

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
        parts = [DECODERS[self.decoder](self.vae, latents[i : i + chunk], self.pixel_range)
                 for i in range(0, len(latents), chunk)]  # fmt: skip
        return torch.cat(parts)

    def forward_noising(
        self, x0: Tensor, t: Tensor, noise: Tensor, cond: FlowCondition, *,
        which: Literal["current", "old", "ref"] = "current", guidance_scale: float = 1.0,
    ) -> Tensor:  # fmt: skip
        """Velocity Float[B, ...] at x_t = (1 - t) x0 + t noise (t: Float[B] in [0, 1]); "current"
        keeps the graph, "old" / "ref" run without grad under the old / reference weights."""
        _check_choice("which", which, ("current", "old", "ref"))
        t = t.float().to(x0.device)  # [B]
        xt = (1 - bcast(t, x0)) * x0.float() + bcast(t, x0) * noise.float()  # [B, ...]
        cols = {
            "sigmas": t[:, None],
            "timesteps": (t * self.scheduler_config.get("num_train_timesteps", 1000))[:, None],
        }
        gscale = torch.full_like(t, guidance_scale)  # [B]
        if which == "current":
            return self._predict(self.model, xt, cols, 0, cond, gscale)
        ctx = self.old_weights() if which == "old" else self.reference()
        with torch.no_grad(), ctx as scorer:
            model = self.model if which == "old" else scorer._model
            return self._predict(model, xt, cols, 0, cond, gscale)

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

    def _save_scheduler(self, directory: Path) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        sched.save_config(directory / "scheduler")

    def save_pretrained(self, directory: str | Path, *, merge_lora: bool = False) -> Path:
        """A diffusers layout: <folder>/ (transformer or unet: config + merged safetensors; under
        LoRA only with merge_lora), scheduler/, pytorch_lora_weights.safetensors under LoRA (what
        `pipe.load_lora_weights(directory)` reads) and grouprl_flow.json (family, latent shape)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.weights.save(directory, merge_lora)
        self._save_scheduler(directory)
        meta = {"family": self.family.name, "latent_shape": list(self.latent_shape),
                "lora": None if self.lora is None else asdict(self.lora)}  # fmt: skip
        (directory / "grouprl_flow.json").write_text(json.dumps(meta, indent=2))
        return directory

    def load_saved_weights(self, directory: str | Path) -> None:
        """Load what save_pretrained wrote: the LoRA file (LoRA) or the full model folder."""
        self.weights.load(Path(directory))


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _gen_device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")
