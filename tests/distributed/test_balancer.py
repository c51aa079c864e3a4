"""zellige.Balancer and the examples on 2 and 4 gloo processes against single-process runs.

One spawn per world size runs every case in one process group. The examples' training (a user's
DiT with cross-attention, a user's MMDiT with joint attention) must give the losses of the same
training in one process without Zellige (float64) under the zellige, knapformer and static-cp
planners and a hand-made plan with ring, Ulysses and hybrid placements. The Balancer's own
contract: routing round trips, both loss normalisations equal their single-process definitions,
ranks without samples take part, and every kind of disagreement between ranks (different
Balancers, ranks at different steps, a pending step started out of order, a bad sample on one
rank) is the same ValueError on every rank, never a hang.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zellige import Strategy, _core, make_placement
from zellige.runtime import end_rank_process, verify

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORLD_SIZES = [2, 4]
STEPS = 2
TOLERANCE = 1e-9  # relative; float64 losses agree to ~1e-15


def hand_made_plan(batch: _core.Batch, cost_model: _core.CostModel) -> _core.Plan:
    """Ring over every rank for the largest sequence, hybrid (Ulysses 2 x ring) for the next on 4
    ranks (Ulysses over every rank on 2), Ulysses over two ranks for the third, the rest whole
    on ranks in turn."""
    world = cost_model.cluster.num_ranks()
    order = sorted(
        range(len(batch.sequences)),
        key=lambda i: -(batch.sequences[i].num_tokens + batch.sequences[i].text_tokens),
    )
    ranks = list(range(world))
    placements = []
    for position, index in enumerate(order):
        sequence_id = batch.sequences[index].id
        if position == 0:
            placements.append(make_placement(sequence_id, Strategy.ring, ranks[::-1], 0))
        elif position == 1 and world >= 4:
            placements.append(make_placement(sequence_id, Strategy.hybrid, ranks, 2))
        elif position == 1:
            placements.append(make_placement(sequence_id, Strategy.ulysses, ranks, 0))
        elif position == 2:
            placements.append(make_placement(sequence_id, Strategy.ulysses, [1, 0], 0))
        else:
            placements.append(make_placement(sequence_id, Strategy.local, [position % world], 0))
    plan = _core.Plan()
    plan.num_ranks = world
    plan.planner = "hand-made"
    plan.placements = placements
    return plan


def _planners(world: int) -> dict[str, object]:
    knapformer = "knapformer:g1n2" if world == 2 else "knapformer:g1n2+g2n1"
    return {
        "zellige": "zellige",
        knapformer: knapformer,
        "static-cp:2": "static-cp:2",
        "hand-made": hand_made_plan,
    }


def _expect_error(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _all_messages(message: str | None, world: int) -> list:
    messages = [None] * world
    dist.all_gather_object(messages, message)
    return messages


def _contract_cases(rank: int, world: int, report: dict) -> None:
    from dit_cross_attention import draw_samples

    import zellige

    # Routing, normalisation and the way back under a plan with every strategy.
    balancer = zellige.Balancer("tiny", planner=hand_made_plan, plan_ahead=False)
    step = balancer.step(draw_samples(rank, 0) if rank != 1 else [])  # rank 1 draws nothing
    held = step.inputs()
    x_S = torch.cat([s.tokens["target"] for s in step.samples] or [torch.zeros(0, 8)])
    back = step.reverse_tokens(held.tokens["target"])
    value_T = held.tokens["target"].double().sum(dim=1)
    samples = [s for r in range(world) if r != 1 for s in draw_samples(r, 0)]
    per_token = sum(float(s.tokens["target"].double().sum()) for s in samples) / sum(
        s.num_tokens for s in samples
    )
    per_sample = sum(
        float(s.tokens["target"].double().sum()) / s.num_tokens for s in samples
    ) / len(samples)
    times = torch.tensor([float(s.values["time"]) for s in samples], dtype=torch.float64)
    chunk_times = held.samples["time"][torch.tensor(step.runtime_step.chunk_num_tokens) > 0]
    expected_times = times[
        step.chunk_sequence_index[torch.tensor(step.runtime_step.chunk_num_tokens) > 0]
    ]
    case = {
        "round_trip": bool(torch.equal(back, x_S)),
        "unpack": [tuple(t.shape) for t in step.unpack(back)]
        == [(s.num_tokens, 8) for s in step.samples],
        "per_token": (step.reduce(step.loss(value_T)), per_token),
        "per_sample": (step.reduce(step.loss(value_T, per="sample")), per_sample),
        "sample_values": bool(torch.equal(chunk_times, expected_times)),
        "strategies": sorted({_core.strategy_name(p) for p in step.plan.placements}),
        "held_tokens": step.runtime_step.num_held_tokens,
    }
    # The chunk tables come from the program's host arrays: the device tables' own answer.
    num_held = step.runtime_step.num_held_tokens
    first = torch.full((step.num_chunks,), num_held, dtype=torch.int64)
    first.scatter_reduce_(0, step.chunk_index.cpu(), torch.arange(num_held), "amin")
    case["chunk_first"] = bool(torch.equal(step._chunk_first.cpu(), first))
    # The same step planned and compiled ahead (a loader worker's way) and started from it.
    prepared = balancer.pipeline.prepare(step.batch, rank, index=0)
    again = balancer.start(prepared)
    case["prepared"] = (
        prepared.program.fingerprint == step.runtime_step.program.fingerprint
        and dataclasses.replace(again.record, plan_ms=0.0)
        == dataclasses.replace(step.record, plan_ms=0.0)
        and bool(torch.equal(again.position_ids, step.position_ids))
        and bool(torch.equal(again.chunk_sequence_index, step.chunk_sequence_index))
        and bool(torch.equal(again._chunk_first, step._chunk_first))
        and float(again.loss(value_T)) == float(step.loss(value_T))
        and float(again.loss(value_T, per="sample")) == float(step.loss(value_T, per="sample"))
    )
    broken = dataclasses.replace(prepared, program=None, error="rank 1: broken")
    prepared_error = _expect_error(lambda: balancer.start(broken if rank == 1 else prepared))
    cases = [None] * world
    dist.all_gather_object(cases, case)
    report["contract"] = cases
    balancer.close()

    # Disagreements: the same ValueError on every rank.
    errors = {}
    errors["different balancers"] = _expect_error(
        lambda: zellige.Balancer("tiny", seed=rank % 2, plan_ahead=False).step(
            draw_samples(rank, 0)
        )
    )
    ahead, behind = (zellige.Balancer("tiny", plan_ahead=False) for _ in range(2))
    ahead.schedule(draw_samples(rank, 0))
    # rank 0 schedules its second step while the others schedule their first
    errors["different steps"] = _expect_error(
        lambda: (ahead if rank == 0 else behind).schedule(draw_samples(rank, 1))
    )
    stale = zellige.Balancer("tiny", plan_ahead=False)
    first, second = (stale.schedule(draw_samples(rank, i)) for i in range(2))
    errors["started out of order"] = _expect_error(
        lambda: (second if rank == world - 1 else first).start()
    )
    other_dtype = draw_samples(0, 0)  # rank 0's draw: never empty
    if rank == 1:
        for sample in other_dtype:
            sample.tokens["noisy"] = sample.tokens["noisy"].double()
    errors["different dtypes"] = _expect_error(
        lambda: zellige.Balancer("tiny", plan_ahead=False).step(other_dtype)
    )
    bad = draw_samples(0, 0)
    if rank == 1:
        bad[0].tokens["noisy"] = bad[0].tokens["noisy"][:-1]
    errors["bad sample"] = _expect_error(
        lambda: zellige.Balancer("tiny", plan_ahead=False).step(bad)
    )
    errors["no samples anywhere"] = _expect_error(
        lambda: zellige.Balancer("tiny", plan_ahead=False).step([])
    )
    errors["unknown planner"] = _expect_error(lambda: zellige.Balancer("tiny", planner="zelige"))
    errors["joint reference"] = _expect_error(lambda: zellige.Balancer("tiny", planner="joint"))
    errors["prepared step error"] = prepared_error
    report["errors"] = {key: _all_messages(message, world) for key, message in errors.items()}


def _compiled_cases(rank: int, world: int, report: dict) -> None:
    """Each example's model compiled whole (fullgraph: any graph break is an error; aot_eager
    runs the ops' fake implementations and registered backward) under a plan with every
    strategy: the same loss and gradients as eager, and no graph break counted."""
    import dit_cross_attention
    import mmdit_joint_attention
    from torch._dynamo.utils import counters

    import zellige

    torch._dynamo.reset()
    counters.clear()
    results = {}
    for example in (dit_cross_attention, mmdit_joint_attention):
        torch.manual_seed(0)
        model = (
            example.TinyDiT() if example is dit_cross_attention else example.TinyMMDiT()
        ).double()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
        spec = zellige.model_spec_from_module(
            model, text_tokens=6, joint_attention=example is mmdit_joint_attention, num_heads=4
        )
        balancer = zellige.Balancer(spec, planner=hand_made_plan, plan_ahead=False)
        worst = 0.0
        for step_index in range(2):
            step = balancer.step(example.draw_samples(rank, step_index))
            held = step.inputs()
            if example is dit_cross_attention:
                args = (
                    held.tokens["noisy"].double(), step.position_ids, held.samples["time"],
                    step.chunk_index, held.text["text"].double(), step.attention,
                    step.cross_attention,
                )  # fmt: skip
            else:
                chunk_V, chunk_L = step.split(step.chunk_index)
                args = (
                    held.tokens["noisy"].double(), step.split(step.position_ids)[0],
                    held.text["text"].double(), held.samples["time"], chunk_V, chunk_L,
                    step.attention, step.join, step.split,
                )  # fmt: skip
            grads = []
            for forward in (model, compiled):
                model.zero_grad()
                out = forward(*args)
                loss = step.loss(out.square().mean(dim=1))
                loss.backward()
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
                grads.append(loss.detach().reshape(1))
            worst = max(worst, float((grads[0] - grads[2]).abs().max()))
            worst = max(worst, float((grads[1] - grads[3]).abs().max()))
        # The routes as ops in a compiled function: there and back is the identity.
        x = torch.randn(sum(s.num_tokens for s in step.samples), 3, dtype=torch.float64)
        there_and_back = torch.compile(
            lambda x, ops=step.ops: ops.reverse_route(ops.route(x, "visual"), "visual"),
            backend="aot_eager",
            fullgraph=True,
        )
        results[example.__name__] = (worst, bool(torch.equal(there_and_back(x), x)))
        balancer.close()
    report["compiled"] = results
    report["graph_breaks"] = dict(counters["graph_break"])


def _worker(rank: int, world: int, port: int, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import dit_cross_attention
    import mmdit_joint_attention

    report: dict = {"losses": {}}
    try:
        for example in (dit_cross_attention, mmdit_joint_attention):
            name = example.__name__
            if rank == 0:
                report["losses"][(name, "single process")] = example.reference_losses(STEPS, world)
            for label, planner in _planners(world).items():
                report["losses"][(name, label)] = example.train(STEPS, planner)
            if example is dit_cross_attention:  # the weights sharded by FSDP2
                report["losses"][(name, "hand-made, fsdp")] = example.train(
                    STEPS, hand_made_plan, fsdp=True
                )
        _contract_cases(rank, world, report)
        if world == 2:  # compiling is the slow part; one world size shows the graph is whole
            _compiled_cases(rank, world, report)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["exception"] = traceback.format_exc()
    if rank == 0:
        queue.put(report)
    end_rank_process()  # together, and without interpreter finalization (runtime/teardown.py)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def report(request):
    world = request.param
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, verify.free_port(), queue), nprocs=world, join=True)
    data = queue.get()
    assert "exception" not in data, data["exception"]
    return world, data


@pytest.mark.parametrize("example", ["dit_cross_attention", "mmdit_joint_attention"])
def test_examples_match_a_single_process(report, example) -> None:
    world, data = report
    reference = data["losses"][(example, "single process")]
    labels = [*_planners(world), *(["hand-made, fsdp"] if example == "dit_cross_attention" else [])]
    for label in labels:
        losses = data["losses"][(example, label)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        assert worst <= TOLERANCE, f"{example} under {label}: {losses} vs {reference}"


def test_routing_and_loss_normalisation(report) -> None:
    world, data = report
    for rank, case in enumerate(data["contract"]):
        assert case["round_trip"] and case["unpack"] and case["sample_values"], rank
        assert case["chunk_first"] and case["prepared"], rank
        for key in ("per_token", "per_sample"):
            got, expected = case[key]
            assert got == pytest.approx(expected, rel=1e-12), (rank, key)
    assert data["contract"][1]["held_tokens"] > 0  # rank 1 drew nothing and still works
    strategies = set(data["contract"][0]["strategies"])
    assert {"ring", "ulysses"} <= strategies
    if world >= 4:
        assert any(name.startswith("hybrid") for name in strategies)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("different balancers", "ranks built different Balancers: seed is 0 on rank 0 and 1 on"),
        ("different dtypes", "tokens['noisy'] is float32 with trailing shape"),
        ("different steps", "ranks are at different steps"),
        ("started out of order", "is the next one"),
        ("bad sample", "rank 1: sample 0: tokens['noisy'] has shape"),
        ("no samples anywhere", "no rank has a sample"),
        ("unknown planner", "unknown planner 'zelige' (allowed:"),
        ("joint reference", "not training"),
        ("prepared step error", "rank 1: broken"),
    ],
)
def test_disagreement_is_one_error_on_every_rank(report, kind, needle) -> None:
    world, data = report
    messages = data["errors"][kind]
    assert len(set(messages)) == 1, messages  # the same message everywhere
    assert messages[0] is not None and needle in messages[0], messages


def test_compiled_models_have_no_graph_break_and_match_eager(report) -> None:
    world, data = report
    if world != 2:
        pytest.skip("compiled on 2 processes only")
    assert data["graph_breaks"] == {}
    for example, (worst, round_trip) in data["compiled"].items():
        assert worst <= 1e-12, f"{example}: compiled differs from eager by {worst:.2e}"
        assert round_trip, example


@pytest.mark.parametrize(
    "script,nproc", [("dit_cross_attention.py", 2), ("mmdit_joint_attention.py", 4)]
)
def test_example_runs_under_torchrun(script, nproc) -> None:
    """As a user runs it: torchrun, gloo, --check against the single-process run."""
    import subprocess

    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            str(EXAMPLES / script), "--steps", "2", "--check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "PASS" in result.stdout
