"""The coalesced engine's CUDA streams: which stream each call takes, and how many streams the
automatic policy uses (the device's measured call table, or EngineConfig.streams)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zellige import _core
from zellige.runtime import EngineConfig, SegmentTable, coalesced_attention, merging
from zellige.runtime.coalesced import stream_assignment


def test_each_call_goes_to_the_least_loaded_stream() -> None:
    # longest first: the two long calls take a stream each, the short ones fill in behind
    assert stream_assignment([100, 90, 30, 20, 10, 5], 2) == [0, 1, 1, 0, 0, 1]
    assert stream_assignment([8, 8, 8, 8, 8], 3) == [0, 1, 2, 0, 1]
    assert stream_assignment([5, 4], 1) == [0, 0]
    assert stream_assignment([], 4) == []
    # balanced: no stream ends holding more than the others' maximum plus its last call
    works = [int(x) for x in np.random.default_rng(0).integers(1, 1000, 40)]
    works.sort(reverse=True)
    chosen = stream_assignment(works, 4)
    loads = [sum(w for w, s in zip(works, chosen, strict=True) if s == i) for i in range(4)]
    assert max(loads) - min(loads) <= max(works)


def _table_data(**extra) -> dict:
    grid = [[1e-3, 2e-3], [4e-3, 8e-3]]
    return {
        "lengths": [64, 512],
        "heads": [1, 8],
        **{n: grid for n in ("forward_s", "backward_s", "masked_forward_s", "masked_backward_s")},
        "gather_bytes_per_s": 1e12,
        **extra,
    }


def test_call_table_carries_the_stream_count() -> None:
    assert merging.CallCosts.from_call_table(_table_data(), "t.json").streams == 1
    assert merging.CallCosts.from_call_table(_table_data(streams=3), "t.json").streams == 3
    for bad in (0, 9, 2.5, "4", True):
        with pytest.raises(ValueError, match="t.json: streams must be an integer from 1 to 8"):
            merging.CallCosts.from_call_table(_table_data(streams=bad), "t.json")


def test_stream_count_policy(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)  # only passed along: nothing runs on it
    monkeypatch.delenv("ZELLIGE_ATTENTION_STREAMS", raising=False)
    engine = EngineConfig.from_env()
    monkeypatch.setattr(merging, "costs_for_device", lambda device, call_table=None: None)
    assert merging.streams_for_device(cuda, engine) == 1  # nothing measured: one stream
    table = merging.CallCosts.from_call_table(_table_data(streams=4), "t.json")
    monkeypatch.setattr(merging, "costs_for_device", lambda device, call_table=None: table)
    assert merging.streams_for_device(cuda, engine) == 4
    monkeypatch.setenv("ZELLIGE_ATTENTION_STREAMS", "2")
    assert merging.streams_for_device(cuda, EngineConfig.from_env()) == 2
    assert merging.streams_for_device(cuda, EngineConfig(streams=2)) == 2
    monkeypatch.setenv("ZELLIGE_ATTENTION_STREAMS", "many")
    with pytest.raises(ValueError, match="ZELLIGE_ATTENTION_STREAMS must be an integer"):
        EngineConfig.from_env()
    with pytest.raises(ValueError, match="streams must be an integer from 1 to 8"):
        EngineConfig(streams=9)


def test_streams_leave_cpu_results_unchanged() -> None:
    """On the CPU streams are ignored: the same calls in the same order, bit for bit."""
    lengths = [7, 5, 5, 3, 2]
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    table = SegmentTable.packed(cu, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths) * 2, 4, generator=gen, dtype=torch.float64) for _ in "qkv")
    one = coalesced_attention(q, k, v, table, streams=1)
    for streams in (None, 3):
        assert torch.equal(coalesced_attention(q, k, v, table, streams=streams), one)


def _least_loaded_reference(works: list[int], streams: int) -> list[int]:
    """The assignment written out plainly: each call to the first stream of least work."""
    queued, chosen = [0] * max(1, streams), []
    for work in works:
        i = min(range(len(queued)), key=lambda s: (queued[s], s))
        queued[i] += work
        chosen.append(i)
    return chosen


def test_engine_and_cost_model_share_one_assignment() -> None:
    # The engine's stream_assignment is the C++ one the cost model prices with (one place);
    # both agree with the plain reference on random tables, ties and huge works included.
    rng = np.random.default_rng(13)
    for trial in range(300):
        count, streams = int(rng.integers(0, 40)), int(rng.integers(1, 9))
        high = [4, 1000, 1 << 40][trial % 3]  # few distinct works (ties), many, and huge ones
        works = sorted((int(w) for w in rng.integers(1, high, count)), reverse=True)
        expected = _least_loaded_reference(works, streams)
        assert stream_assignment(works, streams) == expected
        assert list(_core.stream_assignment(works, streams)) == expected


def test_streamed_calls_price_one_stream_as_the_sum() -> None:
    works, seconds = [9, 7, 4, 1], [0.9, 0.75, 0.4, 0.12]
    assert _core.streamed_calls_s(works, seconds, 1, 0.9) == sum(seconds)
    assert _core.streamed_calls_s(works, seconds, 2, 0.0) == sum(seconds)
    # 2 streams: {9, 1} and {7, 4}: the most loaded holds 1.15 s
    assert _core.streamed_calls_s(works, seconds, 2, 1.0) == pytest.approx(1.15)
    assert _core.streamed_calls_s(works, seconds, 2, 0.5) == pytest.approx(
        sum(seconds) - 0.5 * (sum(seconds) - 1.15)
    )
