"""Distributed attention on 2, 3 and 4 gloo processes against single-process attention.

One spawn per world size runs every case in one process group (spawning is what costs on a small
machine). Every case runs as joint attention (MMDiT: each sequence's text tokens then its visual
tokens attend together; text and visual rows compared separately) and, where marked, as self-
plus cross-attention (Wan: text delivered by route_text). Cases: random batches with random
valid plans, and structured ones for the corners: head counts the Ulysses degree does not
divide, lengths the degree does not divide, 1-token and text-heavy sequences (empty chunks and
ring blocks, chunks of text only), ranks with no work, one sequence over every rank,
overlapping rank sets, hybrid. The bound is the one of zellige.runtime.verify (8x the reference's
own rounding, measured by re-evaluating it with the keys in another order, + 4 unit roundoffs).
A corrupted route must FAIL, and a plan that does not fit (or a text too long for any rank, or
one rank's loader error) must raise the same error everywhere.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zellige import Strategy, _core, make_placement, sequence_from_tokens
from zellige.runtime import compile_step, end_rank_process, load_step, verify
from zellige.runtime.verify import CheckConfig, check_rank

WORLD_SIZES = [2, 3, 4]
NUM_RANDOM_CASES = 4


def _batch(lengths_and_sources: list[tuple[int, ...]]) -> _core.Batch:
    """(visual tokens, source rank[, text tokens]) per sequence; text defaults to 3."""
    batch = _core.Batch()
    batch.sequences = [
        sequence_from_tokens(10 + i, "video", spec[0], spec[2] if len(spec) > 2 else 3, spec[1])
        for i, spec in enumerate(lengths_and_sources)
    ]
    return batch


def _joint(cfg: CheckConfig) -> CheckConfig:
    cfg.joint_attention = True
    return cfg


def _cross(cfg: CheckConfig) -> CheckConfig:
    cfg.cross_attention = True
    return cfg


def _plan(world: int, placements: list[tuple[int, str, list[int], int]]) -> _core.Plan:
    """placements: (batch position, strategy, ranks, ulysses degree for hybrid)."""
    plan = _core.Plan()
    plan.num_ranks = world
    plan.planner = "test"
    plan.placements = [
        make_placement(10 + i, getattr(Strategy, strategy), ranks, u)
        for i, strategy, ranks, u in placements
    ]
    return plan


def _random_case(rng: random.Random, world: int, num_heads: int):
    num_sequences = rng.randint(1, 6)
    batch = _batch(
        [
            (
                1 if rng.random() < 0.2 else rng.randint(2, 40),
                rng.randrange(world),
                rng.choice([0, 1, 4, 17]),
            )
            for _ in range(num_sequences)
        ]
    )
    placements = []
    for i in range(num_sequences):
        ranks = rng.sample(range(world), world)
        choice = rng.choice(["local", "ulysses", "ring", "hybrid"])
        max_u = min(world, num_heads)
        if choice == "ulysses" and max_u >= 2:
            placements.append((i, "ulysses", ranks[: rng.randint(2, max_u)], 0))
        elif choice == "hybrid" and world >= 4 and num_heads >= 2:
            u = rng.randint(2, min(max_u, world // 2))
            r = rng.randint(2, world // u)
            placements.append((i, "hybrid", ranks[: u * r], u))
        elif choice == "ring":
            placements.append((i, "ring", ranks[: rng.randint(2, world)], 0))
        else:
            placements.append((i, "local", ranks[:1], 0))
    return batch, _plan(world, placements)


def _cases(world: int) -> list[tuple[str, _core.Batch, _core.Plan, CheckConfig]]:
    """The same list on every rank (deterministic)."""
    all_ranks = list(range(world))
    reversed_ranks = all_ranks[::-1]
    cases = []
    # Ulysses degrees 2..min(W, 4) against 5 heads (5 = 3 + 2, 2 + 2 + 1, ...), odd lengths.
    uneven = (
        _batch([(7, 0, 5), (13, world - 1, 2), (1, 1 % world, 0), (11, 0, 6)]),
        _plan(
            world,
            [
                (0, "ulysses", reversed_ranks[: min(world, 4)], 0),
                (1, "ring", all_ranks, 0),
                (2, "local", [world - 1], 0),
                (3, "ulysses", all_ranks[:2], 0),
            ],
        ),
    )
    cases.append(
        ("uneven-heads-and-lengths", *uneven, _joint(CheckConfig(num_heads=5, head_dim=8)))
    )
    cases.append(("uneven-heads-cross", *uneven, _cross(CheckConfig(num_heads=5, head_dim=8))))
    # 1-token sequences, with and without text: empty Ulysses chunks and empty ring blocks.
    placements = [(0, "ulysses", all_ranks[:2], 0), (1, "ring", reversed_ranks, 0)]
    if world >= 4:
        placements.append((2, "hybrid", all_ranks[:4], 2))
    else:
        placements.append((2, "local", [1], 0))
    cases.append(
        (
            "one-token-sequences",
            _batch([(1, 0, 0), (1, world - 1, 2), (2, 0, 0)]),
            _plan(world, placements),
            _joint(CheckConfig(num_heads=4, head_dim=8)),
        )
    )
    # Text-heavy: far more text than visual tokens, so whole chunks and ring blocks are text.
    heavy = [(0, "ulysses", all_ranks, 0), (1, "ring", reversed_ranks, 0)]
    heavy.append((2, "hybrid", all_ranks[:4], 2) if world >= 4 else (2, "ring", all_ranks[:2], 0))
    cases.append(
        (
            "text-heavy",
            _batch([(1, 0, 30), (3, world - 1, 17), (2, 1, 11)]),
            _plan(world, heavy),
            _joint(CheckConfig(num_heads=max(world, 3), head_dim=8)),
        )
    )
    # One sequence over every rank, three ways; other ranks' loaders hold the sources.
    one = [(0, "ulysses", reversed_ranks, 0), (1, "ring", all_ranks, 0)]
    if world >= 4:
        one.append((2, "hybrid", all_ranks[1:] + all_ranks[:1], 2))
    else:
        one.append((2, "local", [0], 0))
    cases.append(
        (
            "one-sequence-over-every-rank",
            _batch([(37, world - 1, 4), (29, 0, 9), (23, 1, 1)]),
            _plan(world, one),
            _joint(CheckConfig(num_heads=max(world, 3), head_dim=8)),
        )
    )
    if world > 2:  # ranks without any work
        idle = (
            _batch([(9, 0), (6, world - 1), (5, world - 1)]),
            _plan(world, [(0, "ring", [1, 0], 0), (1, "ulysses", [0, 1], 0), (2, "local", [1], 0)]),
        )
        cases.append(("idle-ranks", *idle, _joint(CheckConfig(num_heads=3, head_dim=8))))
        cases.append(("idle-ranks-cross", *idle, _cross(CheckConfig(num_heads=3, head_dim=8))))
    # Overlapping rank sets; two ring sequences over the same ranks in different orders (their
    # blocks share P2P messages per peer) and a hybrid overlapping both.
    overlap = [
        (0, "ring", all_ranks, 0),
        (1, "ring", reversed_ranks, 0),
        (2, "ulysses", all_ranks[: min(world, 3)], 0),
        (3, "local", [world - 1], 0),
    ]
    if world >= 4:
        overlap.append((4, "hybrid", reversed_ranks[:4], 2))
    overlapping = (
        _batch([(19, 0, 7), (17, 1, 0), (12, world - 1, 5), (4, 0, 2), (21, 1, 8)][: len(overlap)]),
        _plan(world, overlap),
    )
    cases.append(
        ("overlapping-rank-sets", *overlapping, _joint(CheckConfig(num_heads=3, head_dim=8)))
    )
    cases.append(("overlapping-cross", *overlapping, _cross(CheckConfig(num_heads=3, head_dim=8))))
    rng = random.Random(1000 + world)
    for i in range(NUM_RANDOM_CASES):
        heads = rng.randint(1, 7)
        batch, plan = _random_case(rng, world, heads)
        mode = _joint if i % 2 == 0 else _cross
        cases.append((f"random-{i}", batch, plan, mode(CheckConfig(num_heads=heads, head_dim=8))))
    if world == 2:  # half precision through the same path
        batch, plan = _random_case(rng, world, 4)
        cfg = _joint(CheckConfig(num_heads=4, dtype="bfloat16"))
        cases.append(("random-bf16", batch, plan, cfg))
    return cases


def _corrupting(prepare):
    """prepare_step whose route of all tokens misplaces held tokens: the check must FAIL."""

    def corrupted(*args, **kwargs):
        step = prepare(*args, **kwargs)
        route = step.routes["all"]
        if route.recv_index.numel() >= 2:
            route.recv_index = route.recv_index.roll(1)
        return step

    return corrupted


def _worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    verify.init_process_group(rank, world, port, "cpu", timeout=timedelta(seconds=120))
    report = {"cases": [], "corrupted": None, "bad_plan": [], "disagree": None}
    report["loader_error"] = None
    for name, batch, plan, cfg in _cases(world):
        result = check_rank(batch, plan, cfg)
        report["cases"].append((name, result.errors, result.passed))

    name, batch, plan, cfg = _cases(world)[0]
    original = verify.prepare_step
    verify.prepare_step = _corrupting(original)
    report["corrupted"] = check_rank(batch, plan, cfg).passed
    verify.prepare_step = original

    # Plans that do not fit: wrong world size, Ulysses degree above the head count, unknown id.
    bad = []
    wrong_world = _plan(world + 1, [(0, "local", [0], 0)])
    bad.append(("world-size", _batch([(5, 0)]), wrong_world, CheckConfig(num_heads=2)))
    too_wide = _plan(world, [(0, "ulysses", list(range(world)), 0)])
    bad.append(("heads", _batch([(5, 0)]), too_wide, CheckConfig(num_heads=1)))
    unknown = _plan(world, [(1, "local", [0], 0)])
    bad.append(("unplaced-sequence", _batch([(5, 0)]), unknown, CheckConfig(num_heads=2)))
    # A text no rank can hold (joint: it is part of the attended tokens); only rank 1 holds it.
    huge = _plan(world, [(0, "local", [0], 0), (1, "local", [1], 0)])
    huge_text = _batch([(5, 0, 2), (5, 1, 2**40)])
    bad.append(("text-too-long", huge_text, huge, _joint(CheckConfig(num_heads=2))))
    for label, batch, plan, cfg in bad:
        try:
            check_rank(batch, plan, cfg)
            message = None
        except ValueError as exc:
            message = str(exc)
        messages = [None] * world
        dist.all_gather_object(messages, message)
        report["bad_plan"].append((label, messages))

    # Rank 0 was handed a different plan than the others: everyone must refuse, nobody hang.
    batch = _batch([(6, 0)])
    plan = _plan(world, [(0, "local", [0 if rank == 0 else 1], 0)])
    try:
        check_rank(batch, plan, CheckConfig(num_heads=2))
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    report["disagree"] = messages

    # One rank's loader found its tensors do not match the program: everyone raises its message.
    program = compile_step(_batch([(6, 0)]), _plan(world, [(0, "local", [0], 0)]), 2, rank)
    try:
        load_step(program, "cpu", error="loader mismatch on rank 1" if rank == 1 else None)
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    report["loader_error"] = messages
    if rank == 0:
        queue.put(report)
    end_rank_process()  # together, and without interpreter finalization (runtime/teardown.py)


def _ragged_worker(rank: int, world: int, port: int, queue) -> None:
    """Every case with the math kernel, its tables as dense groups and then as ragged calls (the
    math ragged kernel standing in for cuDNN's): which cases pass, and how many ragged calls."""
    import os

    from zellige.runtime.ragged import MathRaggedKernel

    torch.set_num_threads(1)
    ragged_calls = [0]
    forward = MathRaggedKernel.forward_into

    def counted(self, *args):
        ragged_calls[0] += 1
        return forward(self, *args)

    MathRaggedKernel.forward_into = counted
    verify.init_process_group(rank, world, port, "cpu", timeout=timedelta(seconds=120))
    passed = {}
    for merge in ("groups", "ragged"):
        os.environ["ZELLIGE_ATTENTION_MERGE"] = merge
        for name, batch, plan, cfg in _cases(world):
            cfg.backend = "math"
            passed[merge, name] = check_rank(batch, plan, cfg).passed
    counts = [None] * world
    dist.all_gather_object(counts, ragged_calls[0])
    if rank == 0:
        queue.put((passed, counts))
    end_rank_process()


def test_ragged_tables_match_single_process_attention() -> None:
    """The step's local, exchanged and cross-attention tables as ragged calls pass every case the
    same kernel passes as dense groups (the math kernel's own rounding misses the bound on a few
    1-token cases either way)."""
    world = 3
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ragged_worker, args=(world, verify.free_port(), queue), nprocs=world, join=True)
    passed, counts = queue.get()
    names = [name for merge, name in passed if merge == "groups"]
    assert sum(passed["groups", name] for name in names) >= 10
    failed = [name for name in names if passed["groups", name] and not passed["ragged", name]]
    assert not failed, f"ragged tables, world {world}: {failed}"
    assert all(count > 0 for count in counts), counts


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def report(request):
    world = request.param
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, verify.free_port(), queue), nprocs=world, join=True)
    return world, queue.get()


def test_matches_single_process_attention(report) -> None:
    world, data = report
    failed = [
        f"{name}: "
        + ", ".join(f"{t} {e:.2e} > {b:.2e}" for t, (e, _, b) in errors.items() if e > b)
        for name, errors, passed in data["cases"]
        if not passed
    ]
    assert not failed, f"world {world}: " + "; ".join(failed)
    assert len(data["cases"]) >= 10
    names = {name for name, _, _ in data["cases"]}
    assert {"text-heavy", "one-token-sequences", "overlapping-rank-sets"} <= names
    checked = {t for _, errors, _ in data["cases"] for t in errors}
    assert {"o.text", "dk.text", "cross.dk"} <= checked  # text rows and route_text were compared


def test_corrupted_layout_fails(report) -> None:
    _, data = report
    assert data["corrupted"] is False


def test_bad_plan_raises_same_error_on_every_rank(report) -> None:
    _, data = report
    expected = {
        "world-size": "ranks",
        "heads": "head",
        "unplaced-sequence": "sequence",
        "text-too-long": "text_tokens must be in [0, 1048576]",  # the batch limit comes first
    }
    for label, messages in data["bad_plan"]:
        assert messages[0] is not None, label
        assert all(m == messages[0] for m in messages), (label, messages)
        assert expected[label] in messages[0], (label, messages[0])


def test_ranks_that_disagree_all_refuse(report) -> None:
    _, data = report
    messages = data["disagree"]
    assert all(m is not None and "disagree" in m for m in messages), messages


def test_one_loader_error_raises_on_every_rank(report) -> None:
    _, data = report
    messages = data["loader_error"]
    assert all(m == "loader mismatch on rank 1" for m in messages), messages
