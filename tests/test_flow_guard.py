"""GRPO-Guard RatioNorm and step loss: hand-computed values, the [inferred] identity
(log-ratio + b) * s = mean_dims[z (mu - mu_old)] for x = mu_old + s z, 1/dt weighting, clips, errors."""

import math

import pytest
import torch

from grouprl.objectives.flow.guard import guard_log_ratio, guard_step_loss, mean_bias

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _gauss_logp(x, mu, s):
    """Flow-GRPO per-step log-density: the Gaussian log-density averaged over the latent dims."""
    per_dim = -((x - mu) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)
    return per_dim.flatten(1).mean(-1)  # [B]


def test_hand_computed_log_ratio_and_identity():
    # mu_old = [0, 0], mu = [0.2, -0.1], s = 0.5, z = [1, 1] -> x = [0.5, 0.5]
    # log p_old = mean(-z^2/2) + c = -0.5 + c; log p = -mean([0.3^2, 0.6^2] / 0.5) + c = -0.45 + c
    # log-ratio = 0.05; b = mean([0.04, 0.01]) / (2 * 0.25) = 0.05; (0.05 + 0.05) * 0.5 = 0.05
    # identity: mean(z * (mu - mu_old)) = mean([0.2, -0.1]) = 0.05
    mu_old, mu, s = _t([[0.0, 0.0]]), _t([[0.2, -0.1]]), 0.5
    x = mu_old + s * _t([[1.0, 1.0]])
    logp, old = _gauss_logp(x, mu, s), _gauss_logp(x, mu_old, s)
    assert (logp - old).item() == pytest.approx(0.05)
    assert mean_bias(mu, mu_old, s, 1).item() == pytest.approx(0.05)
    assert guard_log_ratio(logp, old, mu, mu_old, s).item() == pytest.approx(0.05)


@pytest.mark.parametrize("seed", range(3))
def test_identity_random_latents(seed):
    """[inferred, METHODS section 6] for x = mu_old + s z the RatioNorm log-ratio is
    mean_dims[z (mu - mu_old)], for any s (no 1/s blow-up), with a per-sample std too."""
    g = torch.Generator().manual_seed(seed)
    b, shape = 4, (3, 2, 2)
    mu_old = torch.randn(b, *shape, generator=g, dtype=F64)
    mu = mu_old + 0.1 * torch.randn(b, *shape, generator=g, dtype=F64)
    z = torch.randn(b, *shape, generator=g, dtype=F64)
    for s in (0.01, 0.3, torch.tensor([0.05, 0.2, 0.7, 1.3], dtype=F64)):
        sb = s if isinstance(s, float) else s.view(b, 1, 1, 1)
        x = mu_old + sb * z
        # Gaussian log-density averaged over dims; the constants cancel in the ratio
        logp = (-((x - mu) ** 2) / (2 * sb**2)).flatten(1).mean(-1)  # [B]
        old = (-((x - mu_old) ** 2) / (2 * sb**2)).flatten(1).mean(-1)  # [B]
        expected = (z * (mu - mu_old)).flatten(1).mean(-1)  # [B]
        torch.testing.assert_close(guard_log_ratio(logp, old, mu, mu_old, s), expected)


def test_step_loss_hand_computed():
    # mean == old_mean (b = 0) and s = 1: log rho~ = logp - old. eps 0.2, adv_clip_max 5, dt 0.1.
    # sample 0: rho 1.1, A = 1 -> -1.1 (inside the clip);
    # sample 1: rho 0.7, A = -10 -> clipped to -5; A < 0 and rho < 0.8 -> -A * 0.8 = 4.0
    # L = mean([-1.1, 4.0]) / 0.1 = 14.5; d L / d logp_0 = -1.1 / 2 / 0.1 = -5.5, sample 1: 0
    logp = _t([math.log(1.1), math.log(0.7)]).requires_grad_(True)
    mean = torch.zeros(2, 3, dtype=F64)
    out = guard_step_loss(
        logp, torch.zeros(2, dtype=F64), mean, mean, 1.0, _t([1.0, -10.0]), 0.1, eps=0.2
    )
    assert out.loss.item() == pytest.approx(14.5)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, _t([-5.5, 0.0]))
    assert out.metrics["clip_frac"] == 0.5 and out.metrics["ratio_max"] == pytest.approx(1.1)


def test_step_loss_std_scale_and_bias():
    # s = 0.5, mean moved by [0.1, 0.3] on 2 dims: b = mean([0.01, 0.09]) / (2 * 0.25) = 0.1
    # logp - old = 0.2 -> log rho~ = (0.2 + 0.1) * 0.5 = 0.15; A = 2, eps large: L = -2 e^0.15 / dt
    # d L / d logp = -2 e^0.15 * 0.5 / dt, dt = 0.25; d L / d mean = -2 e^0.15 * s * (mu - mu_old)
    # / (D s^2) / dt = -2 e^0.15 * [0.1, 0.3] / (2 * 0.5) / 0.25
    logp = _t([0.2]).requires_grad_(True)
    mean = _t([[0.1, 0.3]]).requires_grad_(True)
    out = guard_step_loss(logp, _t([0.0]), mean, _t([[0.0, 0.0]]), 0.5, _t([2.0]), 0.25, eps=10.0)
    e = math.exp(0.15)
    assert out.loss.item() == pytest.approx(-2 * e / 0.25)
    assert out.metrics["bias_mean"] == pytest.approx(0.1)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(-2 * e * 0.5 / 0.25)
    torch.testing.assert_close(mean.grad, _t([[-2 * e * 0.1 / 0.25, -2 * e * 0.3 / 0.25]]))


def test_multi_step_shapes_per_step_dt_and_mask():
    # S = [B=2, K=2] steps, latent dims [1]; b = 0; s = 1; A = [[1], [1]]; dt per step [0.5, 0.25]
    # per entry -rho / dt with rho = e^{delta}; the masked entry (1, 1) is left out of the mean
    delta = _t([[0.0, 0.1], [0.2, 5.0]])
    mean = torch.zeros(2, 2, 1, dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    out = guard_step_loss(
        delta, torch.zeros(2, 2, dtype=F64), mean, mean, 1.0, _t([[1.0], [1.0]]),
        _t([0.5, 0.25]), eps=10.0, mask=mask,
    )  # fmt: skip
    expected = -(1 / 0.5 + math.exp(0.1) / 0.25 + math.exp(0.2) / 0.5) / 3
    assert out.loss.item() == pytest.approx(expected)


def test_errors():
    z1, z2 = torch.zeros(2, dtype=F64), torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="std"):
        guard_log_ratio(z1, z1, z2, z2, 0.0)
    with pytest.raises(ValueError, match="dt"):
        guard_step_loss(z1, z1, z2, z2, 1.0, z1, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        guard_log_ratio(z1, z1, z2, z2[:, :2], 1.0)
    with pytest.raises(ValueError, match="latent dims"):
        guard_log_ratio(z1, z1, torch.zeros(3, 3, dtype=F64), torch.zeros(3, 3, dtype=F64), 1.0)
    with pytest.raises(ValueError, match="mask"):
        guard_step_loss(z1, z1, z2, z2, 1.0, z1, 0.1, mask=torch.ones(3, dtype=torch.bool))
