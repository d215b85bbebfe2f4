"""KL estimators: hand values, straight-through gradients, clamping, KL folded into the reward."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.objectives.kl import KL_ESTIMATORS, kl_in_reward, kl_penalty, sequence_kl

LOG2 = math.log(2.0)
ALL = ["k1", "k2", "k3", "k1+", "k3+"]


def pair(p: float, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor([[math.log(p)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(q)]], dtype=torch.float64, requires_grad=True)
    return logp, ref


def test_names():
    assert KL_ESTIMATORS.names() == ALL


@pytest.mark.parametrize(
    ("p", "q", "expected"),
    [
        # logp = log .5, ref = log .25: k1 = log 2 ; k2 = (log 2)^2 / 2 ; k3 = e^{-log 2} + log 2 - 1
        (0.5, 0.25, {"k1": LOG2, "k2": LOG2**2 / 2, "k3": 0.5 + LOG2 - 1}),
        # logp = log .25, ref = log .5: k1 = -log 2 ; k2 the same ; k3 = 2 - log 2 - 1
        (0.25, 0.5, {"k1": -LOG2, "k2": LOG2**2 / 2, "k3": 2 - LOG2 - 1}),
    ],
)
def test_hand_values(p, q, expected):
    logp, ref = pair(p, q)
    for name, value in expected.items():
        assert kl_penalty(logp, ref, name).item() == pytest.approx(value, abs=1e-12)
    # the straight-through variants keep the value of their base estimator
    assert kl_penalty(logp, ref, "k1+").item() == pytest.approx(expected["k1"], abs=1e-12)
    assert kl_penalty(logp, ref, "k3+").item() == pytest.approx(expected["k3"], abs=1e-12)
    assert expected["k3"] == pytest.approx({0.5: 0.193147, 0.25: 0.306853}[p], abs=1e-6)


def _grads(name: str, p: float, q: float) -> tuple[float, float]:
    logp, ref = pair(p, q)
    kl_penalty(logp, ref, name).sum().backward()
    return logp.grad.item(), ref.grad.item()


@pytest.mark.parametrize("p,q", [(0.5, 0.25), (0.25, 0.5), (0.9, 0.1)])
def test_straight_through_gradient_is_k2_gradient(p, q):
    g2 = _grads("k2", p, q)
    # d k2 / d logp = logp - ref ; d k2 / d ref = -(logp - ref)
    d = math.log(p) - math.log(q)
    assert g2 == pytest.approx((d, -d), abs=1e-12)
    assert _grads("k1+", p, q) == pytest.approx(g2, abs=1e-12)
    assert _grads("k3+", p, q) == pytest.approx(g2, abs=1e-12)
    # while the plain estimators have their own gradients: k1 -> (1, -1), k3 -> (1 - q/p, q/p - 1)
    assert _grads("k1", p, q) == pytest.approx((1.0, -1.0), abs=1e-12)
    assert _grads("k3", p, q) == pytest.approx((1 - q / p, q / p - 1), abs=1e-12)


@pytest.mark.parametrize("name", ALL)
def test_zero_when_equal(name):
    logp = torch.log(torch.tensor([[0.3, 0.7], [0.01, 1.0]], dtype=torch.float64)).requires_grad_()
    kl = kl_penalty(logp, logp.detach().clone(), name)
    assert (kl == 0).all()
    kl.sum().backward()
    # k1's gradient is 1 everywhere (its expectation, not each sample, vanishes); the others are 0
    assert (logp.grad == (1.0 if name == "k1" else 0.0)).all()


def test_k3_clamps():
    # x = ref - logp = -30 -> clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> clamped to 10
    # x = +30 -> clamped to 20: e^20 - 21 -> clamped to 10 ; x = +inf (logp = -inf) -> 10, no NaN
    logp = torch.tensor([[0.0, -30.0, -math.inf, -1.0]], requires_grad=True)
    ref = torch.tensor([[-30.0, 0.0, 0.0, -1.5]])
    kl = kl_penalty(logp, ref, "k3")
    assert kl[0, :3].tolist() == [10.0, 10.0, 10.0]
    assert kl[0, 3].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-6)
    kl.sum().backward()
    assert logp.grad[0, :3].tolist() == [0.0, 0.0, 0.0]  # clamped -> no gradient


def test_shape_and_name_errors():
    with pytest.raises(ValueError, match="allowed are"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "low_var_kl")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 2), "k1")


def test_sequence_kl_and_kl_in_reward():
    h, q = math.log(0.5), math.log(0.25)
    logp_old = torch.tensor([[h, h, float("nan")], [h, 0.0, 0.0]])
    ref = torch.tensor([[q, q, 0.0], [q, 5.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # k1 per real token = log 2: row 0 has 2 tokens, row 1 has 1; the NaN padding must not leak
    seq = sequence_kl(logp_old, ref, mask, "k1")
    assert seq.tolist() == pytest.approx([2 * LOG2, LOG2], abs=1e-6)
    out = kl_in_reward(torch.tensor([1.0, float("nan")]), logp_old, ref, mask, 0.1, "k1")
    # 1 - 0.1 * 2 log 2 = 0.861371 ; a NaN (no) reward stays NaN
    assert out[0].item() == pytest.approx(1 - 0.2 * LOG2, abs=1e-6)
    assert math.isnan(out[1].item())
    # k3 in reward: 1 - 0.5 * 2 * (0.5 + log 2 - 1)
    out3 = kl_in_reward(torch.tensor([1.0, 0.0]), logp_old, ref, mask, 0.5, "k3")
    assert out3[0].item() == pytest.approx(1 - (0.5 + LOG2 - 1), abs=1e-6)


def test_kl_in_reward_has_no_gradient_and_checks_shapes():
    logp_old = torch.zeros(2, 3, requires_grad=True)
    out = kl_in_reward(
        torch.zeros(2), logp_old, torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), 1.0, "k2"
    )
    assert not out.requires_grad
    with pytest.raises(ValueError, match="rewards"):
        kl_in_reward(
            torch.zeros(3),
            logp_old,
            torch.ones(2, 3),
            torch.ones(2, 3, dtype=torch.bool),
            1.0,
            "k2",
        )
    with pytest.raises(ValueError, match="mask"):
        sequence_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool), "k1")
