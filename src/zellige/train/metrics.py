"""A step's metrics: its record (finish_step), the sinks that write it, the step line and the
run's summary.

finish_step makes a step's record once the device has passed its end (StepEnd) and gathers the
ranks' values over host tensors; MetricsSinks writes records to JSONL, TensorBoard and Weights &
Biases on rank 0; step_line and summary are what the console shows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zellige.runtime import layout
from zellige.train.config import TrainConfig
from zellige.train.speeds import RankTimes, SpeedEstimate
from zellige.train.timing import region_seconds
from zellige.train.watchdog import TrainingFailed


@dataclass(kw_only=True, slots=True)
class StepEnd:
    """A step whose work is issued and whose values are on their way to the host: what
    finish_step needs to make its metrics record once the device has passed `end`."""

    step: int  # 0-based
    data: object  # the loader's step (plan, token counts)
    wait_s: float  # seconds the host waited for the loader
    checkpointed: int
    full_recompute: int
    values: torch.Tensor  # [local loss, grad norm] float64 on the host (pinned on CUDA)
    intervals: dict  # StepTimer.take(): the step's region marks
    start: object  # a CUDA event (or perf_counter seconds) where the step's time begins
    end: object  # the same, recorded after the step's last work
    peak_backward_gib: float | None
    peak_optimizer_gib: float | None
    allocated_start_gib: float | None
    alloc_retries: int | None
    reserved_gib: float | None
    lr: float
    # seconds the test hook slept in the step (train.speeds.SlowRank): counted as the rank's
    # per-token work, as a slower device would spend them
    injected_s: float = 0.0


def time_mark(device: torch.device):
    """A point in the device's queue (a recorded CUDA event), or the host's clock on CPU (where
    every operation has finished when it returns)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def finish_step(
    config: TrainConfig,
    ended: StepEnd,
    device: torch.device,
    speeds: SpeedEstimate | None = None,
) -> dict:
    """The metrics record of a step whose work is issued: waits for the device to pass the
    step's end, gathers the ranks' values (over host tensors: no device queue to wait for) and
    raises TrainingFailed, on every rank alike, if the loss or gradient norm is not finite.
    `speeds` takes in the step's gathered per-rank times (the same on every rank)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        # the step's end, not the queue's: later work keeps running (polled, not synchronize():
        # the event has almost always passed already)
        while not ended.end.query():
            time.sleep(50e-6)
        step_s = ended.start.elapsed_time(ended.end) / 1e3
    else:
        step_s = ended.end - ended.start
    local_loss, grad_norm = ended.values.tolist()
    regions = region_seconds(ended.intervals)
    busy_s = busy_seconds(regions) + ended.injected_s
    local = torch.tensor(
        [
            local_loss,
            busy_s,
            regions.get("attention", 0.0) + regions.get("attention.backward", 0.0),
            regions.get("cross_attention", 0.0) + regions.get("cross_attention.backward", 0.0),
            step_s,
            ended.wait_s,
        ],
        dtype=torch.float64,
    )
    gathered = _all_gather_host(local, device)  # [ranks, fields]
    loss = float(gathered[:, 0].sum())
    step = ended.step
    # checked once the values reach the host (never a sync of its own): at the step's end, or
    # for a late step before the next step's optimizer step; the weights this step updated are
    # never saved, the run stops (the same on every rank)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingFailed(
            f"step {step + 1}: the loss is {loss} and the gradient norm {grad_norm}: not "
            "finite; stopped, nothing saved",
            report=rank == 0,
        )
    data = ended.data
    rank_busy = gathered[:, 1]
    slowest_step_s = float(gathered[:, 4].max())
    record = data.record
    peak_backward_gib = ended.peak_backward_gib
    attention_s = gathered[:, 2] + gathered[:, 3]
    times = RankTimes(
        layers_s=tuple((rank_busy - attention_s).tolist()), attention_s=tuple(attention_s.tolist())
    )
    if speeds is not None:
        speeds.update(step + 1, data.forecast, times)
    return {
        "step": step + 1,
        "loss": loss,
        "tokens_per_s": data.total_tokens / slowest_step_s,
        "plan_ms": record.plan_ms,
        "mfu": _mfu(data.train_flops, slowest_step_s, num_ranks, config.metrics.peak_flops_per_s),
        "step_s": slowest_step_s,
        "tokens": data.total_tokens,
        "train_flops": data.train_flops,
        "sequences": data.num_sequences,
        "planned_imbalance": record.planned_imbalance,
        "measured_imbalance": float(rank_busy.max() / rank_busy.mean().clamp_min(1e-12)),
        "predicted_makespan_s": record.makespan_s,
        "busy_s_max": float(rank_busy.max()),
        "attention_s_max": float(gathered[:, 2].max()),
        "cross_attention_s_max": float(gathered[:, 3].max()),
        "data_wait_s_max": float(gathered[:, 5].max()),
        "grad_norm": grad_norm,
        "peak_gib": None
        if peak_backward_gib is None
        else max(peak_backward_gib, ended.peak_optimizer_gib),
        "peak_backward_gib": peak_backward_gib,  # forward and backward
        "peak_optimizer_gib": ended.peak_optimizer_gib,
        "predicted_peak_gib": record.rank_peak_bytes[rank] / 2**30,
        "checkpointed_blocks": ended.checkpointed,
        "full_recompute_blocks": ended.full_recompute,
        "allocated_start_gib": ended.allocated_start_gib,  # held when the step began
        "alloc_retries": ended.alloc_retries,
        "reserved_gib": ended.reserved_gib,
        "lr": ended.lr,
        "planner": config.parallelism.planner,
        **_speed_fields(data.forecast.rank_speed_factors, times, speeds),
    }


def busy_seconds(regions: dict[str, float]) -> float:
    """A rank's own work in a step: its blocks' forward and backward (FSDP's collectives run
    in hooks around them and do not count)."""
    return regions.get("block", 0.0) + regions.get("block.backward", 0.0)


def _speed_fields(
    planned: tuple[float, ...], times: RankTimes, speeds: SpeedEstimate | None
) -> dict:
    """The speed factors the step's plan used (empty: none), each rank's measured busy seconds,
    and the estimate after this step (lists: per rank; None before any measurement)."""
    fields = {"speed_factors": list(planned), "rank_busy_s": list(times.busy_s)}
    if speeds is not None:
        for key, factors in (
            ("speed_estimate", speeds.speed_factors()),
            ("speed_estimate_layers", speeds.layers_speed_factors()),
            ("speed_estimate_attention", speeds.attention_speed_factors()),
        ):
            fields[key] = None if factors is None else list(factors)
    return fields


_PER_RANK_SCALARS = ("speed_factors", "speed_estimate", "rank_busy_s")


class MetricsSinks:
    """Rank 0 writes each step's record to the JSONL file, TensorBoard and Weights & Biases
    (each only if asked for). The files are opened at the first record, so a run that fails
    before training leaves an existing metrics file as it was."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        rank: int,
        metrics_path: str | Path | None,
        append: bool,
        tensorboard_dir: str | Path | None,
        wandb_project: str | None,
    ) -> None:
        self._enabled = rank == 0
        self._config = config
        self._metrics_path = metrics_path
        self._append = append
        self._tensorboard_dir = tensorboard_dir
        self._wandb_project = wandb_project
        self._jsonl = self._tensorboard = self._wandb = None
        self._opened = False

    def _open(self) -> None:
        self._opened = True
        if self._metrics_path:
            self._jsonl = open(self._metrics_path, "a" if self._append else "w")  # noqa: SIM115
        if self._tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self._tensorboard_dir))
        if self._wandb_project:
            import wandb

            config = dataclasses.asdict(self._config)
            self._wandb = wandb.init(project=self._wandb_project, config=config)

    def write(self, record: dict) -> None:
        if not self._enabled:
            return
        if not self._opened:
            self._open()
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        scalars = {
            key: value
            for key, value in record.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
        }
        # per-rank lists (speed factors, busy seconds) as one scalar per rank: key/RANK
        scalars |= {
            f"{key}/{rank}": value
            for key, values in record.items()
            if isinstance(values, list) and key in _PER_RANK_SCALARS
            for rank, value in enumerate(values)
        }
        if self._tensorboard:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, record["step"])
            self._tensorboard.flush()
        if self._wandb:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()


def summary(
    history: list[dict],
    seconds: float,
    num_ranks: int,
    last_saved: Path | None,
    metrics_path: str | Path | None,
) -> str:
    if not history:
        return "trained no steps"
    first, last = history[0], history[-1]
    tokens = sum(r["tokens"] for r in history)
    step_s = sum(r["step_s"] for r in history)
    line = (
        f"done: steps {first['step']}-{last['step']} on {num_ranks} rank{'s' * (num_ranks > 1)} "
        f"in {seconds:.1f} s; "
        f"loss {first['loss']:.4f} -> {last['loss']:.4f}; "
        f"{tokens / step_s:,.0f} tok/s; mean step {step_s / len(history):.3f} s"
    )
    if all(r["prediction_comparable"] for r in history):
        predicted = sum(r["predicted_makespan_s"] for r in history)
        line += f" (predicted {predicted / len(history):.3f} s)"
    mfu = [r["mfu"] for r in history if r["mfu"] is not None]
    if mfu:
        line += f"; MFU {100 * sum(mfu) / len(mfu):.1f}%"
    if last_saved:
        line += f"; checkpoint {last_saved}"
    if metrics_path:
        line += f"; metrics {metrics_path}"
    return line


def step_line(record: dict, total_steps: int) -> str:
    mfu = "-" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} "
        f"tok/s {record['tokens_per_s']:,.0f} MFU {mfu} "
        f"imbalance planned {record['planned_imbalance']:.3f} "
        f"measured {record['measured_imbalance']:.3f} plan {record['plan_ms']:.2f} ms"
        + _speeds_text(record.get("speed_factors"))
    )


def _speeds_text(factors: list[float] | None) -> str:
    """The range of the speed factors a step was planned with ("" without feedback)."""
    if not factors:
        return ""
    return f" speeds {min(factors):.2f}-{max(factors):.2f}"


def _mfu(flops: float, step_s: float, num_ranks: int, peak_flops_per_s: float | None):
    if peak_flops_per_s is None:
        return None
    return flops / (step_s * num_ranks * peak_flops_per_s)


def peak_gib(device: torch.device, reset: bool = False) -> float | None:
    """GiB the allocator has held at most since its last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def allocator_stat(device: torch.device, key: str) -> int | None:
    """A counter of the CUDA caching allocator (cumulative since the process began; None off
    CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get(key, 0))


def _all_gather_host(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's copy of a host tensor, stacked; on CUDA over the world's gloo twin (the
    loaders' status exchange makes it), so nothing waits for a device's queue."""
    if dist.get_world_size() == 1:
        return local[None]
    group, _ = layout._status_group(None, device)
    buffers = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(buffers, local, group=group)
    return torch.stack(buffers)
