"""zellige.runtime: executes a Plan in PyTorch. The only package that calls torch.distributed.

The C++ plan compiler turns (batch, plan, rank) into a `StepProgram` (zellige._core): every index
array, split size, ring message and attention group one rank needs for one step. The runtime
copies those arrays to the device, exchanges tensors and calls attention kernels; it computes no
bookkeeping of its own. Formats and the flow of a step: docs/architecture.md, docs/formats.md.

Public API (stable; everything else in the package is private):

    program = compile_step(batch, plan, num_heads, rank, *, joint_attention=False)
        The rank's StepProgram (C++; picklable, so a loader worker builds it one step ahead and
        sends it as is). Raises ValueError when the plan does not match the batch or head count.
    step = load_step(program, device, group=None, *, error=None, engine=None, transport=None)
        Once per step, on every rank of `group` (default: the world): moves the program to
        `device`. One tiny all_gather makes every rank raise the same ValueError when any rank
        failed (`error`: a message from the rank's loader, e.g. compile_step's) or when the ranks'
        programs are for different batches or plans; never a hang. engine: the run's
        EngineConfig (default: EngineConfig.from_env()); transport: how exchanges move rows
        (default: torch.distributed; a Transport subclass for tools that run one rank alone).
    step = prepare_step(batch, plan, num_heads, device, group=None, *, joint_attention=False,
                        engine=None, transport=None)
        compile_step + load_step in one call.

    EngineConfig(merge="auto", backend=None, streams=None, key_split=None, call_table=None)
        How attention runs, chosen once per run (runtime/engine.py); EngineConfig.from_env()
        reads the documented ZELLIGE_ATTENTION_* overrides, the only place they are read.

    Joint attention (MMDiT, joint_attention=True): a sequence's attended tokens are its text
    tokens followed by its visual tokens, and every strategy cuts that joint list. Cross-attention
    models (Wan): held tokens are visual only; each held chunk receives its sequence's whole text.

    step.num_source_tokens / step.num_held_tokens     S / T, all modalities
    step.position_ids      [T, 3] long: (t, h, w) in the latent grid; text token k: (k, 0, 0)
    step.sequence_index    [T] long: index into batch.sequences
    step.chunk_index       [T] long: index of the held chunk the token belongs to
    step.modality          [T] long: 0 visual, 1 text
    step.visual_index / step.text_index   held positions of the visual / text tokens, in order
    step.chunk_sequence_index, step.chunk_num_tokens, step.chunk_num_text_tokens,
    step.chunk_cross_text_tokens          host lists, one entry per held chunk (held order; a chunk
        may be empty); chunk_num_text_tokens: text tokens among its held tokens (joint);
        chunk_cross_text_tokens: text rows route_text delivers for it (cross; 0 if empty)
    step.program           the StepProgram itself

    x_TD = route(x_SD, step, tokens="all")   source tokens -> held tokens (one all_to_all)
        tokens="visual": x is [S_visual, ...] -> [T_visual, ...]; "text": [S_text, ...] ->
        [T_text, ...] (joint); "all": [S, ...] -> [T, ...]. Source order: the rank's sequences
        in batch order, each its text then its visual tokens (per modality: that modality only).
    x_SD = reverse_route(x_TD, step, tokens="all")   the inverse
    text_XE = route_text(text_SE, step)   cross-attention: the whole text of each held chunk's
        sequence, chunks in held order (source: the rank's sequences' text rows in batch order)
        All three: any dtype and trailing shape, differentiable (route_text's backward sums the
        gradients of a text delivered to several ranks).

    fn = attention_fn(step)          self- or joint attention over the held tokens:
        (q_TNH, k_TNH, v_TNH) -> o_TNH, equal to single-process attention of every sequence
    fn = cross_attention_fn(step)    (q_TNH, k_XNH, v_XNH) -> o_TNH: each held chunk's queries
        against its sequence's text (rows from route_text); local, no communication
        Every rank of the group calls the distributed ones every layer. Differentiable.

    o_rows = coalesced_attention(q_rows, k_rows, v_rows, table, *, scale, backend, return_lse,
                                 engine)
        Single-device attention of many segments in few kernel calls: table = SegmentTable.build(
        q_row_offset, k_row_offset, q_len, k_len, num_heads, device) (grouped by the C++ engine
        that also groups the step program's segments) or SegmentTable.packed(cu_seqlens, N).
        The table runs on one backend (dense groups, padded calls or one ragged call:
        runtime/backends.py choose_backend), the same decision a step's tables take.
    fn = local_attention(q_lengths, kv_lengths, device, engine=None)
        (q_TNH, k_SNH, v_SNH) -> o_TNH of segments packed back to back on one rank

    y = checkpointed(block, *args)   block(*args) under selective activation checkpointing: the
        backward recomputes its per-token layers (and Ulysses' q/k/v exchange) but not its
        attention, whose outputs are kept (runtime/recompute.py, docs/training.md)

    end_rank_process(exit_code=0)   the last call of a rank's entry point: a barrier,
        destroy_process_group, then os._exit, so that a process group something still refers
        to (FSDP2 does) is not torn down by Python's finalization, which with gloo aborts a rank
        now and then after its work succeeded (a nonzero exit_code: sys.exit after the
        destroy; runtime/teardown.py)

    t = to_device(host_tensor, device)   a host tensor on the device with no host sync (pinned
        and non_blocking on CUDA): how the step's tables reach the GPU.

    kernel_for(device, dtype, head_dim, backend=None) / KERNELS: the attention kernels; the
        automatic choice (cuDNN > flash > efficient on CUDA half precision, ATen flash on CPU) can
        be overridden with backend= or EngineConfig.backend.
    call_work(call), stream_assignment(works, streams): the order and streams of a table's
        calls (what the profiler measures a pack of calls by).

Legend: S source tokens, T held tokens, X cross-attention text rows, N heads, H head dim,
D features; rows = tokens x heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor

from zellige.runtime.attention import cross_attention, distributed_attention
from zellige.runtime.backends import coalesced_attention, engine_runs_ragged
from zellige.runtime.coalesced import SegmentTable, call_work, stream_assignment, to_device
from zellige.runtime.engine import EngineConfig
from zellige.runtime.exchange import reverse_route, route, route_text
from zellige.runtime.kernels import KERNELS, kernel_for
from zellige.runtime.layout import Step, compile_step, load_step, prepare_step
from zellige.runtime.local import local_attention
from zellige.runtime.recompute import checkpointed
from zellige.runtime.teardown import end_rank_process
from zellige.runtime.transport import Transport


def attention_fn(
    step: Step, *, backend: str | None = None, scale: float | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """distributed_attention bound to one step: the model's self- (or joint) attention."""
    return functools.partial(distributed_attention, step=step, backend=backend, scale=scale)


def cross_attention_fn(
    step: Step, *, backend: str | None = None, scale: float | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Cross-attention of each held chunk's queries [T, N, H] to its sequence's text rows
    [X, N, H] (as route_text delivers them), in the step program's dense groups."""
    return functools.partial(cross_attention, step=step, backend=backend, scale=scale)


__all__ = [
    "KERNELS",
    "EngineConfig",
    "SegmentTable",
    "Step",
    "Transport",
    "attention_fn",
    "call_work",
    "checkpointed",
    "coalesced_attention",
    "compile_step",
    "cross_attention_fn",
    "distributed_attention",
    "end_rank_process",
    "engine_runs_ragged",
    "kernel_for",
    "load_step",
    "local_attention",
    "prepare_step",
    "reverse_route",
    "route",
    "route_text",
    "stream_assignment",
    "to_device",
]
