"""Image / video rollouts in the one training loop: sample groups through a flow (or DDIM) policy,
decode, score with image rewards -> a Rollout; held-out evaluation with fixed prompts and seeds and
image grids saved as PNG.

Glue between train.py, the flow policy (policies/flow/policy.py: FlowPolicy with flow or DDIM rules) and the reward functions
(envs/rewards: fn(images, prompts=..., **columns) -> list[float | None]). The loss side (advantages,
KL, GRPO-Guard, DiffusionNFT / AWM) is workloads/images/loss.py.

- Conditioning (CONDITIONS, keyed by model.condition): "prompt" encodes the examples' prompts with
  the policy's cached text encoders; "class_label" takes the examples' class_label column (with
  model.null_label as the unconditional class for classifier-free guidance); "prompt_image" adds
  the examples' `image` column as the reference image of an image-conditioned pipeline (FLUX.1
  Kontext), its latents in both guidance branches (FlowPolicy.with_reference_images).
- Policy-gradient objectives sample with the configured SDE, the stochastic steps chosen per sample
  (diffusion.train_steps; MixGRPO's window from the optimizer step). Likelihood-free objectives
  (DiffusionNFT, AWM) sample every step deterministically (diffusion.sampler "ode") or with the SDE;
  DiffusionNFT samples with its "old" weights, as its official code does.
- Rewards see the decoded images as one Float[N, 3, H, W] tensor in [0, 1] (video [N, 3, F, H, W]);
  a failing batch is retried one image at a time (score_completions), a failing image is NaN.
- Evaluation: diffusion.eval_steps deterministic steps, no step trained; eval.batch_size prompts per
  batch, each batch's noise from a generator seeded by its first example's "seed", so every
  evaluation draws the same images for the same weights. The grid (a row per prompt, a column per
  seed) goes to <run_dir>/images/step-XXXXXXXX.png.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grouprl.envs.rewards import score_completions
from grouprl.objectives.flow.support import stratified_timestep_indices
from grouprl.policies.flow.fork import sample_tree_groups
from grouprl.policies.flow.weights import OLD
from grouprl.rollouts.filters import cat_rollouts, combined_reward
from grouprl.rollouts.reward_metrics import nanmean_or_nan
from grouprl.rollouts.seeds import sample_seed
from grouprl.runtime.checkpoint import capture_rng, restore_rng
from grouprl.types import Rollout

if TYPE_CHECKING:
    from grouprl.policies.flow.policy import FlowPolicy


def is_images(cfg: Any) -> bool:
    """True when the policy draws images or video (model.type flow or unet)."""
    return cfg.model.type in ("flow", "unet")


def _prompt_condition(cfg: Any, policy: FlowPolicy, examples: list[dict]):
    return policy.encode([ex["prompt"] for ex in examples])


def _class_condition(cfg: Any, policy: FlowPolicy, examples: list[dict]):
    from grouprl.policies.flow.text_encoders import class_condition

    missing = [ex.get("prompt") for ex in examples if "class_label" not in ex]
    if missing:
        raise ValueError(
            f"model.condition='class_label' needs a class_label column; examples without it: "
            f"{missing[:3]} (task image_prompts with source shapes / classes has it)"
        )
    return class_condition([int(ex["class_label"]) for ex in examples], cfg.model.null_label)


def _prompt_image_condition(cfg: Any, policy: FlowPolicy, examples: list[dict]):
    from grouprl.envs.tasks.multimodal import load_image

    missing = [ex.get("prompt") for ex in examples if ex.get("image") is None]
    if missing:
        raise ValueError(
            f"model.condition='prompt_image' needs an `image` column (the reference image); "
            f"examples without it: {missing[:3]}"
        )
    images = [load_image(ex["image"], f"example {ex.get('prompt')!r}: column 'image'")
              for ex in examples]  # fmt: skip
    return policy.with_reference_images(_prompt_condition(cfg, policy, examples), images)


CONDITIONS: dict[str, Callable[[Any, Any, list[dict]], Any]] = {
    "prompt": _prompt_condition,
    "class_label": _class_condition,
    "prompt_image": _prompt_image_condition,
}


def _as_image_batch(fn: Callable) -> Callable:
    """A reward taking Float[N, 3, ...] from score_completions' list of per-image tensors."""

    def reward(images: list[Tensor], **columns: Any) -> list[float | None]:
        return fn(torch.stack(list(images)), **columns)

    return reward


def score_images(
    reward_fns: dict[str, Callable],
    images: Tensor,
    examples: list[dict],
    *,
    fail_fast: bool,
    first_errors: dict[str, str] | None = None,
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """name -> Float[N] rewards of images [N, 3, ...] (examples: one per image) and error counts."""
    if not reward_fns:
        raise ValueError(
            "no reward function for the images: this task has no default reward, list `rewards` "
            "in the config (e.g. jpeg_compressibility, color_target, clip_score, pickscore)"
        )
    fns = {k: _as_image_batch(fn) for k, fn in reward_fns.items()}
    return score_completions(fns, list(images), examples, fail_fast=fail_fast, items_name="images")


def likelihood_free(cfg: Any) -> bool:
    return cfg.diffusion.objective.type != "policy_gradient"


def needs_old_weights(cfg: Any) -> bool:
    """DiffusionNFT's old weights, or AWM's EMA weights (awm_ema_coef > 0): the policy's "old" slot."""
    d = cfg.diffusion
    o = d.objective
    return o.type == "diffusion_nft" or (o.type == "awm" and o.ema_coef > 0)


def has_old_weights(policy: FlowPolicy) -> bool:
    return any(k.startswith(OLD) for k in policy.state_dict())


def lf_mask(cfg: Any, n: int, k: int) -> Tensor:
    """Likelihood-free objectives: Bool[N, K], True at the steps whose sigma may be a training
    timestep (indices 1 .. min(floor(fraction K), K - 1) of the K + 1 sigmas)."""
    cand = stratified_timestep_indices(k, None, cfg.diffusion.objective.timestep_fraction, 1)[
        0
    ]  # [C]
    mask = torch.zeros(n, k, dtype=torch.bool)  # [N, K]
    mask[:, cand - 1] = True
    return mask


@torch.no_grad()
def collect(
    cfg: Any,
    policy: FlowPolicy,
    examples: list[dict],
    reward_fns: dict[str, Callable],
    *,
    first_group_id: int = 0,
    optimizer_step: int = 0,
    first_errors: dict[str, str] | None = None,
    seed: int | None = None,
) -> tuple[Rollout, dict[str, int]]:
    """rollout.group_size images per example, decoded and scored; returns (Rollout, error counts).
    seed: rollout.seeding per_sample, each group sampled alone with torch's RNG seeded from
    (seed, group id) and restored after, so a group's images depend on its id and the weights
    only (not on the batch, the process count or the global RNG); None: the batch from the
    global RNG.

    Rollout: actions FlowBatch, old_logp / mask [N, K] (likelihood-free: mask = the candidate
    training timesteps), rewards name -> Float[N], examples (one per sample; also info prompt /
    example for the logs), generated [N] the denoising steps each row ran (K; a tree's shared
    windows count once: rollout/sampled_actions). rollout.tree (fixed): each group sampled as a
    tree over denoising steps, branch_at in steps (policies/flow/fork.py)."""
    g = cfg.rollout.group_size
    if needs_old_weights(cfg) and not has_old_weights(policy):
        policy.update_old(0.0)  # the first call copies the current weights

    def draw(part: list[dict], first: int) -> Rollout:
        cond = CONDITIONS[cfg.model.condition](cfg, policy, part)
        group_ids = torch.arange(first, first + len(part))  # [B]
        return _sample(cfg, policy, cond, group_ids, optimizer_step)

    if seed is None:  # global seeding: the batch's noise from torch's global RNG
        rollout = draw(examples, first_group_id)
    else:  # per_sample: each group from a generator of its own (the global RNG untouched)
        parts = []
        for i, ex in enumerate(examples):
            with seeded_rng(sample_seed(seed, first_group_id + i, 0)):
                parts.append(draw([ex], first_group_id + i))
        rollout = cat_rollouts(parts)
    if rollout.generated is None:  # flat: every image ran its K steps
        k = rollout.actions.num_steps
        rollout.generated = torch.full((len(rollout),), k, dtype=torch.long)  # [N]
    if likelihood_free(cfg):
        mask = lf_mask(cfg, len(rollout), rollout.actions.num_steps)  # [N, K]
        rollout.mask = mask.to(rollout.old_logp.device)
    repeated = [ex for ex in examples for _ in range(g)]  # one example per image
    images = policy.decode(rollout.actions.final)  # [N, 3, H, W] in [0, 1]
    rollout.rewards, errors = score_images(reward_fns, images, repeated,
                                           fail_fast=cfg.run.fail_fast,
                                           first_errors=first_errors)  # fmt: skip
    rollout.info["prompt"] = [ex.get("prompt", "") for ex in repeated]
    rollout.examples = repeated
    return rollout, errors


def _sample(
    cfg: Any, policy: FlowPolicy, cond: Any, group_ids: Tensor, optimizer_step: int
) -> Rollout:
    """rollout.group_size chains per condition row: flat, a tree (rollout.tree), or with the old
    weights (DiffusionNFT)."""
    d = cfg.diffusion
    mode = "eval" if d.sampler == "ode" else "rollout"  # eval mode: every step deterministic
    guard = getattr(d.objective, "ratio_norm", "off") == "grpo_guard"  # policy_gradient only
    kwargs = dict(steps=d.rollout_steps, mode=mode, group_ids=group_ids,
                  optimizer_step=optimizer_step, store_means=guard)  # fmt: skip
    tree = cfg.rollout.tree
    if tree.type != "none":  # each group a tree over denoising steps (policies/flow/fork.py)
        return sample_tree_groups(policy, cond, tree.branching, tree.offsets(d.rollout_steps),
                                  **kwargs)  # fmt: skip
    if d.objective.type == "diffusion_nft":  # DiffusionNFT samples with its old weights
        with policy.old_weights():
            return policy.sample(cond, cfg.rollout.group_size, **kwargs)
    return policy.sample(cond, cfg.rollout.group_size, **kwargs)


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """torch's global RNG seeded with `seed` inside, restored to its state before on exit."""
    state = capture_rng()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        restore_rng(state)


# ---- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    cfg: Any,
    policy: FlowPolicy,
    examples: list[dict],
    reward_fns: dict[str, Callable],
    weights: dict[str, float],
    *,
    step: int,
    n_samples: int = 8,
    dist: Any = None,
) -> tuple[dict[str, float], list[dict]]:
    """Mean of each reward and of the weighted sum ("reward") over the held-out images drawn with
    diffusion.eval_steps deterministic steps; saves the image grid (main process); rows for
    samples.md. dist (several processes): each draws and scores a share of whole eval batches
    (runtime/distributed map_examples), the images and scores are gathered."""

    def draw(part: list[dict], first: int) -> list[tuple[Tensor, dict[str, float]]]:
        out = []
        for lo in range(0, len(part), cfg.eval.batch_size):
            chunk = part[lo : lo + cfg.eval.batch_size]
            gen = torch.Generator().manual_seed(int(chunk[0].get("seed", first + lo)))
            cond = CONDITIONS[cfg.model.condition](cfg, policy, chunk)
            drawn = policy.sample(cond, 1, mode="eval", generator=gen)
            imgs = policy.decode(drawn.actions.final).cpu()  # [b, 3, ...]
            scores, _ = score_images(reward_fns, imgs, chunk, fail_fast=cfg.run.fail_fast)
            out += [(imgs[i], {k: float(v[i]) for k, v in scores.items()})
                    for i in range(len(chunk))]  # fmt: skip
        return out

    if dist is None:
        results = draw(examples, 0)
    else:
        results = dist.map_examples(examples, draw, unit=cfg.eval.batch_size)
    imgs = torch.stack([r[0] for r in results])  # [E, 3, ...]
    scores = {k: torch.tensor([r[1][k] for r in results]) for k in results[0][1]}  # name -> [E]
    total = combined_reward(scores, {k: weights.get(k, 1.0) for k in scores})  # [E]
    metrics = {"reward": nanmean_or_nan(total), **{k: nanmean_or_nan(v) for k, v in scores.items()}}
    if dist is None or dist.is_main:
        path = Path(cfg.run_dir) / "images" / f"step-{step:08d}.png"
        save_grid(imgs, [ex.get("prompt", "") for ex in examples], path)
    rows = [{"prompt": ex.get("prompt", ""), "seed": ex.get("seed"), "reward": float(total[i]),
             **{k: float(v[i]) for k, v in scores.items()}}
            for i, ex in enumerate(examples[:n_samples])]  # fmt: skip
    return metrics, rows


def save_grid(images: Tensor, prompts: list[str], path: Path, min_tile: int = 64) -> Path:
    """PNG of images [E, 3, H, W] in [0, 1] (video: the first frame): one row per run of equal
    consecutive prompts, labelled with the prompt; tiles upscaled (nearest) to >= min_tile px."""
    from PIL import Image, ImageDraw

    if images.dim() == 5:  # [E, 3, F, H, W] video -> first frame
        images = images[:, :, 0]
    rows: list[list[int]] = []
    for i, p in enumerate(prompts):
        if rows and prompts[rows[-1][0]] == p:
            rows[-1].append(i)
        else:
            rows.append([i])
    h, w = images.shape[-2:]
    scale = max(1, math.ceil(min_tile / min(h, w)))
    th, tw, label_w, pad = h * scale, w * scale, 8 + 7 * max(len(p) for p in prompts), 2
    ncols = max(len(r) for r in rows)
    canvas = Image.new("RGB", (label_w + ncols * (tw + pad), len(rows) * (th + pad)), "white")
    draw = ImageDraw.Draw(canvas)
    pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for r, idx in enumerate(rows):
        y = r * (th + pad)
        draw.text((4, y + th // 2 - 5), prompts[idx[0]], fill="black")
        for c, i in enumerate(idx):
            tile = Image.fromarray(pixels[i]).resize((tw, th), Image.NEAREST)
            canvas.paste(tile, (label_w + c * (tw + pad), y))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    canvas.save(tmp, format="PNG")
    tmp.replace(path)
    return path
