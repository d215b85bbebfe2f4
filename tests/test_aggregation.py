"""Aggregation modes: hand-computed values, global counts, empty rows, micro-batch invariance."""

import pytest
import torch

from grouprl.objectives.aggregation import AGGREGATIONS, aggregate, local_counts

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
ALL_MODES = [*MODES, "delta_l"]

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, False, False]])
# valid values: row 0 -> 1, 2 (|o_0| = 2, sum 3); row 1 -> 4 (|o_1| = 1, sum 4); 3 tokens, 2 seqs
EXPECTED = {
    "token_mean": 7 / 3,  # (1 + 2 + 4) / 3
    "seq_mean_token_mean": 2.75,  # (3/2 + 4/1) / 2
    "seq_mean_token_sum": 3.5,  # (3 + 4) / 2
    "seq_mean_token_sum_norm": 0.875,  # (1 + 2 + 4) / (2 seqs * max_len 4)
    "delta_l": 1.1875,  # weights W = [0.5, 2]: (0.5 * 3 + 2 * 4) / (2 seqs * max_len 4)
}
W = torch.tensor([0.5, 2.0, 3.0, 1.5, 0.25, 1.0, 2.5], dtype=torch.float64)  # row weights, delta_l


def _w(mode, n):
    """Delta-L's sequence weights (rows 0..n-1 of W) for mode delta_l, None for the others."""
    return W[:n] if mode == "delta_l" else None


def test_registry_has_exactly_the_config_modes():
    assert sorted(AGGREGATIONS.names()) == sorted(ALL_MODES)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_hand_values_local_counts(mode):
    out = aggregate(LOSS, MASK, mode, max_len=4, seq_weights=_w(mode, 2))
    assert out.item() == pytest.approx(EXPECTED[mode])


def test_global_counts_override_local():
    # token_mean: 7 / 14 global tokens; seq means: numerators over 7 global sequences
    assert aggregate(LOSS, MASK, "token_mean", num_tokens=14).item() == pytest.approx(0.5)
    assert aggregate(LOSS, MASK, "seq_mean_token_mean", num_seqs=11).item() == pytest.approx(
        5.5 / 11
    )
    assert aggregate(LOSS, MASK, "seq_mean_token_sum", num_seqs=7).item() == pytest.approx(1.0)
    out = aggregate(LOSS, MASK, "seq_mean_token_sum_norm", num_seqs=7, max_len=2)
    assert out.item() == pytest.approx(0.5)  # 7 / (7 * 2)
    # tensor counts work too (e.g. after an all_reduce)
    assert aggregate(LOSS, MASK, "token_mean", num_tokens=torch.tensor(14.0)).item() == 0.5


def test_local_counts():
    assert local_counts(MASK) == (3, 2)
    assert local_counts(torch.zeros(3, 4, dtype=torch.bool)) == (0, 0)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_empty_rows_and_padding_change_nothing(mode):
    # an extra fully-masked row of NaN and two extra NaN columns
    loss = torch.full((3, 5), float("nan"), dtype=torch.float64)
    loss[:2, :3] = LOSS
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:2, :3] = MASK
    loss.requires_grad_(True)
    out = aggregate(loss, mask, mode, max_len=4, seq_weights=_w(mode, 3))
    assert out.item() == pytest.approx(EXPECTED[mode])
    out.backward()
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_all_masked_gives_zero_with_graph(mode):
    loss = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = aggregate(loss, mask, mode, max_len=3, seq_weights=_w(mode, 2))
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(loss.grad, torch.zeros_like(loss))
    # also with global counts of zero (every process empty)
    out = aggregate(loss, mask, mode, num_tokens=0, num_seqs=0, max_len=3, seq_weights=_w(mode, 2))
    assert out.item() == 0.0


@pytest.mark.parametrize("mode", ALL_MODES)
def test_micro_batches_with_global_counts_sum_to_the_big_batch(mode):
    """delta_l: weights of the whole batch, each micro-batch gets its slice."""
    g = torch.Generator().manual_seed(0)
    n, t, max_len = 7, 6, 8
    lengths = torch.tensor([6, 1, 0, 4, 3, 6, 2])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [7, 6]
    base = torch.randn(n, t, generator=g, dtype=torch.float64)
    full = base.clone().requires_grad_(True)
    ref = aggregate(full, mask, mode, max_len=max_len, seq_weights=_w(mode, n))
    ref.backward()
    tokens, seqs = local_counts(mask)
    split = base.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1], [2], [3, 4, 5, 6]):
        # each micro-batch is also trimmed to its own padded width
        width = max(int(lengths[rows].max()), 1)
        total = total + aggregate(
            split[rows, :width],
            mask[rows, :width],
            mode,
            num_tokens=tokens,
            num_seqs=seqs,
            max_len=max_len,
            seq_weights=None if mode != "delta_l" else W[rows],
        )
    total.backward()
    assert total.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(split.grad, full.grad)


def test_errors():
    with pytest.raises(ValueError, match="max_len"):
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(LOSS, MASK, "token_means")
    with pytest.raises(ValueError, match="same shape"):
        aggregate(LOSS, MASK[:, :2], "token_mean")
    with pytest.raises(TypeError, match="bool"):
        aggregate(LOSS, MASK.float(), "token_mean")
    with pytest.raises(ValueError, match="seq_weights"):
        aggregate(LOSS, MASK, "delta_l", max_len=4)
    with pytest.raises(ValueError, match=r"seq_weights must be \[n\]"):
        aggregate(LOSS, MASK, "delta_l", max_len=4, seq_weights=W)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(LOSS, MASK, "delta_l", seq_weights=W[:2])


def test_seq_weights_apply_to_every_mode():
    # generic per-row weights: row 0 (values 1, 2) x 0.5, row 1 (value 4) x 2
    # token_mean (0.5 * 3 + 2 * 4) / 3 tokens; seq_mean_token_mean (0.5 * 1.5 + 2 * 4) / 2 seqs
    w = W[:2]
    assert aggregate(LOSS, MASK, "token_mean", seq_weights=w).item() == pytest.approx(9.5 / 3)
    out = aggregate(LOSS, MASK, "seq_mean_token_mean", seq_weights=w)
    assert out.item() == pytest.approx(8.75 / 2)
