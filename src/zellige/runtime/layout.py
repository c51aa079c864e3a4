"""Step: one rank's StepProgram (C++ plan compiler) as device tensors, and how it is loaded.

Built once per step (every layer reuses it). All bookkeeping comes from the program: routes,
exchange indices, the ring schedule and the dense attention groups; this file only copies arrays
to the device and wraps the groups as SegmentTables. Formats: docs/formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from zellige import _core
from zellige.runtime.coalesced import SegmentTable, to_device
from zellige.runtime.engine import EngineConfig
from zellige.runtime.transport import DISTRIBUTED, Transport

Tensor = torch.Tensor
TOKENS = ("all", "visual", "text")


def _long(array: np.ndarray, device: torch.device) -> Tensor:
    """A program array (host numpy) on the device; never read back (no host sync)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)), device)


def _inverse(index: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(index)
    inverse[index] = np.arange(index.size, dtype=index.dtype)
    return inverse


@dataclass(slots=True)
class DeviceRoute:
    """A TokenRoute on the device. recv_inverse: received row of each destination row, inverted
    (recv_index is a permutation of the received rows). A token route sends every source row
    once; the cross-attention text route may send one row to several ranks (gradients add)."""

    num_source: int
    num_held: int
    send_index: Tensor
    recv_index: Tensor
    recv_inverse: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    sends_each_row_once: bool


def _device_route(route: _core.TokenRoute, device: torch.device) -> DeviceRoute:
    send_index = route.send_index
    return DeviceRoute(
        num_source=route.num_source,
        num_held=route.num_held,
        send_index=_long(send_index, device),
        recv_index=_long(route.recv_index, device),
        recv_inverse=_long(_inverse(route.recv_index), device),
        send_splits=route.send_splits.tolist(),
        recv_splits=route.recv_splits.tolist(),
        sends_each_row_once=bool((np.bincount(send_index, minlength=route.num_source) == 1).all()),
    )


@dataclass(slots=True)
class RingStep:
    """Ring step s >= 1 of the program (see plan_compiler.h RingStep): sends (peer, compact row
    slices), recvs (peer, receive-buffer slice), the attention table against received blocks."""

    sends: list[tuple[int, list[slice]]]
    recvs: list[tuple[int, slice]]
    num_recv_rows: int
    table: SegmentTable


@dataclass(slots=True)
class RingPlan:
    """Ring and hybrid segments gathered into compact rows (own-row blocks first, then hybrid)."""

    num_rows: int
    own_index: Tensor  # own rows -> compact rows [0, len)
    exchange_index: Tensor  # exchange rows -> compact rows [len(own_index), num_rows)
    step0: SegmentTable
    steps: list[RingStep]


def _ring_plan(program: _core.StepProgram, device: torch.device) -> RingPlan:
    steps = []
    for step in program.ring_steps:
        sends = [(peer, [slice(b, e) for b, e in rows]) for peer, rows in step.sends]
        recvs = [(peer, slice(*rows[0])) for peer, rows in step.recvs]
        table = SegmentTable.from_groups(step.groups, device)
        steps.append(RingStep(sends, recvs, step.num_recv_rows, table))
    return RingPlan(
        num_rows=program.ring_num_rows,
        own_index=_long(program.ring_own_rows, device),
        exchange_index=_long(program.ring_exchange_rows, device),
        step0=SegmentTable.from_groups(program.ring_step0_groups, device),
        steps=steps,
    )


@dataclass(slots=True)
class Step:
    """Everything one rank needs for one step under one plan (see zellige.runtime)."""

    rank: int
    num_ranks: int
    num_heads: int
    joint_attention: bool
    device: torch.device
    group: dist.ProcessGroup | None
    program: _core.StepProgram
    num_held_tokens: int
    num_source_tokens: int
    position_ids: Tensor  # [T, 3] (t, h, w) long; text token k: (k, 0, 0)
    sequence_index: Tensor  # [T] long, index into batch.sequences
    chunk_index: Tensor  # [T] long, index of the held chunk
    modality: Tensor  # [T] long, 0 visual 1 text
    visual_index: Tensor  # held positions of the visual tokens
    text_index: Tensor  # held positions of the text tokens
    chunk_sequence_index: list[int]
    chunk_num_tokens: list[int]
    chunk_num_text_tokens: list[int]
    chunk_cross_text_tokens: list[int]
    routes: dict[str, DeviceRoute]  # "all", "visual", "text", "cross_text"
    # Ulysses exchange
    world_has_exchange: bool
    num_exchange_rows: int
    exchange_send_index: Tensor
    exchange_recv_index: Tensor
    exchange_recv_inverse: Tensor
    exchange_send_splits: list[int]
    exchange_recv_splits: list[int]
    # attention
    local_table: SegmentTable  # whole local sequences, own rows
    exchange_table: SegmentTable  # Ulysses sequences, exchange rows
    ring: RingPlan
    cross_table: SegmentTable  # cross-attention: own rows against text rows
    global_ranks: list[int] = field(default_factory=list)  # group rank -> global rank (P2P)
    engine: EngineConfig = field(default_factory=EngineConfig)  # how attention runs
    transport: Transport = DISTRIBUTED  # how the exchanges move rows


def compile_step(
    batch: _core.Batch,
    plan: _core.Plan,
    num_heads: int,
    rank: int,
    *,
    joint_attention: bool = False,
) -> _core.StepProgram:
    """This rank's StepProgram (C++ plan compiler): picklable, built once, loaded by load_step.
    Raises ValueError when the plan does not match the batch or the head count, or when the rank
    would hold more rows than any rank's memory (a text far too long, say)."""
    try:
        return _core.compile_step_program(batch, plan, rank, num_heads, joint_attention)
    except MemoryError as exc:  # std::bad_alloc: report it as the input's fault, like the limit
        raise ValueError(
            f"rank {rank}: the step program does not fit in host memory ({exc})"
        ) from None


# The world's gloo twin for the status exchange on CUDA: {"world": the default group it mirrors,
# "host": the gloo group}; made again when the default group is (a new init_process_group).
_HOST_GROUP: dict = {}


def _status_group(group, device: torch.device):
    """The group that exchanges the loaders' status as host tensors, so that reading it involves
    no device (gathering a CUDA tensor and reading it on the host would wait for the GPU's
    queue: a host sync in every step). CPU devices use `group`; on CUDA the world's statuses go
    over a gloo group made once (every rank calls load_step, so every rank makes it); a
    subgroup without a CPU backend gathers on the device (one sync per step)."""
    if device.type == "cpu":
        return group, torch.device("cpu")
    backend = str(dist.get_backend(group))
    if "gloo" in backend:  # a group with a CPU backend ("cpu:gloo,cuda:nccl" or gloo)
        return group, torch.device("cpu")
    if group is not None and group is not dist.group.WORLD:
        return group, device
    if _HOST_GROUP.get("world") is not dist.group.WORLD:
        _HOST_GROUP.update(world=dist.group.WORLD, host=dist.new_group(backend="gloo"))
    return _HOST_GROUP["host"], torch.device("cpu")


def _agree_on_status(error: str | None, fingerprint: int, group, device: torch.device) -> None:
    """One small all_gather: every rank learns whether any rank failed or disagrees, so all raise
    the same error instead of some entering a collective the others never join."""
    status_group, status_device = _status_group(group, device)
    status = torch.tensor([1 if error else 0, fingerprint], dtype=torch.long, device=status_device)
    world = dist.get_world_size(group)
    gathered = [torch.zeros_like(status) for _ in range(world)]
    dist.all_gather(gathered, status, group=status_group)
    rows = torch.stack(gathered).cpu().tolist()
    failed = [r for r, (flag, _) in enumerate(rows) if flag]
    if failed:
        message = [error]
        source = dist.get_global_rank(group, failed[0]) if group is not None else failed[0]
        dist.broadcast_object_list(message, src=source, group=status_group)
        raise ValueError(message[0])
    if len({fp for _, fp in rows}) > 1:
        raise ValueError(
            "ranks disagree on the batch or the plan (their step programs' fingerprints "
            "differ); every rank must compile the same plan for the same batch"
        )


def load_step(
    program: _core.StepProgram | None,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    *,
    error: str | None = None,
    check_agreement: bool = True,
    engine: EngineConfig | None = None,
    transport: Transport | None = None,
) -> Step:
    """The program's arrays on `device`, for every rank of `group` (default: the world).
    engine: how its attention runs (default: EngineConfig.from_env(), the documented
    overrides); transport: how its exchanges move rows (default: torch.distributed).

    Every rank calls it. When any rank passes an `error` (its loader could not compile, or found
    its tensors do not match the program; program may then be None), or the program is for
    another world size, or (check_agreement) the ranks' programs are for different batches or
    plans, every rank raises the same ValueError after one small all_gather; none hangs.
    Without an initialised process group it only moves the program (no check)."""
    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and error is None:
        if program is None:
            error = "load_step: no step program and no error message"
        elif program.num_ranks != dist.get_world_size(group):
            error = (
                f"the plan is for {program.num_ranks} ranks but the process group has "
                f"{dist.get_world_size(group)}"
            )
        elif program.rank != dist.get_rank(group):
            error = f"rank {dist.get_rank(group)} was given the step program of rank {program.rank}"
    if distributed and check_agreement:
        fingerprint = program.fingerprint if program is not None else 0
        _agree_on_status(error, fingerprint, group, device)
    if error is not None:
        raise ValueError(error)
    if program is None:
        raise ValueError("load_step: no step program and no error message")
    return _build_step(program, device, group if distributed else None, engine, transport)


def prepare_step(
    batch: _core.Batch,
    plan: _core.Plan,
    num_heads: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    *,
    joint_attention: bool = False,
    rank: int | None = None,
    check_agreement: bool = True,
    engine: EngineConfig | None = None,
    transport: Transport | None = None,
) -> Step:
    """compile_step for this process's rank in `group`, then load_step (same errors, raised on
    every rank; engine and transport as there). rank: pass it (and no group) to build a step
    without a process group (tests, tools), even where one is initialised."""
    if rank is not None and group is None:
        return _build_step(
            compile_step(batch, plan, num_heads, rank, joint_attention=joint_attention),
            torch.device(device),
            None,
            engine,
            transport,
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("prepare_step needs an initialised process group or an explicit rank")
    program, error = None, None
    try:
        program = compile_step(
            batch, plan, num_heads, dist.get_rank(group), joint_attention=joint_attention
        )
    except ValueError as exc:
        error = str(exc)
    if error is None and plan.num_ranks != dist.get_world_size(group):
        error = (
            f"the plan is for {plan.num_ranks} ranks but the process group has "
            f"{dist.get_world_size(group)}"
        )
    return load_step(
        program, device, group, error=error, check_agreement=check_agreement, engine=engine,
        transport=transport,
    )  # fmt: skip


def _build_step(
    program: _core.StepProgram,
    device: torch.device,
    group: dist.ProcessGroup | None,
    engine: EngineConfig | None = None,
    transport: Transport | None = None,
) -> Step:
    if group is not None or (dist.is_available() and dist.is_initialized()):
        global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(program.num_ranks)
        ]
    else:
        global_ranks = list(range(program.num_ranks))
    exchange_recv_index = program.exchange_recv_index
    return Step(
        rank=program.rank,
        num_ranks=program.num_ranks,
        num_heads=program.num_heads,
        joint_attention=program.joint_attention,
        device=device,
        group=group,
        program=program,
        num_held_tokens=program.num_held_tokens,
        num_source_tokens=program.num_source_tokens,
        position_ids=_long(program.token_position_thw, device),
        sequence_index=_long(program.token_sequence_index, device),
        chunk_index=_long(program.token_chunk_index, device),
        modality=_long(program.token_modality, device),
        visual_index=_long(program.held_visual_index, device),
        text_index=_long(program.held_text_index, device),
        chunk_sequence_index=program.chunk_sequence_index.tolist(),
        chunk_num_tokens=program.chunk_num_tokens.tolist(),
        chunk_num_text_tokens=program.chunk_num_text_tokens.tolist(),
        chunk_cross_text_tokens=program.chunk_cross_text_tokens.tolist(),
        routes={
            "all": _device_route(program.route, device),
            "visual": _device_route(program.visual_route, device),
            "text": _device_route(program.text_route, device),
            "cross_text": _device_route(program.cross_text_route, device),
        },
        world_has_exchange=bool(program.world_has_exchange),
        num_exchange_rows=program.num_exchange_rows,
        exchange_send_index=_long(program.exchange_send_index, device),
        exchange_recv_index=_long(exchange_recv_index, device),
        exchange_recv_inverse=_long(_inverse(exchange_recv_index), device),
        exchange_send_splits=program.exchange_send_splits.tolist(),
        exchange_recv_splits=program.exchange_recv_splits.tolist(),
        local_table=SegmentTable.from_groups(program.local_groups, device),
        exchange_table=SegmentTable.from_groups(program.exchange_groups, device),
        ring=_ring_plan(program, device),
        cross_table=SegmentTable.from_groups(program.cross_groups, device),
        global_ranks=global_ranks,
        engine=EngineConfig.from_env() if engine is None else engine,
        transport=DISTRIBUTED if transport is None else transport,
    )
