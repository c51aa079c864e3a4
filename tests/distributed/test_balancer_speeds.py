"""Balancer.set_speed_factors on 2 gloo processes: a step scheduled after it plans at the factors
(its prediction is the cost model's at the sped cluster, and the slowed rank holds less work),
ranks that set different factors get the same ValueError, and a malformed list is refused."""

from __future__ import annotations

import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zellige.runtime import end_rank_process, verify

WORLD = 2
GROUP_TIMEOUT_S = 30


def _samples(rank: int) -> list:
    import zellige

    # clips of 1 to 12 frames of 2x2 tokens, split over the ranks: a plan can shift any share
    return [
        zellige.Sample(grid_thw=(frames, 2, 2), text_tokens=3)
        for frames in range(1 + rank, 13, WORLD)
    ]


def _held_tokens(step) -> int:
    return int(step.visual_index.shape[0])


def _worker(rank: int, port: int, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    import zellige
    from zellige.pipeline import with_speed_factors

    report: dict = {}
    try:
        balancer = zellige.Balancer("tiny", plan_ahead=False)
        plain = balancer.step(_samples(rank))
        report["plain"] = (list(plain.record.rank_time_s), _held_tokens(plain))
        factors = (0.25, 1.75)
        balancer.set_speed_factors(factors)
        sped = balancer.step(_samples(rank))
        # the oracle: the same plan priced by the cost model at the sped cluster
        priced = with_speed_factors(balancer.cost_model, factors).evaluate(sped.batch, sped.plan)
        report["sped"] = (
            list(sped.record.rank_time_s),
            _held_tokens(sped),
            [r.time_s for r in priced.ranks],
        )
        balancer.set_speed_factors(None)
        report["reset"] = list(balancer.step(_samples(rank)).record.rank_time_s)
        balancer.set_speed_factors((1.0, 1.0) if rank == 0 else (1.0, 0.5))
        try:
            balancer.step(_samples(rank))
            report["disagree"] = None
        except ValueError as error:
            report["disagree"] = str(error)
        for bad in ((1.0,), (1.0, 0.0), (1.0, float("nan")), (1.0, True)):
            try:
                balancer.set_speed_factors(bad)
                report[f"bad {bad}"] = None
            except ValueError as error:
                report[f"bad {bad}"] = str(error)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        report["exception"] = traceback.format_exc()
    reports = [None] * WORLD
    dist.all_gather_object(reports, report)
    if rank == 0:
        queue.put(reports)
    end_rank_process()


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(verify.free_port(), queue), nprocs=WORLD, join=True)
    data = queue.get()
    for report in data:
        assert "exception" not in report, report["exception"]
    return data


def test_steps_after_set_speed_factors_plan_at_them(reports) -> None:
    (plain_times, plain_held0), (sped_times, sped_held0, priced) = (
        reports[0]["plain"],
        reports[0]["sped"],
    )
    assert sped_times == pytest.approx(priced, rel=1e-12)
    assert sped_held0 < plain_held0  # rank 0, at a quarter speed, holds less
    assert reports[1]["sped"][1] > reports[1]["plain"][1]
    # both ranks planned the same
    assert reports[1]["sped"][0] == sped_times and reports[1]["plain"][0] == plain_times
    assert reports[0]["reset"] == plain_times  # None: the cluster's own speeds again


def test_ranks_with_different_factors_get_the_same_error(reports) -> None:
    messages = [report["disagree"] for report in reports]
    assert messages[0] == messages[1] and messages[0] is not None
    assert "speed factors" in messages[0], messages[0]


@pytest.mark.parametrize("bad", ["(1.0,)", "(1.0, 0.0)", "(1.0, nan)", "(1.0, True)"])
def test_malformed_factors_are_refused(reports, bad) -> None:
    message = reports[0][f"bad {bad}"]
    assert message is not None and "2 positive finite numbers" in message, message
