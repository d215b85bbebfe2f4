"""The composed loss: policy term + KL term + entropy term, token weights, errors, presets, and
micro-batch invariance of the whole thing."""

import math
from types import SimpleNamespace

import pytest
import torch

from grouprl.config.algorithm import AlgorithmConfig
from grouprl.config.presets import PRESETS, preset_settings
from grouprl.config.surrogates import ClipSurrogate, ReinforceSurrogate
from grouprl.objectives.aggregation import delta_l_weights
from grouprl.objectives.kl import kl_penalty
from grouprl.objectives.losses import policy_loss
from grouprl.objectives.objective import count_tokens, total_loss
from grouprl.types import PolicyOutput

F64 = torch.float64

# the `algorithm:` config defaults (grouprl/config/algorithm.py)
DEFAULTS = dict(
    preset="grpo", advantage="grpo", scale="group", adv_eps=1e-4,
    reward_aggregation="sum_then_normalize", ratio_level="token", surrogate=ClipSurrogate(),
    aggregation="token_mean", kl_coef=0.0, kl_estimator="k3", kl_mode="loss",
    entropy_coef=0.0, top_entropy_quantile=1.0, engine_correction="none",
    engine_correction_max=2.0, engine_correction_min=0.0, dynamic_sampling="off",
    max_sampling_rounds=3, overlong_shaping="off", overlong_buffer_frac=0.2, overlong_factor=1.0,
    epochs=1, minibatches=1,
)  # fmt: skip


def _algo(**overrides):
    return SimpleNamespace(**{**DEFAULTS, **overrides})


def _t(values):
    return torch.tensor(values, dtype=F64)


def test_count_tokens():
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    assert count_tokens(mask) == {"num_tokens": 3, "num_seqs": 2, "max_len": 3}
    assert count_tokens(mask, max_len=16)["max_len"] == 16


def test_plain_grpo_equals_policy_loss():
    logp = _t([[0.1, -0.3], [0.2, 0.0]]).requires_grad_(True)
    old, adv, mask = _t([[0.0, 0.0]] * 2), _t([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool)
    counts = count_tokens(mask)
    out = total_loss(
        PolicyOutput(logp=logp),
        old_logp=old,
        advantages=adv,
        mask=mask,
        algo=_algo(),
        counts=counts,
    )
    ref = policy_loss(logp, old, adv, mask, **counts)
    assert out.loss.item() == pytest.approx(ref.loss.item())
    assert out.metrics["pg_loss"] == pytest.approx(ref.loss.item())
    assert out.metrics["loss"] == pytest.approx(ref.loss.item())
    assert "kl" not in out.metrics and "entropy" not in out.metrics


def test_kl_and_entropy_terms_hand_computed():
    # rho = 1 (logp == old), A = +1 on one sequence of 2 tokens: pg = -1 (token mean of -A rho).
    # ref_logp = logp - 0.5 -> k1 = 0.5 per token; kl_coef 0.1 -> +0.05.
    # entropy [1.0, 3.0] -> token mean 2; entropy_coef 0.01 -> -0.02. total = -1 + 0.05 - 0.02
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    ent = _t([[1.0, 3.0]]).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    algo = _algo(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    out = total_loss(
        PolicyOutput(logp=logp, entropy=ent), old_logp=logp.detach(), advantages=_t([1.0]),
        mask=mask, algo=algo, counts=count_tokens(mask), ref_logp=logp.detach() - 0.5,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.0 + 0.05 - 0.02)
    assert out.metrics["kl"] == pytest.approx(0.5) and out.metrics["kl_loss"] == pytest.approx(0.05)
    assert out.metrics["entropy"] == pytest.approx(2.0)
    assert out.metrics["entropy_loss"] == pytest.approx(-0.02)
    out.loss.backward()
    # d/dlogp: pg -A rho / 2 = -0.5; KL k1 0.1 * 1 / 2 = +0.05 -> -0.45 per token
    torch.testing.assert_close(logp.grad, _t([[-0.45, -0.45]]))
    # a positive entropy_coef pushes entropy up: d loss / d H = -0.01 / 2 per token
    torch.testing.assert_close(ent.grad, _t([[-0.005, -0.005]]))


def test_kl_uses_the_configured_estimator_and_kl_out():
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    ref = _t([[-1.3, -1.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    common = dict(
        old_logp=logp.detach(), advantages=_t([0.0]), mask=mask, counts=count_tokens(mask)
    )
    out = total_loss(
        PolicyOutput(logp=logp), algo=_algo(kl_coef=1.0, kl_estimator="k3"), ref_logp=ref, **common
    )
    expected = kl_penalty(logp.detach(), ref, "k3").mean().item()  # A = 0: the loss is the KL
    assert out.loss.item() == pytest.approx(expected)
    # k3 by hand for the first token: x = ref - logp = -0.3 -> e^-0.3 + 0.3 - 1
    assert kl_penalty(logp.detach(), ref, "k3")[0, 0].item() == pytest.approx(
        math.exp(-0.3) + 0.3 - 1
    )
    # a policy-specific KL (e.g. flow mean-space KL) replaces the estimator
    out = total_loss(
        PolicyOutput(logp=logp), algo=_algo(kl_coef=2.0), kl_out=_t([[1.0, 3.0]]), **common
    )
    assert out.loss.item() == pytest.approx(2.0 * 2.0)


def test_kl_in_reward_mode_is_logged_not_added():
    logp = _t([[-1.0]]).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = total_loss(
        PolicyOutput(logp=logp), old_logp=logp.detach(), advantages=_t([0.0]), mask=mask,
        algo=_algo(kl_coef=0.5, kl_mode="reward", kl_estimator="k1"), counts=count_tokens(mask),
        ref_logp=_t([[-2.0]]),
    )  # fmt: skip
    assert out.loss.item() == 0.0 and out.metrics["kl"] == pytest.approx(1.0)
    assert "kl_loss" not in out.metrics


def test_engine_correction_and_entropy_mask_weight_the_policy_term():
    # reinforce, A = 1, logp = -1 everywhere: per-token loss 1. 4 tokens in one row.
    # engine token_truncate: w = exp(old - engine) = [e^1 -> clamp 2, 1, 1, e^-1]
    # entropy [0, 1, 2, 3], top quantile 0.5 -> threshold = 0.5-quantile = 1.5 -> keep tokens 2, 3
    # weighted loss = (0 + 0 + 1 * 1 + e^-1) / 4 tokens (counts unchanged)
    logp = torch.full((1, 4), -1.0, dtype=F64, requires_grad=True)
    old = torch.full((1, 4), -1.0, dtype=F64)
    engine = _t([[-2.0, -1.0, -1.0, 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    algo = _algo(
        surrogate=ReinforceSurrogate(), engine_correction="token_truncate", top_entropy_quantile=0.5
    )
    out = total_loss(
        PolicyOutput(logp=logp, entropy=_t([[0.0, 1.0, 2.0, 3.0]])), old_logp=old,
        advantages=_t([1.0]), mask=mask, algo=algo, counts=count_tokens(mask), engine_logp=engine,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx((1 + math.exp(-1)) / 4)
    assert out.metrics["entropy_mask_frac"] == 0.5
    assert "engine_is/mean_weight" in out.metrics


def test_missing_inputs_fail_loudly():
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    common = dict(
        old_logp=logp.detach(), advantages=_t([1.0]), mask=mask, counts=count_tokens(mask)
    )
    with pytest.raises(ValueError, match="ref_logp"):
        total_loss(PolicyOutput(logp=logp), algo=_algo(kl_coef=0.1), **common)
    with pytest.raises(ValueError, match="engine_logp"):
        total_loss(PolicyOutput(logp=logp), algo=_algo(engine_correction="token_mask"), **common)
    with pytest.raises(ValueError, match="entropies"):
        total_loss(PolicyOutput(logp=logp), algo=_algo(top_entropy_quantile=0.2), **common)
    with pytest.raises(ValueError, match="entropies"):
        total_loss(PolicyOutput(logp=logp), algo=_algo(entropy_coef=0.01), **common)
    with pytest.raises(ValueError, match="detached"):
        total_loss(
            PolicyOutput(logp=logp, entropy=_t([[1.0, 1.0]])),
            algo=_algo(entropy_coef=0.01),
            **common,
        )
    with pytest.raises(ValueError, match="kl_mode"):
        total_loss(PolicyOutput(logp=logp), algo=_algo(kl_mode="both"), **common)
    with pytest.raises(ValueError, match="surrogate"):
        total_loss(
            PolicyOutput(logp=logp), algo=_algo(surrogate=SimpleNamespace(type="ppo")), **common
        )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs_and_splits_into_micro_batches(name):
    """Each preset, with KL and entropy terms switched on, gives the same loss and gradient as one
    batch or as three micro-batches (of whole groups) aggregated with the global counts; delta_l
    gets whole-batch seq_weights sliced per micro-batch."""
    g = torch.Generator().manual_seed(0)
    n, t = 6, 5
    lengths = torch.tensor([5, 1, 0, 3, 4, 2])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [6, 5]
    old = -torch.rand(n, t, generator=g, dtype=F64) * 2
    logp0 = old + 0.2 * torch.randn(n, t, generator=g, dtype=F64)
    ref = old + 0.1 * torch.randn(n, t, generator=g, dtype=F64)
    engine = old + 0.05 * torch.randn(n, t, generator=g, dtype=F64)
    ent0 = torch.rand(n, t, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    settings = {**preset_settings(name), "kl_coef": 0.05, "kl_mode": "loss", "entropy_coef": 0.01}
    if settings.get("surrogate", {}).get("type") != "tpo":  # TPO refuses token weights
        settings["engine_correction"] = "token_truncate"
    if "distill" in settings:  # a preset never names the teacher (opd)
        settings["distill"] = {**settings["distill"], "teacher": "teacher-folder"}
    teacher = old + 0.3 * torch.randn(n, t, generator=g, dtype=F64)
    algo = AlgorithmConfig.model_validate({**settings, "preset": name})  # the typed surrogate
    group_ids = torch.tensor([0, 0, 1, 2, 2, 2])  # the micro-batches below hold whole groups
    counts = count_tokens(mask, max_len=8, group_ids=group_ids)
    w = delta_l_weights(lengths.double(), 0.75) if algo.aggregation == "delta_l" else None

    def run(rows, width, logp, ent):
        return total_loss(
            PolicyOutput(logp=logp[rows, :width], entropy=ent[rows, :width]),
            old_logp=old[rows, :width], advantages=adv[rows], mask=mask[rows, :width], algo=algo,
            counts=counts, ref_logp=ref[rows, :width], engine_logp=engine[rows, :width],
            group_ids=group_ids[rows], seq_weights=None if w is None else w[rows],
            teacher_logp=teacher[rows, :width],
        )  # fmt: skip

    logp_a, ent_a = logp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
    full = run(list(range(n)), t, logp_a, ent_a)
    full.loss.backward()
    assert math.isfinite(full.loss.item())
    logp_b, ent_b = logp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5]):
        total = total + run(rows, max(int(lengths[rows].max()), 1), logp_b, ent_b).loss
    total.backward()
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logp_b.grad, logp_a.grad)
    torch.testing.assert_close(ent_b.grad, ent_a.grad)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weighted_kl_hand_computed(level):
    # TRL use_bias_correction_kl: per_token_kl * coef_1, coef_1 = exp(log importance weight) of the
    # ratio level, not detached. A = 0 isolates the KL term. logp [-1, -2], old [-1.5, -2]:
    # token log-ratios [0.5, 0]; ref = logp - 0.5 -> k1 = 0.5 on both tokens; coef 0.1, token_mean.
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    algo = _algo(kl_coef=0.1, kl_estimator="k1", kl_weighting="importance", ratio_level=level)
    out = total_loss(
        PolicyOutput(logp=logp), old_logp=_t([[-1.5, -2.0]]), advantages=_t([0.0]), mask=mask,
        algo=algo, counts=count_tokens(mask), ref_logp=logp.detach() - 0.5,
    )  # fmt: skip
    out.loss.backward()
    if level == "token":
        w = [math.exp(0.5), 1.0]  # rho_t
        # d/dlogp_t 0.1 * (1/2) * k1_t rho_t = 0.05 * (rho_t + k1_t rho_t) = 0.05 * 1.5 * rho_t
        grad = [0.05 * 1.5 * w[0], 0.05 * 1.5 * w[1]]
    else:
        s = math.exp(0.25)  # exp of the mean token log-ratio
        w = [s, s]
        # d/dlogp_t 0.05 * sum_u k1_u s = 0.05 * (s + (0.5 + 0.5) * s / 2)
        grad = [0.05 * 1.5 * s, 0.05 * 1.5 * s]
    kl = (0.5 * w[0] + 0.5 * w[1]) / 2
    assert out.metrics["kl"] == pytest.approx(kl)
    assert out.loss.item() == pytest.approx(0.1 * kl)
    torch.testing.assert_close(logp.grad, _t([grad]))


def test_importance_weighted_kl_needs_the_kl_loss_term():
    logp = _t([[-1.0]]).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="kl_weighting"):
        total_loss(
            PolicyOutput(logp=logp), old_logp=logp.detach(), advantages=_t([0.0]), mask=mask,
            algo=_algo(kl_coef=0.1, kl_mode="reward", kl_weighting="importance"),
            counts=count_tokens(mask), ref_logp=logp.detach(),
        )  # fmt: skip
