"""One attention backend interface: how a segment table's attention runs, decided in one place.

A table (runtime/coalesced.py SegmentTable) runs on one of three backends:
- DenseBackend: one dense kernel call per group of equal shapes (runtime/kernels.py), spread over
  CUDA streams and with split forwards where the device's call table says so;
- PaddedBackend: the same with nearby lengths merged into padded calls (runtime/merging.py prices
  the merges from the device's measured call table; the kernel takes a key mask);
- RaggedBackend: every segment in ONE ragged call, read and written in place (runtime/ragged.py).

`choose_backend` is the decision, from the run's EngineConfig; `engine_runs_ragged` is the same
decision asked for the planner (zellige.profile.priced_as_engine_runs: the cost model then prices
a table of short sequences as the ragged call the engine runs). `coalesced_attention` is
the differentiable entry over one table; distributed attention (runtime/attention.py) runs its
step's tables through the same backends.

Merge policy "auto" runs a table of at least RAGGED_MIN_CALLS dense calls whose segments are all
at most RAGGED_MAX_SEGMENT_TOKENS query and key tokens as one ragged call, with a ragged kernel
trusted for automatic use (AUTO_RAGGED_KERNELS). On one H200 (cuDNN 9.19) the cuDNN frontend's
ragged call ran the packs of only short sequences (opensora2-stage1) 13-15% faster forward and
2-3% backward than the groups, in a tenth of their host time, and the packs with a long sequence
3-6% slower (bench/results/attention_engine_h200_202612.md). RAGGED_MIN_CALLS is 1: a table
of one dense call (a micro-batch of one bucket: equal lengths) runs ragged too, because the dense
cuDNN call builds an execution plan for every new (count, q_len, k_len) on the host (37-39 ms a
pass on one H100, a new shape nearly every step of opensora2-stage1, whose lengths vary with
aspect ratio and frames) where the ragged call's graphs serve a shape bucket. The cost model
prices the same rule (cost_model.h), so both constants come from there.
"""

from __future__ import annotations

import torch

from zellige import _core
from zellige.runtime import merging, recompute
from zellige.runtime.coalesced import (
    SegmentTable,
    _dense,
    _flat,
    _whole,
    backward_into,
    forward_into,
    key_split_ok,
)
from zellige.runtime.engine import MERGE_CHOICES, EngineConfig
from zellige.runtime.kernels import (
    ContiguousKernel,
    Kernel,
    default_scale,
    kernel_for,
    lse_dtype,
    masked_kernel_for,
)
from zellige.runtime.ragged import RaggedKernel, RaggedLayout, ragged_kernel_for

Tensor = torch.Tensor

RAGGED_MIN_CALLS = _core.RAGGED_MIN_CALLS
RAGGED_MAX_SEGMENT_TOKENS = _core.RAGGED_MAX_SEGMENT_TOKENS
AUTO_RAGGED_KERNELS: tuple[str, ...] = ("cudnn-fe",)
RAGGED_MAX_ELEMENTS = 2**31 - 1  # cuDNN's ragged offsets are int32 element counts
# every dense call shape (kernel, dtype, count, heads, q_len, k_len) a CUDA table was given in
# this process: a new one makes cuDNN build an execution plan on the host (tens of ms)
_dense_shapes: set[tuple] = set()


def dense_shapes_seen() -> int:
    """Distinct dense call shapes this process's CUDA tables have run (or were prepared to)."""
    return len(_dense_shapes)


class AttentionBackend:
    """How one table's attention runs. Rows are [R, H] (row = token x head); lse is per query
    row (float32, float64 for float64 rows).

    forward / backward: allocate and return every row's results (rows no segment covers: zero
    output, -inf lse, zero gradients). forward_into / backward_into: write the table's rows of
    the given buffers (a step's local and exchanged tables, whose segments share no rows)."""

    name = "base"

    def forward(self, q_rows: Tensor, k_rows: Tensor, v_rows: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(
        self, do_rows: Tensor, q_rows: Tensor, k_rows: Tensor, v_rows: Tensor, o_rows: Tensor,
        lse_rows: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        raise NotImplementedError

    def forward_into(self, q, k, v, o, lse) -> None:
        raise NotImplementedError

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv) -> None:
        raise NotImplementedError


def _zeros_or_empty(rows: Tensor, covered_rows: int, disjoint: bool = True) -> Tensor:
    """A result buffer like `rows`: uninitialised when the segments write every row."""
    whole = disjoint and covered_rows == rows.shape[0]
    return torch.empty_like(rows) if whole else torch.zeros_like(rows)


class DenseBackend(AttentionBackend):
    """One dense kernel call per group (and per padded call of the table), the most work first;
    streams, copies beside the next call (overlap_copies) and split forwards (key_split) as
    coalesced.forward_into describes them."""

    name = "dense"

    def __init__(
        self,
        table: SegmentTable,
        kernel: Kernel,
        scale: float,
        *,
        streams: int = 1,
        overlap_copies: bool = False,
        key_split: int = 0,
    ) -> None:
        self.table, self.kernel, self.scale = table, kernel, scale
        self.streams, self.overlap_copies, self.key_split = streams, overlap_copies, key_split

    def forward(self, q_rows, k_rows, v_rows):
        table, kernel = self.table, self.kernel
        num_q, num_k = q_rows.shape[0], k_rows.shape[0]
        lse_type = lse_dtype(q_rows.dtype)
        if _whole(table, num_q, num_k):  # one group over all rows: no copies
            g = table.groups[0]
            o, lse = kernel.forward(
                _dense(q_rows, g.q_index, g, g.q_len),
                _dense(k_rows, g.k_index, g, g.k_len),
                _dense(v_rows, g.k_index, g, g.k_len),
                self.scale,
            )
            return _flat(o), lse.transpose(1, 2).reshape(-1).to(lse_type)
        o_rows = _zeros_or_empty(q_rows, table.q_rows, table.disjoint)
        lse_rows = torch.full((num_q,), float("-inf"), dtype=lse_type, device=q_rows.device)
        forward_into(
            table, kernel, self.scale, q_rows, k_rows, v_rows, o_rows, lse_rows, self.streams,
            self.overlap_copies, self.key_split,
        )  # fmt: skip
        return o_rows, lse_rows

    def backward(self, do_rows, q_rows, k_rows, v_rows, o_rows, lse_rows):
        table, kernel = self.table, self.kernel
        num_q, num_k = q_rows.shape[0], k_rows.shape[0]
        if _whole(table, num_q, num_k):
            g = table.groups[0]
            dq, dk, dv = kernel.backward(
                _dense(do_rows, g.q_index, g, g.q_len),
                _dense(q_rows, g.q_index, g, g.q_len),
                _dense(k_rows, g.k_index, g, g.k_len),
                _dense(v_rows, g.k_index, g, g.k_len),
                _dense(o_rows, g.q_index, g, g.q_len),
                lse_rows.view(g.count, g.q_len, g.num_heads).transpose(1, 2),
                self.scale,
            )
            return _flat(dq), _flat(dk), _flat(dv)
        dq = _zeros_or_empty(q_rows, table.q_rows, table.disjoint)
        dk, dv = (_zeros_or_empty(k_rows, table.k_rows, table.disjoint) for _ in "kv")
        backward_into(
            table, kernel, self.scale, q_rows, k_rows, v_rows, o_rows, lse_rows, do_rows, dq, dk,
            dv, accumulate=not table.disjoint, streams=self.streams,
            overlap_copies=self.overlap_copies,
        )  # fmt: skip
        return dq, dk, dv

    def forward_into(self, q, k, v, o, lse):
        forward_into(
            self.table, self.kernel, self.scale, q, k, v, o, lse, self.streams,
            self.overlap_copies, self.key_split,
        )  # fmt: skip

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv):
        backward_into(
            self.table, self.kernel, self.scale, q, k, v, o, lse, do, dq, dk, dv,
            accumulate=False, streams=self.streams, overlap_copies=self.overlap_copies,
        )  # fmt: skip


class PaddedBackend(DenseBackend):
    """DenseBackend over a table with padded calls (SegmentTable.merge_padded); its kernel takes
    the key mask."""

    name = "padded"


class RaggedBackend(AttentionBackend):
    """Every segment of the table in one ragged kernel call, in place in the rows."""

    name = "ragged"

    def __init__(
        self, table: SegmentTable, kernel: RaggedKernel, layout: RaggedLayout, scale: float
    ) -> None:
        self.table, self.kernel, self.layout, self.scale = table, kernel, layout, scale

    def forward(self, q_rows, k_rows, v_rows):
        num_q = q_rows.shape[0]
        o_rows = _zeros_or_empty(q_rows, self.table.q_rows)
        lse_rows = torch.full(
            (num_q,), float("-inf"), dtype=lse_dtype(q_rows.dtype), device=q_rows.device
        )
        self.forward_into(q_rows, k_rows, v_rows, o_rows, lse_rows)
        return o_rows, lse_rows

    def backward(self, do_rows, q_rows, k_rows, v_rows, o_rows, lse_rows):
        table = self.table
        grads = (
            _zeros_or_empty(q_rows, table.q_rows),
            _zeros_or_empty(k_rows, table.k_rows),
            _zeros_or_empty(v_rows, table.k_rows),
        )
        self.backward_into(do_rows, q_rows, k_rows, v_rows, o_rows, lse_rows, *grads)
        return grads

    def forward_into(self, q, k, v, o, lse):
        self.kernel.forward_into(q, k, v, o, lse, self.layout, self.scale)

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv):
        self.kernel.backward_into(do, q, k, v, o, lse, dq, dk, dv, self.layout, self.scale)


def _ragged_layout(table: SegmentTable) -> RaggedLayout | None:
    """The table's segments as one ragged call sees them, in place in the rows, the most work
    first (a call schedules its batch entries in order: long ones first leave short ones to fill
    the last wave); None unless the segments are disjoint and share one head count."""
    if "ragged" not in table.merged:
        heads = {g.num_heads for g in table.groups}
        layout = None
        if table.disjoint and len(heads) == 1 and table.groups:
            segments = sorted(
                ((g.q_len, g.k_len, q0, k0) for g in table.groups
                 for q0, k0 in zip(g.q_offsets, g.k_offsets, strict=True)),
                key=lambda s: -s[0] * s[1],
            )  # fmt: skip
            q_lens, k_lens, q_starts, k_starts = zip(*segments, strict=True)
            layout = RaggedLayout(heads.pop(), q_starts, k_starts, q_lens, k_lens)
        table.merged["ragged"] = layout
    return table.merged["ragged"]


def _trusted_ragged_kernel(
    merge: str | None, device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None
) -> RaggedKernel | None:
    """The checked ragged kernel the merge policy may use here, or None ("groups": never; "auto":
    only a kernel of AUTO_RAGGED_KERNELS; backend "math": the oracle, for tests)."""
    if merge == "groups":
        return None
    kernel = ragged_kernel_for(device, dtype, head_dim, "math" if backend == "math" else None)
    if merge == "auto" and kernel is not None and kernel.name not in AUTO_RAGGED_KERNELS:
        return None
    return kernel


def _ragged_choice(
    table: SegmentTable,
    q_rows: Tensor,
    k_rows: Tensor,
    backend: str | None,
    merge: str | None,
    scale: float | None = None,
) -> tuple[RaggedKernel, RaggedLayout] | None:
    """(kernel, layout) when the merge policy runs this table as one ragged call; None also
    where the kernel cannot run this table's shape (RaggedKernel.prepare)."""
    if (
        merge == "groups"
        or table.padded
        or max(q_rows.numel(), k_rows.numel()) > RAGGED_MAX_ELEMENTS
    ):
        return None
    if merge == "auto" and (
        table.num_calls < RAGGED_MIN_CALLS
        or max(max(g.q_len, g.k_len) for g in table.groups) > RAGGED_MAX_SEGMENT_TOKENS
    ):
        return None
    kernel = _trusted_ragged_kernel(merge, q_rows.device, q_rows.dtype, q_rows.shape[-1], backend)
    layout = _ragged_layout(table) if kernel is not None else None
    if layout is None:
        return None
    scale = default_scale(q_rows.shape[-1]) if scale is None else scale
    return (kernel, layout) if kernel.prepare(q_rows, k_rows, layout, scale) else None


def engine_runs_ragged(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    engine: EngineConfig | None = None,
) -> bool:
    """Whether `engine` (default: EngineConfig.from_env()) runs a disjoint table of
    RAGGED_MIN_CALLS or more dense calls with one head count and no segment over
    RAGGED_MAX_SEGMENT_TOKENS as one ragged call here (choose_backend's rule, automatic kernel):
    the one place that decides a profile's attention_ragged, both where `zellige profile`
    measures and where a run prices its plans (zellige.profile.priced_as_engine_runs). The first
    call on a device checks the kernel against the math kernel (runtime/ragged.py)."""
    engine = EngineConfig.from_env() if engine is None else engine
    kernel = _trusted_ragged_kernel(engine.merge, torch.device(device), dtype, head_dim, None)
    return kernel is not None


def _auto_padded(
    table: SegmentTable, kernel: Kernel, q_rows: Tensor, call_table: str | None = None
) -> SegmentTable:
    """The merge policy for padded calls: the table with the priced plan of merging.py applied
    where the device has measured call costs and the kernel takes a key mask; else the table.
    Planned once per table, kernel and dtype (a table serves every layer of a step)."""
    if not table.disjoint or table.padded or len(table.groups) < 2:
        return table
    key = ("padded", kernel.name, q_rows.dtype)
    if key not in table.merged:
        device, head_dim = q_rows.device, q_rows.shape[-1]
        costs = merging.costs_for_device(device, call_table)
        plan = table
        if costs is not None and masked_kernel_for(kernel, device, q_rows.dtype, head_dim):
            buckets, _, _ = merging.plan_padded_merges(
                table.groups, costs, head_dim, q_rows.element_size()
            )
            if buckets:
                plan = table.merge_padded(buckets, device)
        table.merged[key] = plan
    return table.merged[key]


def planned_table(
    table: SegmentTable,
    q_rows: Tensor,
    backend: str | None = None,
    engine: EngineConfig | None = None,
) -> SegmentTable:
    """The table merge="auto" runs for rows like `q_rows` (dtype, device, head dim): `table`
    itself, or it with padded merges where they pay (bench output shows it). engine: as
    coalesced_attention's."""
    engine = EngineConfig.from_env() if engine is None else engine
    kernel = kernel_for(q_rows.device, q_rows.dtype, q_rows.shape[-1], backend or engine.backend)
    return _auto_padded(table, kernel, q_rows, engine.call_table)


def choose_backend(
    table: SegmentTable,
    q_rows: Tensor,
    k_rows: Tensor,
    engine: EngineConfig,
    *,
    scale: float | None = None,
    backend: str | None = None,
    merge: str | None = None,
    streams: int | None = None,
    key_split: int | None = None,
    overlap_copies: bool = False,
    kernel: Kernel | None = None,
    plain_groups: bool = False,
) -> AttentionBackend:
    """The backend that runs `table` over rows like q_rows / k_rows under `engine`; backend,
    merge, streams and key_split override the engine's for this call. `kernel`: the dense
    kernel already chosen (distributed attention's, shared with its ring steps); plain_groups:
    dense calls as the groups are, one stream, no split (a step's local and exchanged tables).
    Decided once per table and arguments: a step's tables serve every layer."""
    key = (
        "backend", engine, scale, backend, merge, streams, key_split, overlap_copies,
        None if kernel is None else kernel.name, plain_groups, q_rows.device, q_rows.dtype,
        q_rows.shape[-1], q_rows.shape[0], k_rows.shape[0],
    )  # fmt: skip
    if key not in table.merged:
        table.merged[key] = _choose_backend(
            table, q_rows, k_rows, engine, scale=scale, backend=backend, merge=merge,
            streams=streams, key_split=key_split, overlap_copies=overlap_copies, kernel=kernel,
            plain_groups=plain_groups,
        )  # fmt: skip
    return table.merged[key]


def _choose_backend(
    table: SegmentTable,
    q_rows: Tensor,
    k_rows: Tensor,
    engine: EngineConfig,
    *,
    scale: float | None,
    backend: str | None,
    merge: str | None,
    streams: int | None,
    key_split: int | None,
    overlap_copies: bool,
    kernel: Kernel | None,
    plain_groups: bool,
) -> AttentionBackend:
    merge = merge or engine.merge
    if merge not in MERGE_CHOICES:
        raise ValueError(f"unknown attention merge '{merge}' (allowed: {', '.join(MERGE_CHOICES)})")
    device, dtype, head_dim = q_rows.device, q_rows.dtype, q_rows.shape[-1]
    scale = default_scale(head_dim) if scale is None else scale
    # the ragged oracle only where the call asks for the math backend (tests); the engine's
    # backend names a dense kernel
    ragged = _ragged_choice(table, q_rows, k_rows, backend, merge, scale)
    if ragged is not None:
        return RaggedBackend(table, ragged[0], ragged[1], scale)
    if kernel is None:
        kernel = kernel_for(device, dtype, head_dim, backend or engine.backend)
    if plain_groups:
        return DenseBackend(table, kernel, scale)
    if merge == "auto":
        table = _auto_padded(table, kernel, q_rows, engine.call_table)
    padded = any(p.masked and p.keys_padded for p in table.padded)
    if padded:
        masked = masked_kernel_for(kernel, device, dtype, head_dim)
        if masked is None:
            raise ValueError(
                f"the {kernel.name} attention kernel cannot take the key mask of a padded merge "
                "on this device (use merge='groups' or another backend)"
            )
        kernel = masked
    if streams is None:
        streams = 1
        if device.type == "cuda" and table.num_calls > 1:
            streams = merging.streams_for_device(device, engine)
    if key_split is None:
        key_split = merging.key_split_for_device(device, engine) if device.type == "cuda" else 0
    if key_split < 0:
        raise ValueError(f"key_split must be a number of key tokens >= 0, got {key_split}")
    if key_split > 0 and not key_split_ok(kernel, device, dtype, head_dim):
        key_split = 0
    kind = PaddedBackend if table.padded else DenseBackend
    _note_dense_shapes(table, kernel, device, dtype)
    return kind(
        table, kernel, scale, streams=streams, overlap_copies=overlap_copies, key_split=key_split
    )


def _note_dense_shapes(
    table: SegmentTable, kernel: Kernel, device: torch.device, dtype: torch.dtype
) -> None:
    if device.type == "cuda":
        _dense_shapes.update(
            (kernel.name, dtype, g.count, g.num_heads, g.q_len, g.k_len)
            for g in (*table.padded, *table.groups)
        )


def prepare_step_tables(
    step, dtype: torch.dtype, head_dim: int, backend: str | None = None
) -> None:
    """Makes now the choices distributed_attention and cross_attention (runtime/attention.py)
    make at the first layer of `step` for q / k / v rows of `dtype` and `head_dim`, with what
    they need built: a ragged call's cuDNN graphs of a new shape bucket (tens of ms on the host).
    The trainer calls it while the device still runs the previous step, so that host work
    overlaps the device's instead of leaving it idle inside the first layer's attention.
    Launches no kernel and allocates one row per table. backend: as distributed_attention's."""
    device, n = step.device, step.num_heads

    def rows(count: int) -> Tensor:
        return torch.empty((1, head_dim), dtype=dtype, device=device).expand(count, head_dim)

    kernel = step_kernel(step.engine, device, dtype, head_dim, backend)
    scale = default_scale(head_dim)
    held = rows(step.num_held_tokens * n)
    tables = [(step.local_table, held)]
    if step.world_has_exchange:
        tables.append((step.exchange_table, rows(step.exchange_recv_index.numel())))
    for table, q_rows in tables:
        if table.groups or table.padded:
            choose_backend(
                table, q_rows, q_rows, step.engine, scale=scale, backend=backend, kernel=kernel,
                plain_groups=True,
            )  # fmt: skip
    cross = step.routes.get("cross_text") if not step.joint_attention else None
    if cross is not None and step.cross_table.groups:
        choose_backend(step.cross_table, held, rows(cross.num_held * n), step.engine)


def step_kernel(
    engine: EngineConfig, device: torch.device, dtype: torch.dtype, head_dim: int,
    backend: str | None = None,
) -> Kernel:  # fmt: skip
    """The dense kernel of a step's tables and ring steps under `engine` (backend overrides)."""
    kernel = kernel_for(device, dtype, head_dim, backend or engine.backend)
    return ContiguousKernel(kernel) if engine.contiguous_kernel_inputs else kernel


class _BackendAttention(torch.autograd.Function):
    """o, lse of a table's attention through its backend; differentiable in q, k, v. Under a
    checkpointed block's recompute the forward's outputs are replayed (runtime/recompute.py)."""

    @staticmethod
    def forward(ctx, q_rows, k_rows, v_rows, backend: AttentionBackend):
        q_rows, k_rows, v_rows = q_rows.contiguous(), k_rows.contiguous(), v_rows.contiguous()
        kept = recompute.replayed()
        if kept is not None:
            o_rows, lse_rows = kept
        else:
            o_rows, lse_rows = backend.forward(q_rows, k_rows, v_rows)
            recompute.keep(o_rows, lse_rows)
        ctx.save_for_backward(q_rows, k_rows, v_rows, o_rows, lse_rows)
        ctx.backend = backend
        ctx.mark_non_differentiable(lse_rows)
        return o_rows, lse_rows

    @staticmethod
    def backward(ctx, do_rows, _dlse):
        q_rows, k_rows, v_rows, o_rows, lse_rows = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(
            do_rows.contiguous(), q_rows, k_rows, v_rows, o_rows, lse_rows
        )
        return dq, dk, dv, None


def coalesced_attention(
    q_rows: Tensor,
    k_rows: Tensor,
    v_rows: Tensor,
    table: SegmentTable,
    *,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    streams: int | None = None,
    merge: str | None = None,
    overlap_copies: bool = False,
    key_split: int | None = None,
    engine: EngineConfig | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of every segment of `table` in one call; differentiable in q, k, v.

    q_rows [Rq, H], k_rows / v_rows [Rk, H]; returns o_rows [Rq, H] (zero on rows that no segment
    covers) and, with return_lse, the log-sum-exp per query row (float32; -inf where uncovered).
    engine: the run's EngineConfig (default: EngineConfig.from_env()); the keywords below
    override it for this call.
    backend: a name of KERNELS ("cudnn", "flash", "cpu", ...) or None for the automatic choice.
    streams: on CUDA, spread the calls over this many side streams (each call to the least
    loaded, longest first: concurrent calls fill each other's last waves); None: the device's
    measured count (runtime/merging.py streams_for_device; 1 where nothing was measured).
    overlap_copies: on CUDA (one stream), write each call's results into the rows on a side
    stream, beside the next call's kernel (measured by bench/attention_engine.py --overhead).
    key_split: in the forward, a group of at least this many keys that are not a multiple of
    128 runs as two calls merged by lse (forward_into), where the kernel passes the check of it
    (key_split_ok); 0: never; None: the device's measured value (runtime/merging.py
    key_split_for_device; 0 where nothing was measured).
    merge: "groups" (one dense call per group, or as the table's own padded merges say),
    "ragged" (one ragged call where a checked ragged kernel exists: the cuDNN frontend on CUDA,
    or the math oracle with backend="math"; else as "groups"), or "auto" (one ragged call for a
    disjoint table of RAGGED_MIN_CALLS or more calls, none over RAGGED_MAX_SEGMENT_TOKENS tokens,
    where a kernel of AUTO_RAGGED_KERNELS passes its check (runtime/ragged.py: the
    `nvidia-cudnn-frontend` package installed); otherwise nearby lengths merged into padded calls
    where the device's measured call costs say it pays (runtime/merging.py), the rest as groups).
    """
    engine = EngineConfig.from_env() if engine is None else engine
    chosen = choose_backend(
        table, q_rows, k_rows, engine, scale=scale, backend=backend, merge=merge,
        streams=streams, key_split=key_split, overlap_copies=overlap_copies,
    )  # fmt: skip
    o_rows, lse_rows = _BackendAttention.apply(q_rows, k_rows, v_rows, chosen)
    return (o_rows, lse_rows) if return_lse else o_rows
