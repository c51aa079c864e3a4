"""The forward's key split (coalesced.forward_into, key_split > 0): a group whose key count is
not a multiple of KEY_TILE runs its queries against the first multiple of KEY_TILE keys and
against the rest, merged by lse. Results must equal per-sequence attention (float64, CPU),
forward and every gradient, and the unsplit engine's."""

from __future__ import annotations

import math

import pytest
import torch

from zellige.runtime import (
    EngineConfig,
    SegmentTable,
    coalesced,
    coalesced_attention,
    kernel_for,
    merging,
)
from zellige.runtime.coalesced import KEY_TILE
from zellige.runtime.kernels import MathKernel

# (q_len, k_len, heads) per segment: 300 x 2 side by side (a slice group, split at 256), 130
# (split at 128), 256 (a multiple: one call), 70 (< KEY_TILE: one call), a cross-attention
# shape (7 queries x 150 keys) twice apart (a gathered group, split at 128), 129 keys with one
# query
SEGMENTS = [(300, 300, 2), (300, 300, 2), (130, 130, 2), (7, 150, 2), (256, 256, 2),
            (70, 70, 2), (7, 150, 2), (1, 129, 2)]  # fmt: skip


def _explicit(q, k, v):
    """q [Lq, n, H], k/v [Lk, n, H] -> o [Lq, n, H], lse [Lq, n] (float64)."""
    scores = torch.einsum("qnh,knh->nqk", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("nqk,knh->qnh", torch.softmax(scores, -1), v), lse.transpose(0, 1)


@pytest.mark.parametrize("backend", ["cpu", "math"])
def test_split_forward_equals_per_segment_attention(backend: str) -> None:
    gen = torch.Generator().manual_seed(7)
    head_dim = 4
    q_off, k_off, q_total, k_total = [], [], 0, 0
    for lq, lk, n in SEGMENTS:
        q_off.append(q_total)
        k_off.append(k_total)
        q_total += lq * n
        k_total += lk * n
    q, do = (torch.randn(q_total, head_dim, generator=gen, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(k_total, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
    q_len, k_len, heads = zip(*SEGMENTS, strict=True)
    table = SegmentTable.build(q_off, k_off, q_len, k_len, heads)
    splits = {(g.q_len, g.k_len): coalesced._key_split(g, 100) for g in table.groups}
    assert splits == {(300, 300): 256, (130, 130): 128, (7, 150): 128, (256, 256): 0,
                      (70, 70): 0, (1, 129): 128}  # fmt: skip
    assert coalesced._key_split(table.groups[0], 1000) == 0  # below the threshold: one call
    gathered = [g for g in table.groups if g.k_len == 150][0]
    assert not isinstance(gathered.q_index, slice)

    kernel = kernel_for(torch.device("cpu"), torch.float64, head_dim, backend)
    assert coalesced.key_split_ok(kernel, torch.device("cpu"), torch.float64, head_dim)
    results = []
    for key_split in (0, 100):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = coalesced_attention(
            *leaves, table, backend=backend, return_lse=True, key_split=key_split
        )
        o.backward(do)
        results.append((o.detach(), lse, *(t.grad for t in leaves)))
    for unsplit, split in zip(*results, strict=True):
        torch.testing.assert_close(split, unsplit, rtol=0, atol=1e-12)

    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o_parts, lse_parts = [], []
    for (lq, lk, n), qo, ko in zip(SEGMENTS, q_off, k_off, strict=True):
        o_s, lse_s = _explicit(
            ref_leaves[0][qo : qo + lq * n].view(lq, n, head_dim),
            *(t[ko : ko + lk * n].view(lk, n, head_dim) for t in ref_leaves[1:]),
        )
        o_parts.append(o_s.reshape(-1, head_dim))
        lse_parts.append(lse_s.reshape(-1))
    o_ref = torch.cat(o_parts)
    o_ref.backward(do)
    torch.testing.assert_close(results[1][0], o_ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(results[1][1], torch.cat(lse_parts).detach(), rtol=0, atol=1e-12)
    for got, want in zip(results[1][2:], ref_leaves, strict=True):
        torch.testing.assert_close(got, want.grad, rtol=0, atol=1e-12)


def test_key_split_check_refuses_a_kernel_with_a_wrong_lse() -> None:
    cpu = torch.device("cpu")

    class ShiftedLse(MathKernel):  # right o, lse off by 1: the merge weights come out wrong
        name = "shifted-lse"

        def forward(self, q, k, v, scale, bias=None):
            o, lse = super().forward(q, k, v, scale, bias)
            return o, lse - 1 if k.shape[2] < KEY_TILE else lse

    assert coalesced.key_split_ok(MathKernel(), cpu, torch.float64, 8)
    assert not coalesced.key_split_ok(ShiftedLse(), cpu, torch.float64, 8)


def test_key_split_comes_from_the_call_table_or_the_environment(monkeypatch) -> None:
    grid = [[1e-3, 2e-3], [4e-3, 8e-3]]
    data = {
        "lengths": [64, 512],
        "heads": [1, 8],
        **{n: grid for n in ("forward_s", "backward_s", "masked_forward_s", "masked_backward_s")},
        "gather_bytes_per_s": 1e12,
    }
    assert merging.CallCosts.from_call_table(data, "t.json").key_split == 0
    assert merging.CallCosts.from_call_table({**data, "key_split": 4096}, "t").key_split == 4096
    with pytest.raises(ValueError, match="key_split must be an integer >= 0"):
        merging.CallCosts.from_call_table({**data, "key_split": -1}, "t.json")
    monkeypatch.setenv("ZELLIGE_ATTENTION_KEY_SPLIT", "2048")
    assert merging.key_split_for_device(torch.device("cpu"), EngineConfig.from_env()) == 2048
    monkeypatch.setenv("ZELLIGE_ATTENTION_KEY_SPLIT", "many")
    with pytest.raises(ValueError, match="ZELLIGE_ATTENTION_KEY_SPLIT"):
        EngineConfig.from_env()
    monkeypatch.delenv("ZELLIGE_ATTENTION_KEY_SPLIT")
    q = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="key_split must be a number"):
        coalesced_attention(q, q, q, SegmentTable.packed([0, 2, 4], 1), key_split=-1)
