"""objectives/distill.py: the reverse-KL distillation forms, by hand, with gradients."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grouprl.objectives import total_loss
from grouprl.objectives.distill import (
    distill_loss_term,
    full_reverse_kl,
    k1_distill,
    k3_distill,
    per_token_distill,
)
from grouprl.types import PolicyOutput


def _algo(estimator="k1", coef=1.0, pg_coef=0.0, aggregation="token_mean"):
    from grouprl.config.algorithm import AlgorithmConfig

    return AlgorithmConfig(
        pg_coef=pg_coef,
        aggregation=aggregation,
        distill={"teacher": "/nowhere", "estimator": estimator, "coef": coef},
    )


def test_k1_value_and_gradient_by_hand():
    ls = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)  # [2]
    lt = torch.tensor([math.log(0.25), math.log(0.5)])
    v = k1_distill(ls, lt)
    # values ls - lt = log 2, -log 2
    assert torch.allclose(v, torch.tensor([math.log(2), -math.log(2)]))
    v.sum().backward()
    # gradient d * grad ls = (log 2, -log 2)
    assert torch.allclose(ls.grad, torch.tensor([math.log(2), -math.log(2)]))


def test_k3_value_and_gradient_by_hand():
    ls = torch.tensor([math.log(0.5)], requires_grad=True)
    lt = torch.tensor([math.log(0.25)])
    v = k3_distill(ls, lt)
    # exp(lt - ls) - (lt - ls) - 1 = 0.5 + log 2 - 1
    assert torch.allclose(v, torch.tensor([0.5 + math.log(2) - 1]))
    v.backward()
    # d/dls = 1 - exp(lt - ls) = 0.5
    assert torch.allclose(ls.grad, torch.tensor([0.5]))


def test_full_kl_by_hand_on_a_two_token_vocabulary():
    s = torch.log(torch.tensor([[0.75, 0.25]]))  # [1, 2] logits = log-probs
    t = torch.log(torch.tensor([[0.5, 0.5]]))
    want = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.1308
    assert torch.allclose(full_reverse_kl(s, t), torch.tensor([want]), atol=1e-6)
    assert abs(want - 0.130812) < 1e-5


def test_k1_gradient_equals_the_exact_full_kl_gradient_by_enumeration():
    """E_{y~pi_s}[grad k1(y)] over a 3-token vocabulary, one step, enumerated exactly (each y
    weighted by its detached probability) == grad of the exact KL(pi_s || pi_t)."""
    z = torch.tensor([0.3, -1.2, 0.8], requires_grad=True)  # student logits [V]
    zt = torch.tensor([-0.5, 0.4, 1.5])  # teacher logits [V]
    ls = torch.log_softmax(z, -1)  # [V]
    lt = torch.log_softmax(zt, -1)  # [V]
    probs = ls.exp().detach()  # [V]
    expected = (probs * k1_distill(ls, lt)).sum()  # sum_y p(y) * k1(y)
    (g_k1,) = torch.autograd.grad(expected, z)
    exact = full_reverse_kl(z[None], zt[None]).sum()
    (g_full,) = torch.autograd.grad(exact, z)
    assert torch.allclose(g_k1, g_full, atol=1e-6)
    assert g_full.abs().max() > 0.05  # not a trivial zero
    # and the k1 value is unbiased: sum_y p(y) (ls - lt) = KL
    assert torch.allclose(expected.detach(), exact.detach(), atol=1e-6)


def test_k3_gradient_is_not_the_reverse_kl_gradient():
    """The documented caveat: k3 differentiated directly gives sum_v (p_s - p_t) grad log p_s."""
    z = torch.tensor([0.3, -1.2, 0.8], requires_grad=True)
    zt = torch.tensor([-0.5, 0.4, 1.5])
    ls, lt = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    probs = ls.exp().detach()
    (g_k3,) = torch.autograd.grad((probs * k3_distill(ls, lt)).sum(), z)
    # sum_v (p_s - p_t)(v) grad log p_s(v) = p_s - p_t for softmax logits (as sum_v p_s = 1)
    assert torch.allclose(g_k3, probs - lt.exp(), atol=1e-6)
    (g_full,) = torch.autograd.grad(full_reverse_kl(z[None], zt[None]).sum(), z)
    assert not torch.allclose(g_k3, g_full, atol=1e-3)


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_teacher_equal_to_student_gives_zero_value_and_zero_gradient(estimator):
    z = torch.randn(2, 3, 5, requires_grad=True)  # student logits [n, T, V]
    ids = torch.tensor([[0, 2, 4], [1, 1, 3]])  # [n, T]
    mask = torch.tensor([[True, True, True], [True, False, False]])  # [n, T]
    ls = torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)  # [n, T]
    full = full_reverse_kl(z.reshape(-1, 5), z.detach().reshape(-1, 5)).view(2, 3)  # [n, T]
    term, m = distill_loss_term(
        ls, mask, SimpleNamespace(estimator=estimator, coef=1.0), "token_mean", {},
        teacher_logp=ls.detach(), full_kl=full,
    )  # fmt: skip
    assert abs(float(term.detach())) < 1e-6 and abs(m["distill_kl"]) < 1e-6
    (g,) = torch.autograd.grad(term, z)
    assert g.abs().max() < 1e-6


def test_k1_with_teacher_equal_to_student_has_zero_value_and_gradient():
    ls = torch.tensor([[-0.3, -2.0]], requires_grad=True)
    v = per_token_distill("k1", ls, torch.ones(1, 2, dtype=torch.bool), teacher_logp=ls.detach())
    v.sum().backward()
    assert float(v.abs().sum()) == 0.0 and float(ls.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k3", "full"])
def test_fully_masked_rows_give_zero_and_no_nan(estimator):
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.1]], requires_grad=True)  # [n, T]
    mask = torch.tensor([[True, True], [False, False]])
    teacher = torch.tensor([[-1.0, -0.5], [float("nan"), float("-inf")]])  # padding: garbage
    full = torch.tensor([[0.2, 0.4], [float("nan"), float("inf")]], requires_grad=True)
    term, m = distill_loss_term(
        logp, mask, SimpleNamespace(estimator=estimator, coef=2.0), "seq_mean_token_mean",
        {}, teacher_logp=teacher, full_kl=full,
    )  # fmt: skip
    grads = torch.autograd.grad(term, [logp, full], allow_unused=True)
    used = grads[1] if estimator == "full" else grads[0]  # [n, T]: the input the form reads
    assert torch.isfinite(term) and math.isfinite(m["distill_kl"])
    assert torch.isfinite(used).all() and float(used[1].abs().sum()) == 0.0
    assert float(used[0].abs().sum()) > 0
    # one valid row of 2 tokens, seq_mean_token_mean over num_seqs = 1 (the local count)
    by_hand = {
        "k1": (0.5 + -0.5) / 2,
        "k3": ((math.exp(-0.5) + 0.5 - 1) + (math.exp(0.5) - 0.5 - 1)) / 2,
        "full": (0.2 + 0.4) / 2,
    }[estimator]
    assert abs(float(term.detach()) - 2.0 * by_hand) < 1e-6
    # all rows masked: 0 and no NaN
    none = torch.zeros(2, 2, dtype=torch.bool)
    term0, m0 = distill_loss_term(
        logp, none, SimpleNamespace(estimator=estimator, coef=1.0), "token_mean", {},
        teacher_logp=teacher, full_kl=full,
    )  # fmt: skip
    assert float(term0.detach()) == 0.0 and m0["distill_kl"] == 0.0


def test_total_loss_adds_the_term_with_global_counts_and_logs_it():
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.1]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    teacher = torch.tensor([[-1.0, -0.5], [-0.7, 0.0]])
    counts = {"num_tokens": 6, "num_seqs": 4, "max_len": 2}  # the step's: more than this micro
    res = total_loss(
        PolicyOutput(logp=logp), old_logp=logp.detach(), advantages=torch.zeros(2), mask=mask,
        algo=_algo("k1", coef=0.5), counts=counts, teacher_logp=teacher,
    )  # fmt: skip
    k1_sum = 0.5 + -0.5 + 0.5
    assert abs(res.metrics["distill_loss"] - 0.5 * k1_sum / 6) < 1e-6
    assert abs(res.metrics["loss"] - 0.5 * k1_sum / 6) < 1e-6  # pg_coef 0
    assert abs(res.metrics["distill_kl"] - k1_sum / 3) < 1e-6
    res.loss.backward()
    want = 0.5 * torch.tensor([[0.5, -0.5], [0.5, 0.0]]) / 6
    assert torch.allclose(logp.grad, want, atol=1e-6)


def test_total_loss_without_teacher_logp_names_the_option():
    logp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="algorithm.distill.estimator='k1'"):
        total_loss(
            PolicyOutput(logp=logp), old_logp=logp.detach(), advantages=torch.zeros(1),
            mask=torch.ones(1, 2, dtype=torch.bool), algo=_algo("k1"), counts={},
        )  # fmt: skip


def test_with_the_rl_loss_the_term_adds_to_the_policy_loss():
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.1]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    teacher = torch.tensor([[-1.0, -0.5], [-0.7, 0.0]])
    common = dict(
        old_logp=logp.detach(), advantages=torch.tensor([1.0, -1.0]), mask=mask, counts={}
    )
    rl = total_loss(PolicyOutput(logp=logp), algo=_algo("k3", pg_coef=1.0), **common,
                    teacher_logp=teacher)  # fmt: skip
    alone = total_loss(PolicyOutput(logp=logp), algo=_algo("k3", pg_coef=0.0), **common,
                       teacher_logp=teacher)  # fmt: skip
    # ratio 1: the clip surrogate is -A per token; token_mean over 3 tokens: -(1 + 1 - 1) / 3
    assert abs(rl.metrics["pg_loss"] - (-1.0 / 3)) < 1e-6
    assert abs(rl.metrics["loss"] - (rl.metrics["pg_loss"] + alone.metrics["loss"])) < 1e-6
    assert abs(alone.metrics["loss"] - alone.metrics["distill_loss"]) < 1e-9
