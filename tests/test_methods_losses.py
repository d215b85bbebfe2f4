"""PMD-mean and TPO surrogates, Delta-L sequence weights, pg_coef and the new total_loss inputs
(token_scales, seq_weights, group_ids): hand-computed values and gradients, edge cases, micro-batch
splits with global counts, and "switched off = plain GRPO"."""

import math
from types import SimpleNamespace

import pytest
import torch

from grouprl.config.surrogates import ClipSurrogate, PmdSurrogate, ReinforceSurrogate, TpoSurrogate
from grouprl.objectives.advantages import compute_advantages
from grouprl.objectives.aggregation import delta_l_weights
from grouprl.objectives.group_losses import pmd_token_loss, tpo_loss
from grouprl.objectives.losses import policy_loss
from grouprl.objectives.objective import count_tokens, total_loss
from grouprl.types import PolicyOutput

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _sig(x):
    return 1 / (1 + math.exp(-x))


def _algo(**kw):
    base = dict(
        ratio_level="token", surrogate=ClipSurrogate(), aggregation="token_mean",
        kl_coef=0.0, kl_estimator="k1", kl_mode="loss", entropy_coef=0.0,
        top_entropy_quantile=1.0, engine_correction="none", engine_correction_max=2.0,
        engine_correction_min=0.0,
    )  # fmt: skip  # no pg_coef: config objects without it must keep working
    return SimpleNamespace(**{**base, **kw})


def _random_batch(n=6, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])[:n]
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [n, t]
    old = -torch.rand(n, t, generator=g, dtype=F64) * 2
    logp = old + 0.3 * torch.randn(n, t, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    return lengths, mask, old, logp, adv


def _split_equals_full(loss_fn, logp0, splits):
    """loss_fn(rows, logp_leaf) -> scalar; the sum over `splits` == the full batch, with grads."""
    a = logp0.clone().requires_grad_(True)
    full = loss_fn(list(range(len(logp0))), a)
    full.backward()
    b = logp0.clone().requires_grad_(True)
    total = sum(loss_fn(rows, b) for rows in splits)
    total.backward()
    assert total.item() == pytest.approx(full.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(b.grad, a.grad)
    return full.item()


# ----------------------------------------------------------------------------- PMD-mean


def test_pmd_hand_computed_seq_mean_token_mean():
    # logp - old = [0.1, 0.2] -> Delta = 0.3; A = 0.5, tau = 0.1 -> A/tau = 5
    # loss = (tau/2)(5 - 0.3)^2 / |o| = 0.05 * 22.09 / 2 = 0.55225
    # d/dlogp_t = -(A - tau Delta) / |o| = -(0.5 - 0.03) / 2 = -0.235 on each token
    logp = _t([[0.1, 0.2]]).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(
        logp, _t([[0.0, 0.0]]), _t([0.5]), mask, surrogate=PmdSurrogate(tau=0.1),
        aggregation="seq_mean_token_mean",
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(0.55225)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, _t([[-0.235, -0.235]]))


def test_pmd_seq_mean_token_sum_norm_is_mean_over_lmax():
    # row 0 as above: 0.05 * 22.09 = 1.1045; row 1: Delta = -0.1, A = -0.5 -> 0.05 * (-5 + 0.1)^2
    # = 1.2005. mean_i[(tau/2)(...)^2] / L_max = (1.1045 + 1.2005) / 2 / 4 = 0.288125
    logp = _t([[0.1, 0.2], [-0.1, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = policy_loss(
        logp, torch.zeros(2, 2, dtype=F64), _t([0.5, -0.5]), mask, surrogate=PmdSurrogate(tau=0.1),
        aggregation="seq_mean_token_sum_norm", max_len=4,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(0.288125)
    per_token = pmd_token_loss(logp, torch.zeros(2, 2, dtype=F64), _t([0.5, -0.5]), mask, 0.1)
    torch.testing.assert_close(per_token, _t([[1.1045 / 2, 1.1045 / 2], [1.2005, 0.0]]))


def test_pmd_first_gradient_equals_reinforce_seq_mean_token_mean():
    # at logp == old, d loss / d logp_it = -A_i / (N |o_i|), the GRPO-style policy gradient
    _, mask, old, _, adv = _random_batch()
    grads = []
    for surrogate in (PmdSurrogate(), ReinforceSurrogate()):
        logp = old.clone().requires_grad_(True)
        policy_loss(
            logp, old, adv, mask, surrogate=surrogate, aggregation="seq_mean_token_mean"
        ).loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_pmd_micro_batch_split_and_padding():
    lengths, mask, old, logp0, adv = _random_batch()
    counts = count_tokens(mask, max_len=8)
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):

        def fn(rows, logp, agg=agg):
            width = max(int(lengths[rows].max()), 1)
            return policy_loss(
                logp[rows, :width], old[rows, :width], adv[rows], mask[rows, :width],
                surrogate=PmdSurrogate(), aggregation=agg, **counts,
            ).loss  # fmt: skip

        _split_equals_full(fn, logp0, ([0, 1], [2], [3, 4, 5]))
    nan_pad = old.masked_fill(~mask, float("nan"))
    a = policy_loss(
        logp0, old, adv, mask, surrogate=PmdSurrogate(), aggregation="seq_mean_token_mean"
    )
    b = policy_loss(
        logp0, nan_pad, adv, mask, surrogate=PmdSurrogate(), aggregation="seq_mean_token_mean"
    )
    assert a.loss.item() == pytest.approx(b.loss.item())


def test_pmd_and_tpo_need_token_ratio_level():
    _, mask, old, logp, adv = _random_batch()
    for surrogate in (PmdSurrogate(), TpoSurrogate()):
        with pytest.raises(ValueError, match="ratio_level 'token'"):
            policy_loss(logp, old, adv, mask, surrogate=surrogate, ratio_level="sequence")
    with pytest.raises(ValueError, match="pmd_tau"):
        policy_loss(logp, old, adv, mask, surrogate=PmdSurrogate.model_construct(tau=0.0))


# ----------------------------------------------------------------------------- TPO

# group 7: two candidates of 2 tokens, summed old log-probs l_old = [-1, -2]; u = [1, -1], eta = 1.
# p_old = softmax([-1, -2]) = [sig(1), sig(-1)]; q = softmax(l_old + u) = softmax([0, -3])
# = [sig(3), sig(-3)]. At logp == old: p = p_old, loss = -(q0 log p0 + q1 log p1),
# d loss / d l_i = p_i - q_i, and each token of row i gets that gradient (l is a sum).
# group 4: a single candidate -> p = q = 1, loss 0, gradient 0; it still counts as a group.
TPO_OLD = _t([[-0.5, -0.5], [-1.0, -1.0], [-3.0, 0.0]])
TPO_MASK = torch.tensor([[True, True], [True, True], [True, False]])
TPO_U = _t([1.0, -1.0, 2.0])
TPO_GROUPS = torch.tensor([7, 7, 4])
P0, Q0 = _sig(1), _sig(3)
TPO_CE = -(Q0 * math.log(P0) + (1 - Q0) * math.log(1 - P0))


def test_tpo_hand_computed():
    logp = TPO_OLD.clone().requires_grad_(True)
    out = policy_loss(
        logp, TPO_OLD, TPO_U, TPO_MASK, surrogate=TpoSurrogate(eta=1.0), group_ids=TPO_GROUPS
    )
    assert out.loss.item() == pytest.approx(TPO_CE / 2)  # 2 groups here
    out.loss.backward()
    g0, g1 = (P0 - Q0) / 2, (Q0 - P0) / 2
    torch.testing.assert_close(logp.grad, _t([[g0, g0], [g1, g1], [0.0, 0.0]]))
    kl = Q0 * math.log(Q0 / P0) + (1 - Q0) * math.log((1 - Q0) / (1 - P0))
    entropy = -(Q0 * math.log(Q0) + (1 - Q0) * math.log(1 - Q0))
    assert out.metrics["tpo_kl"] == pytest.approx(kl / 2)
    assert out.metrics["tpo_target_entropy"] == pytest.approx(entropy / 2)
    assert out.metrics["clip_frac_high"] == 0.0 and out.metrics["pg_loss"] == pytest.approx(
        TPO_CE / 2
    )


def test_tpo_eta_and_global_num_groups():
    # eta = 2: q = softmax(l_old + u/2) = softmax([-0.5, -2.5]) -> q0 = sig(2); num_groups = 5
    q0 = _sig(2)
    out = tpo_loss(TPO_OLD, TPO_OLD, TPO_U, TPO_MASK, TPO_GROUPS, eta=2.0, num_groups=5)
    ce = -(q0 * math.log(P0) + (1 - q0) * math.log(1 - P0))
    assert out.loss.item() == pytest.approx(ce / 5)


def test_tpo_zero_variance_first_epoch_has_no_gradient_and_target_stays_frozen():
    # u = 0 -> q = p_old; at logp == old the gradient p - q vanishes
    logp = TPO_OLD.clone().requires_grad_(True)
    tpo_loss(logp, TPO_OLD, torch.zeros(3, dtype=F64), TPO_MASK, TPO_GROUPS).loss.backward()
    assert logp.grad.abs().max().item() == pytest.approx(0.0, abs=1e-12)
    # a later epoch: logp moved (l = [-1, -1.5]), the target q still comes from old_logp
    logp = _t([[-0.5, -0.5], [-0.75, -0.75], [-3.0, 0.0]]).requires_grad_(True)
    out = tpo_loss(logp, TPO_OLD, TPO_U, TPO_MASK, TPO_GROUPS)
    p0 = _sig(0.5)
    assert out.loss.item() == pytest.approx(-(Q0 * math.log(p0) + (1 - Q0) * math.log(1 - p0)) / 2)


def test_tpo_empty_rows_permutation_and_padding():
    # an empty row in group 7 is no candidate: same loss as without it
    old = torch.cat([TPO_OLD, _t([[5.0, 5.0]])])
    mask = torch.cat([TPO_MASK, torch.tensor([[False, False]])])
    out = tpo_loss(old, old, torch.cat([TPO_U, _t([9.0])]), mask, torch.tensor([7, 7, 4, 7]))
    assert out.loss.item() == pytest.approx(TPO_CE / 2)
    perm = torch.tensor([2, 1, 0])
    out = tpo_loss(TPO_OLD[perm], TPO_OLD[perm], TPO_U[perm], TPO_MASK[perm], TPO_GROUPS[perm])
    assert out.loss.item() == pytest.approx(TPO_CE / 2)
    nan_pad = TPO_OLD.masked_fill(~TPO_MASK, float("nan"))
    out = policy_loss(
        nan_pad, nan_pad, TPO_U, TPO_MASK, surrogate=TpoSurrogate(), group_ids=TPO_GROUPS
    )
    assert out.loss.item() == pytest.approx(TPO_CE / 2)
    # every row empty: 0, finite, backward runs
    logp = TPO_OLD.clone().requires_grad_(True)
    out = tpo_loss(logp, TPO_OLD, TPO_U, torch.zeros_like(TPO_MASK), TPO_GROUPS)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(logp.grad).all()


def test_tpo_whole_group_micro_batches_sum_to_the_batch():
    lengths, mask, old, logp0, _ = _random_batch()
    groups = torch.tensor([3, 3, 8, 1, 1, 1])
    u = compute_advantages("tpo", torch.tensor([1.0, 0.0, 5.0, 0.0, 2.0, 1.0]), groups)
    counts = count_tokens(mask, group_ids=groups)
    assert counts["num_groups"] == 2  # group 8 has no valid row

    def fn(rows, logp):
        width = max(int(lengths[rows].max()), 1)
        return policy_loss(
            logp[rows, :width], old[rows, :width], u[rows], mask[rows, :width], surrogate=TpoSurrogate(),
            group_ids=groups[rows], num_groups=counts["num_groups"],
        ).loss  # fmt: skip

    assert _split_equals_full(fn, logp0, ([0, 1], [2], [3, 4, 5])) != 0.0


def test_tpo_refusals():
    _, mask, old, logp, adv = _random_batch()
    with pytest.raises(ValueError, match="group_ids"):
        policy_loss(logp, old, adv, mask, surrogate=TpoSurrogate())
    with pytest.raises(ValueError, match="token weights"):
        policy_loss(
            logp, old, adv, mask, surrogate=TpoSurrogate(), group_ids=torch.zeros(6, dtype=torch.long),
            token_weights=torch.full_like(old, 0.5),
        )  # fmt: skip
    with pytest.raises(ValueError, match="seq_weights"):
        policy_loss(
            logp, old, adv, mask, surrogate=TpoSurrogate(), group_ids=torch.zeros(6, dtype=torch.long),
            seq_weights=torch.ones(6, dtype=F64),
        )  # fmt: skip
    with pytest.raises(ValueError, match="tpo_eta"):
        tpo_loss(logp, old, adv, mask, torch.zeros(6, dtype=torch.long), eta=0.0)


# ----------------------------------------------------------------------------- Delta-L


def test_delta_l_weights_hand_computed():
    # alpha 1: L^-1 = [1, 1/4, -, 1/2]; mean over non-empty rows = 1.75 / 3; zero length -> 0
    w = delta_l_weights(_t([1.0, 4.0, 0.0, 2.0]), 1.0)
    torch.testing.assert_close(w, _t([3 / 1.75, 0.75 / 1.75, 0.0, 1.5 / 1.75]))
    torch.testing.assert_close(delta_l_weights(_t([3.0, 0.0, 7.0]), 0.0), _t([1.0, 0.0, 1.0]))
    assert delta_l_weights(_t([0.0, 0.0]), 0.75).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=">= 0"):
        delta_l_weights(_t([-1.0]), 1.0)


def test_delta_l_equals_advantage_scaling_of_the_official_code():
    # w_i on the loss == A_i * w_i in a dual-clip PPO loss over the padded [n, L_max] mean
    lengths, mask, old, logp, adv = _random_batch()
    w = delta_l_weights(lengths.double(), 0.75)
    kw = dict(
        surrogate=ClipSurrogate(eps_low=0.2, eps_high=0.3, dual_clip_c=3.0),
        **count_tokens(mask, max_len=8),
    )
    ours = policy_loss(logp, old, adv, mask, aggregation="delta_l", seq_weights=w, **kw)
    official = policy_loss(logp, old, adv * w, mask, aggregation="seq_mean_token_sum_norm", **kw)
    assert ours.loss.item() == pytest.approx(official.loss.item(), rel=1e-12)


def test_delta_l_sliced_weights_split_exactly():
    lengths, mask, old, logp0, adv = _random_batch()
    w = delta_l_weights(lengths.double(), 1.0)  # once, over the whole batch
    counts = count_tokens(mask, max_len=8)

    def fn(rows, logp):
        width = max(int(lengths[rows].max()), 1)
        return policy_loss(
            logp[rows, :width], old[rows, :width], adv[rows], mask[rows, :width],
            aggregation="delta_l", seq_weights=w[rows], **counts,
        ).loss  # fmt: skip

    _split_equals_full(fn, logp0, ([0, 1], [2], [3, 4, 5]))


# ----------------------------------------------------------------------------- total_loss


def _total(algo, logp, mask, adv, **kw):
    return total_loss(
        PolicyOutput(logp=logp, entropy=kw.pop("entropy", None)), old_logp=logp.detach(),
        advantages=adv, mask=mask, algo=algo, counts=kw.pop("counts", count_tokens(mask)), **kw,
    )  # fmt: skip


def test_pg_coef_entropy_only():
    # pg_coef 0: loss = -0.001 * token-mean H = -0.001 * 2; no gradient reaches logp
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    ent = _t([[1.0, 3.0]]).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    algo = _algo(pg_coef=0.0, entropy_coef=0.001)
    out = _total(algo, logp, mask, _t([1.0]), entropy=ent)
    assert out.loss.item() == pytest.approx(-0.002)
    assert out.metrics["pg_loss"] == pytest.approx(-1.0)  # logged before the coefficient
    out.loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
    torch.testing.assert_close(ent.grad, _t([[-0.0005, -0.0005]]))
    # pg_coef 0.5 halves the policy term; an algo without the field means 1.0
    half = _total(_algo(pg_coef=0.5), logp, mask, _t([1.0]))
    assert half.loss.item() == pytest.approx(-0.5)
    assert _total(_algo(), logp, mask, _t([1.0])).loss.item() == pytest.approx(-1.0)


def test_token_scales_multiply_the_policy_term_only():
    # reinforce, A = 1, logp = -1: per-token loss 1; scales [1, 0.5, 0, 0.25] -> token mean
    # (1 + 0.5 + 0 + 0.25) / 4 tokens; the k1 KL (0.5 per token, coef 0.1) is not scaled
    logp = torch.full((1, 4), -1.0, dtype=F64, requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    algo = _algo(surrogate=ReinforceSurrogate(), kl_coef=0.1)
    scales = torch.tensor([[1.0, 0.5, 0.0, 0.25]])  # float32: cast to logp's dtype
    out = _total(algo, logp, mask, _t([1.0]), token_scales=scales, ref_logp=logp.detach() - 0.5)
    assert out.loss.item() == pytest.approx(1.75 / 4 + 0.05)
    assert out.metrics["token_scale_mean"] == pytest.approx(1.75 / 4)
    with pytest.raises(ValueError, match="token_scales"):
        _total(algo, logp, mask, _t([1.0]), token_scales=scales[:, :2])


def test_seq_weights_weight_policy_not_kl():
    # delta_l, reinforce: rows of 2 and 1 tokens, logp = -1, A = [1, 2], w = [0.5, 2]
    # pg = (0.5 * 2 * 1 + 2 * 1 * 2) / (2 seqs * max_len 4) = 5 / 8
    # KL k1 = 0.5 per token, unit weights, same normaliser: 0.1 * 1.5 / 8
    logp = torch.full((2, 2), -1.0, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    algo = _algo(surrogate=ReinforceSurrogate(), aggregation="delta_l", kl_coef=0.1)
    out = _total(
        algo, logp, mask, _t([1.0, 2.0]), seq_weights=_t([0.5, 2.0]),
        ref_logp=logp.detach() - 0.5, counts=count_tokens(mask, max_len=4),
    )  # fmt: skip
    assert out.metrics["pg_loss"] == pytest.approx(5 / 8)
    assert out.metrics["kl_loss"] == pytest.approx(0.1 * 1.5 / 8)
    with pytest.raises(ValueError, match="seq_weights"):
        _total(algo, logp, mask, _t([1.0, 2.0]), counts=count_tokens(mask, max_len=4))


def test_tpo_through_total_loss():
    algo = _algo(surrogate=TpoSurrogate(eta=1.0))
    counts = count_tokens(TPO_MASK, group_ids=TPO_GROUPS)
    out = total_loss(
        PolicyOutput(logp=TPO_OLD.clone()), old_logp=TPO_OLD, advantages=TPO_U, mask=TPO_MASK,
        algo=algo, counts=counts, group_ids=TPO_GROUPS,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(TPO_CE / 2)
    with pytest.raises(ValueError, match="token weights"):
        total_loss(
            PolicyOutput(logp=TPO_OLD.clone()), old_logp=TPO_OLD, advantages=TPO_U,
            mask=TPO_MASK, algo=algo, counts=counts, group_ids=TPO_GROUPS,
            token_scales=torch.full(TPO_MASK.shape, 0.5),
        )  # fmt: skip


def test_components_switched_off_recover_plain_grpo():
    lengths, mask, old, logp, adv = _random_batch()
    algo = _algo(aggregation="seq_mean_token_mean")
    counts = count_tokens(mask, max_len=8)
    kw = dict(old_logp=old, advantages=adv, mask=mask, algo=algo, counts=counts)
    plain = total_loss(PolicyOutput(logp=logp), **kw).loss.item()
    off = total_loss(
        PolicyOutput(logp=logp), token_scales=mask.double(), seq_weights=torch.ones(6, dtype=F64),
        group_ids=torch.arange(6), **kw,
    )  # fmt: skip
    assert off.loss.item() == pytest.approx(plain, rel=1e-12)
    # delta_l with alpha 0 (all weights 1) is Dr. GRPO's constant normaliser
    dl = policy_loss(
        logp, old, adv, mask, aggregation="delta_l",
        seq_weights=delta_l_weights(lengths.double(), 0.0), **counts,
    )  # fmt: skip
    dr = policy_loss(logp, old, adv, mask, aggregation="seq_mean_token_sum_norm", **counts)
    assert dl.loss.item() == pytest.approx(dr.loss.item(), rel=1e-12)


def test_count_tokens_num_groups():
    mask = torch.tensor([[True], [False], [True], [True]])
    assert count_tokens(mask, group_ids=torch.tensor([5, 6, 5, 9]))["num_groups"] == 2
    assert "num_groups" not in count_tokens(mask)
    with pytest.raises(ValueError, match="group_ids"):
        count_tokens(mask, group_ids=torch.tensor([1, 2]))
