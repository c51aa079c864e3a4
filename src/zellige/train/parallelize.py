"""Parallelism, activation checkpointing, precision and timing are applied here, in one place;
the model itself knows none of them.

FSDP2 (fully_shard) over all ranks, one unit per block plus the root. FSDP averages gradients
over ranks; the loop scales each rank's loss by the rank count so the result is their sum (each
rank's loss is already normalised by the global token count). A divide factor of 1 would say the
same, but gloo lacks the PREMUL_SUM reduction it needs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zellige.model import VideoDiT, fused
from zellige.runtime.recompute import recomputed
from zellige.train.timing import StepTimer

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


class BlockRunner(nn.Module):
    """Runs one block under the step timer; when checkpointing, its backward recomputes the
    block's per-token layers (selective checkpointing: the attention outputs are kept,
    zellige.runtime.recompute), or with `full_recompute` the whole block, attention included
    (where the plan's memory has no room for the kept outputs). Both may change between steps
    (set_checkpointed_blocks)."""

    def __init__(self, block: nn.Module, timer: StepTimer, activation_checkpointing: bool) -> None:
        super().__init__()
        self.block = block
        self.activation_checkpointing = activation_checkpointing
        self.full_recompute = False
        self._timed = timer.wrap("block", self._run)

    def _run(self, *args):
        if self.activation_checkpointing:
            return recomputed(self.block, *args, full=self.full_recompute)
        return self.block(*args)

    def forward(self, *args):
        return self._timed(*args)


def set_checkpointed_blocks(model: VideoDiT, count: int, full: int = 0) -> None:
    """Checkpoint the first `count` blocks of a parallelized model, the first `full` of them
    with a full recompute, and keep the others' activations (the cost model lays memory out the
    same way: the backward frees the full activations of the last blocks first, while the
    gradients grow)."""
    if not 0 <= count <= len(model.blocks):
        raise ValueError(f"checkpointed blocks must be in [0, {len(model.blocks)}], got {count}")
    if not 0 <= full <= count:
        raise ValueError(f"fully recomputed blocks must be in [0, {count}], got {full}")
    for index, runner in enumerate(model.blocks):
        runner.activation_checkpointing = index < count
        runner.full_recompute = index < full


def bf16_policy() -> MixedPrecisionPolicy:
    """bf16 compute on fp32 master weights, gradients reduced in fp32. Inputs keep their dtypes:
    activations are bf16 from the first layer on, and the RoPE tables must stay float32 (bf16
    angles would blur neighbouring positions)."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def parallelize(
    model: VideoDiT,
    mesh: DeviceMesh,
    *,
    dtype: str,
    activation_checkpointing: bool,
    timer: StepTimer,
    compile_elementwise: bool = False,
) -> VideoDiT:
    """Shards `model` in place over `mesh` and returns it. bfloat16 means bf16 compute with fp32
    master weights and fp32 gradient reduction; float32 / float64 compute in that dtype.
    compile_elementwise fuses the blocks' per-token layers with torch.compile (zellige.model.fused).
    Each block unit prefetches the next one's all-gather in the forward (FSDP2's backward
    prefetches one unit by default)."""
    fused.use_compiled(compile_elementwise)
    if dtype == "bfloat16":
        policy = bf16_policy()
    else:
        model.to(DTYPES[dtype])
        policy = MixedPrecisionPolicy()
    for index, block in enumerate(model.blocks):
        runner = BlockRunner(block, timer, activation_checkpointing)
        fully_shard(runner, mesh=mesh, mp_policy=policy)
        model.blocks[index] = runner
    fully_shard(model, mesh=mesh, mp_policy=policy)
    runners = list(model.blocks)
    for runner, following in zip(runners, runners[1:], strict=False):
        runner.set_modules_to_forward_prefetch([following])
    return model
