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


def test_step_timer_leaves_tensors_without_gradients_alone() -> None:
    """Marks go on tensors that need gradients only: a table passed beside them (RoPE) must not
    start requiring grad, or every product with it would save operands for its gradient."""
    timer = StepTimer(torch.device("cpu"))
    seen = {}

    def region(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        seen["table requires grad"] = table.requires_grad
        return x * table

    x, table = torch.ones(3, requires_grad=True), torch.full((3,), 2.0)
    y = timer.wrap("region", region, fresh_output=False)(x, table)
    assert seen["table requires grad"] is False
    assert y._is_view()  # fresh_output=False: no copy of the output
    y.sum().backward()
    torch.testing.assert_close(x.grad, table)
    assert set(timer.seconds()) == {"region", "region.backward"}


def test_checkpointed_blocks_follow_the_plan() -> None:
    """Adaptive: the plan's count for this rank; otherwise every block, or none."""
    import dataclasses

    from zellige.train.loop import _checkpointed_blocks

    config = dataclasses.replace(get_config("wan1p3b-h200"), activation_checkpointing=True)
    plan = {"predicted": {"rank_checkpointed_layers": [7, 30]}}
    assert _checkpointed_blocks(config, plan, 0) == 7
    assert _checkpointed_blocks(config, plan, 1) == 30
    assert _checkpointed_blocks(config, {"predicted": {}}, 0) == 30  # an older plan: all
    fixed = dataclasses.replace(config, adaptive_checkpointing=False)
    assert _checkpointed_blocks(fixed, plan, 0) == 30
    assert (
        _checkpointed_blocks(dataclasses.replace(config, activation_checkpointing=False), plan, 0)
        == 0
    )
