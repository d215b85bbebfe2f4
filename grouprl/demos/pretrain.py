"""Flow-matching pretraining of the tiny shapes model, cached in a folder keyed by its settings.

Rectified flow / flow matching (Lipman et al. arXiv 2210.02747, Liu et al. arXiv 2209.03003) in the
diffusers convention: x0 = the image scaled to [-1, 1], eps ~ N(0, I), sigma ~ U(0, 1),
x_sigma = (1 - sigma) x0 + sigma eps, loss = mean |v(x_sigma, sigma, label) - (eps - x0)|^2.
The label is replaced by the null class with probability `label_dropout` (classifier-free guidance,
Ho & Salimans arXiv 2207.12598). The saved weights are an exponential moving average of the
trained ones (sharper samples after a short run, as in most diffusion training).

    path = cached_pretrain(PretrainSettings(steps=1500), root="runs")   # trains once, then reuses

The cache folder `root/shapes-flow-<hash>` holds the diffusers layout of ShapesVelocityNet plus
`pretrain.json` (settings, losses, seconds); its name carries a hash of every setting, so changing
any of them trains a new model instead of silently reusing an old one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from grouprl.demos.velocity import ShapesVelocityNet
from grouprl.envs.shapes import (
    COLORS,
    DATA_VERSION,
    SHAPES,
    SIZE,
    colour_coverage,
    sample_batch,
)


@dataclasses.dataclass(frozen=True)
class PretrainSettings:
    """Everything the pretrained weights depend on (all of it goes into the cache key)."""

    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 50
    channels: tuple[int, int] = (16, 32)
    emb_dim: int = 128
    label_dropout: float = 0.1
    ema_decay: float = 0.995
    size: int = SIZE
    seed: int = 0

    def key(self) -> str:
        text = json.dumps([dataclasses.asdict(self), DATA_VERSION], sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]


def to_model_space(images: Tensor) -> Tensor:
    """Images in [0, 1] -> the model's data space [-1, 1]."""
    return images * 2 - 1


def to_images(x: Tensor) -> Tensor:
    """The model's data space -> images in [0, 1] (clamped)."""
    return ((x + 1) / 2).clamp(0, 1)


def flow_matching_loss(model, x0: Tensor, labels: Tensor, generator: torch.Generator) -> Tensor:
    """mean |v(x_sigma, sigma, label) - (eps - x0)|^2 with sigma ~ U(0, 1) per sample (scalar)."""
    eps = torch.randn(x0.shape, generator=generator)  # [B, 3, H, W]
    sigma = torch.rand(x0.shape[0], generator=generator)  # [B]
    s = sigma.view(-1, 1, 1, 1)  # [B, 1, 1, 1]
    x = (1 - s) * x0 + s * eps  # [B, 3, H, W]
    return ((model(x, sigma, labels) - (eps - x0)) ** 2).mean()


@torch.no_grad()
def euler_sample(
    model,
    labels: Tensor,
    steps: int,
    generator: torch.Generator,
    guidance: float = 1.0,
    size: int = SIZE,
) -> Tensor:
    """Deterministic Euler (ODE) samples from pure noise on a uniform sigma grid, images in [0, 1],
    Float[B, 3, H, W]; guidance > 1 mixes in the null-class velocity (classifier-free guidance)."""
    x = torch.randn((len(labels), 3, size, size), generator=generator)  # [B, 3, H, W]
    null = torch.full_like(labels, model.num_classes)  # [B]
    sigmas = torch.linspace(1.0, 0.0, steps + 1)  # [steps + 1]
    for sigma, nxt in zip(sigmas[:-1], sigmas[1:]):
        v = model(x, sigma, labels)  # [B, 3, H, W]
        if guidance != 1.0:
            v = model(x, sigma, null) + guidance * (v - model(x, sigma, null))
        x = x + (nxt - sigma) * v  # [B, 3, H, W]
    return to_images(x)


def _lr_factor(step: int, s: PretrainSettings) -> float:
    warm = min(1.0, (step + 1) / (s.warmup + 1))
    progress = min(1.0, step / max(1, s.steps))
    return warm * 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine decay to 0


def pretrain(
    s: PretrainSettings, out_dir: Path, log: Callable[[str], None] = print, log_every: int = 250
) -> dict:
    """Train ShapesVelocityNet from scratch with flow matching; save the EMA weights to `out_dir`.

    Returns the record written to out_dir/pretrain.json: settings, loss curve (mean per
    `log_every` steps), seconds, and the colour coverage of 20-step Euler samples (a sanity
    number: the fraction of pixels in the prompt's colour; real data has about 0.12)."""
    torch.manual_seed(s.seed)
    n_classes = len(COLORS) * len(SHAPES)
    model = ShapesVelocityNet(num_classes=n_classes, channels=s.channels, emb_dim=s.emb_dim)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: _lr_factor(u, s))
    gen = torch.Generator().manual_seed(s.seed)
    t0, cpu0, losses, window = time.time(), time.process_time(), [], []
    for step in range(s.steps):
        images, labels = sample_batch(s.batch_size, generator=gen, size=s.size)  # [B,3,S,S], [B]
        drop = torch.rand(s.batch_size, generator=gen) < s.label_dropout  # [B]
        labels = labels.masked_fill(drop, n_classes)  # [B] null class where dropped
        loss = flow_matching_loss(model, to_model_space(images), labels, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(s.ema_decay, (1 + step) / (10 + step))  # short warm-up of the average
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        window.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == s.steps:
            losses.append(sum(window) / len(window))
            log(f"  pretrain step {step + 1}/{s.steps}: loss {losses[-1]:.4f} "
                f"({time.time() - t0:.0f} s)")  # fmt: skip
            window = []
    seconds, cpu_seconds = time.time() - t0, time.process_time() - cpu0
    check = torch.Generator().manual_seed(s.seed + 1)
    labels = torch.arange(n_classes).repeat(4)  # [4 * classes]
    samples = euler_sample(ema.eval(), labels, 20, check, size=s.size)  # [4 * classes, 3, S, S]
    record = {
        "settings": dataclasses.asdict(s),
        "loss_curve": losses,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # summed over threads; less inflated by other load
        "colour_coverage_ode20": float(colour_coverage(samples, labels).mean()),
    }
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ema.save_pretrained(tmp)
    (tmp / "pretrain.json").write_text(json.dumps(record, indent=1))
    tmp.rename(out_dir)  # the folder appears complete or not at all
    return record


def cache_dir(s: PretrainSettings, root: str | Path) -> Path:
    return Path(root) / f"shapes-flow-{s.key()}"


def cached_pretrain(
    s: PretrainSettings, root: str | Path, log: Callable[[str], None] = print
) -> Path:
    """The pretrained model folder for settings `s` under `root`: trained now unless cached."""
    out = cache_dir(s, root)
    if (out / "pretrain.json").exists():
        log(f"reusing the pretrained shapes model in {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    n_params = sum(
        p.numel() for p in ShapesVelocityNet(channels=s.channels, emb_dim=s.emb_dim).parameters()
    )
    log(f"flow-matching pretraining of a {n_params / 1e3:.0f}k-parameter velocity model on "
        f"{s.size}x{s.size} coloured shapes ({s.steps} steps of {s.batch_size})")  # fmt: skip
    pretrain(s, out, log)
    return out
