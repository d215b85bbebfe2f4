"""DiffusionNFT and AWM losses: hand-computed values and gradients, edge cases; timestep draws, decays."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.config.diffusion import DiffusionConfig
from grouprl.objectives.flow.losses import (
    LIKELIHOOD_FREE,
    awm_log_likelihood,
    awm_loss,
    forward_noise,
    nft_loss,
    optimality_probability,
)
from grouprl.objectives.flow.support import (
    EMA_DECAYS,
    ema_update_,
    likelihood_free_options,
    stratified_timestep_indices,
)

# one sample, one timestep, two latent elements (hand-computable)
X0 = torch.tensor([[1.0, -1.0]])  # [B=1, D=2]
NOISE = torch.tensor([[[0.5, 0.5]]])  # [1, K=1, 2]
T = torch.tensor([[0.5]])  # [1, 1]
V = torch.tensor([[[0.2, -0.6]]])  # [1, 1, 2]
V_OLD = torch.tensor([[[0.0, -1.0]]])  # [1, 1, 2]


def _mean(xs):
    return sum(xs) / len(xs)


def _rand(b=3, k=2, d=(2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, *d, generator=g)
    noise = torch.randn(b, k, *d, generator=g)
    t = torch.rand(b, k, generator=g) * 0.9 + 0.05
    v = torch.randn(b, k, *d, generator=g)
    v_old = v + 0.1 * torch.randn(b, k, *d, generator=g)
    return x0, noise, t, v, v_old


# ---- shared pieces -----------------------------------------------------------------------------


def test_forward_noise_by_hand():
    assert torch.allclose(forward_noise(X0, NOISE, T), torch.tensor([[[0.75, -0.25]]]))
    t = torch.tensor([[0.0, 1.0]])
    both = forward_noise(X0, torch.cat([NOISE, NOISE], 1), t)  # [1, 2, 2]
    assert torch.equal(both[0, 0], X0[0]) and torch.equal(both[0, 1], NOISE[0, 0])


def test_optimality_probability_by_hand():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 10.0])
    assert torch.allclose(
        optimality_probability(adv, 5.0), torch.tensor([0, 0, 0.25, 0.5, 0.75, 1])
    )
    with pytest.raises(ValueError, match="A_max"):
        optimality_probability(adv, 0.0)


# ---- DiffusionNFT ------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_nft_loss_by_hand(beta):
    x_t = [0.75, -0.25]  # 0.5 x0 + 0.5 noise
    vp = [beta * a + (1 - beta) * b for a, b in zip([0.2, -0.6], [0.0, -1.0])]
    vn = [(1 + beta) * b - beta * a for a, b in zip([0.2, -0.6], [0.0, -1.0])]
    pos = [x - 0.5 * u - x0 for x, u, x0 in zip(x_t, vp, [1.0, -1.0])]
    neg = [x - 0.5 * u - x0 for x, u, x0 in zip(x_t, vn, [1.0, -1.0])]
    err_p = _mean([e * e for e in pos]) / _mean([abs(e) for e in pos])
    err_n = _mean([e * e for e in neg]) / _mean([abs(e) for e in neg])
    r = 0.75  # A = 2.5 with A_max = 5
    expected = 5 * (r * err_p + (1 - r) * err_n) / beta
    out = nft_loss(V, X0, NOISE, T, torch.tensor([2.5]), v_old=V_OLD, beta=beta, adv_clip_max=5.0)
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-6)
    if beta == 1.0:
        assert math.isclose(expected, 4.94140625, rel_tol=1e-9)  # worked out on paper
    assert math.isclose(out.metrics["r_mean"], 0.75) and out.metrics["kl"] == 0.0


def test_nft_with_r_one_is_adaptively_weighted_flow_matching():
    # beta 1, A = A_max: L = A_max mean t^2 |v - v*|^2 / w with w = t mean |v - v*| (no gradient)
    x0, noise, t, v, v_old = _rand(b=2, k=1)
    v = v.requires_grad_()
    out = nft_loss(v, x0, noise, t, torch.tensor([5.0, 5.0]), v_old=v_old, adv_clip_max=5.0)
    out.loss.backward()
    target = noise - x0.unsqueeze(1)  # [B, K, *D]
    vv = v.detach().clone().requires_grad_()
    tt = t[..., None, None]
    w = (tt * (vv - target).abs()).flatten(2).mean(-1).detach()  # [B, K]
    ref = 5 * ((tt**2 * (vv - target) ** 2).flatten(2).mean(-1) / w).mean()
    ref.backward()
    assert torch.allclose(out.loss, ref) and torch.allclose(v.grad, vv.grad, atol=1e-6)


def test_nft_all_equal_rewards_give_no_gradient_on_policy():
    x0, noise, t, v, _ = _rand()
    v = v.requires_grad_()
    out = nft_loss(v, x0, noise, t, torch.zeros(3), v_old=None)  # r~ = 0.5, v_old = sg(v)
    out.loss.backward()
    assert out.loss.item() > 0 and torch.allclose(v.grad, torch.zeros_like(v), atol=1e-7)


def test_nft_gradient_moves_towards_the_target_for_good_samples_and_away_for_bad():
    x0, noise, t, v, _ = _rand(b=1, k=1)
    target = noise - x0.unsqueeze(1)
    for adv, sign in [(3.0, -1), (-3.0, +1)]:
        vv = v.clone().requires_grad_()
        nft_loss(vv, x0, noise, t, torch.tensor([adv])).loss.backward()
        stepped = vv.detach() - 1e-3 * vv.grad
        change = float(((stepped - target) ** 2).mean() - ((v - target) ** 2).mean())
        assert change * sign > 0, adv


def test_nft_timesteps_at_the_boundaries():
    x0, noise, _, v, v_old = _rand(b=2, k=2)
    t = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    v = v.requires_grad_()
    out = nft_loss(v, x0, noise, t, torch.tensor([1.0, -1.0]), v_old=v_old)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(v.grad).all()
    assert torch.equal(v.grad[:, 0], torch.zeros_like(v.grad[:, 0]))  # t = 0: x_t = x0, no signal
    only_t0 = nft_loss(v, x0, noise, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), v_old=v_old)
    assert only_t0.loss.item() == 0.0


def test_nft_kl_term_by_hand_and_missing_reference_fails():
    v_ref = torch.tensor([[[0.0, 0.0]]])
    base = nft_loss(V, X0, NOISE, T, torch.tensor([2.5]), v_old=V_OLD)
    with_kl = nft_loss(V, X0, NOISE, T, torch.tensor([2.5]), v_old=V_OLD, v_ref=v_ref, kl_coef=0.1)
    assert math.isclose((with_kl.loss - base.loss).item(), 0.1 * (0.04 + 0.36) / 2, rel_tol=1e-5)
    assert math.isclose(with_kl.metrics["kl"], 0.02, rel_tol=1e-5)
    with pytest.raises(ValueError, match="needs its velocities"):
        nft_loss(V, X0, NOISE, T, torch.tensor([2.5]), kl_coef=0.1)


# ---- AWM ---------------------------------------------------------------------------------------


def test_awm_ghuber_log_likelihood_by_hand():
    target = torch.tensor([[[-0.1, 0.1]]])  # v - target = (0.3, -0.7)
    mse = (0.09 + 0.49) / 2
    ghuber = awm_log_likelihood(V, target, torch.tensor([[0.4]]), "ghuber", 0.25)
    assert math.isclose(
        float(ghuber), -((mse + 1e-10) ** 0.25 - 1e-10**0.25) * 0.4 / 0.25, rel_tol=1e-5
    )
    uniform = awm_log_likelihood(V, target, torch.tensor([[0.4]]), "uniform", 0.25)
    assert math.isclose(float(uniform), -mse, rel_tol=1e-6)
    with pytest.raises(ValueError, match="allowed are uniform, ghuber"):
        awm_log_likelihood(V, target, torch.tensor([[0.4]]), "huber", 0.25)


def test_awm_on_policy_is_advantage_weighted_flow_matching():
    # ratio 1 in value; gradient of mean(-A~ rho) = A~ d mse / dv = A~ 2 (v - v*) / (D n)
    x0, noise, t, v, _ = _rand(b=2, k=2, d=(3,))
    adv = torch.tensor([10.0, -2.5])  # clipped to 5 -> scaled by 1/5: (1.0, -0.5)
    v = v.requires_grad_()
    out = awm_loss(v, x0, noise, t, adv, weighting="uniform")
    out.loss.backward()
    a = torch.tensor([1.0, -0.5])
    assert math.isclose(out.loss.item(), -float(a.mean()), rel_tol=1e-6)  # -mean A~ over 4 pairs
    assert out.metrics["ratio_mean"] == 1.0 and out.metrics["clip_frac_high"] == 0.0
    target = noise - x0.unsqueeze(1)
    expected = a[:, None, None] * 2 * (v.detach() - target) / (3 * 4)
    assert torch.allclose(v.grad, expected, atol=1e-6)


def test_awm_ratio_outside_the_clip_range_stops_the_gradient_for_good_samples():
    target = NOISE - X0.unsqueeze(1)  # (-0.5, 1.5)
    near = (target + 0.1).requires_grad_()  # mse 0.01
    far = target + 1.0  # mse 1.0: rho = exp(1.0 - 0.01) = 2.69 > 1 + c
    good = awm_loss(near, X0, NOISE, T, torch.tensor([5.0]), v_old=far, weighting="uniform")
    good.loss.backward()
    assert good.metrics["clip_frac_high"] == 1.0 and torch.equal(near.grad, torch.zeros_like(near))
    assert math.isclose(good.loss.item(), -2.0, rel_tol=1e-6)  # -A~ (1 + c)
    near.grad = None
    bad = awm_loss(near, X0, NOISE, T, torch.tensor([-5.0]), v_old=far, weighting="uniform")
    bad.loss.backward()
    assert bad.metrics["clip_frac_low"] == 0.0 and bool((near.grad.abs() > 0).all())
    assert math.isclose(bad.loss.item(), math.exp(0.99), rel_tol=1e-5)  # -A~ rho, A~ = -1


def test_awm_all_equal_rewards_leave_only_the_regularisers():
    x0, noise, t, v, v_old = _rand()
    v = v.requires_grad_()
    out = awm_loss(v, x0, noise, t, torch.zeros(3), v_old=v_old)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(v.grad, torch.zeros_like(v))
    v_ref, v_ema = torch.zeros_like(v), torch.ones_like(v)
    reg = awm_loss(
        v, x0, noise, t, torch.zeros(3), v_ref=v_ref, kl_coef=0.1, v_ema=v_ema, ema_coef=2.0
    )
    kl = 0.1 * float((v.detach() ** 2).mean())
    ema = 2.0 * float(((v.detach() - 1) ** 2).mean())
    assert math.isclose(reg.loss.item(), kl + ema, rel_tol=1e-5)
    assert math.isclose(reg.metrics["kl"], kl, rel_tol=1e-5)
    assert math.isclose(reg.metrics["ema_reg"], ema, rel_tol=1e-5)


def test_awm_timesteps_at_the_boundaries():
    x0, noise, _, v, v_old = _rand(b=2, k=2)
    t = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    v = v.requires_grad_()
    out = awm_loss(v, x0, noise, t, torch.tensor([1.0, -1.0]), v_old=v_old)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(v.grad).all()
    assert torch.equal(v.grad[:, 0], torch.zeros_like(v.grad[:, 0]))  # ghuber weight t = 0
    assert bool((v.grad[:, 1].abs() > 0).all())


# ---- both --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_masked_slots_change_nothing_even_when_nan(name):
    loss_fn = LIKELIHOOD_FREE[name]
    x0, noise, t, v, v_old = _rand(b=3, k=2)
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[True, False], [True, True], [False, False]])
    v_bad, noise_bad, old_bad = v.clone(), noise.clone(), v_old.clone()
    for x in (v_bad, noise_bad, old_bad):
        x[~mask] = float("nan")
    v_bad.requires_grad_()
    out = loss_fn(v_bad, x0, noise_bad, t, adv, v_old=old_bad, mask=mask)
    out.loss.backward()
    # the same loss from the valid slots alone: sample 0 step 0, sample 1 steps 0 and 1
    rows = [(0, [0]), (1, [0, 1])]
    parts = [
        loss_fn(v[i : i + 1, ks], x0[i : i + 1], noise[i : i + 1, ks], t[i : i + 1, ks], adv[i : i + 1],
                v_old=v_old[i : i + 1, ks]).loss * len(ks)
        for i, ks in rows
    ]  # fmt: skip
    assert torch.allclose(out.loss, sum(parts) / 3, atol=1e-6)
    assert torch.isfinite(v_bad.grad).all() and torch.equal(v_bad.grad[~mask], torch.zeros(3, 2, 3))
    none = loss_fn(v, x0, noise, t, adv, v_old=v_old, mask=torch.zeros(3, 2, dtype=torch.bool))
    assert none.loss.item() == 0.0


@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_a_global_count_rescales_the_mean(name):
    x0, noise, t, v, v_old = _rand()
    local = LIKELIHOOD_FREE[name](v, x0, noise, t, torch.tensor([1.0, -1.0, 0.3]), v_old=v_old)
    glob = LIKELIHOOD_FREE[name](
        v, x0, noise, t, torch.tensor([1.0, -1.0, 0.3]), v_old=v_old, num_terms=12
    )
    assert torch.allclose(glob.loss, local.loss / 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"t": torch.tensor([0.5])}, r"need t \[B, K\]"),
        ({"t": torch.tensor([[1.5]])}, r"must lie in \[0, 1\]"),
        ({"v": torch.zeros(1, 1, 3)}, r"v must be \[B, K, \*D\]"),
        ({"advantages": torch.zeros(2)}, r"advantages must be \[B\]"),
        ({"mask": torch.ones(1, 2, dtype=torch.bool)}, r"mask must be \[B, K\]"),
    ],
)
@pytest.mark.parametrize("name", ["diffusion_nft", "awm"])
def test_malformed_inputs_fail_with_a_message(name, kwargs, match):
    args = {"v": V, "x0": X0, "noise": NOISE, "t": T, "advantages": torch.tensor([1.0])}
    kwargs = dict(kwargs)  # the parametrized dict is shared between the two objectives
    mask = kwargs.pop("mask", None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LIKELIHOOD_FREE[name](**args, mask=mask)


def test_registry():
    assert LIKELIHOOD_FREE.names() == ["diffusion_nft", "awm"]
    assert LIKELIHOOD_FREE["awm"] is awm_loss and LIKELIHOOD_FREE["diffusion_nft"] is nft_loss
    with pytest.raises(ValueError, match="unknown likelihood-free objective 'nft'"):
        LIKELIHOOD_FREE["nft"]


# ---- flow_support ------------------------------------------------------------------------------


def test_stratified_timesteps_follow_awm():
    idx = stratified_timestep_indices(14, 6, 0.9, 500, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (500, 6) and idx.dtype == torch.long
    for j in range(6):  # candidates 1..12 in strata (1, 2), (3, 4) ... (11, 12)
        assert set(idx[:, j].tolist()) == {2 * j + 1, 2 * j + 2}
    every = stratified_timestep_indices(10, None, 1.0, 2)
    assert torch.equal(every, torch.arange(1, 10).expand(2, -1))  # never index 0 or the clean end
    with pytest.raises(ValueError, match="only 12 candidates"):
        stratified_timestep_indices(14, 13, 0.9, 1)
    with pytest.raises(ValueError, match="leave none"):
        stratified_timestep_indices(1, None, 1.0, 1)


def test_decays_by_hand():
    assert [EMA_DECAYS["nft_ramp"](s) for s in (0, 100, 1000)] == [0.0, 0.1, 0.5]
    assert [EMA_DECAYS["nft_delayed"](s) for s in (74, 75, 175, 1000)] == [0.0, 0.0, 0.75, 0.999]
    assert [EMA_DECAYS["awm_ramp"](s) for s in (100, 500)] == [0.1, 0.3]
    assert EMA_DECAYS["none"](10) == 0.0
    w, p = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 4.0])]
    ema_update_(w, p, 0.25)
    assert torch.equal(w[0], torch.tensor([2.5, 3.5]))
    with pytest.raises(ValueError, match="decay must be in"):
        ema_update_(w, p, 1.5)


def test_config_options_reach_the_losses():
    d = DiffusionConfig(objective={"type": "awm", "clip": 0.5, "ema_coef": 1.0}, sampler="ode")
    opts = likelihood_free_options(d)
    assert opts == {
        "clip": 0.5, "weighting": "ghuber", "p": 0.25, "adv_max": 1.0, "ema_coef": 1.0,
        "adv_clip_max": 5.0,
    }  # fmt: skip
    x0, noise, t, v, v_old = _rand()
    awm_loss(v, x0, noise, t, torch.ones(3), v_ema=v_old, **opts)  # every key is a keyword
    nft_cfg = DiffusionConfig(objective={"type": "diffusion_nft", "beta": 0.1}, sampler="ode")
    nft = likelihood_free_options(nft_cfg)
    assert nft == {"beta": 0.1, "adv_clip_max": 5.0}
    nft_loss(v, x0, noise, t, torch.ones(3), **nft)
