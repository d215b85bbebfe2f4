"""Engine-mismatch importance weights (TIS / MIS): hand values per mode, metrics, safety."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.objectives.correction import CORRECTIONS, engine_is_weights

NAN = float("nan")
# trainer probabilities and engine probabilities; token ratios w = old / engine:
#   row 0: .5/.25 = 2, .5/.5 = 1, .5/1 = 0.5      row 1: .2/.05 = 4, .9/.9 = 1, padding
OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.9, 0.3]], dtype=torch.float64))
ENG = torch.log(torch.tensor([[0.25, 0.5, 1.0], [0.05, 0.9, 0.7]], dtype=torch.float64))
ENG[1, 2] = NAN  # garbage in a padding slot must not leak
MASK = torch.tensor([[True, True, True], [True, True, False]])
BOUNDS = {"min_weight": 0.6, "max_weight": 3.0}  # away from the exact ratios, no float ties


def weights(mode: str, **kw) -> tuple[torch.Tensor, dict[str, float]]:
    return engine_is_weights(OLD, ENG, MASK, mode, **{**BOUNDS, **kw})


def rows(w: torch.Tensor) -> list[list[float]]:
    return [[round(x, 6) for x in row] for row in w.tolist()]


def test_names():
    assert CORRECTIONS.names() == [
        "none",
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "sequence_mask",
    ]


def test_none_is_all_ones():
    w, m = weights("none")
    assert (w == 1).all()
    assert m["engine_is/mean_weight"] == 1.0 and m["engine_is/frac_clipped"] == 0.0
    w2, m2 = engine_is_weights(OLD, None, MASK, "none")
    assert (w2 == 1).all() and m2 == {}


def test_token_truncate():
    w, m = weights("token_truncate")
    # [2, 1, 0.5 -> 0.6 | 4 -> 3, 1, padding -> 1]
    assert rows(w) == [[2.0, 1.0, 0.6], [3.0, 1.0, 1.0]]
    assert m["engine_is/frac_clipped"] == pytest.approx(2 / 5)
    assert m["engine_is/mean_weight"] == pytest.approx((2 + 1 + 0.6 + 3 + 1) / 5)


def test_token_mask_keeps_weight_w():
    w, m = weights("token_mask")
    # kept tokens keep w (as TRL); out-of-range tokens -> 0
    assert rows(w) == [[2.0, 1.0, 0.0], [0.0, 1.0, 1.0]]
    assert m["engine_is/frac_clipped"] == pytest.approx(2 / 5)
    assert m["engine_is/mean_weight"] == pytest.approx(4 / 5)


def test_sequence_modes():
    # row 0: log(2 * 1 * 0.5) = 0 -> W = 1 ; row 1: log(4 * 1) -> W = 4 (padding excluded from the sum)
    w, m = weights("sequence_truncate")
    assert rows(w) == [[1.0, 1.0, 1.0], [3.0, 3.0, 1.0]]
    assert m["engine_is/frac_clipped"] == pytest.approx(1 / 2)  # counted over sequences
    w, m = weights("sequence_mask")
    assert rows(w) == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    assert m["engine_is/mean_weight"] == pytest.approx(3 / 5)
    w, _ = weights("sequence_mask", max_weight=5.0)
    assert rows(w) == [[1.0, 1.0, 1.0], [4.0, 4.0, 1.0]]


def test_diagnostic_metrics():
    _, m = weights("token_truncate")
    # |log w| = log 2, 0, log 2, log 4, 0 -> mean 4 log 2 / 5
    assert m["engine_is/mean_abs_log_w"] == pytest.approx(4 * math.log(2) / 5)
    # k3 of KL(engine || trainer): w - 1 - log w = (1 - log 2) + 0 + (log 2 - .5) + (3 - log 4) + 0
    assert m["engine_is/kl_engine_trainer"] == pytest.approx((3.5 - 2 * math.log(2)) / 5)
    assert m["engine_is/kl_engine_trainer"] == pytest.approx(0.422741, abs=1e-6)


def test_extreme_ratios_stay_finite_and_detached():
    old = torch.tensor([[0.0, 0.0], [-200.0, 0.0]], requires_grad=True)
    eng = torch.tensor([[-100.0, -100.0], [0.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    for mode in CORRECTIONS.names():
        w, m = engine_is_weights(old, eng, mask, mode)
        assert torch.isfinite(w).all() and not w.requires_grad
        assert all(math.isfinite(v) for v in m.values())
    w, _ = engine_is_weights(old, eng, mask, "token_truncate")
    # log w = 100 -> clamped to 20 -> e^20 truncated to 2 ; log w = -200 -> clamped to -20 -> e^-20 kept
    assert w[0].tolist() == [2.0, 2.0]
    assert w[1].tolist() == pytest.approx([math.exp(-20), 1.0], rel=1e-5)


def test_empty_mask_gives_zero_metrics():
    w, m = engine_is_weights(OLD, ENG, torch.zeros(2, 3, dtype=torch.bool), "token_mask")
    assert (w == 1).all()
    assert m["engine_is/frac_clipped"] == 0.0 and m["engine_is/mean_weight"] == 0.0


def test_errors():
    with pytest.raises(ValueError, match="needs engine_logp"):
        engine_is_weights(OLD, None, MASK, "token_mask")
    with pytest.raises(ValueError, match="min_weight"):
        engine_is_weights(OLD, ENG, MASK, "token_mask", min_weight=3.0, max_weight=2.0)
    with pytest.raises(ValueError, match="same shape"):
        engine_is_weights(OLD, ENG[:, :2], MASK, "token_mask")
    with pytest.raises(ValueError, match="did you mean 'token_mask'"):
        engine_is_weights(OLD, ENG, MASK, "token_masks")
