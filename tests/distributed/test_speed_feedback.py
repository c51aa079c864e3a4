"""Measured-time feedback on CPU with gloo: one rank slowed by the test hook (train.speeds.SlowRank)
keeps the step imbalanced under a fixed-speed plan, and plans made with the measured speed factors
balance it within a few steps, without changing the loss (the loss does not depend on the
placement: float64, the same as the fixed plans' within 1e-9 relative)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from speed_feedback_worker import SEQUENCES

from zellige.data import StepDataset
from zellige.train.config import tiny_cpu

TIMEOUT_S = 240
NUM_RANKS = 3
SLOW_RANK, SLOW_FACTOR = 1, 3.0
STEPS = 10
# each rank sleeps this long per step at its share of the fixed plan (the test hook's emulated
# device): long against the tiny model's CPU time, so the times follow the plan as a GPU's do
EMULATED_STEP_S = 0.3


def _emulation_scale() -> float:
    """Seconds slept per predicted second: a balanced rank of the fixed plan sleeps
    EMULATED_STEP_S."""
    config = tiny_cpu()
    dataset = StepDataset(
        model=config.model.dit,
        recipe="tiny",
        planner=config.parallelism.planner,
        rank=0,
        num_ranks=NUM_RANKS,
        gpus_per_node=NUM_RANKS,
        seed=config.seed,
        activation_checkpointing=config.parallelism.activation_checkpointing,
        adaptive_checkpointing=config.parallelism.activation_checkpointing
        and config.parallelism.adaptive_checkpointing,
        sequences=SEQUENCES,
    )
    batch = dataset.batch(0)
    ranks = dataset.pipeline().cost_model.evaluate(batch, dataset.plan(0)).ranks
    return EMULATED_STEP_S / (sum(r.time_s for r in ranks) / len(ranks))


def _run(tmp_path: Path, feedback: str, scale: float) -> list[dict]:
    out = tmp_path / f"{feedback}.jsonl"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        ZELLIGE_TEST_SLOW_RANK=f"{SLOW_RANK}:{SLOW_FACTOR}:{scale!r}",
    )
    worker = Path(__file__).with_name("speed_feedback_worker.py")
    with tempfile.TemporaryDirectory() as logs:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
        command += [str(NUM_RANKS), "--master-port", str(29300 + os.getpid() % 500)]
        command += ["--log-dir", logs, "--tee", "3", str(worker), str(out), feedback, str(STEPS)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        ranks = "".join(
            f"\n--- rank {path.parent.name} stderr:\n{path.read_text()[-2000:]}"
            for path in sorted(Path(logs).rglob("stderr.log"))
            if done.returncode != 0
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + ranks
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_feedback_balances_a_slow_rank_and_keeps_the_loss(tmp_path):
    scale = _emulation_scale()
    fixed = _run(tmp_path, "off", scale)
    adapted = _run(tmp_path, "on", scale)
    assert [r["step"] for r in fixed] == [r["step"] for r in adapted] == list(range(1, STEPS + 1))

    # without feedback the slow rank holds a third of the work at a third of the speed:
    # max / mean = 3 / (5 / 3) = 1.8 on 3 ranks
    fixed_imbalance = [r["measured_imbalance"] for r in fixed]
    assert min(fixed_imbalance) > 1.5, fixed_imbalance
    assert all(not r["speed_factors"] for r in fixed)
    # with it, plans use the factors once the first measurement reaches the planner (the
    # loader's prefetch depth and the late metrics later), and balance from then on
    imbalance = [r["measured_imbalance"] for r in adapted]
    assert max(imbalance[7:]) < 1.15, imbalance  # steps 8 to 10
    factors = adapted[-1]["speed_factors"]
    others = [f for rank, f in enumerate(factors) if rank != SLOW_RANK]
    # about 1 / SLOW_FACTOR of the others'; the CPU time of the model is not slowed
    assert factors[SLOW_RANK] / (sum(others) / len(others)) < 1.35 / SLOW_FACTOR, factors
    assert adapted[-1]["planned_imbalance"] < 1.15

    # placement does not change the loss (float64: summation order only)
    for a, b in zip(adapted, fixed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"]), (
            a["step"],
            a["loss"],
            b["loss"],
        )
