import math

import pytest

from RL2.workers.fsdp import lr_lambda


def test_warmup_then_constant():
    # 10 steps, 20% warmup = 2 steps: 1/2, 2/2, then flat
    assert [lr_lambda(s, 10, 0.2, "constant", 0.0) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_warmup_counts_the_whole_steps_the_ratio_names():
    # 100 * 0.29 is 28.999999999999996 in floating point: still 29 warmup steps; 30 * 0.05 = 1.5 is 1.
    assert [lr_lambda(s, 100, 0.29, "constant", 0.0) for s in (27, 28)] == [28 / 29, 1.0]
    assert [lr_lambda(s, 100, 0.57, "constant", 0.0) for s in (55, 56)] == [56 / 57, 1.0]
    assert lr_lambda(0, 30, 0.05, "constant", 0.0) == 1.0


def test_cosine_reaches_the_floor():
    total, warmup_ratio, floor = 12, 0.25, 0.1  # 3 warmup steps, then 9 cosine steps
    values = [lr_lambda(s, total, warmup_ratio, "cosine", floor) for s in range(total + 1)]
    assert values[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # halfway through the decay: floor + (1 - floor) * 0.5 * (1 + cos(pi / 2))
    assert lr_lambda(3 + 4.5, total, warmup_ratio, "cosine", floor) == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[-1] == pytest.approx(floor)
    assert values[5] == pytest.approx(floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 2 / 9)))
    assert all(a >= b for a, b in zip(values[2:], values[3:]))  # never rises after warmup
