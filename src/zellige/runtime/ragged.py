"""Ragged attention: many sequences of different lengths in ONE kernel call, read and written in
place in the engine's row buffers.

Rows: a row is one (token, head) pair of head_dim values, as in runtime/coalesced.py. Segment i
is q_lens[i] query tokens x n heads starting at row q_starts[i] of q_rows (token-major,
[q_len, n, H]), attending to k_lens[i] key tokens at row k_starts[i] of k_rows / v_rows. The
segments may sit anywhere in the buffers (gaps, any order), but no two share a row: results are
written, not added. A kernel writes o / lse (forward) and dq / dk / dv (backward) only on the
segments' rows; the caller fills the other rows (zero output, -inf lse, zero gradients).

The cuDNN frontend kernel (CudnnFrontendRaggedKernel) passes each segment's start as a "ragged
offset" and its length as the padding mask's sequence length, so one fused call covers the whole
pack with no gather or scatter copies. Its graphs are built once per shape bucket (segment count
and longest lengths rounded up: `_bucket`, `_bucket_length`) and cached; each kernel is checked
against the math oracle (one sequence at a time) on an uneven layout with a gap, reversed keys
and a sequence of over 1k tokens before first use (`ragged_kernel_for`).

A new bucket's graph took 73-90 ms a pass to build on one H200 (a new dense cuDNN shape 37-39 ms
on one H100), mostly its kernel's; graphs are built as cuDNN "dynamic shape" graphs sharing a
kernel cache (one per device and pass), so a later bucket of the same topology reuses the
compiled kernel. Where this cuDNN refuses that, or its kernel fails the check, the kernel builds
static graphs as before (`dynamic_shapes`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from zellige.runtime.kernels import MathKernel, close_to_math

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class RaggedLayout:
    """Where each segment's rows are (host ints; see the module docstring)."""

    num_heads: int
    q_starts: tuple[int, ...]
    k_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    # per-kernel device tensors made from the above (offsets, lengths), built on first use
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        counts = {len(self.q_starts), len(self.k_starts), len(self.q_lens), len(self.k_lens)}
        if len(counts) != 1 or not self.q_lens:
            raise ValueError("a ragged layout needs one start and one length per segment, >= 1")
        if min(self.q_lens) < 1 or min(self.k_lens) < 1 or self.num_heads < 1:
            raise ValueError("ragged segments need at least one query, one key and one head")

    @property
    def count(self) -> int:
        return len(self.q_lens)

    @property
    def q_rows(self) -> int:
        """Rows the segments cover in q_rows."""
        return sum(self.q_lens) * self.num_heads

    @property
    def k_rows(self) -> int:
        return sum(self.k_lens) * self.num_heads

    def spans(self):
        """(q0, q1, k0, k1) row spans of each segment."""
        n = self.num_heads
        for qs, ks, lq, lk in zip(
            self.q_starts, self.k_starts, self.q_lens, self.k_lens, strict=True
        ):
            yield qs, qs + lq * n, ks, ks + lk * n


class RaggedKernel:
    """Attention of every segment of a RaggedLayout in one call (see the module docstring).
    q / k / v / o / do and the gradients are row buffers [R, H]; lse is [Rq] (float32, float64
    for float64 rows)."""

    name = "base"

    def prepare(self, q, k, layout: RaggedLayout, scale: float) -> bool:
        """Whether this kernel runs `layout` over rows like q / k (forward and backward); False
        sends the table to the dense calls. Called before a table's first ragged call."""
        return True

    def forward_into(self, q, k, v, o, lse, layout: RaggedLayout, scale: float) -> None:
        raise NotImplementedError

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv, layout, scale) -> None:
        raise NotImplementedError


def _dense(rows: Tensor, start: int, end: int, n: int) -> Tensor:
    """A segment's rows [L * n, H] as the dense kernels' [1, n, L, H] view."""
    return rows[start:end].view(-1, n, rows.shape[-1]).transpose(0, 1)[None]


class MathRaggedKernel(RaggedKernel):
    """The math kernel, one segment at a time: any device and dtype; the oracle."""

    name = "math"

    def forward_into(self, q, k, v, o, lse, layout, scale):
        math_kernel, n = MathKernel(), layout.num_heads
        for q0, q1, k0, k1 in layout.spans():
            o_part, lse_part = math_kernel.forward(
                _dense(q, q0, q1, n), _dense(k, k0, k1, n), _dense(v, k0, k1, n), scale
            )
            o[q0:q1] = o_part[0].transpose(0, 1).reshape(-1, q.shape[-1])
            lse[q0:q1] = lse_part[0].transpose(0, 1).reshape(-1)

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv, layout, scale):
        math_kernel, n = MathKernel(), layout.num_heads
        for q0, q1, k0, k1 in layout.spans():
            lse_part = lse[q0:q1].view(-1, n).transpose(0, 1)[None]
            grads = math_kernel.backward(
                _dense(do, q0, q1, n), _dense(q, q0, q1, n), _dense(k, k0, k1, n),
                _dense(v, k0, k1, n), _dense(o, q0, q1, n), lse_part, scale,
            )  # fmt: skip
            for out, grad, (a, b) in zip(
                (dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1)), strict=True
            ):
                out[a:b] = grad[0].transpose(0, 1).reshape(-1, q.shape[-1])


def _bucket(count: int) -> int:
    """Segment counts rounded up to 2^k or 1.5 * 2^k (at least 8): a new batch rarely needs a new
    cuDNN graph; the extra entries have length 0 and cost nothing."""
    count = max(count, 8)
    power = 1 << (count - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= count else power


def _bucket_length(tokens: int) -> int:
    """A graph's longest sequence, rounded up to a multiple of 1/8 of its power of two (and of
    128): at most 12.5% more (empty, exiting) tiles than the call needs, eight graphs an octave.
    On one H200 a 40% larger bound cost up to 7% of a forward (knapformer-mixed-images joint,
    bench/results/attention_engine_h200_202612.md)."""
    step = max(128, (1 << (max(tokens, 1).bit_length() - 1)) // 8)
    return -(-tokens // step) * step


class CudnnFrontendRaggedKernel(RaggedKernel):
    """cuDNN's fused attention through its Python frontend (the `nvidia-cudnn-frontend` package,
    imported as `cudnn`): segments are batch entries of a padding-masked call whose ragged
    offsets point at each segment's first row, so the call reads and writes the engine's rows in
    place. bf16 / fp16 on CUDA."""

    name = "cudnn-fe"
    # cuDNN graphs kept per process (each holds its execution plan); oldest dropped first
    max_graphs = 256

    def __init__(self, dynamic_shapes: bool = True) -> None:
        import cudnn  # noqa: F401  (ImportError: the package is not installed)

        # build dynamic-shape graphs over a kernel cache (see the module docstring); False
        # after cuDNN refused one
        self.dynamic_shapes = dynamic_shapes
        self._graphs: dict[tuple, tuple] = {}
        self.graphs_built = 0  # cuDNN graphs built so far (tens of ms each: a new shape bucket)
        self.graph_build_s = 0.0  # host seconds those builds took
        self.graphs_refused = 0  # shape buckets cuDNN refused (their tables run dense calls)
        self._handles: dict[int, int] = {}
        self._kernel_caches: dict[tuple, object] = {}  # (device index, backward) -> cache
        self._refused: dict[tuple, bool] = {}  # prepare's answer per shape bucket

    # -- device tensors of a layout --------------------------------------------------------
    def _layout_tensors(self, layout: RaggedLayout, head_dim: int, device: torch.device):
        key = (self.name, device, head_dim)
        if key not in layout.cache:
            count = _bucket(layout.count)

            def column(values, scale: int, extra: int = 0) -> Tensor:
                # entries past the real segments: length 0 (no work), offset 0
                out = np.zeros(count + extra, dtype=np.int64)
                out[: layout.count] = np.asarray(values, dtype=np.int64) * scale
                if out.max(initial=0) >= 2**31:
                    raise ValueError("ragged attention: row offsets past 2^31 elements")
                return torch.from_numpy(out.astype(np.int32)).view(-1, 1, 1, 1)

            host = {
                "seq_q": column(layout.q_lens, 1),
                "seq_k": column(layout.k_lens, 1),
                "off_q": column(layout.q_starts, head_dim, 1),
                "off_k": column(layout.k_starts, head_dim, 1),
                "off_lse": column(layout.q_starts, 1, 1),
            }
            pinned = {name: t.pin_memory() for name, t in host.items()}
            layout.cache[key] = {
                name: t.to(device, non_blocking=True) for name, t in pinned.items()
            }
            layout.cache[key]["shape"] = (
                count,
                _bucket_length(max(layout.q_lens)),
                _bucket_length(max(layout.k_lens)),
            )
        return layout.cache[key]

    def _handle(self, device: torch.device) -> int:
        import cudnn

        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._handles:
            with torch.cuda.device(index):
                self._handles[index] = cudnn.create_handle()
        handle = self._handles[index]
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
        return handle

    # -- graphs ----------------------------------------------------------------------------
    def _graph(self, backward: bool, dtype, n, head_dim, shape, totals, scale, device):
        key = (backward, dtype, n, head_dim, shape, totals, scale, device)
        if key in self._graphs:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            return self._graphs[key]
        start = time.perf_counter()
        if self.dynamic_shapes:
            try:
                built = self._build(
                    backward, dtype, n, head_dim, shape, totals, scale, device, True
                )
            except Exception:  # this cuDNN refuses a dynamic-shape graph: static ones from now on
                self.dynamic_shapes = False
        if not self.dynamic_shapes:
            built = self._build(backward, dtype, n, head_dim, shape, totals, scale, device, False)
        self.graphs_built += 1
        self.graph_build_s += time.perf_counter() - start
        self._graphs[key] = built
        while len(self._graphs) > self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        return self._graphs[key]

    def _kernel_cache(self, device: torch.device, backward: bool):
        import cudnn

        index = device.index if device.index is not None else torch.cuda.current_device()
        if (index, backward) not in self._kernel_caches:
            with torch.cuda.device(index):
                self._kernel_caches[index, backward] = cudnn.create_kernel_cache()
        return self._kernel_caches[index, backward]

    def _build(self, backward, dtype, n, head_dim, shape, totals, scale, device, dynamic: bool):
        """A built graph and its tensors (graph, {name: tensor}); raises where cuDNN refuses."""
        import cudnn

        io_type = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[
            dtype
        ]
        options = {}
        if dynamic:
            options = {
                "is_dynamic_shape_enabled": True,
                "kernel_cache": self._kernel_cache(device, backward),
            }
        graph = cudnn.pygraph(
            io_data_type=io_type,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self._handle(device),
            **options,
        )
        count, s_q, s_k = shape

        def scalar_column(name: str, length: int):
            return graph.tensor(
                name=name, dim=[length, 1, 1, 1], stride=[1, 1, 1, 1],
                data_type=cudnn.data_type.INT32,
            )  # fmt: skip

        t = {name: scalar_column(name, count) for name in ("seq_q", "seq_k")}
        t |= {name: scalar_column(name, count + 1) for name in ("off_q", "off_k", "off_lse")}

        def rows(name, s, offset, data_type=io_type, width=head_dim):
            # [count, n, s, width] over token-major rows: batch entry b starts at its offset
            return graph.tensor(
                name=name, dim=[count, n, s, width], stride=[s * n * width, width, n * width, 1],
                data_type=data_type, ragged_offset=t[offset],
            )  # fmt: skip

        def mark(tensor, s, offset, data_type=io_type, width=head_dim):
            tensor.set_output(True).set_dim([count, n, s, width]).set_stride(
                [s * n * width, width, n * width, 1]
            ).set_data_type(data_type).set_ragged_offset(t[offset])

        for name, s, offset in (("q", s_q, "off_q"), ("k", s_k, "off_k"), ("v", s_k, "off_k")):
            t[name] = rows(name, s, offset)
        mask = dict(use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_k"])
        if not backward:
            o, stats = graph.sdpa(
                name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                attn_scale=scale, **mask,
            )  # fmt: skip
            mark(o, s_q, "off_q")
            mark(stats, s_q, "off_lse", cudnn.data_type.FLOAT, 1)
            t["o"], t["lse"] = o, stats
        else:
            t["o"], t["do"] = rows("o", s_q, "off_q"), rows("do", s_q, "off_q")
            t["lse"] = rows("lse", s_q, "off_lse", cudnn.data_type.FLOAT, 1)
            dq, dk, dv = graph.sdpa_backward(
                name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                stats=t["lse"], attn_scale=scale, max_total_seq_len_q=totals[0],
                max_total_seq_len_kv=totals[1], **mask,
            )  # fmt: skip
            mark(dq, s_q, "off_q")
            mark(dk, s_k, "off_k")
            mark(dv, s_k, "off_k")
            t["dq"], t["dk"], t["dv"] = dq, dk, dv
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph, t

    def _graph_for(self, backward: bool, q: Tensor, k: Tensor, layout: RaggedLayout, scale):
        device, head_dim, n = q.device, q.shape[-1], layout.num_heads
        if q.dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda":
            raise ValueError("the cuDNN frontend ragged kernel takes bf16 / fp16 rows on CUDA")
        columns = self._layout_tensors(layout, head_dim, device)
        # the backward's fp32 dq / dk accumulators are sized by tokens: every row of the buffers,
        # bucketed like the lengths (a step's rank holds a new token count every step)
        totals = tuple(_bucket_length(math.ceil(t.shape[0] / n)) for t in (q, k))
        graph, t = self._graph(
            backward, q.dtype, n, head_dim, columns["shape"], totals if backward else None,
            float(scale), device,
        )  # fmt: skip
        return graph, t, columns

    def prepare(self, q, k, layout, scale):
        """Builds (or finds) the forward and backward graphs of this shape bucket; a shape
        cuDNN refuses is remembered and its tables run as dense calls."""
        n = layout.num_heads
        key = (q.dtype, q.shape[-1], n, float(scale),
               self._layout_tensors(layout, q.shape[-1], q.device)["shape"],
               *(_bucket_length(math.ceil(t.shape[0] / n)) for t in (q, k)))  # fmt: skip
        if key not in self._refused:
            try:
                for backward in (False, True):
                    self._graph_for(backward, q, k, layout, scale)
                self._refused[key] = False
            except Exception:  # cuDNN's refusal (its errors derive from Exception)
                self._refused[key] = True
                self.graphs_refused += 1
        return not self._refused[key]

    def _run(self, backward: bool, buffers: dict, layout: RaggedLayout, scale: float) -> None:
        q, device = buffers["q"], buffers["q"].device
        graph, t, columns = self._graph_for(backward, q, buffers["k"], layout, scale)
        pack = {t[name]: columns[name] for name in ("seq_q", "seq_k", "off_q", "off_k", "off_lse")}
        pack |= {t[name]: tensor for name, tensor in buffers.items()}
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        graph.execute(pack, workspace, handle=self._handle(device))

    def forward_into(self, q, k, v, o, lse, layout, scale):
        self._run(False, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, layout, scale)

    def backward_into(self, do, q, k, v, o, lse, dq, dk, dv, layout, scale):
        buffers = {
            "do": do,
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "lse": lse,
            "dq": dq,
            "dk": dk,
            "dv": dv,
        }
        self._run(True, buffers, layout, scale)


def check_layout(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The uneven layout the check runs (rows, layout, gen): three segments of 37, 5 and 1,100
    query tokens (the last longer than 1k: torch 2.11's ragged cuDNN backward was right on short
    sequences only), keys in reverse order, a gap of uncovered rows between queries."""
    heads, q_lens, k_lens = 3, (37, 5, 1100), (53, 5, 1029)
    gap = 7 * heads
    q_starts, row = [], 0
    for length in q_lens:
        q_starts.append(row)
        row += length * heads + gap
    q_rows = row
    k_starts, row = [0] * 3, 0
    for i in reversed(range(3)):
        k_starts[i] = row
        row += k_lens[i] * heads
    layout = RaggedLayout(heads, tuple(q_starts), tuple(k_starts), q_lens, k_lens)
    return q_rows, row, layout


def _agrees_with_math(kernel: RaggedKernel, device, dtype, head_dim: int) -> bool:
    """Forward, lse and backward on check_layout against MathRaggedKernel, outputs compared on
    every row (a kernel that writes outside its segments fails)."""
    q_rows, k_rows, layout = check_layout(device, dtype, head_dim)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def rand(rows):
        return torch.randn(rows, head_dim, generator=gen).to(device, dtype)

    q, do = rand(q_rows), rand(q_rows)
    k, v = rand(k_rows), rand(k_rows)
    scale = head_dim**-0.5
    lse_type = torch.float64 if dtype == torch.float64 else torch.float32

    def run(candidate: RaggedKernel):
        o = torch.zeros_like(q)
        lse = torch.full((q_rows,), float("-inf"), dtype=lse_type, device=device)
        candidate.forward_into(q, k, v, o, lse, layout, scale)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        candidate.backward_into(do, q, k, v, o, lse, dq, dk, dv, layout, scale)
        return o, lse, dq, dk, dv

    try:
        got = run(kernel)
    except Exception:  # any failure refuses the kernel (cuDNN's own errors derive from Exception)
        return False
    want = run(MathRaggedKernel())
    for a, b in zip(got, want, strict=True):
        finite = torch.isfinite(b)  # -inf lse on the gaps: the same rows in both
        if not torch.equal(finite, torch.isfinite(a)) or not close_to_math(
            a[finite], b[finite], dtype
        ):
            return False
    return True


_verified: dict[tuple, RaggedKernel | None] = {}
_made: list[RaggedKernel] = []  # every kernel ragged_kernel_for made, checked or refused
_failed_checks = [0]  # kernels ragged_kernel_for made that failed the check
_dynamic_shape_graphs = [True]


def set_dynamic_shape_graphs(enabled: bool) -> None:
    """Whether the cuDNN frontend kernels made from now on build dynamic-shape graphs over a
    kernel cache (default True; see the module docstring). Forgets the kernels made so far: the
    next use makes and checks a new one. For measurements (bench/train_throughput.py
    :static-ragged-graphs)."""
    _dynamic_shape_graphs[0] = enabled
    _verified.clear()


@dataclass(frozen=True, slots=True)
class GraphCounts:
    """What the ragged kernels of this process did to their graphs so far (differences of two
    readings are one step's)."""

    built: int = 0  # graphs built (a new shape bucket, forward or backward)
    build_s: float = 0.0  # host seconds those builds took
    refused: int = 0  # shape buckets cuDNN refused: their tables ran dense calls
    failed_checks: int = 0  # kernels that failed the check against the math kernel

    def __sub__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(
            built=self.built - other.built,
            build_s=self.build_s - other.build_s,
            refused=self.refused - other.refused,
            failed_checks=self.failed_checks - other.failed_checks,
        )


def graph_counts() -> GraphCounts:
    """The counts over every ragged kernel this process made, the ones refused by their check
    included (their graphs were built too)."""
    return GraphCounts(
        built=sum(getattr(k, "graphs_built", 0) for k in _made),
        build_s=sum(getattr(k, "graph_build_s", 0.0) for k in _made),
        refused=sum(getattr(k, "graphs_refused", 0) for k in _made),
        failed_checks=_failed_checks[0],
    )


def graphs_built() -> int:
    """cuDNN graphs the ragged kernels of this process have built (a training loop's steps
    after the first few should build none: their shapes fall into cached buckets)."""
    return graph_counts().built


def ragged_kernel_for(
    device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None = None
) -> RaggedKernel | None:
    """A ragged kernel for this device/dtype that agrees with the math oracle, or None. backend:
    "math" for the oracle itself (any device: tests), None for the cuDNN frontend on CUDA
    (bf16 / fp16, where the `cudnn` package is installed)."""
    if backend == "math":
        return MathRaggedKernel()
    if backend not in (None, "cudnn-fe"):
        raise ValueError(f"unknown ragged attention backend '{backend}' (allowed: cudnn-fe, math)")
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    key = (device.type, dtype, head_dim)
    if key not in _verified:
        _verified[key] = None
        # dynamic-shape graphs first; static ones where those fail the check
        for dynamic_shapes in (True, False) if _dynamic_shape_graphs[0] else (False,):
            try:
                kernel = CudnnFrontendRaggedKernel(dynamic_shapes=dynamic_shapes)
            except (ImportError, OSError, RuntimeError):
                break
            _made.append(kernel)
            if _agrees_with_math(kernel, device, dtype, head_dim):
                _verified[key] = kernel
                break
            _failed_checks[0] += 1
    return _verified[key]
