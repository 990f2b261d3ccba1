"""Learning-rate schedule: linear warm-up, then constant / linear / cosine decay to a floor."""

from __future__ import annotations

import math

import pytest

from polar_training.trainer import TrainConfig, lr_lambda


def test_warmup_then_cosine_and_linear_decay():
    cos = lr_lambda(TrainConfig(warmup_steps=4, lr_schedule="cosine", total_steps=14, min_lr_ratio=0.1))
    assert [cos(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cos(4) == pytest.approx(1.0)
    assert cos(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(14) == pytest.approx(0.1) and cos(100) == pytest.approx(0.1)
    lin = lr_lambda(TrainConfig(lr_schedule="linear", total_steps=10))
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    const = lr_lambda(TrainConfig(warmup_steps=2))
    assert [const(s) for s in (0, 1, 2, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError):
        TrainConfig(lr_schedule="step")
