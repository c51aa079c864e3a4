"""Balancer.global_step on 2 gloo processes: a user's loop (the cross-attention example's model,
sharded by FSDP2) that runs a global batch as K planned micro-batches with gradient accumulation
gets the loss and gradients of one single-process step over the whole global batch (float64),
per token and per sample, for K = 1..3; and a loop whose loader planned the global batch ahead
(StepPipeline.prepare_global, Balancer.start_global) gets the same micro-batches."""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from zellige.runtime import end_rank_process, verify

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORLD = 2
COUNTS = (1, 2, 3)
RELATIVE_BOUND = 1e-12  # float64: micro-batches change only the summation order


def _samples(rank: int) -> list:
    """This rank's share of the global batch: three of the example's draws."""
    from dit_cross_attention import draw_samples

    return [s for step in range(3) for s in draw_samples(rank, step)]


def _model():
    from dit_cross_attention import TinyDiT

    torch.manual_seed(0)
    return TinyDiT().double()


def _velocity_error(model, step, held):
    velocity_TC = model(
        held.tokens["noisy"].double(),
        step.position_ids,
        held.samples["time"],
        step.chunk_index,
        held.text["text"].double(),
        step.attention,
        step.cross_attention,
    )
    return (velocity_TC - held.tokens["target"].double()).square().mean(dim=1)


def _balancer(count: int, per: str):
    import zellige
    from zellige import _core
    from zellige.pipeline import StepPipeline

    spec = zellige.model_spec_from_module(_model(), text_tokens=6, num_heads=4)
    balancer = zellige.Balancer(spec, plan_ahead=False)
    if count == 1:
        return balancer
    # the tiny model never fills the memory floor: a round-robin cut, each micro-batch placed by
    # the zellige planner (every rank computes the same)
    batch = balancer.global_step(_samples(dist.get_rank())).batch
    ids = [s.id for s in batch.sequences]
    cut = [ids[k::count] for k in range(count)]
    fixed = _core.place_micro_batches("zellige", batch, cut, balancer.cost_model)
    pipeline = StepPipeline(spec, balancer.cost_model, global_planner=fixed)
    return zellige.Balancer.from_pipeline(pipeline, plan_ahead=False)


def _accumulated(count: int, per: str) -> dict:
    """One optimizer step's gradients over the planned micro-batches (the documented loop)."""
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    balancer = _balancer(count, per)
    global_step = balancer.global_step(_samples(dist.get_rank()))
    loss_sum, seen = 0.0, []
    for step in global_step:
        held = step.inputs()
        loss = step.loss(_velocity_error(model, step, held), per=per)
        (loss * step.num_ranks).backward()  # FSDP averages over ranks: a sum
        loss_sum += step.reduce(loss)
        seen.append((step.micro_batch, step.num_micro_batches))
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    # the same micro-batches planned and compiled ahead, as a loader worker would
    prepared = balancer.pipeline.prepare_global(global_step.batch, dist.get_rank(), index=0)
    ahead = [
        (step.runtime_step.program.fingerprint, step.num_global_tokens, step.is_last)
        for step in balancer.start_global(prepared)
    ]
    now = [
        (step.runtime_step.program.fingerprint, step.num_global_tokens, step.is_last)
        for step in balancer.global_step(_samples(dist.get_rank()))
    ]
    return {
        "loss": loss_sum,
        "grads": grads,
        "micro_batches": len(global_step),
        "seen": seen,
        "ahead_matches": ahead == now,
    }


def _reference(per: str) -> dict:
    """Every rank's samples in one process, each attending whole: one step's loss, gradients."""
    from dit_cross_attention import sdpa

    model = _model()
    samples = [s for rank in range(WORLD) for s in _samples(rank)]
    total_tokens = sum(s.num_tokens for s in samples)
    loss = torch.zeros((), dtype=torch.float64)
    for s in samples:
        t, h, w = s.grid_thw
        grid = torch.stack(torch.meshgrid(*map(torch.arange, (t, h, w)), indexing="ij"), -1)
        velocity = model(
            s.tokens["noisy"].double(),
            grid.reshape(-1, 3),
            s.values["time"][None],
            torch.zeros(s.num_tokens, dtype=torch.int64),
            s.text["text"].double(),
            sdpa,
            sdpa,
        )
        error = (velocity - s.tokens["target"].double()).square().mean(dim=1)
        loss = loss + (
            error.sum() / total_tokens if per == "token" else error.mean() / len(samples)
        )
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _worker(rank: int, port: int, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    report: dict = {}
    try:
        for per in ("token", "sample"):
            results = {count: _accumulated(count, per) for count in COUNTS}
            if rank == 0:  # compared here: tensors do not outlive this process in a queue
                want = _reference(per)
                for count, got in results.items():
                    grads = got.pop("grads")
                    got["grad_error"] = _relative_error(grads, want["grads"])
                    got["reference_loss"] = want["loss"]
                    report[(per, count)] = got
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["exception"] = traceback.format_exc()
    if rank == 0:
        queue.put(report)
    end_rank_process()


@pytest.fixture(scope="module")
def report() -> dict:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(verify.free_port(), queue), nprocs=WORLD, join=True)
    data = queue.get()
    assert "exception" not in data, data["exception"]
    return data


def _relative_error(got: dict, want: dict) -> float:
    return max(
        float((got[name] - w).abs().max() / w.abs().max().clamp_min(1e-30))
        for name, w in want.items()
    )


@pytest.mark.parametrize("per", ["token", "sample"])
@pytest.mark.parametrize("count", COUNTS, ids=lambda k: f"K{k}")
def test_micro_batches_give_the_global_batch_gradient(report, per: str, count: int) -> None:
    got = report[(per, count)]
    assert got["micro_batches"] == count
    assert got["seen"] == [(k, count) for k in range(count)]
    assert got["loss"] == pytest.approx(got["reference_loss"], rel=RELATIVE_BOUND)
    assert got["grad_error"] < RELATIVE_BOUND
    assert got["ahead_matches"]
