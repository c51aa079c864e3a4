"""Coalesced attention (single process) against per-segment explicit softmax attention."""

from __future__ import annotations

import math

import pytest
import torch

from zellige.runtime import KERNELS, SegmentTable, coalesced_attention, kernel_for


def _explicit(q, k, v):
    """q [Lq, n, H], k/v [Lk, n, H] -> o [Lq, n, H], lse [Lq, n] (float64)."""
    scores = torch.einsum("qnh,knh->nqk", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("nqk,knh->qnh", torch.softmax(scores, -1), v), lse.transpose(0, 1)


# (q_len, k_len, heads) per segment; k rows laid out in reverse order so groups need gathers.
SEGMENTS = [(5, 5, 3), (1, 1, 3), (5, 5, 3), (7, 2, 2), (7, 2, 2), (3, 9, 1), (5, 5, 3)]


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_segments_match_explicit_attention(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    head_dim = 8
    q_off, k_off, q_rows_total, k_rows_total = [], [], 0, 0
    for lq, _, n in SEGMENTS:
        q_off.append(q_rows_total)
        q_rows_total += lq * n
    for _, lk, n in reversed(SEGMENTS):
        k_off.append(k_rows_total)
        k_rows_total += lk * n
    k_off.reverse()
    q = torch.randn(q_rows_total, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(k_rows_total, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
    do = torch.randn_like(q)
    q_len, k_len, heads = zip(*SEGMENTS, strict=True)
    table = SegmentTable.build(q_off, k_off, q_len, k_len, heads)
    assert table.num_calls == 4  # one dense call per distinct shape

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = coalesced_attention(*leaves, table, backend=backend, return_lse=True)
    o.backward(do)

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    parts = []
    for (lq, lk, n), qo, ko in zip(SEGMENTS, q_off, k_off, strict=True):
        qs = ref_leaves[0][qo : qo + lq * n].view(lq, n, head_dim)
        ks = ref_leaves[1][ko : ko + lk * n].view(lk, n, head_dim)
        vs = ref_leaves[2][ko : ko + lk * n].view(lk, n, head_dim)
        os_, ls = _explicit(qs, ks, vs)
        parts.append((qo, lq * n, os_, ls))
    o_ref = torch.cat([p[2].reshape(-1, head_dim) for p in sorted(parts, key=lambda p: p[0])])
    lse_ref = torch.cat([p[3].reshape(-1) for p in sorted(parts, key=lambda p: p[0])])
    o_ref.backward(do)
    torch.testing.assert_close(o.detach(), o_ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=0, atol=1e-12)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-12)


def test_packed_table_groups_equal_lengths() -> None:
    table = SegmentTable.packed([0, 256, 512, 768, 1792, 1793], num_heads=4)
    shapes = [(g.count, g.q_len) for g in table.groups]
    assert shapes == [(1, 1024), (3, 256), (1, 1)]
    assert isinstance(table.groups[1].q_index, slice)  # side by side: a view, no gather


def test_kernel_choice_and_override() -> None:
    assert kernel_for(torch.device("cpu"), torch.float64, 16).name == "cpu"
    assert kernel_for(torch.device("cpu"), torch.float32, 16, backend="math").name == "math"
    with pytest.raises(ValueError, match="allowed"):
        kernel_for(torch.device("cpu"), torch.float32, 16, backend="nope")
    assert set(KERNELS) >= {"cudnn", "flash", "efficient", "cpu", "math"}


@pytest.mark.parametrize("lengths", [[4, 4, 4], [6, 3, 6, 1]], ids=["one-group", "three-groups"])
def test_packed_sequences_match_per_sequence_attention(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, head_dim = 2, 4
    total = sum(lengths)
    q, k, v, do = (
        torch.randn(total, num_heads, head_dim, generator=gen, dtype=torch.float64)
        for _ in range(4)
    )
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rows = [t.view(total * num_heads, head_dim) for t in leaves]
    o = coalesced_attention(*rows, SegmentTable.packed(cu, num_heads)).view(total, num_heads, -1)
    o.backward(do)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref = torch.cat(
        [_explicit(*(t[a:b] for t in ref_leaves))[0] for a, b in zip(cu, cu[1:], strict=False)]
    )
    o_ref.backward(do)
    torch.testing.assert_close(o.detach(), o_ref.detach(), rtol=0, atol=1e-12)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("heads", [1, 3])
def test_ragged_merge_equals_grouped_calls(heads: int) -> None:
    """One ragged call over every group (the math oracle's ragged kernel) computes what the
    per-group dense calls do: outputs, lse and gradients, with gathers and a row no segment
    covers; auto keeps the groups (the math oracle is not trusted for automatic use)."""
    from zellige.runtime import backends

    gen = torch.Generator().manual_seed(3)
    head_dim = 8
    lengths = [(5, 7), (3, 3), (5, 7), (9, 2), (1, 4), (3, 3)]  # (q_len, k_len), 4 shapes
    q_off, k_off, q_total, k_total = [], [0] * len(lengths), 0, 0
    for lq, _ in lengths:
        q_off.append(q_total)
        q_total += lq * heads
    for i in reversed(range(len(lengths))):  # keys in reverse order: the groups gather
        k_off[i] = k_total
        k_total += lengths[i][1] * heads
    q_total += heads  # one query token of no segment: zero output, -inf lse
    q = torch.randn(q_total, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(k_total, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
    do = torch.randn_like(q)
    q_len, k_len = zip(*lengths, strict=True)
    table = SegmentTable.build(q_off, k_off, q_len, k_len, [heads] * len(lengths))
    assert table.num_calls == 4 >= backends.RAGGED_MIN_CALLS
    assert any(isinstance(g.k_index, torch.Tensor) for g in table.groups)

    results = []
    for merge in ("groups", "ragged"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = coalesced_attention(*leaves, table, backend="math", return_lse=True, merge=merge)
        o.backward(do)
        results.append((o.detach(), lse, *(t.grad for t in leaves)))
    for grouped, ragged in zip(*results, strict=True):
        torch.testing.assert_close(ragged, grouped, rtol=0, atol=1e-12)
    assert torch.isinf(results[1][1][-heads:]).all()
    assert backends._ragged_choice(table, q, k, None, None) is None  # CPU: no ragged kernel
    assert backends._ragged_choice(table, q, k, "math", "auto") is None  # the oracle: not auto
    kernel, layout = backends._ragged_choice(table, q, k, "math", "ragged")
    works = [lq * lk for lq, lk in zip(layout.q_lens, layout.k_lens, strict=True)]
    assert works == sorted(works, reverse=True)  # the most work first
    assert sorted(zip(layout.q_lens, layout.k_lens, strict=True)) == sorted(lengths)
    with pytest.raises(ValueError, match="merge"):
        coalesced_attention(q, k, v, table, merge="padded")


def test_auto_runs_ragged_only_for_tables_of_short_segments(monkeypatch) -> None:
    """The automatic policy: one ragged call for a table of RAGGED_MIN_CALLS or more calls whose
    segments are all at most RAGGED_MAX_SEGMENT_TOKENS tokens, a table of one dense call (equal
    lengths: its dense plan would be built anew for each new shape) included; "ragged" asked for
    explicitly runs it whatever the lengths. The math oracle stands in for a trusted kernel."""
    from zellige import _core
    from zellige.runtime import backends

    assert backends.RAGGED_MIN_CALLS == _core.RAGGED_MIN_CALLS == 1  # the cost model's values
    assert backends.RAGGED_MAX_SEGMENT_TOKENS == _core.RAGGED_MAX_SEGMENT_TOKENS
    monkeypatch.setattr(backends, "AUTO_RAGGED_KERNELS", ("math",))
    q = torch.randn(2 * 10, 4, dtype=torch.float64)
    table = SegmentTable.build([0, 6], [0, 6], [3, 7], [3, 7], [2, 2])  # 2 calls, longest 7
    one_call = SegmentTable.build([0, 6], [0, 6], [3, 3], [3, 3], [2, 2])
    empty = SegmentTable.build([], [], [], [], [])
    assert backends._ragged_choice(table, q, q, "math", "auto") is not None
    assert one_call.num_calls == 1
    assert backends._ragged_choice(one_call, q, q, "math", "auto") is not None
    assert backends._ragged_choice(empty, q, q, "math", "auto") is None
    assert backends._ragged_choice(one_call, q, q, "math", "groups") is None
    monkeypatch.setattr(backends, "RAGGED_MAX_SEGMENT_TOKENS", 6)
    assert backends._ragged_choice(table, q, q, "math", "auto") is None
    assert backends._ragged_choice(one_call, q, q, "math", "auto") is not None  # longest 3
    assert backends._ragged_choice(table, q, q, "math", "ragged") is not None


def test_a_shape_the_ragged_kernel_refuses_runs_as_groups(monkeypatch) -> None:
    """RaggedKernel.prepare saying no (cuDNN refusing a graph) sends the table to the dense
    calls, with their results, instead of failing mid-step."""
    from zellige.runtime import backends
    from zellige.runtime import ragged as R

    class Refusing(R.MathRaggedKernel):
        def prepare(self, q, k, layout, scale):
            return False

        def forward_into(self, *args):
            raise AssertionError("a refused shape must not run")

    monkeypatch.setattr(backends, "ragged_kernel_for", lambda *args: Refusing())
    q = torch.randn(2 * 10, 4, dtype=torch.float64)
    table = SegmentTable.build([0, 6], [0, 6], [3, 7], [3, 7], [2, 2])
    assert backends._ragged_choice(table, q, q, None, "ragged") is None
    o = coalesced_attention(q, q, q, table, merge="ragged")
    torch.testing.assert_close(
        o, coalesced_attention(q, q, q, table, merge="groups"), rtol=0, atol=0
    )


def test_ragged_call_falls_back_to_groups_past_int32_offsets(monkeypatch) -> None:
    """Rows past cuDNN's int32 ragged offsets run as groups (same results), never a failure."""
    from zellige.runtime import backends

    q = torch.randn(2 * 6, 4, dtype=torch.float64)
    table = SegmentTable.build([0, 6], [0, 6], [3, 3], [3, 3], [2, 2])
    table2 = SegmentTable.build([0, 4], [0, 4], [2, 4], [2, 4], [2, 2])
    assert backends._ragged_choice(table2, q, q, "math", "ragged") is not None
    monkeypatch.setattr(backends, "RAGGED_MAX_ELEMENTS", q.numel() - 1)
    assert backends._ragged_choice(table2, q, q, "math", "ragged") is None
    o = coalesced_attention(q, q, q, table, backend="math", merge="ragged")
    o_groups = coalesced_attention(q, q, q, table, backend="math", merge="groups")
    torch.testing.assert_close(o, o_groups, rtol=0, atol=0)


def test_ragged_kernel_check_catches_wrong_kernels() -> None:
    """The check that gates a ragged kernel passes the math oracle and fails kernels that are
    right on short segments only (as torch 2.11's ragged cuDNN backward was: dq wrong from 512
    tokens on) or that write rows outside their segments."""
    from zellige.runtime import ragged as R

    class WrongWhenLong(R.MathRaggedKernel):
        def backward_into(self, do, q, k, v, o, lse, dq, dk, dv, layout, scale):
            super().backward_into(do, q, k, v, o, lse, dq, dk, dv, layout, scale)
            for (q0, q1, _, _), length in zip(layout.spans(), layout.q_lens, strict=True):
                if length >= 512:
                    dq[q0:q1] *= 2

    class WritesTheGaps(R.MathRaggedKernel):
        def forward_into(self, q, k, v, o, lse, layout, scale):
            super().forward_into(q, k, v, o, lse, layout, scale)
            o[layout.q_starts[1] - 1] = 1.0  # the last row before segment 1: a gap row

    cpu = torch.device("cpu")
    assert R._agrees_with_math(R.MathRaggedKernel(), cpu, torch.float32, 16)
    assert not R._agrees_with_math(WrongWhenLong(), cpu, torch.float32, 16)
    assert not R._agrees_with_math(WritesTheGaps(), cpu, torch.float32, 16)
    assert R.ragged_kernel_for(cpu, torch.float32, 16) is None  # no ragged kernel on the CPU
    with pytest.raises(ValueError, match="ragged attention backend"):
        R.ragged_kernel_for(cpu, torch.float32, 16, backend="flash")


def test_ragged_layout_rejects_bad_segments_and_buckets_round_up() -> None:
    from zellige.runtime import ragged as R

    with pytest.raises(ValueError, match="one start and one length"):
        R.RaggedLayout(2, (0,), (0, 4), (1,), (1,))
    with pytest.raises(ValueError, match="at least one query"):
        R.RaggedLayout(2, (0,), (0,), (0,), (1,))
    assert [R._bucket(v) for v in (1, 8, 9, 12, 13, 16, 17, 33)] == [8, 8, 12, 12, 16, 16, 24, 48]
    lengths = [1, 100, 128, 129, 1100, 8382, 17436, 76608]
    assert [R._bucket_length(v) for v in lengths] == [128, 128, 128, 256, 1152, 9216, 18432, 81920]
    for tokens in range(1, 200_000, 997):  # at most 12.5% (or one 128-token tile) above
        assert tokens <= R._bucket_length(tokens) <= max(tokens * 1.125, tokens + 127)


def test_cudnn_ragged_graphs_fall_back_to_static_ones(monkeypatch) -> None:
    """The cuDNN frontend kernel builds dynamic-shape graphs first; where cuDNN refuses one it
    builds static graphs from then on, and where a dynamic-shape kernel fails the check against
    the math kernel a static one is made and checked. graph_counts() counts builds, their time
    and the failed check. A stand-in `cudnn` module and builder replace the GPU."""
    import sys
    import types

    from zellige.runtime import ragged as R

    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setattr(R, "_verified", {})
    monkeypatch.setattr(R, "_made", [])
    monkeypatch.setattr(R, "_failed_checks", [0])
    builds = []

    class Stand(R.CudnnFrontendRaggedKernel):
        def _build(self, backward, dtype, n, head_dim, shape, totals, scale, device, dynamic):
            builds.append(dynamic)
            if dynamic:
                raise RuntimeError("dynamic shapes not supported here")
            return object(), {}

    kernel = Stand()
    args = (torch.bfloat16, 2, 8, (8, 128, 128), None, 0.5, torch.device("cpu"))
    first = kernel._graph(False, *args)
    assert builds == [True, False] and not kernel.dynamic_shapes
    assert kernel._graph(False, *args) is first and builds == [True, False]  # cached
    kernel._graph(True, *args)
    assert builds == [True, False, False] and kernel.graphs_built == 2

    checked = []

    def check(candidate, device, dtype, head_dim):
        checked.append(candidate.dynamic_shapes)
        return not candidate.dynamic_shapes  # the dynamic-shape kernel computes wrong results

    monkeypatch.setattr(R, "_agrees_with_math", check)
    monkeypatch.setattr(R, "CudnnFrontendRaggedKernel", Stand)
    before = R.graph_counts()
    chosen = R.ragged_kernel_for(torch.device("cuda", 0), torch.bfloat16, 8)
    assert checked == [True, False] and chosen is not None and not chosen.dynamic_shapes
    assert R.ragged_kernel_for(torch.device("cuda", 0), torch.bfloat16, 8) is chosen
    assert (R.graph_counts() - before).failed_checks == 1
    R.set_dynamic_shape_graphs(False)
    try:
        again = R.ragged_kernel_for(torch.device("cuda", 0), torch.bfloat16, 8)
        assert again is not chosen and checked == [True, False, False]
    finally:
        R.set_dynamic_shape_graphs(True)
    assert R.graph_counts().failed_checks == 1
    R._made.append(kernel)  # graph_counts() sums what every kernel made did
    counts = R.graph_counts()
    assert counts.built == 2 and counts.build_s >= 0 and counts.refused == 0
