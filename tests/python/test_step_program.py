"""The step program from Python: it pickles as one C++ binary form, refuses bytes that are not
one, and a one-rank step routes and attends like single-process attention (joint and cross)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from zellige import Strategy, _core, make_placement, sequence_from_tokens
from zellige.runtime import (
    attention_fn,
    compile_step,
    cross_attention_fn,
    prepare_step,
    reverse_route,
    route,
    route_text,
    verify,
)


def _case(world: int = 2):
    batch = _core.Batch()
    batch.sequences = [
        sequence_from_tokens(5, "video", 7, 3, 0),
        sequence_from_tokens(6, "image", 4, 0, world - 1),
        sequence_from_tokens(7, "video", 9, 5, 0),
    ]
    plan = _core.Plan(planner="hand", num_ranks=world)
    plan.placements = [
        make_placement(5, Strategy.ring, list(range(world))[::-1]),
        make_placement(6, Strategy.local, [0]),
        make_placement(7, Strategy.ulysses, list(range(world))),
    ]
    return batch, plan


@pytest.mark.parametrize("joint", [False, True], ids=["cross", "joint"])
def test_program_pickles_through_its_binary_form(joint: bool) -> None:
    batch, plan = _case()
    for rank in range(2):
        program = compile_step(batch, plan, 3, rank, joint_attention=joint)
        again = pickle.loads(pickle.dumps(program))
        assert again == program and again.to_bytes() == program.to_bytes()
        assert again.fingerprint == program.fingerprint
        assert _core.StepProgram.from_bytes(program.to_bytes()) == program
        assert again.route.recv_index.tolist() == program.route.recv_index.tolist()
    other = compile_step(batch, plan, 3, 0, joint_attention=not joint)
    assert other != compile_step(batch, plan, 3, 0, joint_attention=joint)
    assert other.fingerprint != compile_step(batch, plan, 3, 0, joint_attention=joint).fingerprint


def test_bytes_that_are_not_a_program_are_refused() -> None:
    batch, plan = _case()
    data = compile_step(batch, plan, 3, 0).to_bytes()
    for bad in (data[:-3], data + b"\0", b"", b"not a program at all"):
        with pytest.raises(ValueError, match="step program"):
            _core.StepProgram.from_bytes(bad)


def test_mismatched_plans_are_value_errors() -> None:
    batch, plan = _case()
    with pytest.raises(ValueError, match="rank 5"):
        compile_step(batch, plan, 3, 5)
    with pytest.raises(ValueError, match="head"):
        compile_step(batch, plan, 1, 0)  # Ulysses over 2 ranks needs 2 heads
    # Within the batch limits (2^32 tokens, 2^20 text tokens: issue 17), but more attended
    # tokens than the program's int32 positions hold.
    batch.sequences = [*batch.sequences[:2], sequence_from_tokens(7, "video", 2**31, 5, 0)]
    with pytest.raises(ValueError, match="2\\^31"):
        compile_step(batch, plan, 3, 0, joint_attention=True)


@pytest.fixture
def one_process_group():
    verify.init_process_group(0, 1, verify.free_port(), "cpu")
    yield
    dist.destroy_process_group()


def _assert_cross_attention(out, x, text_XE, batch) -> None:
    """Each sequence's rows of `out` are its queries' attention to its own text (zero without
    text), as single-process SDPA computes it."""
    start = text_at = 0
    for s in batch.sequences:
        q = x[start : start + s.num_tokens].transpose(0, 1)
        kv = text_XE[text_at : text_at + s.text_tokens].transpose(0, 1)
        want = (
            F.scaled_dot_product_attention(q, kv, kv).transpose(0, 1)
            if s.text_tokens
            else torch.zeros_like(q.transpose(0, 1))
        )
        torch.testing.assert_close(out[start : start + s.num_tokens], want, rtol=0, atol=1e-13)
        start += s.num_tokens
        text_at += s.text_tokens


def _one_rank_step(joint: bool, requires_grad: bool = False):
    """(batch, step, generator, lengths, x): _case's batch on a world of one, every sequence
    whole on rank 0, and random rows of its attended lengths (text first where joint)."""
    batch, plan = _case(world=1)
    plan.placements = [make_placement(s.id, Strategy.local, [0]) for s in batch.sequences]
    step = prepare_step(batch, plan, 2, "cpu", joint_attention=joint)
    gen = torch.Generator().manual_seed(0)
    lengths = [(s.text_tokens if joint else 0) + s.num_tokens for s in batch.sequences]
    x = torch.randn(
        sum(lengths), 2, 4, generator=gen, dtype=torch.float64, requires_grad=requires_grad
    )
    return batch, step, gen, lengths, x


def _whole_attention(x, lengths):
    """Single-process attention of each sequence of x (packed back to back) on its own."""
    parts, start = [], 0
    for length in lengths:
        part = x[start : start + length].transpose(0, 1)
        parts.append(F.scaled_dot_product_attention(part, part, part).transpose(0, 1))
        start += length
    return torch.cat(parts)


@pytest.mark.parametrize("joint", [False, True], ids=["self+cross", "joint"])
def test_one_rank_step_equals_single_process_attention(joint: bool, one_process_group) -> None:
    """World of one: routes are permutations into held order, attention is whole sequences."""
    batch, step, gen, lengths, x = _one_rank_step(joint)
    held = route(x, step)
    o = reverse_route(attention_fn(step)(held, held, held), step)
    torch.testing.assert_close(o, _whole_attention(x, lengths), rtol=0, atol=1e-13)
    if joint:  # text tokens are held tokens: (k, 0, 0), modality 1
        assert step.text_index.numel() == sum(s.text_tokens for s in batch.sequences)
        assert (step.modality[step.text_index] == 1).all()
        assert (step.position_ids[step.text_index][:, 1:] == 0).all()
        return
    text_XE = torch.randn(8, 2, 4, generator=gen, dtype=torch.float64)  # 3 + 0 + 5 rows
    routed = route_text(text_XE, step)
    out = reverse_route(cross_attention_fn(step)(held, routed, routed), step)
    _assert_cross_attention(out, x, text_XE, batch)


@pytest.mark.parametrize("joint", [False, True], ids=["self+cross", "joint"])
def test_one_rank_step_runs_its_tables_as_ragged_calls(
    joint: bool, one_process_group, monkeypatch
) -> None:
    """With merge="ragged" the step's local table (three lengths) and cross-attention table (two
    text lengths) each run as one ragged call, forward and backward, and attention and its
    gradients equal single-process attention (the math ragged kernel as the engine's)."""
    from zellige.runtime.ragged import MathRaggedKernel

    calls = {"forward_into": 0, "backward_into": 0}
    for name in calls:
        original = getattr(MathRaggedKernel, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(MathRaggedKernel, name, counted)
    monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", "ragged")
    batch, step, gen, lengths, x = _one_rank_step(joint, requires_grad=True)
    weight = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    held = route(x, step)
    o = reverse_route(attention_fn(step, backend="math")(held, held, held), step)
    (grad,) = torch.autograd.grad((o * weight).sum(), x)
    assert calls == {"forward_into": 1, "backward_into": 1}
    x_ref = x.detach().requires_grad_()
    want = _whole_attention(x_ref, lengths)
    (grad_want,) = torch.autograd.grad((want * weight).sum(), x_ref)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-13)
    torch.testing.assert_close(grad, grad_want, rtol=0, atol=1e-12)
    if joint:
        return
    text_XE = torch.randn(8, 2, 4, generator=gen, dtype=torch.float64)  # 3 + 0 + 5 rows
    out = reverse_route(
        cross_attention_fn(step, backend="math")(held, *(route_text(text_XE, step),) * 2), step
    )
    assert calls["forward_into"] == 2  # the cross-attention table: one more ragged call
    _assert_cross_attention(out, x, text_XE, batch)


def test_loader_tensors_that_do_not_match_the_program_are_an_error() -> None:
    """A plan compiled for another batch: the loader's tensors have other sizes than the program
    expects; assemble_step hands that to load_step, which raises it on every rank."""
    from zellige.data import StepDataset
    from zellige.model import model_preset
    from zellige.train.step import _source_error

    dataset = StepDataset(
        model=model_preset("tiny-cpu"),
        recipe="tiny",
        planner="dp-cost",
        rank=0,
        num_ranks=2,
        gpus_per_node=2,
        seed=0,
    )
    data = dataset[0]
    assert data.error is None and _source_error(data) is None
    data.source_noisy_TC = data.source_noisy_TC[1:]
    assert "latent tokens" in _source_error(data)
    data = dataset[0]
    data.source_text_XE = torch.cat([data.source_text_XE, data.source_text_XE[:1]])
    assert "text rows" in _source_error(data)
