"""Padded merges of the coalesced engine (runtime/coalesced.PaddedGroup) and their priced plan
(runtime/merging.py): exact against per-segment explicit attention, forward and every gradient."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from zellige.runtime import SegmentTable, coalesced_attention, merging
from zellige.runtime import kernels as K


def _explicit(q, k, v):
    """q [Lq, n, H], k/v [Lk, n, H] -> o [Lq, n, H], lse [Lq, n] (float64)."""
    scores = torch.einsum("qnh,knh->nqk", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("nqk,knh->qnh", torch.softmax(scores, -1), v), lse.transpose(0, 1)


# (q_len, k_len, heads): groups (5,5,3) x3, (3,3,3), (1,1,3), (7,2,2) x2, (4,2,2), (3,9,1)
SEGMENTS = [
    (5, 5, 3), (1, 1, 3), (5, 5, 3), (7, 2, 2), (3, 3, 3), (7, 2, 2), (3, 9, 1), (5, 5, 3),
    (4, 2, 2),
]  # fmt: skip


def _problem(segments, seed: int, q_scale: float = 1.0, uncovered: int = 0):
    """Segments side by side (queries in order, keys in reverse order so groups gather), plus
    `uncovered` query rows no segment covers."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 8
    q_off, k_off, q_total, k_total = [], [0] * len(segments), 0, 0
    for lq, _, n in segments:
        q_off.append(q_total)
        q_total += lq * n
    for i in reversed(range(len(segments))):
        k_off[i] = k_total
        k_total += segments[i][1] * segments[i][2]
    q = torch.randn(q_total + uncovered, head_dim, generator=gen, dtype=torch.float64) * q_scale
    k, v = (torch.randn(k_total, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
    do = torch.randn_like(q)
    q_len, k_len, heads = zip(*segments, strict=True)
    table = SegmentTable.build(q_off, k_off, q_len, k_len, heads)
    return table, (q, k, v, do), q_off, k_off


def _reference(segments, tensors, q_off, k_off):
    """o, lse and gradients of every segment's explicit attention (uncovered rows: 0, -inf)."""
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = torch.zeros_like(q)
    lse = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
    for (lq, lk, n), qo, ko in zip(segments, q_off, k_off, strict=True):
        qs = leaves[0][qo : qo + lq * n].view(lq, n, -1)
        ks, vs = (t[ko : ko + lk * n].view(lk, n, -1) for t in leaves[1:])
        o_s, lse_s = _explicit(qs, ks, vs)
        o = o.index_copy(0, torch.arange(qo, qo + lq * n), o_s.reshape(lq * n, -1))
        lse[qo : qo + lq * n] = lse_s.detach().reshape(-1)
    o.backward(do)
    return o.detach(), lse, *(t.grad for t in leaves)


def _engine(table, tensors, backend, merge="groups"):
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = coalesced_attention(*leaves, table, backend=backend, return_lse=True, merge=merge)
    o.backward(do)
    return o.detach(), lse, *(t.grad for t in leaves)


def _shape(g) -> tuple[int, int, int]:
    return g.q_len, g.k_len, g.num_heads


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("q_scale", [1.0, 60.0], ids=["plain", "extreme-scores"])
def test_padded_merges_equal_explicit_attention(backend: str, q_scale: float) -> None:
    """Two padded calls (self-shaped members of 3 heads; cross-shaped members of 2 heads with
    different query and key lengths) and the rest as groups: o, lse, dq, dk, dv as the explicit
    attention of every segment, with key rows gathered and a query row no segment covers.
    Extreme scores (|q.k| in the hundreds) leave no NaN: a padded query reads its own row's lse."""
    table, tensors, q_off, k_off = _problem(SEGMENTS, seed=0, q_scale=q_scale, uncovered=2)
    shapes = [_shape(g) for g in table.groups]
    buckets = [
        [shapes.index((5, 5, 3)), shapes.index((3, 3, 3)), shapes.index((1, 1, 3))],
        [shapes.index((7, 2, 2)), shapes.index((4, 2, 2))],
    ]
    merged = table.merge_padded(buckets, "cpu")
    assert merged.num_calls == table.num_calls - 3 and len(merged.padded) == 2
    assert {p.q_len for p in merged.padded} == {5, 7}
    # (7, 2) with (4, 2): only queries are padded, so that call runs without a key mask
    assert {p.q_len: p.keys_padded for p in merged.padded} == {5: True, 7: False}
    want = _reference(SEGMENTS, tensors, q_off, k_off)
    got = _engine(merged, tensors, backend)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all() or name == "lse", name
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * max(1.0, q_scale), msg=name)


def test_packed_sequences_all_in_one_padded_call() -> None:
    """Self-attention of a pack of many lengths (as bench/attention_engine.py's packs) as ONE
    padded call equals the plain groups (float64)."""
    lengths = [9, 8, 8, 6, 5, 3, 3, 2, 1]
    heads, head_dim = 2, 4
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (
        torch.randn(sum(lengths) * heads, head_dim, generator=gen, dtype=torch.float64)
        for _ in range(4)
    )
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    table = SegmentTable.packed(cu, heads)
    merged = table.merge_padded([list(range(len(table.groups)))], "cpu")
    assert merged.num_calls == 1 and merged.padded[0].count == len(lengths)
    for a, b in zip(
        _engine(merged, (q, k, v, do), "cpu"), _engine(table, (q, k, v, do), "cpu"), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_padded_merge_bad_input() -> None:
    table, _, _, _ = _problem(SEGMENTS, seed=1)
    shapes = [_shape(g) for g in table.groups]
    with pytest.raises(ValueError, match="one head count"):
        table.merge_padded([[shapes.index((5, 5, 3)), shapes.index((3, 9, 1))]], "cpu")
    with pytest.raises(ValueError, match="two or more"):
        table.merge_padded([[0]], "cpu")
    with pytest.raises(ValueError, match="disjoint"):
        table.merge_padded([[0, 1], [1, 2]], "cpu")
    shared = SegmentTable.build([0, 0], [0, 8], [4, 2], [4, 2], [2, 2])  # ring-like: shared rows
    with pytest.raises(ValueError, match="share no rows"):
        shared.merge_padded([[0, 1]], "cpu")


def test_masked_kernels_agree_with_math() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.float64, torch.float32):
        assert K.masked_kernel_for(K.CpuFlashKernel(), cpu, dtype, 16) is not None
    assert K._masked_agrees_with_math(K.MathKernel(), cpu, torch.float64, 16)
    with pytest.raises(NotImplementedError, match="mask"):
        K.FlashKernel().forward(*(torch.zeros(1, 1, 2, 8) for _ in "qkv"), 1.0, torch.zeros(1))
    mask = K.key_mask(torch.tensor([[True, True, False]]), torch.float32)
    assert mask.shape == (1, 1, 1, 3) and mask.stride(0) == 8  # rows 16-byte aligned
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, float("-inf")]


def _costs(fixed_s: float, mask_factor: float) -> merging.CallCosts:
    """A call table where a call costs fixed_s plus 1 ns per (head x query x key): small calls
    are dominated by fixed_s; masked calls take mask_factor times as long."""
    lengths, heads = [8, 64, 512], [1, 4, 64]
    grid = [[fixed_s + 1e-9 * h * n * n for h in heads] for n in lengths]
    data = {
        "lengths": lengths,
        "heads": heads,
        "forward_s": grid,
        "backward_s": [[2.5 * x for x in row] for row in grid],
        "masked_forward_s": [[mask_factor * x for x in row] for row in grid],
        "masked_backward_s": [[2.5 * mask_factor * x for x in row] for row in grid],
        "gather_bytes_per_s": 1e12,
        "created": "synthetic (test)",
    }
    return merging.CallCosts.from_call_table(data, "test table")


def test_plan_merges_only_where_they_pay() -> None:
    lengths = [60, 58, 57, 40, 39, 38, 20, 19]
    table = SegmentTable.packed(np.concatenate([[0], np.cumsum(lengths)]).tolist(), 2)
    # launch-dominated calls: merging nearby lengths pays, and the plan says what it saves
    buckets, planned, alone = merging.plan_padded_merges(table.groups, _costs(1e-3, 1.1), 8, 8)
    assert buckets and planned < alone
    merged_lengths = sorted(table.groups[i].q_len for b in buckets for i in b)
    assert len(merged_lengths) >= 4
    # no fixed cost and a slow mask: nothing pays, the groups stay
    buckets, planned, alone = merging.plan_padded_merges(table.groups, _costs(0.0, 1.5), 8, 8)
    assert buckets == [] and planned == pytest.approx(alone)


def test_auto_policy_applies_the_plan(monkeypatch) -> None:
    """merge='auto' runs the priced plan where the device has measured costs (a CPU has none:
    the groups); the merged run still equals the explicit attention."""
    from zellige.runtime import backends

    lengths = [9, 8, 8, 6, 5, 3]
    segments = [(n, n, 2) for n in lengths]
    table, tensors, q_off, k_off = _problem(segments, seed=5)
    kernel = K.kernel_for(torch.device("cpu"), torch.float64, 8)
    assert backends._auto_padded(table, kernel, tensors[0]) is table  # CPU: no costs
    monkeypatch.setattr(
        merging, "costs_for_device", lambda device, call_table=None: _costs(1e-3, 1.0)
    )
    table, tensors, q_off, k_off = _problem(segments, seed=5)  # a fresh table: plans are cached
    planned = backends._auto_padded(table, kernel, tensors[0])
    assert planned.padded and planned.num_calls < table.num_calls
    want = _reference(segments, tensors, q_off, k_off)
    for a, b in zip(_engine(table, tensors, None, merge="auto"), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_call_table_errors() -> None:
    with pytest.raises(ValueError, match="not an attention call table"):
        merging.CallCosts.from_call_table({"lengths": [1]}, "t.json")
    bad = {
        "lengths": [64, 8],
        "heads": [1],
        **{n: [[1e-3], [1e-3]] for n in ("forward_s", "backward_s")},
        **{n: [[1e-3], [1e-3]] for n in ("masked_forward_s", "masked_backward_s")},
        "gather_bytes_per_s": 1e12,
    }
    with pytest.raises(ValueError, match="t.json: lengths must increase"):
        merging.CallCosts.from_call_table(bad, "t.json")


def test_the_built_in_call_table_prices_calls() -> None:
    """The shipped H200 table (zellige/profiles/) reads and prices a call; masked calls cost
    more there (cuDNN's bias path), which is why the engine merges no self-attention pack."""
    from importlib import resources

    name = merging.CALL_TABLES["NVIDIA H200"]
    data = json.loads((resources.files("zellige") / "profiles" / name).read_text())
    assert data["device_name"] == "NVIDIA H200"
    costs = merging.CallCosts.from_call_table(data, name)
    plain, masked = costs.call_s(2048, 2048, 96), costs.call_s(2048, 2048, 96, masked=True)
    assert 0 < plain[0] < masked[0] and 0 < plain[1] < masked[1]
    assert costs.streams == 2  # measured: bench/results/attention_engine_h200_202612.md
