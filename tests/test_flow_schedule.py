"""Flow schedules, step selection, initial noise, mean-space KL and ratio diagnostics: hand-computed
values (policies/flow_schedule.py, policies/flow_math.py)."""

import math

import pytest
import torch

from grouprl.policies.flow.gaussian import gaussian_mean_kl, ratio_diagnostics
from grouprl.policies.flow.schedule import (
    StepSelectionSettings,
    dynamic_shift_mu,
    flow_sigmas,
    initial_noise,
    select_steps,
)


def _sel(name, k, gids, step=0, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    settings = StepSelectionSettings(name=name, **kw)
    return select_steps(settings, k, torch.as_tensor(gids), generator=g, optimizer_step=step)


# ---- sigmas ------------------------------------------------------------------------------------


def test_linear_spacing_shift_hand_computed():
    # base sigmas [1, .75, .5, .25]; shift 3: 3s / (1 + 2s) = [1, .9, .75, .5]; then a terminal 0
    sig = flow_sigmas({"shift": 3.0}, 4, spacing="linear")
    torch.testing.assert_close(sig, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))


def test_scheduler_spacing_matches_diffusers_and_is_decreasing():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(10)
    sig = flow_sigmas({"shift": 3.0}, 10)
    assert torch.equal(sig, sched.sigmas)
    assert sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0
    assert bool((sig[1:] < sig[:-1]).all())
    # shift 1, 2 steps: linspace(1, 1/1000, 2) unshifted -> [1, 0.001, 0]
    torch.testing.assert_close(flow_sigmas(None, 2), torch.tensor([1.0, 0.001, 0.0]))


def test_dynamic_shift_mu_endpoints_and_errors():
    from types import SimpleNamespace

    c = SimpleNamespace(
        base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15
    )
    assert dynamic_shift_mu(c, 256) == pytest.approx(0.5)
    assert dynamic_shift_mu(c, 4096) == pytest.approx(1.15)
    assert dynamic_shift_mu(c, 2176) == pytest.approx(0.825)  # the midpoint
    with pytest.raises(ValueError, match="image_seq_len"):
        flow_sigmas({"use_dynamic_shifting": True}, 4)
    # mu = 0.5 at 256 tokens: exponential time shift s -> e^mu / (e^mu + 1/s - 1), linear spacing
    sig = flow_sigmas({"use_dynamic_shifting": True}, 2, image_seq_len=256, spacing="linear")
    e = math.exp(0.5)
    torch.testing.assert_close(sig, torch.tensor([1.0, e / (e + 1), 0.0]))
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(None, 0)


# ---- step selection ----------------------------------------------------------------------------


def test_all_but_last():
    out = _sel("all_but_last", 5, [0, 0, 1])
    assert out.train.tolist() == [[True, True, True, True, False]] * 3
    assert bool(out.stochastic.all())
    with pytest.raises(ValueError, match=">= 2 steps"):
        _sel("all_but_last", 1, [0])


def test_random_fraction_counts_per_sample():
    # K = 11: floor(10 * 0.6) = 6 of the first 10 steps, the last never, rows drawn independently
    out = _sel("random_fraction", 11, list(range(8)), fraction=0.6)
    assert out.train.sum(1).tolist() == [6] * 8
    assert not bool(out.train[:, -1].any()) and bool(out.stochastic.all())
    assert len({tuple(r) for r in out.train.tolist()}) > 1
    assert torch.equal(out.train, _sel("random_fraction", 11, list(range(8)), fraction=0.6).train)
    # at least one step even for a tiny fraction; fraction outside (0, 1] fails
    assert _sel("random_fraction", 3, [0, 1], fraction=0.01).train.sum(1).tolist() == [1, 1]
    with pytest.raises(ValueError, match="fraction"):
        _sel("random_fraction", 5, [0], fraction=0.0)


def test_random_window_one_window_per_group_ode_elsewhere():
    gids = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    out = _sel("random_window", 10, gids, window_size=2)  # default range [0, 5)
    assert torch.equal(out.train, out.stochastic)
    assert out.train.sum(1).tolist() == [2] * 12
    starts = out.train.float().argmax(1)  # [N]
    for i in range(12):  # contiguous and inside [0, 5)
        s = int(starts[i])
        assert out.train[i, s : s + 2].all() and s + 2 <= 5
    assert all(len(set(starts[3 * g : 3 * g + 3].tolist())) == 1 for g in range(4))
    custom = _sel("random_window", 10, [0, 1, 2, 3], window_size=3, window_range=(4, 7))
    assert custom.train[:, 4:7].all() and custom.train.sum().item() == 12
    with pytest.raises(ValueError, match="does not fit"):
        _sel("random_window", 10, [0], window_size=3, window_range=(4, 6))


@pytest.mark.parametrize(
    ("step", "at_end", "start"),
    [(0, "stay", 0), (4, "stay", 0), (5, "stay", 2), (17, "stay", 6), (20, "stay", 7),
     (99, "stay", 7), (20, "wrap", 0), (25, "wrap", 2)],
)  # fmt: skip
def test_sliding_window_positions(step, at_end, start):
    # K 10, window 3 (starts 0..7), moves by 2 every 5 optimizer steps: step 20 -> moved 8
    out = _sel("sliding_window", 10, [0, 1], step=step, window_size=3, shift_every=5, shift_by=2,
               at_end=at_end)  # fmt: skip
    expected = torch.zeros(10, dtype=torch.bool)
    expected[start : start + 3] = True
    assert out.train.tolist() == [expected.tolist()] * 2
    assert torch.equal(out.train, out.stochastic)


def test_sliding_window_range_and_errors():
    out = _sel("sliding_window", 10, [0], step=3, window_size=2, window_range=(2, 6), shift_every=1)
    assert out.train[0].nonzero().flatten().tolist() == [4, 5]  # lo 2 + min(3, 2) -> start 4
    with pytest.raises(ValueError, match="unknown step selection"):
        _sel("every_other", 10, [0])
    with pytest.raises(ValueError, match="shift_every"):
        _sel("sliding_window", 10, [0], shift_every=0)


# ---- initial noise -----------------------------------------------------------------------------


def test_shared_noise_equal_within_group_and_different_across():
    gids = torch.tensor([3, 3, 3, 7, 7, 7])
    x = initial_noise((2, 4, 4), gids, "shared", generator=torch.Generator().manual_seed(0))
    assert x.shape == (6, 2, 4, 4) and x.dtype == torch.float32
    assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2]) and torch.equal(x[3], x[5])
    assert not torch.allclose(x[0], x[3])
    ind = initial_noise((2, 4, 4), gids, "independent", generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(ind[0], ind[1])
    again = initial_noise((2, 4, 4), gids, "shared", generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, again)
    with pytest.raises(ValueError, match="noise mode"):
        initial_noise((2,), gids, "per_prompt")


# ---- KL and ratio diagnostics ------------------------------------------------------------------


def test_gaussian_mean_kl_hand_computed():
    # row 0 step 0: diffs [1, 3] -> mean sq 5, var 0.5 -> 5 / 1 = 5; step 1: var 0 -> 0
    mean = torch.tensor([[[1.0, 3.0], [2.0, 2.0]]], requires_grad=True)
    ref = torch.zeros(1, 2, 2)
    kl = gaussian_mean_kl(mean, ref, torch.tensor([[0.5, 0.0]]))
    torch.testing.assert_close(kl, torch.tensor([[5.0, 0.0]]))
    kl.sum().backward()  # d/dmu of mean(mu^2) / (2 var) = mu / (2 var) = mu
    torch.testing.assert_close(mean.grad, torch.tensor([[[1.0, 3.0], [0.0, 0.0]]]))
    with pytest.raises(ValueError, match="var"):
        gaussian_mean_kl(mean, ref, torch.ones(2, 2))


def test_ratio_diagnostics_hand_computed():
    # step 0: ratios [e^0.1, e^-0.1] both valid; step 1: only row 0 (ratio 1); step 2: none valid
    logp = torch.tensor([[0.1, 0.0, 5.0], [-0.1, 3.0, 5.0]])
    old = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    d = ratio_diagnostics(logp, old, mask, clip_eps=0.05)
    r = [math.exp(0.1), math.exp(-0.1)]
    assert d["ratio/step0/mean"] == pytest.approx(sum(r) / 2)
    assert d["ratio/step0/std"] == pytest.approx(abs(r[0] - r[1]) / 2)
    assert d["ratio/step0/clip_frac"] == 1.0
    assert d["ratio/step1/mean"] == 1.0 and d["ratio/step1/clip_frac"] == 0.0
    assert "ratio/step2/mean" not in d
    assert d["ratio/mean"] == pytest.approx((sum(r) + 1) / 3)
    assert d["ratio/clip_frac"] == pytest.approx(2 / 3)
    assert d["ratio/max_abs_log"] == pytest.approx(0.1)
    assert ratio_diagnostics(logp, old, torch.zeros(2, 3, dtype=torch.bool), clip_eps=0.1) == {}
