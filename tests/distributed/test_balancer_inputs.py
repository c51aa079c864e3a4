"""The Balancer's input checks on 2 gloo processes: one rank's malformed samples (or a bad
constructor argument) are the same ValueError on every rank within seconds, never a hang until
the process group's timeout and never another exception type."""

from __future__ import annotations

import math
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zellige.runtime import end_rank_process, verify

WORLD = 2
GROUP_TIMEOUT_S = 30  # a rank that skipped the collective would leave the other waiting this long


def _good(rank: int) -> list:
    import zellige

    return [zellige.Sample(grid_thw=(1, 4, 4), text_tokens=3, tokens={"x": torch.zeros(16, 2)})]


def _bad_samples() -> dict[str, object]:
    """Rank 1's samples in each case (rank 0 passes good ones)."""
    import zellige

    def sample(**fields):
        fields.setdefault("grid_thw", (1, 4, 4))
        return zellige.Sample(**fields)

    return {
        "None in the grid": [sample(grid_thw=(1, None, 4))],
        "NaN in the grid": [sample(grid_thw=(1, math.nan, 4))],
        "float in the grid": [sample(grid_thw=(1, 4.0, 4))],
        "bool in the grid": [sample(grid_thw=(True, 4, 4))],
        "two grid elements": [sample(grid_thw=(4, 4))],
        "grid element 2^40": [sample(grid_thw=(1, 1 << 40, 1))],
        "grid product past the limit": [sample(grid_thw=(1 << 11, 1 << 11, 1 << 11))],
        "text_tokens None": [sample(text_tokens=None)],
        "text_tokens negative": [sample(text_tokens=-1)],
        "a list, not a tensor": [sample(tokens={"x": [[0.0, 0.0]] * 16})],
        "not a Sample": [{"grid_thw": (1, 4, 4)}],
        "samples not a list": 7,
        "wrong rows": [sample(tokens={"x": torch.zeros(15, 2)})],
    }


def _worker(rank: int, port: int, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    import zellige

    report: dict = {}
    try:
        for case, bad in _bad_samples().items():
            balancer = zellige.Balancer("tiny", plan_ahead=False)
            began = time.perf_counter()
            try:
                balancer.step(_good(rank) if rank == 0 else bad)
                outcome = None
            except ValueError as error:
                outcome = str(error)
            except Exception as error:  # noqa: BLE001 - the test reports the wrong type
                outcome = f"not a ValueError: {type(error).__name__}: {error}"
            report[case] = (outcome, time.perf_counter() - began)
            balancer.close()
        for seed in (-1, 1 << 63, 1.5, True):
            try:
                zellige.Balancer("tiny", seed=seed, plan_ahead=False)
                report[f"seed {seed!r}"] = (None, 0.0)
            except ValueError as error:
                report[f"seed {seed!r}"] = (str(error), 0.0)
        # the good samples still plan and train after the refusals
        step = zellige.Balancer("tiny", plan_ahead=False).step(_good(rank))
        report["good"] = (step.inputs().tokens["x"].shape[1], 0.0)
        try:  # "tiny" is a cross-attention model: a text part for join is refused by name
            step.join(torch.zeros(step.visual_index.shape[0], 2), torch.zeros(3, 2))
            report["join text"] = (None, 0.0)
        except ValueError as error:
            report["join text"] = (str(error), 0.0)
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


@pytest.mark.parametrize("case", [
    "None in the grid", "NaN in the grid", "float in the grid", "bool in the grid",
    "two grid elements", "grid element 2^40", "grid product past the limit", "text_tokens None",
    "text_tokens negative", "a list, not a tensor", "not a Sample", "samples not a list",
    "wrong rows",
])  # fmt: skip
def test_one_ranks_malformed_samples_are_one_value_error_on_every_rank(reports, case) -> None:
    outcomes = [report[case] for report in reports]
    messages = [message for message, _ in outcomes]
    assert len(set(messages)) == 1, messages  # the same on both ranks
    assert messages[0] is not None and messages[0].startswith("rank 1: "), messages
    assert "not a ValueError" not in messages[0], messages[0]
    assert max(seconds for _, seconds in outcomes) < GROUP_TIMEOUT_S / 3, outcomes


@pytest.mark.parametrize("seed", ["-1", str(1 << 63), "1.5", "True"])
def test_a_seed_outside_the_limits_is_refused_by_the_constructor(reports, seed) -> None:
    message, _ = reports[0][f"seed {seed}"]
    assert message is not None and "seed must be an int in [0, 2**63)" in message


def test_good_samples_still_step(reports) -> None:
    assert [report["good"][0] for report in reports] == [2, 2]


def test_join_refuses_text_the_spec_does_not_expect(reports) -> None:
    for report in reports:
        message, _ = report["join text"]
        assert message is not None and "joint_attention = false" in message, message
