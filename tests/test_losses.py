"""Policy-gradient surrogates: hand-computed values and gradients, clip boundaries, masking,
and the gradient-accumulation invariance (micro-batches with global counts == one big batch)."""

import math
from types import SimpleNamespace

import pytest
import torch

from grouprl.config.surrogates import (
    CispoSurrogate,
    ClipCovSurrogate,
    ClipSurrogate,
    KlCovSurrogate,
    ReinforceSurrogate,
    SapoSurrogate,
)
from grouprl.objectives.aggregation import local_counts
from grouprl.objectives.losses import RATIO_LEVELS, SURROGATES, ClipRange, policy_loss

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _leaf(values):
    return _t(values).requires_grad_(True)


def _run(logp_vals, old_vals, adv, mask=None, **kw):
    """Loss value, d loss / d logp and metrics, with logp a float64 leaf."""
    logp = _leaf(logp_vals)
    mask = torch.ones(logp.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    out = policy_loss(logp, _t(old_vals), _t(adv), mask, **kw)
    out.loss.backward()
    return out.loss.item(), logp.grad, out.metrics


def test_registries_match_the_config_names():
    assert sorted(SURROGATES.names()) == sorted(
        ["clip", "cispo", "sapo", "reinforce", "clip_cov", "kl_cov", "pmd", "tpo"]
    )
    assert sorted(RATIO_LEVELS.names()) == ["geometric", "sequence", "token"]


# ---------------------------------------------------------------------------------------- clip


def test_ppo_clip_positive_advantage():
    rho = [0.5, 0.9, 1.1, 1.5]
    # A = +1, eps 0.2: l = -min(rho, 1.2) (the lower clip never binds for A > 0)
    #   = [-0.5, -0.9, -1.1, -1.2]; token mean = -3.7 / 4 = -0.925
    # d l / d logp = -rho where unclipped, 0 where clipped; / 4 tokens
    loss, grad, m = _run([[math.log(r) for r in rho]], [[0.0] * 4], [1.0])
    assert loss == pytest.approx(-0.925)
    torch.testing.assert_close(grad, _t([[-0.5 / 4, -0.9 / 4, -1.1 / 4, 0.0]]))
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.0
    assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(1.5)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["pg_loss"] == pytest.approx(loss)


def test_ppo_clip_negative_advantage():
    rho = [0.5, 0.9, 1.1, 1.5]
    # A = -1: l = max(rho, 0.8) = [0.8, 0.9, 1.1, 1.5]; mean = 4.3 / 4 = 1.075
    # gradient +rho / 4 except the lower-clipped first token
    loss, grad, m = _run([[math.log(r) for r in rho]], [[0.0] * 4], [-1.0])
    assert loss == pytest.approx(1.075)
    torch.testing.assert_close(grad, _t([[0.0, 0.9 / 4, 1.1 / 4, 1.5 / 4]]))
    assert m["clip_frac_low"] == 0.25 and m["clip_frac_high"] == 0.0


def test_clip_higher_asymmetric():
    # eps_low 0.2, eps_high 0.28: for A > 0, rho 1.25 is inside, rho 1.3 is clipped at 1.28
    loss, grad, _ = _run(
        [[math.log(1.25), math.log(1.3)]],
        [[0.0, 0.0]],
        [2.0],
        surrogate=ClipSurrogate(eps_low=0.2, eps_high=0.28),
    )
    assert loss == pytest.approx(-(2 * 1.25 + 2 * 1.28) / 2)
    torch.testing.assert_close(grad, _t([[-2 * 1.25 / 2, 0.0]]))


@pytest.mark.parametrize("side", ["high", "low"])
def test_clip_boundaries(side):
    """rho exactly at 1 +- eps keeps its gradient; just inside too; just outside has none."""
    adv = 1.0 if side == "high" else -1.0
    target = 1.25 if side == "high" else 0.75
    logp0 = _t([math.log(target)])
    rho = torch.exp(logp0).item()  # the exact float64 ratio the loss will see
    eps = rho - 1 if side == "high" else 1 - rho  # exact: |rho - 1| < 1 makes these roundtrip
    step = 1e-6 if side == "high" else -1e-6
    cases = {"at": 0.0, "inside": -step, "outside": step}
    for name, shift in cases.items():
        loss, grad, m = _run(
            [[logp0.item() + shift]],
            [[0.0]],
            [adv],
            surrogate=ClipSurrogate(eps_low=eps, eps_high=eps),
        )
        r = math.exp(logp0.item() + shift)
        if name == "outside":
            assert grad.item() == 0.0, name
            assert loss == pytest.approx(-adv * (1 + eps if side == "high" else 1 - eps))
            assert m[f"clip_frac_{side}"] == 1.0
        else:
            assert grad.item() == pytest.approx(-adv * r), name  # d(-A rho)/d logp = -A rho
            assert loss == pytest.approx(-adv * r)
            assert m[f"clip_frac_{side}"] == 0.0


def test_dual_clip():
    rho = [0.5, 2.0, 4.0]
    # A = -1, c = 3: PPO l = max(rho, 0.8) = [0.8, 2.0, 4.0]; dual: min(l, -A c = 3) = [0.8, 2, 3]
    # mean = 5.8 / 3; gradient only on the middle token: rho / 3 = 2 / 3
    loss, grad, m = _run(
        [[math.log(r) for r in rho]], [[0.0] * 3], [-1.0], surrogate=ClipSurrogate(dual_clip_c=3.0)
    )
    assert loss == pytest.approx(5.8 / 3)
    torch.testing.assert_close(grad, _t([[0.0, 2.0 / 3, 0.0]]))
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    # positive advantages are untouched by the dual clip: -min(rho, 1.2) = [-0.5, -1.2, -1.2]
    loss, _, m = _run(
        [[math.log(r) for r in rho]], [[0.0] * 3], [1.0], surrogate=ClipSurrogate(dual_clip_c=3.0)
    )
    assert loss == pytest.approx(-2.9 / 3) and m["dual_clip_frac"] == 0.0


def test_dual_clip_errors():
    args = (_leaf([[0.0]]), _t([[0.0]]), _t([1.0]), torch.ones(1, 1, dtype=torch.bool))
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
            policy_loss(*args, surrogate=ClipRange(0.2, 0.2, dual_clip_c=bad))
    with pytest.raises(ValueError, match="dual_clip_c applies"):
        policy_loss(*args, surrogate=ClipSurrogate(dual_clip_c=3.0), ratio_level="geometric")
    with pytest.raises(ValueError, match="dual_clip_c"):  # cispo has no dual clip at all
        CispoSurrogate(dual_clip_c=3.0)


# ------------------------------------------------------------------------- other surrogates


def test_cispo_every_token_keeps_a_gradient():
    # old_logp = -1, rho = [0.5, 1.0, 1.5], so logp = -1 + log rho; A = +1, eps 0.2 (two-sided)
    # weights sg(clip(rho, 0.8, 1.2)) = [0.8, 1.0, 1.2]; l = -w * A * logp; grad = -w * A / 3
    rho = [0.5, 1.0, 1.5]
    logp = [-1 + math.log(r) for r in rho]
    loss, grad, m = _run([logp], [[-1.0] * 3], [1.0], surrogate=CispoSurrogate())
    w = [0.8, 1.0, 1.2]
    assert loss == pytest.approx(sum(-wi * lp for wi, lp in zip(w, logp)) / 3)
    torch.testing.assert_close(grad, _t([[-0.8 / 3, -1.0 / 3, -1.2 / 3]]))
    # clip metrics still report trust-region violations (only the A > 0 upper one here)
    assert m["clip_frac_high"] == pytest.approx(1 / 3)


def test_sapo_values_and_on_policy_gradient():
    # rho = 1: sigma(0) = 1/2, l = -(4 / tau) * 1/2 * A: A=+1, tau_pos=1 -> -2; A=-1, tau_neg=1.05
    # -> +2/1.05. The gradient at rho = 1 is -(4/tau) sigma'(0) tau rho A = -A (on-policy PG).
    loss, grad, _ = _run([[0.3], [0.7]], [[0.3], [0.7]], [1.0, -1.0], surrogate=SapoSurrogate())
    assert loss == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    torch.testing.assert_close(grad, _t([[-0.5], [0.5]]))
    # rho = 2, A = +1: -(4/1) sigmoid(1 * (2 - 1)) = -4 sigmoid(1)
    sig1 = 1 / (1 + math.exp(-1))
    loss, grad, _ = _run([[math.log(2.0)]], [[0.0]], [1.0], surrogate=SapoSurrogate())
    assert loss == pytest.approx(-4 * sig1)
    # d/dlogp = -(4/tau) sig(1)(1 - sig(1)) tau rho A = -4 * sig1 * (1 - sig1) * 2
    assert grad.item() == pytest.approx(-8 * sig1 * (1 - sig1))
    # tau by sign of A: rho = 2, A = -1, tau_neg = 2 -> +(4/2) sigmoid(2)
    loss, _, _ = _run([[math.log(2.0)]], [[0.0]], [-1.0], surrogate=SapoSurrogate(tau_neg=2.0))
    assert loss == pytest.approx(2 / (1 + math.exp(-2)))


def test_reinforce_no_ratio():
    # l = -A logp = [2, 4] with A = 2, logp = [-1, -2]; mean 3; gradient -A / 2 = -1
    loss, grad, _ = _run([[-1.0, -2.0]], [[-5.0, 0.0]], [2.0], surrogate=ReinforceSurrogate())
    assert loss == pytest.approx(3.0)
    torch.testing.assert_close(grad, _t([[-1.0, -1.0]]))


# Covariance batch for clip_cov / kl_cov: A = [+2, -2] per row, logp = [[-1, -3], [-5, -8]].
# mean A = 0; mean logp = -17/4 = -4.25; cov = (A - 0)(logp + 4.25):
#   row 0: 2 * [3.25, 1.25] = [6.5, 2.5];  row 1: -2 * [-0.75, -3.75] = [1.5, 7.5]
COV_LOGP = [[-1.0, -3.0], [-5.0, -8.0]]
COV_ADV = [2.0, -2.0]


def test_clip_cov_detaches_the_band_tokens():
    # rho = 1 everywhere (nothing PPO-clipped). Band (1, 5) holds (0, 1) = 2.5 and (1, 0) = 1.5.
    # ratio 0.5 -> max(1, int(0.5 * 4)) = 2 picks: both band tokens lose their gradient.
    # value unchanged: token mean of -A * 1 = (-2 - 2 + 2 + 2) / 4 = 0
    loss, grad, m = _run(
        COV_LOGP, COV_LOGP, COV_ADV, surrogate=ClipCovSurrogate(ratio=0.5),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert loss == pytest.approx(0.0)
    torch.testing.assert_close(grad, _t([[-0.5, 0.0], [0.0, 0.5]]))  # -A rho / 4 elsewhere
    assert m["clip_cov_frac"] == 0.5


def test_clip_cov_random_pick_is_seeded_and_skips_ppo_clipped():
    picks = set()
    for seed in range(20):
        kw = dict(surrogate=ClipCovSurrogate(ratio=2e-4))  # -> max(1, 0) = 1 token
        _, g1, _ = _run(
            COV_LOGP, COV_LOGP, COV_ADV, generator=torch.Generator().manual_seed(seed), **kw
        )
        _, g2, _ = _run(
            COV_LOGP, COV_LOGP, COV_ADV, generator=torch.Generator().manual_seed(seed), **kw
        )
        assert torch.equal(g1, g2)  # same seed, same choice
        zero = tuple(map(tuple, (g1 == 0).nonzero().tolist()))
        assert len(zero) == 1 and zero[0] in {(0, 1), (1, 0)}
        picks.add(zero[0])
    assert picks == {(0, 1), (1, 0)}  # both band tokens get picked for some seed
    # make (0, 1) PPO-clipped (A = +2, rho = 2 > 1.2): the one pick must be (1, 0)
    old = [[-1.0, -3.0 - math.log(2.0)], [-5.0, -8.0]]
    _, grad, _ = _run(COV_LOGP, old, COV_ADV, surrogate=ClipCovSurrogate(ratio=0.5))
    assert grad[1, 0] == 0 and grad[0, 1] == 0  # (0, 1) clipped by PPO, (1, 0) by clip_cov
    assert grad[0, 0] != 0 and grad[1, 1] != 0


def test_kl_cov_penalises_the_top_covariance_token():
    # delta = logp - old = 0.1 everywhere, rho = e^0.1. top-1 cov is (1, 1) = 7.5.
    # l = -A rho (+ coef |0.1| on (1, 1)): [-2r, -2r, 2r, 2r + 0.1] -> sum 0.1, mean 0.025
    # gradients: -A r / 4, plus coef * sign(0.1) / 4 on (1, 1)
    old = [[v - 0.1 for v in row] for row in COV_LOGP]
    loss, grad, m = _run(COV_LOGP, old, COV_ADV, surrogate=KlCovSurrogate(ratio=0.25))
    r = math.exp(0.1)
    assert loss == pytest.approx(0.025)
    torch.testing.assert_close(grad, _t([[-2 * r / 4, -2 * r / 4], [2 * r / 4, (2 * r + 1) / 4]]))
    assert m["kl_cov_frac"] == 0.25
    # no clipping in kl_cov: rho = e^1 with A > 0 keeps its full -A rho gradient
    _, grad, _ = _run([[1.0]], [[0.0]], [1.0], surrogate=KlCovSurrogate(coef=0.0))
    assert grad.item() == pytest.approx(-math.e)


# ------------------------------------------------------------------------------ ratio levels


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    # deltas [0.1, 0.3] (+ one padded slot): log s = 0.2; A = 1, wide clip.
    # every token's value is -A s = -e^0.2 -> token mean -e^0.2.
    # gradient per token: -A * s * 1 / 2 tokens (sg(log s) + logp - sg(logp) has d/dlogp = 1)
    loss, grad, m = _run(
        [[0.1, 0.3, 9.0]], [[0.0, 0.0, 0.0]], [1.0], mask=[[True, True, False]],
        ratio_level="sequence", surrogate=ClipSurrogate(eps_low=1.0, eps_high=1.0),
    )  # fmt: skip
    s = math.exp(0.2)
    assert loss == pytest.approx(-s)
    torch.testing.assert_close(grad, _t([[-s / 2, -s / 2, 0.0]]))
    assert m["ratio_mean"] == pytest.approx(s) and m["ratio_max"] == pytest.approx(s)


def test_gspo_token_form_gradient_follows_token_advantages():
    # token advantages [2, 0] in one sequence, deltas [0.1, 0.3], log s = 0.2, wide clip.
    # token form: l_t = -A_t s_t with value s = e^0.2 and d s_t / d logp_u = s [t == u], so the
    # gradient is -A_t s / 2 = [-s, 0]. (Differentiating the sequence ratio itself would give
    # -(2 s + 0) / 2 * 1/2 = -s/2 on both tokens: the token form is what GSPO-token / verl use.)
    loss, grad, _ = _run(
        [[0.1, 0.3]],
        [[0.0, 0.0]],
        [[2.0, 0.0]],
        ratio_level="sequence",
        surrogate=ClipSurrogate(eps_low=1.0, eps_high=1.0),
    )
    s = math.exp(0.2)
    assert loss == pytest.approx(-s)
    torch.testing.assert_close(grad, _t([[-s, 0.0]]))


def test_gspo_clips_whole_sequences():
    # deltas [0.9, -0.1]: token ratios e^0.9 (outside) and e^-0.1 (inside), but the sequence ratio
    # e^0.4 = 1.49 > 1.2 with A > 0: every token of the sequence is clipped, gradient 0.
    loss, grad, m = _run([[0.9, -0.1]], [[0.0, 0.0]], [1.0], ratio_level="sequence")
    assert loss == pytest.approx(-1.2)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m["clip_frac_high"] == 1.0


def test_gmpo_formula():
    # eps 0.4 / 0.4. seq 0 (A = +1): deltas [-0.5, 0.6] -> c = [-0.5 (A>0: no floor), 0.4]
    #   R_0 = exp(-0.05). seq 1 (A = -1): deltas [-0.6, 0.8, pad] -> c = [-0.4, 0.8 (no cap)]
    #   R_1 = exp(0.2). L = -(1/2)(1 * R_0 + (-1) * R_1)
    # gradients: seq 0 token 0: -(1/2) A R_0 / 2 tokens, token 1 clipped -> 0;
    #            seq 1 token 0 clipped -> 0, token 1: -(1/2)(-1) R_1 / 2
    logp = [[-0.5, 0.6, 0.0], [-0.6, 0.8, 5.0]]
    mask = [[True, True, False], [True, True, False]]
    r0, r1 = math.exp(-0.05), math.exp(0.2)
    for agg in ("token_mean", "seq_mean_token_sum"):  # the aggregation mode is ignored
        loss, grad, m = _run(
            logp, [[0.0] * 3] * 2, [1.0, -1.0], mask=mask, ratio_level="geometric",
            surrogate=ClipSurrogate(eps_low=0.4, eps_high=0.4), aggregation=agg,
        )  # fmt: skip
        assert loss == pytest.approx(-(r0 - r1) / 2)
        torch.testing.assert_close(grad, _t([[-r0 / 4, 0.0, 0.0], [0.0, r1 / 4, 0.0]]))
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.25
    assert m["ratio_min"] == pytest.approx(r0) and m["ratio_max"] == pytest.approx(r1)
    # global num_seqs: mean over 4 sequences instead of 2
    loss, _, _ = _run(
        logp, [[0.0] * 3] * 2, [1.0, -1.0], mask=mask, ratio_level="geometric",
        surrogate=ClipSurrogate(eps_low=0.4, eps_high=0.4), num_seqs=4,
    )  # fmt: skip
    assert loss == pytest.approx(-(r0 - r1) / 4)


def test_gmpo_zero_advantage_tokens_drop_out_of_the_ratio():
    # token advantages [1, 0], deltas [0.2, 0.3], eps 0.4: sgn(0) = 0 makes c = [0.2, 0]
    # R = exp(0.2 / 2) = e^0.1; A_i = (1 + 0) / 2 = 0.5; L = -0.5 e^0.1 over 1 sequence
    # gradient: token 0 -0.5 e^0.1 / 2, token 1 none (its c is the constant 0)
    loss, grad, _ = _run(
        [[0.2, 0.3]],
        [[0.0, 0.0]],
        [[1.0, 0.0]],
        ratio_level="geometric",
        surrogate=ClipSurrogate(eps_low=0.4, eps_high=0.4),
    )
    assert loss == pytest.approx(-0.5 * math.exp(0.1))
    torch.testing.assert_close(grad, _t([[-0.25 * math.exp(0.1), 0.0]]))


def test_gmpo_token_weights_become_a_geometric_mean_sequence_weight():
    # one sequence, A = 1, deltas [0, 0] -> R = 1, L = -1 * W with W = geometric mean of weights
    def loss_with(weights):
        out = policy_loss(
            _leaf([[0.0, 0.0]]), _t([[0.0, 0.0]]), _t([1.0]), torch.ones(1, 2, dtype=torch.bool),
            ratio_level="geometric", token_weights=_t([weights]),
        )  # fmt: skip
        return out.loss.item()

    assert loss_with([0.25, 4.0]) == pytest.approx(-1.0)  # sqrt(0.25 * 4) = 1
    assert loss_with([0.5, 0.5]) == pytest.approx(-0.5)
    assert abs(loss_with([0.0, 2.0])) < 1e-4  # a zero weight drops the sequence: sqrt(1e-10 * 2)


def test_gmpo_only_with_clip():
    args = (_leaf([[0.0]]), _t([[0.0]]), _t([1.0]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="geometric"):
        policy_loss(*args, ratio_level="geometric", surrogate=SapoSurrogate())


# ------------------------------------------------------------------------ weights and metrics


def test_token_weights_multiply_per_token_loss():
    # reinforce, A = 1, logp = [-1, -1, -1], weights [0.5, 0, 2]: l = [0.5, 0, 2], mean 2.5 / 3
    logp = _leaf([[-1.0, -1.0, -1.0]])
    out = policy_loss(
        logp, _t([[0.0] * 3]), _t([1.0]), torch.ones(1, 3, dtype=torch.bool),
        surrogate=ReinforceSurrogate(), token_weights=_t([[0.5, 0.0, 2.0]]),
    )  # fmt: skip
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2.5 / 3)
    torch.testing.assert_close(logp.grad, _t([[-0.5 / 3, 0.0, -2.0 / 3]]))


def test_token_level_advantages_equal_broadcast():
    a = _run([[0.1, -0.2], [0.3, 0.0]], [[0.0, 0.0]] * 2, [1.5, -0.5])
    b = _run([[0.1, -0.2], [0.3, 0.0]], [[0.0, 0.0]] * 2, [[1.5, 1.5], [-0.5, -0.5]])
    assert a[0] == pytest.approx(b[0])
    torch.testing.assert_close(a[1], b[1])


def test_approx_kl_is_k3_of_old_vs_new():
    # deltas [0.1, -0.2]: mean of (e^d - 1 - d)
    _, _, m = _run([[0.1, -0.2]], [[0.0, 0.0]], [1.0])
    expected = ((math.exp(0.1) - 1.1) + (math.exp(-0.2) - 0.8)) / 2
    assert m["approx_kl"] == pytest.approx(expected)


def test_huge_log_ratio_is_clamped():
    loss, grad, m = _run(
        [[50.0]], [[0.0]], [-1.0], surrogate=ClipSurrogate(eps_low=0.2, eps_high=0.2)
    )
    assert math.isfinite(loss) and loss == pytest.approx(math.exp(20))  # -A * e^20
    assert grad.item() == 0.0  # beyond the clamp the ratio is constant


def test_input_errors():
    logp, mask = _leaf([[0.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="did you mean 'clip'"):
        policy_loss(
            logp, _t([[0.0, 0.0]]), _t([1.0]), mask, surrogate=SimpleNamespace(type="clips")
        )
    with pytest.raises(ValueError, match="ratio level"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0]), mask, ratio_level="tokens")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0, 2.0]), mask)
    with pytest.raises(ValueError, match=r"\[n, T\]"):
        policy_loss(logp, _t([[0.0]]), _t([1.0]), mask)
    with pytest.raises(TypeError, match="bool"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0]), mask.float())
    # specs built in code skip the config's range checks; policy_loss checks them itself
    bad_ratio = KlCovSurrogate.model_construct(ratio=0.0)
    with pytest.raises(ValueError, match="kl_cov ratio"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0]), mask, surrogate=bad_ratio)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0]), mask, surrogate=ClipRange(-0.1, 0.2))
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(logp, _t([[0.0, 0.0]]), _t([1.0]), mask, token_weights=_t([[1.0]]))


# ----------------------------------------------------------------- masking and invariances

CONFIGS = [
    dict(ratio_level="token", surrogate=ClipSurrogate(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)),
    dict(ratio_level="token", surrogate=CispoSurrogate(eps_low=10.0, eps_high=0.2)),
    dict(ratio_level="token", surrogate=SapoSurrogate()),
    dict(ratio_level="token", surrogate=ReinforceSurrogate()),
    dict(ratio_level="sequence", surrogate=ClipSurrogate(eps_low=0.05, eps_high=0.05)),
    dict(ratio_level="sequence", surrogate=SapoSurrogate()),
    dict(ratio_level="geometric", surrogate=ClipSurrogate(eps_low=0.1, eps_high=0.1)),
]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
MAX_LEN = 8


def _batch(seed=0, n=7, t=6):
    """Random batch with varied lengths, an empty row, advantages of both signs, ratios that clip."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 0, 4, 3, 6, 2])[:n]
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [n, t]
    old = -torch.rand(n, t, generator=g, dtype=F64) * 3  # [n, t]
    logp = old + 0.3 * torch.randn(n, t, generator=g, dtype=F64)  # [n, t]
    adv = torch.randn(n, generator=g, dtype=F64)  # [n]
    weights = 0.5 + torch.rand(n, t, generator=g, dtype=F64)  # [n, t]
    return logp, old, adv, mask, weights


def _loss_and_grad(logp, old, adv, mask, weights, **kw):
    leaf = logp.clone().requires_grad_(True)
    out = policy_loss(leaf, old, adv, mask, token_weights=weights, **kw)
    out.loss.backward()
    return out, leaf.grad


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['ratio_level']}-{c['surrogate'].type}")
def test_micro_batches_with_global_counts_equal_one_big_batch(cfg, agg):
    logp, old, adv, mask, w = _batch()
    tokens, seqs = local_counts(mask)
    kw = dict(cfg, aggregation=agg, max_len=MAX_LEN)
    full, full_grad = _loss_and_grad(logp, old, adv, mask, w, **kw)
    clipped = full.metrics["clip_frac_low"] + full.metrics["clip_frac_high"]
    assert clipped > 0 or cfg["surrogate"].type in ("sapo", "reinforce")  # the clip is exercised
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5, 6]):
        width = max(int(mask[rows].sum(-1).max()), 1)  # each micro-batch padded to its own width
        out = policy_loss(
            leaf[rows, :width], old[rows, :width], adv[rows], mask[rows, :width],
            token_weights=w[rows, :width], num_tokens=tokens, num_seqs=seqs, **kw,
        )  # fmt: skip
        total = total + out.loss
    total.backward()
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(leaf.grad, full_grad)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['ratio_level']}-{c['surrogate'].type}")
def test_permuting_samples_changes_nothing(cfg):
    logp, old, adv, mask, w = _batch(seed=1)
    perm = torch.tensor([4, 0, 6, 2, 1, 5, 3])
    kw = dict(cfg, aggregation="seq_mean_token_mean")
    a, ga = _loss_and_grad(logp, old, adv, mask, w, **kw)
    b, gb = _loss_and_grad(logp[perm], old[perm], adv[perm], mask[perm], w[perm], **kw)
    assert b.loss.item() == pytest.approx(a.loss.item(), rel=1e-12)
    torch.testing.assert_close(gb, ga[perm])


PAD_CONFIGS = CONFIGS + [
    dict(ratio_level="sequence", surrogate=KlCovSurrogate(ratio=0.2)),
    dict(
        ratio_level="token",
        surrogate=ClipCovSurrogate(ratio=0.3, lb=-1e9, ub=1e9),
    ),
    dict(ratio_level="token", surrogate=KlCovSurrogate(ratio=0.2)),
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    "cfg", PAD_CONFIGS, ids=lambda c: f"{c['ratio_level']}-{c['surrogate'].type}"
)
def test_padding_columns_and_empty_rows_change_nothing(cfg, agg):
    """Extra NaN-filled padded columns and a fully masked extra row: same loss, same gradients,
    zero (not NaN) gradient on every padded slot."""
    logp, old, adv, mask, w = _batch(seed=2)
    kw = dict(cfg, aggregation=agg, max_len=MAX_LEN)
    ref, ref_grad = _loss_and_grad(
        logp, old, adv, mask, w, generator=torch.Generator().manual_seed(0), **kw
    )
    n, t = logp.shape

    def pad(x, fill):
        out = torch.full((n + 1, t + 3), fill, dtype=x.dtype)
        out[:n, :t] = x
        return out

    big_mask = pad(mask, False)
    nan = float("nan")
    # token-level advantages and weights, NaN on every padded slot as well
    big_adv = pad(adv[:, None].expand(n, t), nan)
    out, grad = _loss_and_grad(
        pad(logp, nan), pad(old, nan), big_adv, big_mask, pad(w, nan),
        generator=torch.Generator().manual_seed(0), **kw,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-12)
    torch.testing.assert_close(grad[:n, :t], ref_grad)
    assert torch.isfinite(grad).all() and (grad[~big_mask] == 0).all()
    for k, v in ref.metrics.items():
        assert out.metrics[k] == pytest.approx(v, rel=1e-9), k


@pytest.mark.parametrize(
    "cfg", PAD_CONFIGS, ids=lambda c: f"{c['ratio_level']}-{c['surrogate'].type}"
)
def test_all_masked_batch_is_zero_with_graph_and_zero_metrics(cfg):
    logp = torch.randn(3, 4, dtype=F64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = policy_loss(logp, torch.randn(3, 4, dtype=F64), _t([1.0, -1.0, 0.5]), mask, **cfg)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(v == 0.0 for v in out.metrics.values()), out.metrics


# GSPO at a clip bound, float32 (the dtype of real runs). log_s = mean token log-ratio sits within
# an ulp of log(1.2); the tokens' log-probs span 0.7 .. 19, so the old per-token form
# (log_s + logp) - logp rounded each token differently and clipped part of the sequence.
_PAST = (  # exp(log_s) > 1.2 after rounding: the whole sequence is clipped
    [[-10.525915145874023, -4.873165130615234, -11.69184684753418, -0.6630527973175049]],
    [[-10.708236694335938, -5.055487155914307, -11.874168395996094, -0.8453747034072876]],
)
_INSIDE = (  # exp(log_s) <= 1.2: no token is clipped
    [[-11.058140754699707, -19.05476188659668, -0.7232964038848877, -3.704620599746704]],
    [[-11.240462303161621, -19.237083435058594, -0.9056180715560913, -3.8869423866271973]],
)


def _run32(logp_vals, old_vals):
    logp = torch.tensor(logp_vals, dtype=torch.float32, requires_grad=True)
    old = torch.tensor(old_vals, dtype=torch.float32)
    mask = torch.ones(logp.shape, dtype=torch.bool)
    out = policy_loss(logp, old, torch.tensor([1.0]), mask, ratio_level="sequence",
                      surrogate=ClipSurrogate(eps_low=0.2, eps_high=0.2))  # fmt: skip
    out.loss.backward()
    return logp.grad, out.metrics


@pytest.mark.parametrize("case", [_PAST, _INSIDE], ids=["past_bound", "inside_bound"])
def test_gspo_ratio_is_one_number_per_sequence(case):
    # every token carries the bit-identical sequence ratio: min == max over the sequence's tokens
    _, m = _run32(*case)
    assert float(m["ratio_min"]) == float(m["ratio_max"])
    assert m["clip_frac_high"] in (0.0, 1.0)  # a sequence is clipped whole or not at all


def test_gspo_sequence_just_past_the_clip_bound_gets_exactly_zero_gradient():
    grad, m = _run32(*_PAST)
    assert m["clip_frac_high"] == 1.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_gspo_sequence_just_inside_the_bound_gets_the_full_gradient_on_every_token():
    # GSPO-token: d(-A s_t)/d logp_t = -A s, averaged over 4 tokens -> -s / 4 on each, s = 1.2
    grad, m = _run32(*_INSIDE)
    assert m["clip_frac_high"] == 0.0
    assert torch.unique(grad).numel() == 1
    assert grad[0, 0].item() == pytest.approx(-1.2 / 4, rel=1e-6)
