"""Pieces of the training stack that need no process group: configs and the step timer."""

from __future__ import annotations

import time

import pytest
import torch

from zellige.train.config import CONFIGS, get_config
from zellige.train.timing import StepTimer


def test_every_named_config_builds_and_names_itself() -> None:
    for name in CONFIGS:
        config = get_config(name)
        assert config.name == name
        assert get_config(name.replace("-", "_")).name == name  # function names work too
    assert get_config("wan14b-width-h200").model.width == get_config("wan14b-h200x8").model.width
    with pytest.raises(ValueError, match="allowed: tiny-cpu"):
        get_config("wan-99b")


def test_step_timer_counts_forward_and_backward_of_a_region() -> None:
    timer = StepTimer(torch.device("cpu"))

    def slow_square(x: torch.Tensor, factor: float) -> torch.Tensor:
        time.sleep(0.02)
        return SlowBackward.apply(x * factor)

    x = torch.ones(3, requires_grad=True)
    y = timer.wrap("region", slow_square)(x, 2.0)
    assert not y._is_view()  # FSDP hooks region outputs: they must not be views
    y.sum().backward()
    seconds = timer.seconds()
    assert seconds["region"] >= 0.02 and seconds["region.backward"] >= 0.03
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    timer.reset()
    assert timer.seconds() == {}


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad
