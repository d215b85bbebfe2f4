"""A tiny class-conditional velocity model for pixel-space flow matching (the demo's base model).

A two-level conv U-Net (16x16 -> 8x8 -> 4x4 and back, skip connections) whose residual blocks are
modulated (FiLM: per-channel scale and shift) by an embedding of the noise level sigma plus an
embedding of the class label. Label `num_classes` is the "null" class used for classifier-free
guidance (pretraining drops the label with a small probability).

Convention (diffusers flow matching): x_sigma = (1 - sigma) x0 + sigma eps, the model predicts
v = eps - x0. It is a diffusers ModelMixin + ConfigMixin, so save_pretrained / from_pretrained write
and read the diffusers layout (config.json + diffusion_pytorch_model.safetensors).

    model = ShapesVelocityNet(num_classes=12)
    v = model(x, sigma, class_labels)      # x [B, 3, H, W], sigma [B] in [0, 1], labels Long[B]
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn


def sigma_embedding(sigma: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of 1000 * sigma (the diffusers timestep scale), Float[B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=sigma.device) / half)  # [h]
    angles = 1000.0 * sigma.float().view(-1, 1) * freqs.view(1, -1)  # [B, h]
    return torch.cat([angles.sin(), angles.cos()], dim=1)  # [B, dim]


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, FiLM from the embedding between them, residual skip."""

    def __init__(self, c_in: int, c_out: int, emb_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.film = nn.Linear(emb_dim, 2 * c_out)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(nn.functional.silu(self.norm1(x)))  # [B, c_out, H, W]
        film = self.film(emb)[:, :, None, None]  # [B, 2 c_out, 1, 1]
        scale, shift = film.chunk(2, dim=1)  # [B, c_out, 1, 1] each
        h = self.norm2(h) * (1 + scale) + shift  # [B, c_out, H, W]
        h = self.conv2(nn.functional.silu(h))  # [B, c_out, H, W]
        return self.skip(x) + h  # [B, c_out, H, W]


class ShapesVelocityNet(ModelMixin, ConfigMixin):
    """Velocity v(x_sigma, sigma, label) for small RGB images (see module docstring)."""

    @register_to_config
    def __init__(
        self,
        num_classes: int = 12,
        in_channels: int = 3,
        channels: tuple[int, int] = (32, 64),
        emb_dim: int = 128,
        groups: int = 8,
    ) -> None:
        super().__init__()
        c1, c2 = channels
        self.num_classes = num_classes
        self.sigma_mlp = nn.Sequential(
            nn.Linear(emb_dim // 2, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        self.label_emb = nn.Embedding(num_classes + 1, emb_dim)  # last row: the null class
        self.conv_in = nn.Conv2d(in_channels, c1, 3, padding=1)
        self.down1 = ResBlock(c1, c1, emb_dim, groups)  # full resolution
        self.pool1 = nn.Conv2d(c1, c2, 3, stride=2, padding=1)
        self.down2 = ResBlock(c2, c2, emb_dim, groups)  # 1/2
        self.pool2 = nn.Conv2d(c2, c2, 3, stride=2, padding=1)
        self.mid = ResBlock(c2, c2, emb_dim, groups)  # 1/4
        self.up2 = ResBlock(2 * c2, c2, emb_dim, groups)  # 1/2, with the skip
        self.up1 = ResBlock(c2 + c1, c1, emb_dim, groups)  # full, with the skip
        self.norm_out = nn.GroupNorm(groups, c1)
        self.conv_out = nn.Conv2d(c1, in_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)  # start as v = 0: stable first steps
        nn.init.zeros_(self.conv_out.bias)

    def forward(self, x: Tensor, sigma: Tensor, class_labels: Tensor) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=x.dtype, device=x.device).expand(x.shape[0])  # [B]
        half = self.label_emb.embedding_dim // 2
        emb = self.sigma_mlp(sigma_embedding(sigma, half).to(x.dtype))  # [B, E]
        emb = emb + self.label_emb(class_labels.long())  # [B, E]
        h1 = self.down1(self.conv_in(x), emb)  # [B, c1, H, W]
        h2 = self.down2(self.pool1(h1), emb)  # [B, c2, H/2, W/2]
        h = self.mid(self.pool2(h2), emb)  # [B, c2, H/4, W/4]
        h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")  # [B, c2, H/2, W/2]
        h = self.up2(torch.cat([h, h2], dim=1), emb)  # [B, c2, H/2, W/2]
        h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")  # [B, c2, H, W]
        h = self.up1(torch.cat([h, h1], dim=1), emb)  # [B, c1, H, W]
        return self.conv_out(nn.functional.silu(self.norm_out(h)))  # [B, 3, H, W]
