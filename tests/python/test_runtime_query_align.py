"""The forward's query padding (coalesced._aligned_queries): each group's queries padded to a
multiple of `query_align` tokens through an overlapping view, keys unchanged, padded rows
dropped. Results must equal the unpadded calls' exactly, forward and every gradient."""

from __future__ import annotations

import math

import pytest
import torch

from zellige.runtime import SegmentTable, coalesced, coalesced_attention, kernel_for, merging
from zellige.runtime.kernels import MathKernel


def _per_sequence(q, k, v, cu):
    """Explicit softmax attention of each packed sequence: o [T, n, H], lse [T, n] (float64)."""
    outs, lses = [], []
    for a, b in zip(cu, cu[1:], strict=False):
        scores = torch.einsum("qnh,knh->nqk", q[a:b], k[a:b]) / math.sqrt(q.shape[-1])
        outs.append(torch.einsum("nqk,knh->qnh", torch.softmax(scores, -1), v[a:b]))
        lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


# (6, 6) side by side: a slice group padded to 8 reading the next problem's rows; 3 -> 4, 5 -> 8,
# 1 -> 4, 7 -> 8; (2, ..., 2) apart: a gathered group (2 -> 4, each problem's last row repeated);
# the last, 9 -> 12, would run past the last row (unpadded)
LENGTHS = [6, 6, 3, 5, 1, 2, 7, 2, 9]


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_padded_queries_equal_unpadded_calls_and_per_sequence_attention(backend: str) -> None:
    gen = torch.Generator().manual_seed(5)
    n, head_dim = 2, 4
    cu = [0]
    for length in LENGTHS:
        cu.append(cu[-1] + length)
    total = cu[-1]
    q, k, v, do = (torch.randn(total, n, head_dim, generator=gen, dtype=torch.float64)
                   for _ in range(4))  # fmt: skip
    table = SegmentTable.packed(cu, n)
    rows = q.view(-1, head_dim)
    padded = {g.q_len: coalesced._aligned_queries(rows, g, 4) for g in table.groups}
    lengths = {q_len: p[1] for q_len, p in padded.items() if p is not None}
    assert lengths == {6: 8, 3: 4, 5: 8, 1: 4, 7: 8, 2: 4}
    assert padded[9] is None  # past the last row
    gathered = padded[2][0]  # [2, n, 4, H]: sequences at tokens 21 and 30, last row repeated
    assert torch.equal(gathered[1, :, :2], q[30:32].transpose(0, 1))
    assert torch.equal(gathered[1, :, 2:], q[31:32].expand(2, n, head_dim).transpose(0, 1))
    view = padded[6][0]  # [2, n, 8, H]: problem b's real rows first, then the rows after it
    assert torch.equal(view[:, :, :6], q[:12].view(2, 6, n, head_dim).transpose(1, 2))
    assert torch.equal(view[0, :, 6:], q[6:8].transpose(0, 1))
    kernel = kernel_for(torch.device("cpu"), torch.float64, head_dim, backend)
    assert coalesced.query_padding_ok(kernel, torch.device("cpu"), torch.float64, head_dim)
    assert not isinstance(table.groups[[g.q_len for g in table.groups].index(2)].q_index, slice)

    results = []
    for align in (1, 4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = coalesced_attention(
            *(t.view(-1, head_dim) for t in leaves), table, backend=backend, return_lse=True,
            query_align=align,
        )  # fmt: skip
        o.view(total, n, head_dim).backward(do)
        results.append((o.detach(), lse, *(t.grad for t in leaves)))
    for unpadded, padded_call in zip(*results, strict=True):
        assert torch.equal(padded_call, unpadded)
    o_ref, lse_ref = _per_sequence(q, k, v, cu)
    torch.testing.assert_close(results[1][0].view(total, n, -1), o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(results[1][1].view(total, n), lse_ref, rtol=0, atol=1e-12)


def test_query_padding_check_refuses_a_kernel_that_mixes_query_rows() -> None:
    cpu = torch.device("cpu")

    class MixesRows(MathKernel):  # reads the padded problem as one sequence of keys and queries
        name = "mixes-rows"

        def forward(self, q, k, v, scale, bias=None):
            o, lse = super().forward(q, k, v, scale, bias)
            return o.flip(2), lse.flip(2)  # query order reversed: padding lands on real rows

    assert coalesced.query_padding_ok(MathKernel(), cpu, torch.float64, 8)
    assert not coalesced.query_padding_ok(MixesRows(), cpu, torch.float64, 8)


def test_query_align_comes_from_the_call_table_or_the_environment(monkeypatch) -> None:
    grid = [[1e-3, 2e-3], [4e-3, 8e-3]]
    data = {
        "lengths": [64, 512],
        "heads": [1, 8],
        **{n: grid for n in ("forward_s", "backward_s", "masked_forward_s", "masked_backward_s")},
        "gather_bytes_per_s": 1e12,
    }
    assert merging.CallCosts.from_call_table(data, "t.json").query_align == 1
    assert merging.CallCosts.from_call_table({**data, "query_align": 128}, "t").query_align == 128
    with pytest.raises(ValueError, match="query_align must be 1 or a power of two"):
        merging.CallCosts.from_call_table({**data, "query_align": 100}, "t.json")
    monkeypatch.setenv("ZELLIGE_ATTENTION_QUERY_ALIGN", "64")
    assert merging.query_align_for_device(torch.device("cpu")) == 64
    monkeypatch.setenv("ZELLIGE_ATTENTION_QUERY_ALIGN", "7")
    with pytest.raises(ValueError, match="ZELLIGE_ATTENTION_QUERY_ALIGN"):
        merging.query_align_for_device(torch.device("cpu"))
    q = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="query_align must be a positive"):
        coalesced_attention(q, q, q, SegmentTable.packed([0, 2, 4], 1), query_align=0)
