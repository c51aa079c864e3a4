"""One rank's compute of one training step, run on the one GPU at hand.

The rank's held tokens go through real DiT blocks of zellige.model (forward, backward, and the
recompute under activation checkpointing, as training's: zellige.runtime.recompute, selective,
and in full for the first `full_recompute_layers` blocks where the cost model says so);
self-attention is the engine's `distributed_attention` over the rank's compiled layout.
Exchanges are EXCLUDED: the rank's step carries a local transport (LocalTransport), so the
all_to_all and ring messages become local copies of the same sizes; every buffer, gather and
kernel of the rank is real but no byte crosses a link.

Legend: T held tokens, C held chunks (one per sequence on the rank), X text tokens of those
chunks, N heads, H head dim, D width.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zellige import _core
from zellige.model.blocks import DiTBlock
from zellige.model.config import DiTConfig, with_layers
from zellige.model.rope import rope_tables
from zellige.runtime import EngineConfig, Step, Transport, distributed_attention, prepare_step
from zellige.runtime.local import AttentionFn, local_attention
from zellige.runtime.precision import bf16_policy
from zellige.runtime.recompute import recomputed


class _Done:
    def wait(self) -> None:
        pass


def _fill_from(dest: Tensor, source: Tensor) -> None:
    """dest rows <- source rows repeated (a stand-in for what a peer would have sent); slices
    only, so the stand-in allocates nothing the real exchange would not."""
    if dest.shape[0] == 0:
        return
    if source.shape[0] == 0:
        dest.normal_()
        return
    filled = 0
    while filled < dest.shape[0]:
        take = min(dest.shape[0] - filled, source.shape[0])
        dest[filled : filled + take].copy_(source[:take])
        filled += take


class LocalTransport(Transport):
    """The exchanges as local copies of the same sizes (one process, no group): every buffer,
    gather and kernel of the rank is real but no byte crosses a link."""

    def all_to_all_rows(self, send, send_splits, recv_splits, group, async_op=False):
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        _fill_from(recv, send)
        return recv, (_Done() if async_op else None)

    def p2p(self, sends, recvs, global_ranks, group, tag):
        sent = [t for _, t in sends if t.numel() > 0]
        for _, buffer in recvs:
            if sent:
                _fill_from(buffer, sent[0])
            else:
                buffer.normal_()
        return []


LOCAL = LocalTransport()


def local_step(
    batch: _core.Batch,
    plan: _core.Plan,
    num_heads: int,
    device: torch.device,
    *,
    rank: int = 0,
    joint_attention: bool = False,
    engine: EngineConfig | None = None,
) -> Step:
    """`rank`'s step under `plan` on this one device, its exchanges local copies (LOCAL)."""
    return prepare_step(
        batch, plan, num_heads, device, rank=rank, check_agreement=False,
        joint_attention=joint_attention, engine=engine, transport=LOCAL,
    )  # fmt: skip


def local_plan(
    shapes: Sequence[tuple[int, int]], kind: str = "video"
) -> tuple[_core.Batch, _core.Plan]:
    """Sequences of (tokens, text tokens), each whole on rank 0 of 1: the single-rank steps the
    profiler, validate-profile and the benchmarks time."""
    batch = _core.Batch()
    batch.sequences = [
        _core.sequence_from_tokens(i, kind, tokens, text, 0)
        for i, (tokens, text) in enumerate(shapes)
    ]
    plan = _core.Plan()
    plan.planner = "local"
    plan.num_ranks = 1
    plan.placements = [
        _core.make_placement(i, _core.Strategy.local, [0]) for i in range(len(shapes))
    ]
    return batch, plan


def make_blocks(
    config: DiTConfig, num_layers: int, device: torch.device, dtype: torch.dtype
) -> nn.ModuleList:
    """`num_layers` blocks initialised as VideoDiT initialises them; for an MMDiT config, its
    share of double-stream blocks then single-stream ones (with_layers), as MMDiT does."""
    if config.joint_attention:
        from zellige.model.mmdit import MMDiT

        return MMDiT(with_layers(config, num_layers)).blocks.to(device=device, dtype=dtype)
    blocks = nn.ModuleList(
        DiTBlock(config.width, config.num_heads, config.ffn_width, config.eps)
        for _ in range(num_layers)
    )
    with torch.no_grad():
        for module in blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for block in blocks:
            nn.init.normal_(block.modulation, std=config.width**-0.5)
    return blocks.to(device=device, dtype=dtype)


@dataclass(kw_only=True, slots=True)
class RankInputs:
    """What the blocks of one rank see in one step (built once, reused by every layer)."""

    x_TD: Tensor
    grad_TD: Tensor | None  # the output's gradient for plain blocks; None for FSDP blocks
    text_XD: Tensor
    modulation_C6D: Tensor
    chunk_index_T: Tensor
    rope_cos: Tensor
    rope_sin: Tensor
    self_attention: object  # AttentionFn
    cross_attention: AttentionFn

    @property
    def num_tokens(self) -> int:
        return int(self.x_TD.shape[0])

    def args(self, block: nn.Module, x_TD: Tensor) -> tuple:
        """A DiTBlock's arguments."""
        return (
            x_TD,
            self.text_XD,
            self.modulation_C6D,
            self.chunk_index_T,
            self.rope_cos,
            self.rope_sin,
            self.self_attention,
            self.cross_attention,
        )

    def leaves(self) -> tuple[Tensor, ...]:
        return (self.x_TD, self.text_XD, self.modulation_C6D)


@dataclass(kw_only=True, slots=True)
class JointRankInputs:
    """The same for MMDiT blocks: held text and visual tokens in held order, where each sits
    (model.mmdit.StreamOrder), the per-sequence conditioning vector, joint attention."""

    x_TD: Tensor
    grad_TD: Tensor | None
    vec_SD: Tensor  # the time embedding's output (trainable upstream, so it gets a gradient)
    sequence_index_T: Tensor
    streams: object  # StreamOrder
    rope_T: tuple[Tensor, Tensor]
    rope_V: tuple[Tensor, Tensor]
    attention: AttentionFn

    @property
    def num_tokens(self) -> int:
        return int(self.x_TD.shape[0])

    @property
    def num_text(self) -> int:
        return self.streams.num_text

    def args(self, block: nn.Module, x_TD: Tensor) -> tuple:
        from zellige.model.mmdit import DoubleStreamBlock

        if isinstance(block, DoubleStreamBlock):
            return (x_TD, self.vec_SD, self.streams, self.rope_V, self.attention)
        return (x_TD, self.vec_SD, self.sequence_index_T, self.rope_T, self.attention)

    def leaves(self) -> tuple[Tensor, ...]:
        return (self.x_TD, self.vec_SD)


def joint_rank_inputs(
    *,
    config: DiTConfig,
    modality_T: Tensor,
    sequence_index_T: Tensor,
    positions_T3: Tensor,
    attention,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
    output_grad: bool = True,
) -> JointRankInputs:
    """MMDiT block inputs for held tokens with these tables (held order, as the runtime's step
    gives them) and `attention` over them."""
    from zellige.model.mmdit import StreamOrder, rope_without_text

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device, dtype)

    modality_T, sequence_index_T = modality_T.to(device), sequence_index_T.to(device)
    streams = StreamOrder.of(modality_T, sequence_index_T)
    rope_T = rope_without_text(positions_T3.to(device), modality_T, config, dtype)
    num_tokens, width = int(modality_T.shape[0]), config.width
    num_sequences = int(sequence_index_T.max()) + 1 if num_tokens else 0
    return JointRankInputs(
        x_TD=randn(num_tokens, width).requires_grad_(True),
        grad_TD=randn(num_tokens, width) if output_grad else None,
        vec_SD=randn(num_sequences, width).requires_grad_(True),
        sequence_index_T=sequence_index_T,
        streams=streams,
        rope_T=rope_T,
        rope_V=tuple(table[streams.visual_positions] for table in rope_T),
        attention=attention,
    )


def rank_inputs(
    *,
    config: DiTConfig,
    chunk_tokens: Sequence[int],
    chunk_text_tokens: Sequence[int],
    positions_T3: Tensor,
    self_attention,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
    output_grad: bool = True,
) -> RankInputs:
    num_tokens = int(sum(chunk_tokens))
    num_text = int(sum(chunk_text_tokens))
    width = config.width

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device, dtype)

    counts = torch.tensor(list(chunk_tokens), dtype=torch.int64)
    chunk_index_T = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(device)
    rope_dtype = torch.promote_types(dtype, torch.float32)
    rope_cos, rope_sin = rope_tables(
        positions_T3.to(device), config.head_dim, config.rope_theta, rope_dtype
    )
    # Text and modulation come out of trainable embeddings in training, so the blocks' backward
    # computes their gradients too (the text projections' input gradients are a GEMM each).
    return RankInputs(
        x_TD=randn(num_tokens, width).requires_grad_(True),
        grad_TD=randn(num_tokens, width) if output_grad else None,
        text_XD=randn(num_text, width).requires_grad_(True),
        modulation_C6D=(randn(len(chunk_tokens), 6, width) * width**-0.5).requires_grad_(True),
        chunk_index_T=chunk_index_T,
        rope_cos=rope_cos,
        rope_sin=rope_sin,
        self_attention=self_attention,
        cross_attention=local_attention(list(chunk_tokens), list(chunk_text_tokens), device),
    )


class _BlockUnit(nn.Module):
    """One block as zellige.train makes it an FSDP unit (parallelize.BlockRunner): the recompute
    of activation checkpointing runs inside the unit."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, checkpointing: bool, full_recompute: bool) -> Tensor:
        if checkpointing:
            return recomputed(self.block, *args, full=full_recompute)
        return self.block(*args)


class FSDPBlocks(nn.Module):
    """The blocks as zellige.train runs them (make_fsdp_blocks): the root FSDP unit, whose
    forward runs every block's unit."""

    def __init__(self, units: nn.ModuleList) -> None:
        super().__init__()
        self.units = units

    def forward(
        self, inputs: RankInputs | JointRankInputs, checkpointing: bool, full_recompute_layers: int
    ) -> Tensor:
        x_TD = inputs.x_TD
        for index, unit in enumerate(self.units):
            x_TD = unit(
                *inputs.args(unit.block, x_TD),
                checkpointing=checkpointing,
                full_recompute=index < full_recompute_layers,
            )
        return x_TD


def make_fsdp_blocks(
    config: DiTConfig, num_layers: int, device: torch.device, dtype: torch.dtype
) -> FSDPBlocks:
    """`num_layers` blocks sharded as zellige.train shards them, over a group of this one process:
    fp32 master weights, each block an FSDP2 unit computing in `dtype` (bf16: training's policy,
    gradients reduced in fp32; float32 on a CPU). Gathered weights, the reduce-scatter buffers
    and the sharded gradients then live and die as in training, which the plain blocks' bf16
    weights and gradients do not."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized() or dist.get_world_size() != 1:
        raise RuntimeError(
            "the FSDP harness runs one rank's work in a process group of one "
            "(rank_work.process_group_of_one)"
        )
    mesh = init_device_mesh(device.type, (1,))
    policy = bf16_policy() if dtype == torch.bfloat16 else MixedPrecisionPolicy()
    units = nn.ModuleList(
        _BlockUnit(block) for block in make_blocks(config, num_layers, device, torch.float32)
    )
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    return fully_shard(FSDPBlocks(units), mesh=mesh, mp_policy=policy)


@contextlib.contextmanager
def process_group_of_one(device: torch.device) -> Iterator[None]:
    """A process group of this one process for make_fsdp_blocks, destroyed on exit; an
    existing group is used as it is."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def persistent_bytes(blocks: nn.Module) -> int:
    """Bytes of the blocks' weights and of the weight gradients they keep between steps (the
    local shard of FSDP blocks)."""
    total = 0
    for param in blocks.parameters():
        for tensor in (param, param.grad):
            if tensor is None:
                continue
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            total += local.numel() * local.element_size()
    return total


def output_loss(out_TD: Tensor) -> Tensor:
    """A loss on the blocks' output for FSDP blocks: its backward hands the last block a fresh
    (T, D) gradient, as the head's backward does in training, and frees the output first."""
    return out_TD.square().mean()


def forward_blocks(
    blocks: nn.Module,
    inputs: RankInputs | JointRankInputs,
    checkpointing: bool,
    full_recompute_layers: int = 0,
) -> Tensor:
    """The rank's tokens through `blocks`: plain blocks (make_blocks) or make_fsdp_blocks. With
    `checkpointing` every block recomputes in the backward as training's do: the first
    `full_recompute_layers` in full (attention again), the others selectively."""
    if isinstance(blocks, FSDPBlocks):
        # the root unit's forward, so FSDP's hooks run
        return blocks(inputs, checkpointing, full_recompute_layers)
    x_TD = inputs.x_TD
    for index, block in enumerate(blocks):
        args = inputs.args(block, x_TD)
        if checkpointing:
            x_TD = recomputed(block, *args, full=index < full_recompute_layers)
        else:
            x_TD = block(*args)
    return x_TD


def train_step(
    blocks: nn.Module,
    inputs: RankInputs | JointRankInputs,
    checkpointing: bool,
    full_recompute_layers: int = 0,
) -> None:
    """Forward + backward of the rank's tokens through `blocks` (plain or make_fsdp_blocks;
    checkpointing as forward_blocks); the optimizer step is not part of the modelled time.
    Plain blocks: the output's gradient is inputs.grad_TD, and weight gradients are dropped
    afterwards. FSDP blocks, as in training: the output's gradient comes out of a loss
    (output_loss; no output or output gradient is held beside the step), and the sharded fp32
    gradients stay allocated (FSDP adds into them), as the gradients of the rank's FSDP shard
    that the cost model counts as always there."""
    if isinstance(blocks, FSDPBlocks):
        output_loss(forward_blocks(blocks, inputs, checkpointing, full_recompute_layers)).backward()
        clear_grads(None, inputs)
    else:
        forward_blocks(blocks, inputs, checkpointing, full_recompute_layers).backward(
            inputs.grad_TD
        )
        clear_grads(blocks, inputs)


def clear_grads(blocks: nn.Module | None, inputs: RankInputs | JointRankInputs) -> None:
    """Drops the inputs' gradients, and the blocks' weight gradients unless blocks is None."""
    weights = blocks.parameters() if blocks is not None else ()
    for tensor in (*inputs.leaves(), *weights):
        tensor.grad = None


def plan_rank_inputs(
    *,
    batch: _core.Batch,
    plan: _core.Plan,
    rank: int,
    config: DiTConfig,
    device: torch.device,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
    output_grad: bool = True,
    engine: EngineConfig | None = None,
) -> RankInputs | JointRankInputs:
    """Inputs of `rank` under `plan`: its held chunks (from the plan compiler), their text and
    positions, and the engine's distributed attention over its layout, exchanges as local
    copies (local_step; engine: the run's EngineConfig, default from the environment).
    `output_grad=False` for FSDP blocks, whose step takes the output's gradient from a loss
    (train_step)."""
    step = local_step(
        batch, plan, config.num_heads, device, rank=rank,
        joint_attention=config.joint_attention, engine=engine,
    )  # fmt: skip
    if config.joint_attention:
        # local sequence = nonempty held chunk (a rank holds at most one chunk of a sequence)
        _, local_sequence_T = torch.unique(step.chunk_index, return_inverse=True)
        return joint_rank_inputs(
            config=config,
            modality_T=step.modality,
            sequence_index_T=local_sequence_T,
            positions_T3=step.position_ids,
            attention=functools.partial(distributed_attention, step=step),
            device=device,
            dtype=dtype,
            generator=generator,
            output_grad=output_grad,
        )
    layout = step.program
    sequences = batch.sequences
    chunk_tokens = [int(n) for n in layout.chunk_num_tokens]
    chunk_text = [int(sequences[int(i)].text_tokens) for i in layout.chunk_sequence_index]

    def self_attention(q_TNH: Tensor, k_TNH: Tensor, v_TNH: Tensor) -> Tensor:
        return distributed_attention(q_TNH, k_TNH, v_TNH, step)

    return rank_inputs(
        config=config,
        chunk_tokens=chunk_tokens,
        chunk_text_tokens=chunk_text,
        positions_T3=step.position_ids,
        self_attention=self_attention,
        device=device,
        dtype=dtype,
        generator=generator,
        output_grad=output_grad,
    )


def no_self_attention(q_TNH: Tensor, k_TNH: Tensor, v_TNH: Tensor) -> Tensor:
    """Stands in for the self-attention core when only the per-token layers are timed. It must
    use k and v: autograd would otherwise skip their projections' backward (two of the six
    projection GEMMs' gradients)."""
    return q_TNH + k_TNH + v_TNH


def no_cross_attention(q_TNH: Tensor, k_XNH: Tensor, v_XNH: Tensor) -> Tensor:
    """Stands in for the cross-attention core (the text is empty when per-token layers are
    timed: text projections are charged per sequence by the cost model)."""
    return q_TNH


def per_token_inputs(
    *, config: DiTConfig, num_tokens: int, device: torch.device, dtype: torch.dtype
) -> RankInputs | JointRankInputs:
    """One sequence of `num_tokens` tokens with both attention cores and the text removed: what
    the cost model calls the per-token layers (projections, norms, modulation, RoPE, FFN). An
    MMDiT's tokens are all visual here: a text token costs the same (its stream's weights have
    the visual stream's shapes), and the cost model charges both alike."""
    positions_T3 = torch.zeros(num_tokens, 3, dtype=torch.int64)
    positions_T3[:, 2] = torch.arange(num_tokens)
    if config.joint_attention:
        return joint_rank_inputs(
            config=config,
            modality_T=torch.zeros(num_tokens, dtype=torch.int64),
            sequence_index_T=torch.zeros(num_tokens, dtype=torch.int64),
            positions_T3=positions_T3,
            attention=no_self_attention,
            device=device,
            dtype=dtype,
        )
    inputs = rank_inputs(
        config=config,
        chunk_tokens=[num_tokens],
        chunk_text_tokens=[0],
        positions_T3=positions_T3,
        self_attention=no_self_attention,
        device=device,
        dtype=dtype,
    )
    inputs.cross_attention = no_cross_attention
    return inputs
