"""Hand-computed checks of every advantage estimator, its edge cases and its invariances."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.objectives.advantages import ADVANTAGES, compute_advantages

EPS = 1e-4
NAN = float("nan")
ALL = ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk", "tpo"]

# The shared example: group 0 = [1, 0, 0, 1], group 1 = [2, 4, 6].
R = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 1])
# group 0: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3 -> std = 0.57735
# group 1: mean 4,   unbiased var = (4 + 0 + 4) / 2 = 4 -> std = 2
CENTERED = [0.5, -0.5, -0.5, 0.5, -2.0, 0.0, 2.0]
STD0, STD1 = math.sqrt(1 / 3), 2.0


def adv(name: str, r=R, g=G, **kw) -> torch.Tensor:
    if name == "opo" and "lengths" not in kw:
        kw["lengths"] = torch.ones_like(g)
    return compute_advantages(name, r, g, **kw)


def close(a: torch.Tensor, b: list[float], tol: float = 1e-5) -> None:
    assert torch.allclose(a.double(), torch.tensor(b, dtype=torch.float64), atol=tol), (a, b)


def test_registry_names_match_config_literal():
    assert ADVANTAGES.names() == ALL


def test_grpo_group_scale():
    s0, s1 = STD0 + EPS, STD1 + EPS
    close(adv("grpo"), [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -2 / s1, 0.0, 2 / s1])
    # 0.5 / 0.57745 = 0.86588 ; 2 / 2.0001 = 0.99995
    close(adv("grpo")[:1], [0.86588], tol=1e-5)


def test_grpo_batch_scale():
    # all 7 rewards: mean 14/7 = 2, squared deviations 1,4,4,1,0,4,16 = 30, var 30/6 = 5
    s = math.sqrt(5) + EPS
    close(adv("grpo", scale="batch"), [c / s for c in CENTERED])


def test_grpo_scale_none_and_dr_grpo():
    close(adv("grpo", scale="none"), CENTERED)
    close(adv("dr_grpo"), CENTERED)
    close(adv("dr_grpo", scale="group"), CENTERED)  # dr_grpo never divides


def test_rloo():
    # group 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3 ; group 1: 2 - 5 = -3, 4 - 4 = 0, 6 - 3 = 3
    close(adv("rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, -3.0, 0.0, 3.0])


def test_reinforce_pp_baseline():
    # centered = [.5,-.5,-.5,.5,-2,0,2], mean 0, squared sum 1 + 8 = 9, unbiased var 9/6 = 1.5
    s = math.sqrt(1.5) + EPS
    close(adv("reinforce_pp_baseline"), [c / s for c in CENTERED])


def test_opo_length_weighted_baseline():
    lengths = torch.tensor([3, 1, 1, 1, 1, 1, 2])
    # group 0: (3*1 + 1*0 + 1*0 + 1*1) / 6 = 2/3 ; group 1: (2 + 4 + 2*6) / 4 = 4.5
    close(
        adv("opo", lengths=lengths),
        [1 / 3, -2 / 3, -2 / 3, 1 / 3, -2.5, -0.5, 1.5],
    )
    close(adv("opo"), CENTERED)  # equal lengths -> plain mean
    # a group whose lengths sum to 0 falls back to the equal-weight mean
    close(adv("opo", lengths=torch.zeros(7, dtype=torch.long)), CENTERED)


def test_opo_needs_lengths():
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("opo", R, G)
    with pytest.raises(ValueError, match=">= 0"):
        adv("opo", lengths=-torch.ones(7, dtype=torch.long))


def test_gpg_alpha():
    # 5 of 7 rewards are nonzero -> alpha = 7/5 = 1.4
    close(adv("gpg"), [1.4 * c for c in CENTERED])
    # a NaN sample counts neither in B nor in the nonzero count: B = 3, nonzero = 2, alpha = 1.5
    r = torch.tensor([1.0, 0.0, 1.0, NAN])
    close(adv("gpg", r, torch.zeros(4, dtype=torch.long)), [1.5 / 3, -1.5 * 2 / 3, 1.5 / 3, 0.0])


def test_grpo_passk():
    # group 0 ties at the top (1, 1): gap 0 -> all 0 ; group 1 best = 6 (index 6), gap 6 - 4 = 2
    close(adv("grpo_passk"), [0, 0, 0, 0, 0, 0, 2 / (STD1 + EPS)])
    close(adv("grpo_passk", scale="none"), [0, 0, 0, 0, 0, 0, 2.0])
    # unsorted ids, group 5 = [3, 9, 4] with the best in the middle: gap 9 - 4 = 5;
    # mean 16/3, squared deviations (7/3)^2 + (11/3)^2 + (4/3)^2 = 186/9, unbiased var 186/18
    r, g = torch.tensor([3.0, 7.0, 9.0, 4.0]), torch.tensor([5, -1, 5, 5])
    std = math.sqrt(186 / 18)
    close(adv("grpo_passk", r, g), [0.0, 0.0, 5 / (std + EPS), 0.0])


@pytest.mark.parametrize("name", ALL)
def test_zero_variance_group_is_exactly_zero(name):
    # 0.1 * 3 / 3 != 0.1 in floating point: the estimator must not leave a residue
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 3.0])
    g = torch.tensor([4, 4, 4, 8, 8, 8])
    a = adv(name, r, g)
    assert (a[:3] == 0.0).all() and not torch.isnan(a).any()
    assert a[3:].abs().sum() > 0 or name == "grpo_passk"


@pytest.mark.parametrize("name", ALL)
def test_singleton_all_nan_and_single_valid_groups_get_zero(name):
    # group 1: singleton ; group 2: all NaN ; group 3: one valid member ; group 0: real signal
    r = torch.tensor([1.0, 0.0, 5.0, NAN, NAN, NAN, 7.0])
    g = torch.tensor([0, 0, 1, 2, 2, 3, 3])
    a = adv(name, r, g)
    assert (a[2:] == 0.0).all(), a
    assert not torch.isnan(a).any()


@pytest.mark.parametrize("name", ALL)
def test_nan_sample_excluded_from_statistics(name):
    # group [1, NaN, 0, 1] must equal group [1, 0, 1] with a 0 slotted in
    with_nan = adv(
        name, torch.tensor([1.0, NAN, 0.0, 1.0, 5.0, 2.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    )
    without = adv(name, torch.tensor([1.0, 0.0, 1.0, 5.0, 2.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert with_nan[1] == 0.0
    close(with_nan[[0, 2, 3, 4, 5]], without.tolist())


def test_tpo_population_std():
    # group 0: mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group 1: mean 4, population var (4 + 0 + 4) / 3 = 8/3 -> (R - 4) / sqrt(8/3)
    s = math.sqrt(8 / 3)
    close(adv("tpo"), [1.0, -1.0, -1.0, 1.0, -2 / s, 0.0, 2 / s])
    # scale and eps play no part (no eps in the denominator)
    close(adv("tpo", scale="none", eps=0.5), adv("tpo").tolist())


def test_rloo_single_valid_member():
    close(adv("rloo", torch.tensor([3.0, NAN]), torch.tensor([0, 0])), [0.0, 0.0])


def test_multi_reward_sum_then_normalize():
    rewards = {"a": torch.tensor([1.0, 0.0, NAN, 1.0]), "b": torch.tensor([0.0, 1.0, NAN, NAN])}
    # R = a + 2b skipping NaN = [1, 2, missing, 1]; valid [1, 2, 1]: mean 4/3, deviations
    # [-1/3, 2/3, -1/3], var (1/9 + 4/9 + 1/9) / 2 = 1/3
    a = compute_advantages(
        "grpo", rewards, torch.zeros(4, dtype=torch.long), weights={"a": 1.0, "b": 2.0}
    )
    s = math.sqrt(1 / 3) + EPS
    close(a, [-1 / 3 / s, 2 / 3 / s, 0.0, -1 / 3 / s])


def test_multi_reward_normalize_then_sum():
    rewards = {"a": torch.tensor([1.0, 0.0, 3.0, 1.0]), "b": torch.tensor([0.0, 0.0, 1.0, 2.0])}
    g = torch.tensor([0, 0, 1, 1])
    # a: g0 [1,0] std sqrt(.5): z = +-.5/(.70711+eps); g1 [3,1] std sqrt(2): z = +-1/(1.41421+eps)
    # b: g0 constant -> 0, 0;            g1 [1,2] std sqrt(.5): z = -+.5/(.70711+eps)
    za = 0.5 / (math.sqrt(0.5) + EPS)  # 0.70701
    za1 = 1.0 / (math.sqrt(2.0) + EPS)  # 0.70706
    r = [za, -za, za1 - 0.5 * za, -za1 + 0.5 * za]  # weights a=1, b=0.5
    # batch whitening: mean of r is exactly 0 here; unbiased std over the 4 samples
    std = math.sqrt(sum(x * x for x in r) / 3)
    a = compute_advantages(
        "grpo", rewards, g, weights={"b": 0.5}, reward_aggregation="normalize_then_sum"
    )
    close(a, [x / (std + EPS) for x in r])


def test_normalize_then_sum_zero_groups_and_restrictions():
    rewards = {"a": torch.tensor([1.0, 1.0, 0.0, 2.0]), "b": torch.tensor([3.0, 3.0, NAN, NAN])}
    a = compute_advantages(
        "grpo", rewards, torch.tensor([0, 0, 1, 1]), reward_aggregation="normalize_then_sum"
    )
    assert (a[:2] == 0.0).all() and a[2] < 0 < a[3]
    with pytest.raises(ValueError, match="normalize_then_sum"):
        compute_advantages(
            "rloo", rewards, torch.tensor([0, 0, 1, 1]), reward_aggregation="normalize_then_sum"
        )
    with pytest.raises(ValueError, match="normalize_then_sum"):
        compute_advantages(
            "grpo",
            rewards,
            torch.tensor([0, 0, 1, 1]),
            scale="batch",
            reward_aggregation="normalize_then_sum",
        )


def test_input_errors():
    with pytest.raises(ValueError, match="unknown rewards"):
        compute_advantages("grpo", {"a": R}, G, weights={"acc": 1.0})
    with pytest.raises(ValueError, match="dict"):
        compute_advantages("grpo", R, G, weights={"a": 1.0})
    with pytest.raises(ValueError, match="inf"):
        compute_advantages("grpo", torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="did you mean 'rloo'"):
        compute_advantages("rlo", R, G)
    with pytest.raises(ValueError, match="scale"):
        compute_advantages("grpo", R, G, scale="groups")
    with pytest.raises(ValueError, match="reward_aggregation"):
        compute_advantages("grpo", R, G, reward_aggregation="mean")
    with pytest.raises(ValueError, match="shape"):
        compute_advantages("grpo", R[:3], G)
    with pytest.raises(TypeError, match="unexpected keyword"):
        compute_advantages("grpo", R, G, alpha=2.0)  # unknown options are never dropped silently


def test_dtypes():
    assert compute_advantages("grpo", R.half(), G).dtype == torch.float16
    assert (
        compute_advantages("grpo", torch.tensor([1, 0, 3]), torch.tensor([0, 0, 0])).dtype
        == torch.float32
    )


@pytest.mark.parametrize("name", ALL)
def test_permutation_and_relabel_invariance(name):
    gen = torch.Generator().manual_seed(0)
    r = torch.randint(0, 4, (24,), generator=gen).double()
    r[[3, 11]] = NAN
    g = torch.randint(0, 5, (24,), generator=gen)
    lengths = torch.randint(1, 9, (24,), generator=gen)
    base = compute_advantages(name, r, g, lengths=lengths)
    perm = torch.randperm(24, generator=gen)
    permuted = compute_advantages(name, r[perm], g[perm], lengths=lengths[perm])
    close(permuted, base[perm].tolist(), tol=1e-9)
    relabeled = compute_advantages(name, r, g * 7 - 100, lengths=lengths)
    close(relabeled, base.tolist(), tol=0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, 2.0, NAN])),
        min_size=1,
        max_size=16,
    ),
    st.sampled_from(ALL),
)
def test_property_finite_zero_mean_and_degenerate_zero(samples, name):
    g = torch.tensor([s[0] for s in samples])
    r = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    a = compute_advantages(name, r, g, lengths=torch.ones_like(g))
    assert torch.isfinite(a).all()
    assert (a[torch.isnan(r)] == 0).all()
    for gid in g.unique():
        members = (g == gid) & ~torch.isnan(r)
        vals = r[members]
        if vals.numel() < 2 or (vals == vals[0]).all():
            assert (a[g == gid] == 0).all()
        elif name in ("grpo", "dr_grpo", "rloo", "gpg", "opo"):
            # group-centred estimators (opo with equal lengths) sum to zero within a group
            assert abs(float(a[members].sum())) < 1e-9


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gpg",
                                  "grpo_passk", "tpo"])  # fmt: skip
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_eps_zero_never_divides_zero_by_zero(name, scale):
    """eps = 0 (no std offset): zero-variance groups still give exactly 0, never NaN. Rewards
    (0, 1 | 1, 1 | 2): a discordant pair, a tied pair and a singleton."""
    r = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0])
    g = torch.tensor([0, 0, 1, 1, 2])
    adv = compute_advantages(name, r, g, scale=scale, eps=0.0)
    assert torch.isfinite(adv).all()
    assert adv[2:].tolist() == [0.0, 0.0, 0.0]
    flat = compute_advantages(name, torch.ones(4), torch.tensor([0, 0, 1, 1]), scale=scale, eps=0.0)
    assert flat.tolist() == [0.0, 0.0, 0.0, 0.0]
