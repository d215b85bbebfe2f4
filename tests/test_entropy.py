"""Token entropy from logits, the high-entropy (80/20) token mask, the entropy bonus."""

import math

import pytest
import torch

from grouprl.objectives.entropy import entropy_bonus, high_entropy_mask, token_entropy_from_logits


def test_entropy_hand_values():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4 -> log 4
            [1000.0, 1000.0, -1000.0, -1000.0],  # two-way tie, huge logits -> log 2, no overflow
            [0.0, math.log(3.0), -1e9, -1e9],  # p = (1/4, 3/4) -> -(1/4 log 1/4 + 3/4 log 3/4)
        ],
        dtype=torch.float64,
    )
    h = token_entropy_from_logits(logits)
    expected = [math.log(4), math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    torch.testing.assert_close(h, torch.tensor(expected, dtype=torch.float64))


def test_entropy_with_minus_inf_logits_is_finite_with_finite_gradient():
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [5.0, float("-inf"), float("-inf")]])
    logits.requires_grad_(True)
    h = token_entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.tensor([math.log(2), 0.0]))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_keeps_leading_shape():
    logits = torch.randn(2, 3, 5)
    assert token_entropy_from_logits(logits).shape == (2, 3)


def test_high_entropy_mask_quantile():
    # valid entropies 1..5 (the padded 100 must never count or be kept)
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    # q = 0.4: threshold = 0.6-quantile of [1..5]: position 0.6 * 4 = 2.4 -> 3 + 0.4 * (4 - 3) = 3.4
    keep = high_entropy_mask(ent, mask, 0.4)
    assert keep.tolist() == [[False, False, False, False], [True, True, False, False]]
    # q = 0.6: 0.4-quantile at position 1.6 -> 2.6: keeps 3, 4, 5
    assert high_entropy_mask(ent, mask, 0.6).sum().item() == 3
    # q = 1 keeps every valid token
    assert torch.equal(high_entropy_mask(ent, mask, 1.0), mask)
    # ties at the threshold are kept (>=): all equal entropies -> all kept
    assert torch.equal(high_entropy_mask(torch.ones(2, 4), mask, 0.2), mask)


def test_high_entropy_mask_edge_cases():
    ent = torch.rand(2, 3)
    assert not high_entropy_mask(ent, torch.zeros(2, 3, dtype=torch.bool), 0.2).any()
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="top_quantile"):
            high_entropy_mask(ent, torch.ones(2, 3, dtype=torch.bool), bad)
    with pytest.raises(ValueError, match="same shape"):
        high_entropy_mask(ent, torch.ones(2, 2, dtype=torch.bool), 0.5)


def test_entropy_bonus_aggregates():
    ent = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert entropy_bonus(ent, mask).item() == pytest.approx(7 / 3)  # token mean (1 + 2 + 4) / 3
    # seq mean of token means: (1.5 + 4) / 2
    assert entropy_bonus(ent, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    assert entropy_bonus(ent, mask, "token_mean", num_tokens=7).item() == pytest.approx(1.0)
