"""Mixed precision as training shards the model (train/parallelize.py), shared with the profiler's
FSDP harness so that its ranks hold what training's hold."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def bf16_policy() -> MixedPrecisionPolicy:
    """bf16 compute on fp32 master weights, gradients reduced in fp32. Inputs keep their dtypes:
    activations are bf16 from the first layer on, and the RoPE tables must stay float32 (bf16
    angles would blur neighbouring positions)."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
