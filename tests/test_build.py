"""Builders: learning-rate schedules by hand."""

import pytest
import torch

from grouprl.config.loading import validate
from grouprl.runtime.build import build_optimizer


class _Params:
    def __init__(self):
        self.w = torch.nn.Parameter(torch.zeros(1))

    def trainable_parameters(self):
        return [self.w]


def _lrs(schedule, warmup=0, steps=4, epochs=1):
    cfg = validate({
        "model": {"name_or_path": "x"}, "task": {"name": "arithmetic"},
        "train": {"steps": steps, "lr": 1.0, "lr_schedule": schedule, "warmup_steps": warmup},
        "algorithm": {"epochs": epochs},
    })  # fmt: skip
    opt, sched = build_optimizer(cfg, _Params())
    out = []
    for _ in range(steps * epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_linear_cosine_by_hand():
    assert _lrs("constant") == [1.0, 1.0, 1.0, 1.0]
    # linear: 1 - u/4 for updates u = 0..3
    assert _lrs("linear") == pytest.approx([1.0, 0.75, 0.5, 0.25])
    # cosine: 0.5 (1 + cos(pi u / 4)) = 1, 0.8536, 0.5, 0.1464
    assert _lrs("cosine") == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)


def test_warmup_then_linear_decay_counts_every_update():
    # warm-up 2 of 4 updates: (u+1)/3 for u = 0, 1, then 1 - (u-2)/2 for u = 2, 3
    assert _lrs("linear", warmup=2) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])
    # epochs=2 doubles the updates: linear over 8
    assert _lrs("linear", steps=2, epochs=2) == pytest.approx([1.0, 0.75, 0.5, 0.25])
