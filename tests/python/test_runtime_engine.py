"""The engine's explicit configuration and seams: EngineConfig (the only reader of the
ZELLIGE_ATTENTION_* overrides), the backend it chooses for a step's tables, and an injected
transport carrying a step's exchanges, checked against single-process attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zellige import Strategy, _core, make_placement, sequence_from_tokens
from zellige.runtime import (
    EngineConfig,
    SegmentTable,
    Transport,
    attention_fn,
    prepare_step,
    reverse_route,
    route,
)
from zellige.runtime.backends import DenseBackend, RaggedBackend, choose_backend


def test_from_env_reads_every_override() -> None:
    env = {
        "ZELLIGE_ATTENTION_MERGE": "groups",
        "ZELLIGE_ATTENTION_BACKEND": "math",
        "ZELLIGE_ATTENTION_STREAMS": "3",
        "ZELLIGE_ATTENTION_KEY_SPLIT": "0",
        "ZELLIGE_ATTENTION_CALLS": "calls.json",
    }
    assert EngineConfig.from_env(env) == EngineConfig(
        merge="groups", backend="math", streams=3, key_split=0, call_table="calls.json"
    )
    assert EngineConfig.from_env({}) == EngineConfig()
    assert EngineConfig.from_env({"ZELLIGE_ATTENTION_MERGE": ""}).merge == "auto"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("ZELLIGE_ATTENTION_MERGE", "padded", "ZELLIGE_ATTENTION_MERGE='padded'"),
        ("ZELLIGE_ATTENTION_STREAMS", "9", "ZELLIGE_ATTENTION_STREAMS must be"),
        ("ZELLIGE_ATTENTION_KEY_SPLIT", "-1", "ZELLIGE_ATTENTION_KEY_SPLIT must be"),
        ("ZELLIGE_ATTENTION_BACKEND", "fast", "unknown attention backend 'fast'"),
    ],
    ids=["merge", "streams", "key-split", "backend"],
)
def test_from_env_names_a_bad_override(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_env({name: value})


def test_engine_config_refuses_bad_values() -> None:
    for bad in (
        {"merge": "padded"},
        {"backend": "fast"},
        {"streams": 0},
        {"streams": 9},
        {"key_split": -1},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    assert EngineConfig().replace(merge="ragged").merge == "ragged"


def test_the_backend_follows_the_engine() -> None:
    """One decision for a table: ragged under merge="ragged" with the math oracle, dense groups
    under "groups"; a step's tables run plain groups when not ragged."""
    q = torch.randn(2 * 10, 4, dtype=torch.float64)
    table = SegmentTable.build([0, 6], [0, 6], [3, 7], [3, 7], [2, 2])
    ragged = choose_backend(table, q, q, EngineConfig(merge="ragged"), backend="math")
    groups = choose_backend(table, q, q, EngineConfig(merge="groups"), backend="math")
    assert isinstance(ragged, RaggedBackend) and ragged.name == "ragged"
    assert type(groups) is DenseBackend and groups.kernel.name == "math"
    plain = choose_backend(table, q, q, EngineConfig(backend="math"), plain_groups=True)
    assert type(plain) is DenseBackend and plain.streams == 1 and plain.key_split == 0
    o_ragged, lse_ragged = ragged.forward(q, q, q)
    o_groups, lse_groups = groups.forward(q, q, q)
    torch.testing.assert_close(o_ragged, o_groups, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse_ragged, lse_groups, rtol=0, atol=1e-14)


class _Loopback(Transport):
    """A world of one without a process group: every exchange returns what it sends (a rank's
    all_to_all to itself), and each call is counted."""

    def __init__(self) -> None:
        self.calls = 0

    def all_to_all_rows(self, send, send_splits, recv_splits, group, async_op=False):
        assert send_splits == recv_splits
        self.calls += 1
        return send.clone(), None

    def p2p(self, sends, recvs, global_ranks, group, tag):
        raise AssertionError("a world of one sends no ring messages")


def _one_rank(engine: EngineConfig, transport: Transport):
    batch = _core.Batch()
    batch.sequences = [
        sequence_from_tokens(5, "video", 7, 3, 0),
        sequence_from_tokens(6, "image", 4, 0, 0),
        sequence_from_tokens(7, "video", 9, 5, 0),
    ]
    plan = _core.Plan(planner="hand", num_ranks=1)
    plan.placements = [make_placement(s.id, Strategy.local, [0]) for s in batch.sequences]
    step = prepare_step(batch, plan, 2, "cpu", rank=0, engine=engine, transport=transport)
    lengths = [s.num_tokens for s in batch.sequences]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), 2, 4, generator=gen, dtype=torch.float64)
    return step, lengths, x


def _whole_attention(x, lengths):
    parts, start = [], 0
    for length in lengths:
        part = x[start : start + length].transpose(0, 1)
        parts.append(F.scaled_dot_product_attention(part, part, part).transpose(0, 1))
        start += length
    return torch.cat(parts)


@pytest.mark.parametrize("merge", ["groups", "ragged"])
def test_a_step_runs_its_engine_over_its_transport(merge: str, monkeypatch) -> None:
    """The step keeps the engine and transport it was built with: its routes go through the
    injected transport, its tables run the engine's backend, and the result is single-process
    attention of every sequence."""
    from zellige.runtime.ragged import MathRaggedKernel

    ragged_calls = []
    forward_into = MathRaggedKernel.forward_into

    def counted(self, *args):
        ragged_calls.append(1)
        return forward_into(self, *args)

    monkeypatch.setattr(MathRaggedKernel, "forward_into", counted)
    monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", "groups" if merge == "ragged" else "ragged")
    transport = _Loopback()
    step, lengths, x = _one_rank(EngineConfig(merge=merge, backend="math"), transport)
    assert step.engine.merge == merge and step.transport is transport
    held = route(x, step)
    o = reverse_route(attention_fn(step, backend="math")(held, held, held), step)
    assert transport.calls == 2  # the route there and back
    assert len(ragged_calls) == (1 if merge == "ragged" else 0)
    torch.testing.assert_close(o, _whole_attention(x, lengths), rtol=0, atol=1e-13)


def _equal_lengths_step(engine: EngineConfig, joint: bool):
    """One rank holding three sequences of one length (a micro-batch of one bucket), with text
    joining attention where `joint`: its local table is one dense call."""
    batch = _core.Batch()
    batch.sequences = [sequence_from_tokens(i, "video", 12, 3 if joint else 0, 0) for i in range(3)]
    plan = _core.Plan(planner="hand", num_ranks=1)
    plan.placements = [make_placement(s.id, Strategy.local, [0]) for s in batch.sequences]
    return prepare_step(
        batch, plan, 2, "cpu", rank=0, engine=engine, transport=_Loopback(),
        joint_attention=joint,
    )  # fmt: skip


@pytest.mark.parametrize("joint", [False, True], ids=["self", "joint"])
def test_a_table_of_one_dense_call_runs_ragged_under_auto(joint: bool, monkeypatch) -> None:
    """Merge "auto" runs a step's table of equal lengths (one dense call, which cuDNN would plan
    anew for every new shape) as one ragged call where a trusted ragged kernel exists, as the
    cost model prices it (RAGGED_MIN_CALLS); the math oracle stands in for the cuDNN frontend.
    Outputs are single-process attention's."""
    from zellige.runtime import backends

    monkeypatch.setattr(backends, "AUTO_RAGGED_KERNELS", ("math",))
    step = _equal_lengths_step(EngineConfig(merge="auto", backend="math"), joint)
    assert step.local_table.num_calls == 1
    lengths = [15 if joint else 12] * 3
    gen = torch.Generator().manual_seed(1)
    held = torch.randn(sum(lengths), 2, 4, generator=gen, dtype=torch.float64)
    o = attention_fn(step, backend="math")(held, held, held)
    chosen = [
        v for v in step.local_table.merged.values() if isinstance(v, backends.AttentionBackend)
    ]
    assert len(chosen) == 1 and isinstance(chosen[0], RaggedBackend)
    # the held order groups each sequence's tokens: attention per sequence, as one process
    order = torch.argsort(torch.from_numpy(step.program.token_chunk_index), stable=True)
    want = torch.empty_like(held)
    want[order] = _whole_attention(held[order], lengths)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("merge", ["auto", "groups"])
def test_prepared_step_tables_are_the_first_layers_choice(merge: str, monkeypatch) -> None:
    """prepare_step_tables makes (and builds: the ragged kernel's prepare) the choice the first
    layer's attention would, so that layer finds it and makes none; the results are unchanged."""
    from zellige.runtime import backends
    from zellige.runtime.ragged import MathRaggedKernel

    monkeypatch.setattr(backends, "AUTO_RAGGED_KERNELS", ("math",))
    prepared = []
    prepare = MathRaggedKernel.prepare

    def counted(self, *args):
        prepared.append(1)
        return prepare(self, *args)

    monkeypatch.setattr(MathRaggedKernel, "prepare", counted)
    step, lengths, x = _one_rank(EngineConfig(merge=merge, backend="math"), _Loopback())
    backends.prepare_step_tables(step, torch.float64, 4, backend="math")

    def choices() -> dict:
        merged = step.local_table.merged
        return {k: v for k, v in merged.items() if isinstance(v, backends.AttentionBackend)}

    made = choices()
    assert len(prepared) == (1 if merge == "auto" else 0)
    kind = RaggedBackend if merge == "auto" else DenseBackend
    assert [type(v) for v in made.values()] == [kind]
    held = route(x, step)
    o = reverse_route(attention_fn(step, backend="math")(held, held, held), step)
    assert choices() == made  # found, not made again
    assert len(prepared) == (1 if merge == "auto" else 0)
    torch.testing.assert_close(o, _whole_attention(x, lengths), rtol=0, atol=1e-13)
