"""The training loop that torchrun runs: rectified flow on the reference DiT under any planner."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import record_function
from tqdm import tqdm

import zellige
from zellige.data import StepDataset, load_training_recipe, make_loader, model_spec
from zellige.model import MMDiT, VideoDiT, conditioning, fused
from zellige.model import build_model as reference_model
from zellige.profile import priced_as_engine_runs
from zellige.runtime import layout
from zellige.runtime.coalesced import engine_runs_ragged
from zellige.train.checkpoint import (
    CheckpointInfo,
    check_out_dir,
    check_resumable,
    find_checkpoint,
    load_checkpoint,
    lock_out_dir,
    run_fields,
    save_checkpoint,
)
from zellige.train.config import TrainConfig, check_world, validate_config
from zellige.train.mmdit_step import assemble_joint_step, joint_step_loss
from zellige.train.optimizer import CopyingAdamW
from zellige.train.parallelize import parallelize, set_checkpointed_blocks
from zellige.train.step import StepInput, assemble_step
from zellige.train.timing import StepTimer, region_seconds


class TrainingFailed(RuntimeError):
    """The run stopped (a non-finite loss, a stuck rank). `report`: this rank prints the message
    (one rank does, so a failure reads as one line)."""

    def __init__(self, message: str, report: bool) -> None:
        super().__init__(message)
        self.report = report


@dataclass(kw_only=True, slots=True)
class RunStart:
    """What the checks before the process group decided."""

    first_step: int  # steps already done (the checkpoint's)
    checkpoint: CheckpointInfo | None
    data_ranks: int


def env_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), before any process group."""
    return int(os.environ.get("RANK", "0"))


def say(text: str) -> None:
    """One line on stderr, from rank 0 only."""
    if env_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def preflight(
    config: TrainConfig,
    *,
    num_ranks: int,
    metrics_path: str | Path | None = None,
    out_dir: str | Path | None = None,
    resume_dir: str | Path | None = None,
    tensorboard_dir: str | Path | None = None,
    wandb_project: str | None = None,
) -> RunStart:
    """Every check that needs no process group, so bad input fails in seconds, before training,
    the same way on every rank. Raises ValueError with one line; creates out_dir."""
    validate_config(config)
    check_world(config, num_ranks)
    if config.device == "cuda":
        _require_cuda(config)
    _check_planning(config, num_ranks)
    if out_dir is not None:
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--out {out}: cannot create ({error.strerror or error})") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise ValueError(f"--out {out}: not writable")
    for flag, path in (("--metrics", metrics_path), ("--tensorboard", tensorboard_dir)):
        if path is not None:
            parent = Path(path).parent
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise ValueError(f"{flag} {path}: {parent} is not a writable directory")
    if metrics_path is not None and Path(metrics_path).is_dir():
        raise ValueError(f"--metrics {metrics_path}: is a directory")
    check_out_dir(out_dir, **{"--metrics": metrics_path, "--tensorboard": tensorboard_dir})
    if tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "--tensorboard needs the tensorboard package (pip install tensorboard; the train "
            "extra includes it)"
        )
    if wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError("--wandb needs the wandb package (pip install wandb)")
    if resume_dir is None:
        return RunStart(first_step=0, checkpoint=None, data_ranks=config.data_ranks or num_ranks)
    info = find_checkpoint(resume_dir)
    if config.steps < info.step:
        raise ValueError(
            f"--steps {config.steps} is below the step of checkpoint {info.path} ({info.step}); "
            f"--steps counts all steps, resumed ones included: pass more than {info.step}"
        )
    model = dataclasses.asdict(config.model)
    keys = sorted(model.keys() | info.model.keys())
    differ = [key for key in keys if model.get(key) != info.model.get(key)]
    if differ:
        key = differ[0]
        raise ValueError(
            f"checkpoint {info.path} holds another model: its {key} is "
            f"{info.model.get(key)!r}, this run's {model.get(key)!r}"
        )
    if config.data_ranks is not None and config.data_ranks != info.data_ranks:
        raise ValueError(
            f"data_ranks {config.data_ranks} differs from the checkpoint's {info.data_ranks}: "
            "the resumed run would see other batches (leave data_ranks unset)"
        )
    check_resumable(info, config, num_ranks)
    return RunStart(first_step=info.step, checkpoint=info, data_ranks=info.data_ranks)


def _check_planning(config: TrainConfig, num_ranks: int) -> None:
    """The recipe, profile and planner name resolve, and the planner accepts this cluster:
    planned here on a token per rank, not in a loader worker after the model is built."""
    load_training_recipe(config.recipe)
    spec = model_spec(config.model)
    cost_model = zellige.make_cost_model(
        spec, num_ranks, min(config.gpus_per_node, num_ranks), config.profile
    )
    sequences = [
        {"id": r, "num_tokens": 1, "text_tokens": 0, "source_rank": r} for r in range(num_ranks)
    ]
    batch = zellige.batch_from_dict({"sequences": sequences}, num_ranks=num_ranks)
    zellige.make_plan(config.planner, batch, cost_model)


def _require_cuda(config: TrainConfig) -> None:
    if torch.version.cuda is None:
        raise ValueError(
            f"config {config.name} trains on CUDA GPUs, but this PyTorch ({torch.__version__}) is "
            "a CPU-only build; install a CUDA build (README, Training: .venv/bin/pip install "
            "torch --index-url https://download.pytorch.org/whl/cu128) or use --config tiny-cpu"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"config {config.name} trains on CUDA GPUs, but none is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible "
            "(start at most that many processes per node)"
        )


def setup_distributed(config: TrainConfig) -> torch.device:
    """Joins the process group torchrun describes (or a one-process group without torchrun).
    A collective that waits more than config.timeout_s fails instead of hanging."""
    if config.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(
            backend=config.backend,
            device_id=device_id,
            timeout=datetime.timedelta(seconds=config.timeout_s),
        )
    return device


def build_model(config: TrainConfig, device: torch.device, timer: StepTimer) -> VideoDiT | MMDiT:
    """The sharded model. On CUDA it is built on the meta device and initialised after sharding
    (no rank ever holds the whole model); on CPU built whole, identical on every rank."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    conditioning.set_row_multiple(8 if config.pad_sequence_rows else 1)
    conditioning.set_split_pieces(config.split_modulation)
    conditioning.set_gathered_head(config.gathered_head)
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        with torch.device("meta"):
            model = reference_model(config.model)
    else:
        model = reference_model(config.model)
    parallelize(
        model,
        mesh,
        dtype=config.dtype,
        activation_checkpointing=config.activation_checkpointing,
        timer=timer,
        compile_elementwise=device.type == "cuda"
        if config.compile_elementwise is None
        else config.compile_elementwise,
        compile_outside=config.compile_outside,
        reshard_after_forward=config.reshard_after_forward,
        fsdp_on_one_rank=config.fsdp_on_one_rank,
        copying_optimizer=uses_copying_optimizer(config),
        compute_dtype_gradients=keeps_compute_dtype_gradients(config),
    )
    if device.type == "cuda":
        model.to_empty(device=device)
        model.reset_parameters()
    return model


def train(
    config: TrainConfig,
    *,
    metrics_path: str | Path | None = None,
    out_dir: str | Path | None = None,
    resume_dir: str | Path | None = None,
    tensorboard_dir: str | Path | None = None,
    wandb_project: str | None = None,
    sequences: list[dict] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Runs config.steps steps (counting the resumed ones); returns each step's metrics (the same
    on every rank). `sequences` fixes every step's batch (tests). Bad input raises ValueError
    before training; a non-finite loss or a stuck rank raises TrainingFailed."""
    start = preflight(
        config,
        num_ranks=int(os.environ.get("WORLD_SIZE", "1")),
        metrics_path=metrics_path,
        out_dir=out_dir,
        resume_dir=resume_dir,
        tensorboard_dir=tensorboard_dir,
        wandb_project=wandb_project,
    )
    first_step = start.first_step
    if start.checkpoint is not None and first_step == config.steps:
        say(
            f"checkpoint {start.checkpoint.path} is already at step {first_step} = --steps: "
            f"nothing to do (pass --steps above {first_step} to train on)"
        )
        return []
    device = setup_distributed(config)
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    out_lock = lock_out_dir(out_dir)  # one run writes --out at a time
    timer = StepTimer(device)
    model = build_model(config, device, timer)
    optimizer = make_optimizer(config, model, device)
    warmup = max(config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    if start.checkpoint is not None:
        info = start.checkpoint
        load_checkpoint(info, model, optimizer, scheduler)
        resharded = (
            ""
            if info.num_ranks == num_ranks
            else (
                f"; saved on {info.num_ranks} ranks, the model and optimizer state resharded to "
                f"{num_ranks}, each step's batch still drawn for {info.data_ranks} loader ranks"
            )
        )
        say(f"resumed from {info.path} at step {info.step}{resharded}")
    profile_note = _profile_note(config, device)
    if profile_note:
        say(profile_note)
    # the planner prices attention as this process's engine runs it (ragged calls or dense)
    attention_ragged = engine_runs_ragged(
        device, getattr(torch, config.dtype), config.model.head_dim
    )
    priced_as_engine_runs(zellige.load_profile(config.profile), attention_ragged, say)

    dataset = StepDataset(
        model=config.model,
        recipe=config.recipe,
        planner=config.planner,
        rank=rank,
        num_ranks=num_ranks,
        data_ranks=start.data_ranks,
        gpus_per_node=config.gpus_per_node,
        seed=config.seed,
        profile=config.profile,
        activation_checkpointing=config.activation_checkpointing,
        adaptive_checkpointing=config.activation_checkpointing and config.adaptive_checkpointing,
        weights_kept_to_backward=weights_kept_to_backward(config, num_ranks),
        gradient_bytes_per_param=gradient_bytes_per_param(config, num_ranks),
        optimizer_copy_bytes_per_param=optimizer_copy_bytes_per_param(config, num_ranks),
        sequences=sequences,
        attention_ragged=attention_ragged,
    )
    num_steps = config.steps - first_step
    loader = make_loader(
        dataset, first_step, num_steps, config.loader_workers, cuda=device.type == "cuda"
    )
    sinks = _MetricsSinks(
        config,
        rank=rank,
        metrics_path=metrics_path,
        append=start.checkpoint is not None,
        tensorboard_dir=tensorboard_dir,
        wandb_project=wandb_project,
    )
    bar = tqdm(
        total=config.steps,
        initial=first_step,
        disable=not progress or rank != 0,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    watch = _RankWatch(rank, num_ranks, config.timeout_s)
    last_saved = start.checkpoint.path if start.checkpoint is not None else None
    saved_now = None  # the newest checkpoint this run wrote
    history = []
    run_start = time.perf_counter()
    ahead = StepsAhead(iter(loader), config, device)
    collector = QuietCollector(enabled=config.freeze_gc)
    pending = None  # a late step's StepEnd, finished by the next step
    try:
        for step in range(first_step, config.steps):
            done = step + 1
            due = config.checkpoint_every and done % config.checkpoint_every == 0
            saving = bool(out_dir) and (due or done == config.steps)
            # a step that saves, and the last one, end with a full sync (no step after them)
            late = config.metrics_one_step_late and done < config.steps and not saving
            try:
                records, pending = _run_step(
                    config, model, optimizer, scheduler, timer, device, ahead, step, watch,
                    pending, late,
                )  # fmt: skip
            except TrainingFailed:
                raise
            except RuntimeError as error:
                raise watch.failure(step + 1, error) from None
            collector.after_step()
            for record in records:
                record["prediction_comparable"] = profile_note is None
                history.append(record)
                sinks.write(record)
                if rank == 0 and progress:
                    bar.update(1)
                    bar.write(_step_line(record, config.steps))
            if saving:
                saved_at = time.perf_counter()
                try:
                    saved_now = last_saved = save_checkpoint(
                        out_dir,
                        done,
                        model,
                        optimizer,
                        scheduler,
                        data_ranks=start.data_ranks,
                        model_config=config.model,
                        run=run_fields(config),
                    )
                except RuntimeError as error:
                    raise watch.failure(done, error) from None
                seconds = time.perf_counter() - saved_at
                _say_above(bar, f"saved checkpoint {last_saved} ({seconds:.1f} s)")
    except TrainingFailed as failure:
        kept = f"; the last checkpoint: {last_saved}" if last_saved else ""
        raise TrainingFailed(str(failure) + kept, failure.report) from None
    finally:
        bar.close()
        sinks.close()
        watch.close()
        collector.close()
        out_lock.close()
        if model.lone_weights is not None:
            model.lone_weights.close()
    if rank == 0 and progress:
        # with the step lines, on stdout; notices (saved, resumed) go to stderr
        seconds = time.perf_counter() - run_start
        print(_summary(history, seconds, num_ranks, saved_now, metrics_path), flush=True)
    return history


def compile_events() -> int:
    """A count that torch.compile increases whenever it captures, compiles or loads a graph
    (forward or backward); unchanged over steps that run compiled code only."""
    counters = torch._dynamo.utils.counters
    return sum(sum(counters[kind].values()) for kind in ("frames", "aot_autograd", "inductor"))


class QuietCollector:
    """Keeps Python's full garbage collections out of the steps' time. torch.compile leaves
    hundreds of thousands of long-lived objects (graphs, guards, generated code, sympy caches);
    Python's full collection, which runs whenever enough new objects have survived since the
    last one, traverses all of them: a pause of 0.2 s on a CPU for 0.4 M objects, and it falls
    in whichever step trips it (on an H200, wan-1.3b: one image step 0.3-0.5 s longer, the
    host idle while the device waits). So the objects that exist when training starts and
    after each step that compiled are collected once, between steps, and then frozen
    (gc.freeze: never traversed again; freed as usual when their last reference goes). A full
    collection in a later step traverses only what came after. close() unfreezes them (a
    finished run's cycles can be collected). enabled=False: does nothing (Python collects as it
    would)."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._events = compile_events()
        if enabled:
            self._settle()

    def after_step(self) -> None:
        """Settles a step's compiled graphs; nothing after a step that compiled nothing."""
        events = compile_events()
        if self._enabled and events != self._events:
            self._events = events
            self._settle()

    @staticmethod
    def _settle() -> None:
        gc.collect()  # the garbage first: a frozen cycle would never be freed
        gc.freeze()

    def close(self) -> None:
        if self._enabled:
            gc.unfreeze()


class StepsAhead:
    """Each step's data and inputs (train/step.py: the step program loaded, the features routed,
    the attention tables on the device), made while the previous step's optimizer still runs
    on the device: the host work of a step's setup overlaps the device's work instead of
    leaving it idle at the step's start. The first step's inputs are made before it starts."""

    def __init__(self, loader_iter, config: TrainConfig, device: torch.device) -> None:
        self._loader_iter = loader_iter
        self._config = config
        self._device = device
        self._ready = None  # (step, data, inputs, seconds waited for the loader) or an error

    def prepare(self, step: int) -> None:
        """Makes step `step`'s inputs now; an error is raised by take(step), in its own step."""
        try:
            wait_start = time.perf_counter()
            data = next(self._loader_iter)
            wait_s = time.perf_counter() - wait_start
            joint = self._config.model.joint_attention  # MMDiT: text joins attention
            assemble = assemble_joint_step if joint else assemble_step
            with record_function("zellige.step.setup"):
                inputs = assemble(data, self._config.model.num_heads, self._device)
            self._ready = (step, data, inputs, wait_s)
        except Exception as error:  # noqa: BLE001 (raised again by take, in its own step)
            self._ready = (step, error)

    def take(self, step: int):
        """(data, inputs, seconds waited for the loader) of step `step`."""
        if self._ready is None or self._ready[0] != step:
            self.prepare(step)
        ready, self._ready = self._ready, None
        if len(ready) == 2:
            raise ready[1]
        return ready[1:]


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


def _time_mark(device: torch.device):
    """A point in the device's queue (a recorded CUDA event), or the host's clock on CPU (where
    every operation has finished when it returns)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _run_step(
    config, model, optimizer, scheduler, timer, device, ahead, step, watch, before, late
) -> tuple[list[dict], StepEnd | None]:
    """One optimizer step. Returns the metrics records finished in it (gathered: the same on
    every rank) and, when `late`, this step's StepEnd, which the next call finishes (as
    `before`) after issuing its own forward and backward and before its optimizer step; so the
    host never waits for the device between steps, and a non-finite loss or gradient norm still
    stops the run before the next update is applied. Not late: the step ends with a full sync
    and returns its own record. `ahead` (StepsAhead) holds the step's inputs; the next step's
    are made after this step's optimizer step is issued."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    watch.at_step(step + 1)
    # torch's generators follow (seed, step, rank): a resumed run continues them on any number
    # of ranks without storing them (the data has generators of its own)
    torch.manual_seed(_seed_of(config.seed, step, rank))
    data, step_input, wait_s = ahead.take(step)  # made during the previous step
    if before is None:
        _synchronize(device)  # nothing in flight: the step's time starts with an idle device
    # the allocator's counters follow the host's order of allocations, not the device's: reset
    # here, where the previous step's last work has been issued, they count this step's alone
    allocated_start_gib = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        allocated_start_gib = torch.cuda.memory_allocated(device) / 2**30
    # after a late step this step's time starts where that one's ended on the device: the
    # steps' times add up to the wall time from the first step's start to the last one's end
    start = before.end if before is not None else _time_mark(device)
    timer.reset()
    checkpointed, full_recompute = _checkpointed_blocks(config, data.plan, rank)
    set_checkpointed_blocks(model, checkpointed, full_recompute)
    sync_check = config.sync_debug and device.type == "cuda"
    if sync_check:
        # every host sync until the next step's inputs are made (the step's end waits)
        torch.cuda.set_sync_debug_mode("warn")
    # the phases are named for torch.profiler (bench/train_throughput.py --trace)
    with record_function("zellige.step.forward"):
        loss_of = joint_step_loss if config.model.joint_attention else step_loss
        local_loss = loss_of(model, step_input, data.total_tokens, timer)
    with record_function("zellige.step.backward"):
        # FSDP averages gradients over ranks: scaling by the rank count makes that their sum
        (local_loss * num_ranks).backward()
    # the graph's last reference: its nodes hold the forward's leaves (on one rank without FSDP
    # the bf16 weight copies, a copy of every weight), which would otherwise live through the
    # optimizer step beside the next step's copies (the cost model's peak has one set)
    local_loss = local_loss.detach()
    # the step's peak split by phase (the cost model's is the larger of the two)
    peak_backward_gib = _peak_gib(device, reset=True)
    records = []
    if before is not None:
        # the previous step's values: the device passed them long ago (this step's forward and
        # backward are queued behind them); a non-finite one raises before this step's update
        with record_function("zellige.step.previous_metrics"):
            records.append(finish_step(config, before, device))
    with record_function("zellige.step.optimizer"):
        grad_norm = clip_and_step(model, optimizer, config.grad_clip_norm, config.clip_in_optimizer)
        scheduler.step()
    del step_input  # its tensors are free once the device is done with them
    if step + 1 < config.steps:
        ahead.prepare(step + 1)  # host work while the device runs this step's tail
    if sync_check:
        torch.cuda.set_sync_debug_mode("default")
    with record_function("zellige.step.end"):
        # the allocator's counters first, before the few bytes below
        peak_optimizer_gib = _peak_gib(device)  # clipping and the optimizer step
        # the caching allocator's state after the step: a retry frees cached blocks and waits
        # for the device (a stall in the step); reserved: what it holds from the driver
        alloc_retries = _allocator_stat(device, "num_alloc_retries")
        reserved = _allocator_stat(device, "reserved_bytes.all.peak")
        # the loss and norm go to the host behind the step's work (no wait here); their device
        # tensors are freed now, as they were when a step returned
        values = torch.stack([local_loss.detach().double(), _full(grad_norm).detach().double()])
        if device.type == "cuda":
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(values, non_blocking=True)
        else:
            host = values
        del local_loss, grad_norm, values
        ended = StepEnd(
            step=step,
            data=data,
            wait_s=wait_s,
            checkpointed=checkpointed,
            full_recompute=full_recompute,
            values=host,
            intervals=timer.take(),
            start=start,
            end=_time_mark(device),
            peak_backward_gib=peak_backward_gib,
            peak_optimizer_gib=peak_optimizer_gib,
            allocated_start_gib=allocated_start_gib,
            alloc_retries=alloc_retries,
            reserved_gib=None if reserved is None else reserved / 2**30,
            lr=scheduler.get_last_lr()[0],
        )
        if late:
            return records, ended
        _synchronize(device)
        records.append(finish_step(config, ended, device))
    return records, None


def finish_step(config: TrainConfig, ended: StepEnd, device: torch.device) -> dict:
    """The metrics record of a step whose work is issued: waits for the device to pass the
    step's end, gathers the ranks' values (over host tensors: no device queue to wait for) and
    raises TrainingFailed, on every rank alike, if the loss or gradient norm is not finite."""
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
    busy_s = regions.get("block", 0.0) + regions.get("block.backward", 0.0)
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
    predicted = data.plan["predicted"]["rank_time_s"]
    peak_backward_gib = ended.peak_backward_gib
    return {
        "step": step + 1,
        "loss": loss,
        "tokens_per_s": data.total_tokens / slowest_step_s,
        "plan_ms": float(data.plan["plan_ms"]),
        "mfu": _mfu(data.train_flops, slowest_step_s, num_ranks, config.peak_flops_per_s),
        "step_s": slowest_step_s,
        "tokens": data.total_tokens,
        "train_flops": data.train_flops,
        "sequences": data.num_sequences,
        "planned_imbalance": max(predicted) / (sum(predicted) / len(predicted)),
        "measured_imbalance": float(rank_busy.max() / rank_busy.mean().clamp_min(1e-12)),
        "predicted_makespan_s": float(data.plan["predicted"]["makespan_s"]),
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
        "predicted_peak_gib": data.plan["predicted"]["rank_peak_bytes"][rank] / 2**30,
        "checkpointed_blocks": ended.checkpointed,
        "full_recompute_blocks": ended.full_recompute,
        "allocated_start_gib": ended.allocated_start_gib,  # held when the step began
        "alloc_retries": ended.alloc_retries,
        "reserved_gib": ended.reserved_gib,
        "lr": ended.lr,
        "planner": config.planner,
    }


class _MetricsSinks:
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


class _RankWatch:
    """Names the stuck rank when a collective times out. Each rank counts heartbeats (a thread,
    once a second) and its step in the launcher's key-value store, which torchrun serves from
    its own process: a stopped or frozen rank's count stands still, a slow one's step lags."""

    _BEAT_S = 1.0

    def __init__(self, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        self._store = None
        if num_ranks > 1 and "MASTER_ADDR" in os.environ:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=30),
            )
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._BEAT_S):
            try:
                self._store.add(f"zellige/beats/{self.rank}", 1)
            except Exception:  # the store went away: the run is ending
                return

    def at_step(self, step: int) -> None:
        if self._store is not None:
            self._store.set(f"zellige/step/{self.rank}", str(step))

    def failure(self, step: int, error: RuntimeError) -> RuntimeError:
        """What to raise for `error` at `step`: a collective that timed out or lost a peer
        becomes one line (from one rank); anything else stays as it was."""
        text = str(error).lower()
        if "timed out" in text or "timeout" in text:
            return self.stuck(step)
        if any(words in text for words in ("connection closed", "connection reset", "broken pipe")):
            # a rank died; torchrun is about to stop this one too
            report = self._first_report()
            return TrainingFailed(
                f"step {step}: rank {self.rank} lost its connection to another rank (it died?)",
                report=report,
            )
        return error

    def _first_report(self) -> bool:
        if self._store is None:
            return True
        try:
            return self._store.add("zellige/failure_reported", 1) == 1
        except Exception:  # the store is gone with the launcher
            return True

    def stuck(self, step: int) -> TrainingFailed:
        """The failure to raise after a collective timed out at `step`."""
        prefix = (
            f"step {step}: rank {self.rank} waited over {self.timeout_s:g} s (--timeout-s) "
            "for the other ranks"
        )
        if self._store is None:
            return TrainingFailed(prefix, report=True)
        try:
            others = [r for r in range(self.num_ranks) if r != self.rank]
            before = {r: self._store.add(f"zellige/beats/{r}", 0) for r in others}
            time.sleep(3 * self._BEAT_S)
            frozen = [r for r in others if self._store.add(f"zellige/beats/{r}", 0) == before[r]]
            steps = {}
            for r in others:
                if self._store.check([f"zellige/step/{r}"]):
                    steps[r] = int(self._store.get(f"zellige/step/{r}").decode())
            behind = [r for r, s in steps.items() if s < step]
            if frozen:
                detail = f"rank {_ranks(frozen)} stopped responding (stopped, frozen or dead)"
            elif behind:
                detail = ", ".join(f"rank {r} is still at step {steps[r]}" for r in behind)
            else:
                detail = "every rank is alive at this step: a rank is stuck inside it"
            report = self._first_report()
        except Exception:  # the store itself is gone: say what this rank knows
            return TrainingFailed(prefix, report=True)
        return TrainingFailed(f"{prefix}: {detail}", report=report)

    def close(self) -> None:
        self._stop.set()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _seed_of(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint32)[0])


def _profile_note(config: TrainConfig, device: torch.device) -> str | None:
    """None when the cost model's profile was measured on this kind of device; otherwise the
    line that says its predicted times are not comparable with the measured ones."""
    profile = zellige.load_profile(config.profile)
    if device.type == "cuda":
        here = torch.cuda.get_device_name(device)
        same = profile.device_name == here
    else:
        here = "CPU"
        same = profile.device_name.startswith("CPU")
    if same:
        return None
    source = config.profile or "the built-in profile"
    return (
        f"cost model: {source} ({profile.device_name}); this run is on {here}, so the "
        "predicted step times are the profile's device's, not comparable with the measured "
        "ones (zellige profile measures this machine; pass its file with --profile)"
    )


def _summary(
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


def _say_above(bar: tqdm, text: str) -> None:
    if env_rank() == 0:
        bar.write(text, file=sys.stderr)


def step_loss(
    model: VideoDiT, step_input: StepInput, total_tokens: int, timer: StepTimer
) -> torch.Tensor:
    """This rank's share of the batch's rectified-flow loss: the sum over its tokens of the mean
    squared velocity error, divided by the GLOBAL token count. Summed over ranks it is the
    batch's mean loss whatever the placement, and summed gradients are its gradient."""
    velocity_TC = model(
        step_input.tokens,
        timer.wrap("attention", step_input.self_attention, fresh_output=False),
        timer.wrap("cross_attention", step_input.cross_attention, fresh_output=False),
    )
    squared_error_sum = fused.kernels["squared_error_sum"]
    return squared_error_sum(velocity_TC, step_input.velocity_TC) / total_tokens


# CopyingAdamW updates this many blocks' weights per compiled call: fewer calls (each checks
# its guards on every tensor it takes) where a model has many blocks; the last chunk may be
# shorter (a graph of its own)
OPTIMIZER_BLOCKS_PER_CHUNK = 8


def copies_in_optimizer(config: TrainConfig, model) -> bool:
    """Whether AdamW writes the weights' compute copies (one rank without FSDP, the update at
    the step's end)."""
    lone = getattr(model, "lone_weights", None) is not None
    return lone and uses_copying_optimizer(config)


def uses_copying_optimizer(config: TrainConfig) -> bool:
    """config.copying_optimizer, None resolved: on CUDA in bf16 (it applies on one rank without
    FSDP; float32 or float64 training computes with the masters themselves, no copies)."""
    chosen = config.copying_optimizer
    default = config.device == "cuda" and config.dtype == "bfloat16"
    return default if chosen is None else chosen


def keeps_compute_dtype_gradients(config: TrainConfig) -> bool:
    """config.compute_dtype_gradients, None resolved: wherever the copying optimizer runs."""
    chosen = config.compute_dtype_gradients
    return uses_copying_optimizer(config) and (chosen is None or chosen)


def make_optimizer(config: TrainConfig, model, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW (fused on CUDA: one kernel over all parameters), or CopyingAdamW where it
    writes the weights' copies (copies_in_optimizer; compiled where the blocks are)."""
    options = dict(lr=config.learning_rate, betas=config.betas, weight_decay=config.weight_decay)
    if copies_in_optimizer(config, model):
        compiled = config.compile_elementwise
        return CopyingAdamW(
            model.parameters(),
            chunks=model.lone_weights.chunks(OPTIMIZER_BLOCKS_PER_CHUNK),
            compiled=device.type == "cuda" if compiled is None else compiled,
            tuned=config.tune_optimizer_kernels,
            **options,
        )
    fused = device.type == "cuda" if config.fused_optimizer is None else config.fused_optimizer
    return torch.optim.AdamW(model.parameters(), fused=fused, **options)


def gradient_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's gradient holds in training (the cost model prices them): fp32, or
    bf16 where the copying optimizer reads the backward's bf16 gradients (one rank)."""
    lone = num_ranks == 1 and not config.fsdp_on_one_rank
    kept = lone and keeps_compute_dtype_gradients(config)
    return 2.0 if kept and config.dtype == "bfloat16" else 4.0


def optimizer_copy_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's copy takes that the optimizer step writes beside the state (the cost
    model prices them): the copying optimizer's next-forward weights, one rank without FSDP."""
    lone = num_ranks == 1 and not config.fsdp_on_one_rank
    return 2.0 if lone and uses_copying_optimizer(config) and config.dtype == "bfloat16" else 0.0


def weights_kept_to_backward(config: TrainConfig, num_ranks: int) -> bool:
    """Whether the blocks' gathered weights live from their forward to their backward (the cost
    model prices them): no FSDP on one rank, or FSDP2 without resharding after the forward."""
    if num_ranks == 1 and not config.fsdp_on_one_rank:
        return True
    reshard = config.reshard_after_forward
    return not (num_ranks > 1 if reshard is None else reshard)


def clip_and_step(model, optimizer, max_norm: float, in_optimizer: bool = True) -> torch.Tensor:
    """Clips the gradients' global 2-norm to max_norm and steps the optimizer, then frees the
    gradients; returns the norm before clipping (a device tensor: no host sync). A fused AdamW
    applies the clipping's scale itself (its grad_scale divides each gradient as it reads it),
    which saves a pass that reads and writes every gradient; otherwise torch's clip_grad_norm_
    scales them first. The scale is the reciprocal of clip_grad_norm_'s coefficient
    min(1, max_norm / (norm + 1e-6)), computed on the device; the optimizer takes it in float32.
    A CopyingAdamW (one rank) also writes the next forward's weight copies, which it offers to
    the LoneRankWeights; where those keep the backward's gradients, it reads them, and the norm
    is the one taken as they arrived."""
    copying = isinstance(optimizer, CopyingAdamW)
    lone = getattr(model, "lone_weights", None) if copying else None
    if lone is not None and lone.keeps_gradients:
        gradients, norm = lone.take_gradients()
        if norm is None:
            norm = torch.zeros((), device=next(model.parameters()).device)
        optimizer.gradients_in = gradients
        scaled_in_optimizer = True
    else:
        parameters = [p for p in model.parameters() if p.grad is not None]
        fused = copying or any(group.get("fused") for group in optimizer.param_groups)
        scaled_in_optimizer = fused and in_optimizer
        if scaled_in_optimizer:
            norm = _full(torch.nn.utils.get_total_norm([p.grad for p in parameters]))
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float() if scaled_in_optimizer else None
    if lone is not None:
        optimizer.copies_out = copies = lone.new_copies()  # the next forward's weights
    _step_scaled(optimizer, scale)
    if lone is not None:
        lone.offer_copies(copies)
    optimizer.zero_grad(set_to_none=True)
    return norm


def _step_scaled(optimizer, grad_scale) -> None:
    """optimizer.step(), its gradients divided by grad_scale (a fused optimizer's own scaling)
    where it is not None."""
    optimizer.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None


def _checkpointed_blocks(config: TrainConfig, plan: dict, rank: int) -> tuple[int, int]:
    """How many of the first blocks this rank checkpoints this step (the plan's choice under
    adaptive checkpointing, else all of them or none), and how many of those recompute in full,
    attention included (the plan's choice where the kept attention outputs do not fit)."""
    if not config.activation_checkpointing:
        return 0, 0
    predicted = plan["predicted"]
    chosen = predicted.get("rank_checkpointed_layers") or []
    count = config.model.num_layers
    if config.adaptive_checkpointing and len(chosen) > rank:
        count = int(chosen[rank])
    full = predicted.get("rank_full_recompute_layers") or []
    return count, min(count, int(full[rank])) if len(full) > rank else 0


def _peak_gib(device: torch.device, reset: bool = False) -> float | None:
    """GiB the allocator has held at most since its last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def _allocator_stat(device: torch.device, key: str) -> int | None:
    """A counter of the CUDA caching allocator (cumulative since the process began; None off
    CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get(key, 0))


def _step_line(record: dict, total_steps: int) -> str:
    mfu = "-" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} "
        f"tok/s {record['tokens_per_s']:,.0f} MFU {mfu} "
        f"imbalance planned {record['planned_imbalance']:.3f} "
        f"measured {record['measured_imbalance']:.3f} plan {record['plan_ms']:.2f} ms"
    )


def _mfu(flops: float, step_s: float, num_ranks: int, peak_flops_per_s: float | None):
    if peak_flops_per_s is None:
        return None
    return flops / (step_s * num_ranks * peak_flops_per_s)


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _all_gather_host(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's copy of a host tensor, stacked; on CUDA over the world's gloo twin (the
    loaders' status exchange makes it), so nothing waits for a device's queue."""
    if dist.get_world_size() == 1:
        return local[None]
    group, _ = layout._status_group(None, device)
    buffers = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(buffers, local, group=group)
    return torch.stack(buffers)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
