"""Gradient accumulation: one optimizer step over a global batch's micro-batches
(docs/global-batch.md, "Training with micro-batches").

Each micro-batch is a step of the one pipeline: its own plan, step program, routed inputs and
checkpointed blocks. Its loss is divided by the whole global batch's token count, so the
gradients its backward adds are its share of the global batch's gradient, and after the last
micro-batch the model holds the global batch's gradient. Under FSDP2 every micro-batch's
backward reduce-scatters (FSDP2's default) and the reductions add into each rank's sharded
gradients; on a lone rank without FSDP the backwards add into the weights' gradients. Either way
a micro-batch after the first holds the sharded gradients from its backward's start, as the plans
price it (CostOptions.accumulating_gradients). Deferring the reduction to the last micro-batch
would hold every parameter's unsharded gradient on every rank (4 bytes a parameter: 56 GB for a
14B model), more than an 80 GB card has beside the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from zellige.data import StepData
from zellige.train.parallelize import set_checkpointed_blocks

StepInputT = TypeVar("StepInputT")


def accumulate(
    model: torch.nn.Module,
    micro_batches: Sequence[StepData],
    first_input: StepInputT,
    *,
    rank: int,
    assemble: Callable[[StepData], StepInputT],
    forward_backward: Callable[[StepInputT, StepData], torch.Tensor],
) -> torch.Tensor:
    """Runs each micro-batch's forward and backward in order and returns the sum of their
    losses on this rank (detached). `first_input` is micro-batch 0's inputs, made ahead;
    micro-batch k + 1's are assembled once k's backward is issued (host work while the device
    runs it). Each micro-batch checkpoints the blocks its own plan chose for this rank."""
    count = len(micro_batches)
    total_loss = None
    step_input = first_input
    for index, micro_batch in enumerate(micro_batches):
        last = index == count - 1
        set_checkpointed_blocks(model, *micro_batch.record.checkpointed_blocks(rank))
        local_loss = forward_backward(step_input, micro_batch)
        total_loss = local_loss if total_loss is None else total_loss + local_loss
        step_input = None  # its tensors are free once the device is done with them
        if not last:
            step_input = assemble(micro_batches[index + 1])
    return total_loss
