"""Named algorithms for image / video flow and diffusion models (same registry as the text presets).

Each entry is the data of one `config.presets.Preset` (presets/__init__.py registers them): `algorithm:`
fields as plain keys, other sections as "section.field" keys ("diffusion.noise_level",
"train.lr", "model.lora"); the typed parts (algorithm.surrogate, diffusion.train_steps,
diffusion.objective) as mappings with their `type`. A preset fills only what the user left unset; a mapping value such as
"model.lora" fills the keys missing from the user's own mapping (grouprl/config/loading.py).

Values, from peers/diffusion.md (read from each project's code and configs) and METHODS.md 7-8:
  flow_grpo       SD3.5 GenEval config: flow_sde a 0.7, 10 rollout / 40 eval steps, all but the last step
                  trained, clip 1e-4, advantages clipped to +-5, beta (kl_coef) 0.04 in mean space,
                  per-prompt mean with the batch std (`global_std`), CFG 4.5 at rollout and training,
                  group 24, LoRA r 32 alpha 64 on the attention projections, lr 3e-4, two
                  optimizer steps per sampling round (minibatches 2, one epoch: its configs set
                  gradient_accumulation_steps = num_batches_per_epoch // 2).
  flow_grpo_fast  Flow-GRPO-Fast: SDE in a random window of 2 steps inside the first half (ODE elsewhere;
                  2 trained steps beat 10 in the README), clip 1e-5 (the fast configs' smaller range),
                  beta 0 (as its configs), two optimizer steps per round as flow_grpo. Group size
                  is not set (its configs vary).
  dance_grpo      DanceGRPO FLUX: dance_sde eta 0.3, 16 steps, shift 3, a random 60% of the first K - 1
                  steps per sample, shared initial noise per group, group 12, clip 1e-4, advantages
                  +-5, std + 1e-8 per group, no KL, no CFG (FLUX's guidance embedding is the model's).
  mix_grpo        MixGRPO: flow_sde with eta (= a) 0.7, 25 steps, a sliding window of 4 SDE steps that
                  moves by 1 every 25 optimizer steps, group 12, no KL; the rest as DanceGRPO, on which
                  it builds. MixGRPO-Flash's DPM-Solver++ after the window is not implemented.
  ddpo            ddpo-pytorch: DDIM eta 1, 50 steps, CFG 5 at rollout and training, clip 1e-4,
                  advantages +-10, std + 1e-6, LoRA rank 4 (diffusers' attention-processor LoRA, scale 1)
                  on the UNet attention. Deviations: DDPO normalises with a per-prompt history of the
                  last 16 rewards (here: the group), and trains all 50 steps (here: all but the last).
  diffusion_nft   DiffusionNFT SD3 (PickScore / GenEval): ODE rollouts, 10 steps, CFG-free, beta 1,
                  A_max 5, KL 1e-4 on velocities, old weights decay_type 1, group 24, batch std,
                  lr 3e-4. Deviations: Euler ODE instead of the dpm2 solver; LoRA r 32 alpha 64 is
                  Flow-GRPO's (NFT builds on its code) [inferred].
  branch_grpo     BranchGRPO (arXiv 2509.06040; builds on DanceGRPO, whose settings it keeps here: dance_sde
                  eta 0.3, 16 steps, shift 3, shared initial noise per group, clip 1e-4, advantages
                  +-5, no KL): each group a binary tree over denoising steps, split at steps 0, 3,
                  6, 9 (branching [2, 2, 2, 2] with the group's shared noise: the two depth-1 nodes
                  start from one noise, so the first split is at step 0), G = 16 leaves; reward
                  fusion + depth-wise advantage = algorithm.tree_advantage branch_grpo (node value
                  = mean leaf reward, standardised over the tree's nodes of that depth,
                  objectives/tree.py). [unconfirmed: the split steps, the branching factor, the
                  uniform fusion weights, training all but the last step, no pruning by default
                  (rollout.tree.prune_fraction): the paper's exact values could not be read here.]
  awm             AWM GenEval: ODE rollouts, 14 steps, CFG-free, K = 6 timesteps stratified over
                  [1, floor(0.9 * 14)], ghuber weighting p 0.25, ratio clip 1, advantages clipped to +-5
                  and scaled by 1/5, beta 0.001, beta_ema 1 (needs EMA weights), group 24, batch std,
                  lr 3e-4. Deviation: Euler ODE instead of the SA-solver.
"""

from __future__ import annotations

from types import MappingProxyType

# LoRA targets: Flow-GRPO adapts the attention projections of SD3 / FLUX transformer blocks
# ("attn.to_q", ..., "attn.add_q_proj", ..., "attn.to_add_out"); written as names they match
# nothing in Wan or SANA (attn1 / attn2), so the presets ask for "attention": every linear layer
# of a diffusers attention module, read from the denoiser's classes (policies/lora_targets.py).
# Deviation: on SD3.5's dual-attention blocks this includes the second self-attention (attn2),
# which the name list skipped. The UNet list is DDPO's.
_TRANSFORMER_LORA = "attention"
_UNET_LORA = ("to_q", "to_k", "to_v", "to_out.0")


def _lora(r: int, alpha: int, targets: str | tuple[str, ...]) -> MappingProxyType:
    return MappingProxyType({"r": r, "alpha": alpha, "target_modules": targets})


_PPO_STEP = {"advantage": "grpo", "ratio_level": "token"}


def _clip(eps: float) -> dict:
    """The PPO-clip surrogate with the range 1 +- eps (algorithm.surrogate)."""
    return {"type": "clip", "eps_low": eps, "eps_high": eps}


# Flow-GRPO's configs take two optimizer steps per sampling round (train.gradient_accumulation_steps
# = sample.num_batches_per_epoch // 2, one inner epoch): the second step's ratio departs from 1
# and the clip can act
_FLOW_GRPO_ALGO = {
    **_PPO_STEP, "scale": "batch", "adv_eps": 1e-4, "surrogate": _clip(1e-4),
    "aggregation": "token_mean", "kl_coef": 0.04, "epochs": 1, "minibatches": 2,
}  # fmt: skip
_FLOW_GRPO_DIFFUSION = {
    "diffusion.objective": {"type": "policy_gradient"}, "diffusion.sampler": "flow_sde",
    "diffusion.noise_level": 0.7, "diffusion.rollout_steps": 10, "diffusion.eval_steps": 40,
    "diffusion.train_steps": {"type": "all_but_last"}, "diffusion.adv_clip_max": 5.0,
    "diffusion.guidance_scale": 4.5, "diffusion.train_guidance": "same",
}  # fmt: skip
_FLOW_LORA = {"model.lora": _lora(32, 64, _TRANSFORMER_LORA), "train.lr": 3e-4}
_DANCE_ALGO = {
    **_PPO_STEP, "scale": "group", "adv_eps": 1e-8, "surrogate": _clip(1e-4),
    "aggregation": "token_mean", "kl_coef": 0.0,
}  # fmt: skip
_LIKELIHOOD_FREE = {
    "advantage": "grpo", "scale": "batch", "adv_eps": 1e-4, "diffusion.sampler": "ode",
    "diffusion.guidance_scale": 1.0, "diffusion.train_guidance": "none",
    "diffusion.adv_clip_max": 5.0, **_FLOW_LORA,
}  # fmt: skip

FLOW_PRESETS: list[dict] = [
    {
        "name": "flow_grpo",
        "arxiv": "2505.05470",
        "summary": "PPO-clipped per-step log-probs of an SDE sampler on a flow model (Flow-GRPO).",
        "settings": {
            **_FLOW_GRPO_ALGO,
            **_FLOW_GRPO_DIFFUSION,
            **_FLOW_LORA,
            "rollout.group_size": 24,
        },  # fmt: skip
    },
    {
        "name": "flow_grpo_fast",
        "arxiv": "2505.05470",
        "summary": "Flow-GRPO with the SDE only in a random window of 2 steps, ODE elsewhere.",
        "settings": {
            **_FLOW_GRPO_ALGO,
            "surrogate": _clip(1e-5),
            "kl_coef": 0.0,
            **_FLOW_GRPO_DIFFUSION,
            "diffusion.train_steps": {"type": "random_window", "window_size": 2},
            **_FLOW_LORA,
        },  # fmt: skip
    },
    {
        "name": "dance_grpo",
        "arxiv": "2505.07818",
        "summary": "Constant-diffusion SDE, a random subset of steps trained, shared group noise.",
        "settings": {
            **_DANCE_ALGO,
            "diffusion.objective": {"type": "policy_gradient"},
            "diffusion.sampler": "dance_sde",
            "diffusion.eta": 0.3,
            "diffusion.rollout_steps": 16,
            "diffusion.shift": 3.0,
            "diffusion.train_steps": {"type": "random_fraction", "fraction": 0.6},
            "diffusion.shared_noise": "group",
            "diffusion.adv_clip_max": 5.0,
            "diffusion.guidance_scale": 1.0,
            **_FLOW_LORA,
            "rollout.group_size": 12,
        },  # fmt: skip
    },
    {
        "name": "mix_grpo",
        "arxiv": "2507.21802",
        "summary": "SDE only in a window that slides along the schedule as training goes, ODE elsewhere.",
        "settings": {
            **_DANCE_ALGO,
            "diffusion.objective": {"type": "policy_gradient"},
            "diffusion.sampler": "flow_sde",
            "diffusion.noise_level": 0.7,
            "diffusion.rollout_steps": 25,
            "diffusion.train_steps": {
                "type": "sliding_window",
                "window_size": 4,
                "shift_every": 25,
                "shift_by": 1,
            },
            "diffusion.adv_clip_max": 5.0,
            "diffusion.guidance_scale": 1.0,
            **_FLOW_LORA,
            "rollout.group_size": 12,
        },  # fmt: skip
    },
    {
        "name": "ddpo",
        "arxiv": "2305.13301",
        "summary": "PPO-clipped per-step log-probs of DDIM (eta 1) on an epsilon-prediction UNet.",
        "settings": {
            **_PPO_STEP,
            "scale": "group",
            "adv_eps": 1e-6,
            "surrogate": _clip(1e-4),
            "aggregation": "token_mean",
            "kl_coef": 0.0,
            "diffusion.objective": {"type": "policy_gradient"},
            "diffusion.sampler": "ddim",
            "diffusion.eta": 1.0,
            "diffusion.rollout_steps": 50,
            "diffusion.eval_steps": 50,
            "diffusion.train_steps": {"type": "all_but_last"},
            "diffusion.adv_clip_max": 10.0,
            "diffusion.guidance_scale": 5.0,
            "diffusion.train_guidance": "same",
            "model.lora": _lora(4, 4, _UNET_LORA),
            "train.lr": 3e-4,
        },  # fmt: skip
    },
    {
        "name": "diffusion_nft",
        "arxiv": "2509.16117",
        "summary": "Flow matching on forward-noised samples pulled to a reward-mixed positive velocity.",
        "settings": {
            **_LIKELIHOOD_FREE,
            "kl_coef": 1e-4,
            "diffusion.objective": {
                "type": "diffusion_nft",
                "beta": 1.0,
                "timesteps": None,
                "timestep_fraction": 1.0,
                "ema_decay": "nft_ramp",
            },
            "diffusion.rollout_steps": 10,
            "rollout.group_size": 24,
        },  # fmt: skip
    },
    {
        "name": "awm",
        "arxiv": "2509.25050",
        "summary": "Advantage-weighted flow-matching loss on forward-noised samples, ODE rollouts.",
        "settings": {
            **_LIKELIHOOD_FREE,
            "kl_coef": 0.001,
            "diffusion.objective": {
                "type": "awm",
                "timesteps": 6,
                "timestep_fraction": 0.9,
                "weighting": "ghuber",
                "ghuber_p": 0.25,
                "clip": 1.0,
                "adv_max": 1.0,
                "ema_coef": 1.0,
                "ema_decay": "awm_ramp",
            },
            "diffusion.rollout_steps": 14,
            "rollout.group_size": 24,
        },  # fmt: skip
    },
    {
        "name": "branch_grpo",
        "arxiv": "2509.06040",
        "summary": "DanceGRPO sampled as a tree over denoising steps, depth-wise advantages per window.",
        "settings": {
            **_DANCE_ALGO,
            "tree_advantage": "branch_grpo",
            "diffusion.objective": {"type": "policy_gradient"},
            "diffusion.sampler": "dance_sde",
            "diffusion.eta": 0.3,
            "diffusion.rollout_steps": 16,
            "diffusion.shift": 3.0,
            "diffusion.train_steps": {"type": "all_but_last"},
            "diffusion.shared_noise": "group",
            "diffusion.adv_clip_max": 5.0,
            "diffusion.guidance_scale": 1.0,
            **_FLOW_LORA,
            "rollout.group_size": 16,
            "rollout.tree": {"type": "fixed", "branching": [2, 2, 2, 2], "branch_at": [3, 6, 9]},
        },  # fmt: skip
    },
]
