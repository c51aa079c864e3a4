"""The training loop that torchrun runs: rectified flow on the reference DiT under any planner."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import record_function
from tqdm import tqdm

import zellige
from zellige.balancer import Balancer
from zellige.cluster_file import read_cluster_file
from zellige.costs import device_memory_bytes, planning_device
from zellige.data import (
    GlobalStepData,
    StepDataset,
    load_training_recipe,
    make_loader,
    model_spec,
)
from zellige.data.latents import open_latent_dataset
from zellige.data.loader import on_cluster_file
from zellige.model import MMDiT, ModelNumerics, VideoDiT, fused
from zellige.model import build_model as reference_model
from zellige.pipeline import (
    JOINT,
    GlobalStepRecord,
    StepRecord,
    check_global_planner_name,
    make_global_plan,
    make_step_plan,
)
from zellige.profile import priced_as_engine_runs
from zellige.runtime import EngineConfig, engine_runs_ragged
from zellige.runtime.backends import prepare_step_tables
from zellige.runtime.collector import QuietCollector
from zellige.train.accumulation import accumulate
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
from zellige.train.config import TrainConfig, check_world, global_batch_size, validate_config
from zellige.train.metrics import (
    MetricsSinks,
    StepEnd,
    allocator_stat,
    busy_seconds,
    finish_step,
    peak_gib,
    step_line,
    summary,
    time_mark,
)
from zellige.train.mmdit_step import assemble_joint_step, joint_step_loss
from zellige.train.optimizer_builder import (
    clip_and_step,
    cost_options,
    full_tensor,
    make_optimizer,
)
from zellige.train.parallelize import DTYPES, parallelize, set_checkpointed_blocks
from zellige.train.speeds import SlowRank, SpeedEstimate
from zellige.train.step import StepInput, assemble_step
from zellige.train.timing import StepTimer
from zellige.train.watchdog import RankWatch, TrainingFailed

# The CUDA caching allocator's setting a run gets unless PYTORCH_CUDA_ALLOC_CONF is set: a step's
# lengths change every step and fixed segments fragment (opensora2-stage2 on an H100 80GB ran out
# of memory with 62.7 GiB allocated and 12.3 GiB reserved but unusable); expandable segments
# grow one mapping in place.
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"


def default_allocator_settings(environ: dict | None = None) -> None:
    """Sets PYTORCH_CUDA_ALLOC_CONF to DEFAULT_CUDA_ALLOC_CONF where the user did not set it
    (an empty value counts as set). The allocator reads it once, when CUDA initialises: call
    this first (the trainer's entry point and train() do; train() leaves an initialised CUDA
    as it is)."""
    environ = os.environ if environ is None else environ
    environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", DEFAULT_CUDA_ALLOC_CONF)


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
    if config.parallelism.cluster is not None:
        cluster_file = read_cluster_file(config.parallelism.cluster)
        if cluster_file.num_ranks != num_ranks:
            raise ValueError(
                f"--cluster {config.parallelism.cluster}: its nodes hold "
                f"{cluster_file.num_ranks} GPUs, this run has {num_ranks} ranks "
                "(torchrun --nproc-per-node x nodes)"
            )
        # the file's nodes give the node size
        config = config.with_fields(gpus_per_node=cluster_file.gpus_per_node)
    check_world(config, num_ranks)
    if config.parallelism.device == "cuda":
        _require_cuda(config)
    _check_planning(config, num_ranks)
    if config.data.data_dir is not None:  # manifest, shards present, channels and text width
        open_latent_dataset(config.data.data_dir).check_model(config.model.dit)
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
        return RunStart(
            first_step=0, checkpoint=None, data_ranks=config.data.data_ranks or num_ranks
        )
    info = find_checkpoint(resume_dir)
    if config.steps < info.step:
        raise ValueError(
            f"--steps {config.steps} is below the step of checkpoint {info.path} ({info.step}); "
            f"--steps counts all steps, resumed ones included: pass more than {info.step}"
        )
    model = dataclasses.asdict(config.model.dit)
    keys = sorted(model.keys() | info.model.keys())
    differ = [key for key in keys if model.get(key) != info.model.get(key)]
    if differ:
        key = differ[0]
        raise ValueError(
            f"checkpoint {info.path} holds another model: its {key} is "
            f"{info.model.get(key)!r}, this run's {model.get(key)!r}"
        )
    if config.data.data_ranks is not None and config.data.data_ranks != info.data_ranks:
        raise ValueError(
            f"data_ranks {config.data.data_ranks} differs from the checkpoint's {info.data_ranks}: "
            "the resumed run would see other batches (leave data_ranks unset)"
        )
    check_resumable(info, config, num_ranks)
    return RunStart(first_step=info.step, checkpoint=info, data_ranks=info.data_ranks)


def _check_planning(config: TrainConfig, num_ranks: int) -> None:
    """The recipe, profile and planner name resolve, and the planner accepts this cluster:
    planned here on a token per rank, not in a loader worker after the model is built."""
    load_training_recipe(config.data.recipe)
    if (
        config.parallelism.planner == JOINT
    ):  # time-limited: ranks could stop at different incumbents
        raise ValueError("the joint MILP reference is for comparisons, not training")
    spec = model_spec(config.model.dit)
    cost_model = zellige.make_cost_model(
        spec,
        num_ranks,
        min(config.parallelism.gpus_per_node, num_ranks),
        config.parallelism.profile,
    )
    sequences = [
        {"id": r, "num_tokens": 1, "text_tokens": 0, "source_rank": r} for r in range(num_ranks)
    ]
    batch = zellige.batch_from_dict({"sequences": sequences}, num_ranks=num_ranks)
    if config.parallelism.cluster is not None:  # its profiles load, its ranks' memory is in range
        cost_model = on_cluster_file(cost_model, config.parallelism.cluster)
    planner = config.parallelism.planner
    if config.data.global_batch is None:
        make_step_plan(planner, batch, cost_model, seed=0)
        return
    # with a global batch the planner cuts it into micro-batches (a global-batch planner)
    check_global_planner_name(planner)
    if not accumulates_gradients(config, num_ranks):
        raise ValueError(
            "compute_dtype_gradients hands one backward's gradients to the optimizer as they "
            "are: a global batch's micro-batches add theirs up (leave it unset)"
        )
    make_global_plan(planner, batch, cost_model, seed=0)


def accumulates_gradients(config: TrainConfig, num_ranks: int) -> bool:
    """Whether the optimizer can take micro-batches' gradients added up: not where it is handed
    one backward's compute-dtype gradients as they are (one rank without FSDP)."""
    return not (
        config.optimizer.compute_dtype_gradients
        and num_ranks == 1
        and not config.parallelism.fsdp_on_one_rank
    )


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
    A collective that waits more than config.parallelism.timeout_s fails instead of hanging."""
    if config.parallelism.device == "cuda":
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
            backend=config.parallelism.backend,
            device_id=device_id,
            timeout=datetime.timedelta(seconds=config.parallelism.timeout_s),
        )
    return device


def build_model(config: TrainConfig, device: torch.device, timer: StepTimer) -> VideoDiT | MMDiT:
    """The sharded model of a resolved config (TrainConfig.resolved). On CUDA it is built on the
    meta device and initialised after sharding (no rank ever holds the whole model); on CPU
    built whole, identical on every rank."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    numerics = ModelNumerics(
        row_multiple=8 if config.model.pad_sequence_rows else 1,
        split_pieces=config.model.split_modulation,
        gathered_head=config.model.gathered_head,
    )
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        with torch.device("meta"):
            model = reference_model(config.model.dit, numerics)
    else:
        model = reference_model(config.model.dit, numerics)
    parallelize(
        model,
        mesh,
        dtype=config.model.dtype,
        activation_checkpointing=config.parallelism.activation_checkpointing,
        timer=timer,
        compile_elementwise=config.model.compile_elementwise,
        compile_outside=config.model.compile_outside,
        reshard_after_forward=config.parallelism.reshard_after_forward,
        fsdp_on_one_rank=config.parallelism.fsdp_on_one_rank,
        copying_optimizer=config.optimizer.copying_optimizer,
        compute_dtype_gradients=config.optimizer.compute_dtype_gradients,
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
    global_plan: dict | None = None,
    progress: bool = True,
) -> list[dict]:
    """Runs config.steps steps (counting the resumed ones); returns each step's metrics (the same
    on every rank). `sequences` fixes every step's batch (tests); with a global batch,
    `global_plan` (global_plan_to_dict's form) fixes its cut into micro-batches (tests). Bad
    input raises ValueError before training; a non-finite loss or a stuck rank raises
    TrainingFailed."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_initialized():
        default_allocator_settings()
    start = preflight(
        config,
        num_ranks=world_size,
        metrics_path=metrics_path,
        out_dir=out_dir,
        resume_dir=resume_dir,
        tensorboard_dir=tensorboard_dir,
        wandb_project=wandb_project,
    )
    config = config.resolved(world_size)  # the None choices made: from here on, bools
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
    warmup = max(config.optimizer.warmup_steps, 1)
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
    cuda = device.type == "cuda"
    profile, gpu_memory_bytes, notes = planning_device(
        config.parallelism.profile,
        torch.cuda.get_device_name(device) if cuda else None,
        device_memory_bytes(device) if cuda else None,
    )
    for note in notes:
        say(note)
    profile_note = _profile_note(profile, device)
    if profile_note:
        say(profile_note)
    # the attention engine's choices, made once for the run (the documented overrides); the
    # planner prices attention as this engine runs it (ragged calls or dense)
    engine = EngineConfig.from_env()
    attention_ragged = engine_runs_ragged(
        device, getattr(torch, config.model.dtype), config.model.dit.head_dim, engine
    )
    priced_as_engine_runs(zellige.load_profile(profile), attention_ragged, say)

    dataset = StepDataset(
        model=config.model.dit,
        recipe=config.data.recipe,
        planner=config.parallelism.planner,
        rank=rank,
        num_ranks=num_ranks,
        data_ranks=start.data_ranks,
        gpus_per_node=config.parallelism.gpus_per_node,
        cluster=config.parallelism.cluster,
        seed=config.seed,
        profile=profile,
        gpu_memory_bytes=gpu_memory_bytes,
        cost_options=cost_options(config, num_ranks),
        sequences=sequences,
        attention_ragged=attention_ragged,
        global_batch=global_batch_size(config),
        global_plan=global_plan,
        data_dir=config.data.data_dir,
        # a bf16 model casts the text to bf16 before its first use: the loader sends it so
        text_dtype=torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32,
        micro_batches_when_needed=accumulates_gradients(config, num_ranks),
    )
    _check_first_step_fits(dataset, first_step, say)
    num_steps = config.steps - first_step
    # measured on every run (logged); plans use it with adapt_speeds (train/speeds.py)
    speeds = SpeedEstimate(
        num_ranks,
        smoothing=config.parallelism.speed_smoothing,
        start_step=config.parallelism.adapt_speeds_start_step,
    )
    loader = make_loader(
        dataset,
        first_step,
        num_steps,
        config.data.loader_workers,
        cuda=device.type == "cuda",
        speed_factors=speeds.speed_factors if config.parallelism.adapt_speeds else None,
    )
    sinks = MetricsSinks(
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
    watch = RankWatch(rank, num_ranks, config.parallelism.timeout_s)
    last_saved = start.checkpoint.path if start.checkpoint is not None else None
    run = run_fields(config)  # what each checkpoint records (the data's digest read once)
    saved_now = None  # the newest checkpoint this run wrote
    history = []
    run_start = time.perf_counter()
    # the trainer is a user of the public Balancer: the loader worker plans and compiles each
    # step one ahead with the same pipeline, the Balancer loads it
    balancer = Balancer.from_pipeline(
        dataset.pipeline(), device=device, plan_ahead=False, engine=engine
    )
    ahead = StepsAhead(iter(loader), config, device, balancer)
    slow = SlowRank.from_env(num_ranks)  # test-only
    collector = QuietCollector(enabled=config.freeze_gc)
    pending = None  # a late step's StepEnd, finished by the next step
    try:
        for step in range(first_step, config.steps):
            done = step + 1
            due = (
                config.checkpoint.checkpoint_every
                and done % config.checkpoint.checkpoint_every == 0
            )
            saving = bool(out_dir) and (due or done == config.steps)
            # a step that saves, and the last one, end with a full sync (no step after them)
            late = config.metrics.metrics_one_step_late and done < config.steps and not saving
            try:
                records, pending = train_step(
                    config, model, optimizer, scheduler, timer, device, ahead, step, watch,
                    pending, late, speeds=speeds, slow=slow,
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
                    bar.write(step_line(record, config.steps) + _micro_batch_note(config, record))
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
                        model_config=config.model.dit,
                        run=run,
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
        print(summary(history, seconds, num_ranks, saved_now, metrics_path), flush=True)
    return history


class StepsAhead:
    """Each step's data and inputs (train/step.py: the step program loaded, the features routed,
    the attention tables on the device), made while the previous step's optimizer still runs
    on the device: the host work of a step's setup overlaps the device's work instead of
    leaving it idle at the step's start. The first step's inputs are made before it starts."""

    def __init__(
        self, loader_iter, config: TrainConfig, device: torch.device, balancer: Balancer
    ) -> None:
        self._loader_iter = loader_iter
        self._config = config
        self._device = device
        self._balancer = balancer
        self._ready = None  # (step, data, inputs, seconds waited for the loader) or an error

    def prepare(self, step: int) -> None:
        """Makes step `step`'s inputs now; an error is raised by take(step), in its own step."""
        try:
            wait_start = time.perf_counter()
            data = next(self._loader_iter)
            wait_s = time.perf_counter() - wait_start
            # a global batch: its first micro-batch's inputs (the others are made as it trains)
            first = data.micro_batches[0] if isinstance(data, GlobalStepData) else data
            inputs = self.assemble(first)
            self._ready = (step, data, inputs, wait_s)
        except Exception as error:  # noqa: BLE001 (raised again by take, in its own step)
            self._ready = (step, error)

    def assemble(self, data):
        """One step's (or micro-batch's) inputs on the device: its program loaded by the
        Balancer and the loader's tensors routed."""
        dit = self._config.model.dit
        assemble = assemble_joint_step if dit.joint_attention else assemble_step  # MMDiT: joint
        with record_function("zellige.step.setup"):
            inputs = assemble(data, dit.num_heads, self._device, self._balancer)
            # the attention tables' choices now, with the cuDNN graphs a new shape bucket
            # needs (host work), while the device still runs the previous step
            prepare_step_tables(inputs.step, DTYPES[self._config.model.dtype], dit.head_dim)
            return inputs

    def take(self, step: int):
        """(data, inputs, seconds waited for the loader) of step `step`."""
        if self._ready is None or self._ready[0] != step:
            self.prepare(step)
        ready, self._ready = self._ready, None
        if len(ready) == 2:
            raise ready[1]
        return ready[1:]


def forward_backward_step(
    config: TrainConfig, model, step_input, total_tokens: int, timer: StepTimer
) -> torch.Tensor:
    """The step's forward and backward on this rank: returns its share of the loss, detached
    (the gradients are in the model)."""
    # the phases are named for torch.profiler (bench/train_throughput.py --trace)
    with record_function("zellige.step.forward"):
        loss_of = joint_step_loss if config.model.dit.joint_attention else step_loss
        local_loss = loss_of(model, step_input, total_tokens, timer)
    with record_function("zellige.step.backward"):
        # FSDP averages gradients over ranks: scaling by the rank count makes that their sum
        (local_loss * dist.get_world_size()).backward()
    # the graph's last reference: its nodes hold the forward's leaves (on one rank without FSDP
    # the bf16 weight copies, a copy of every weight), which would otherwise live through the
    # optimizer step beside the next step's copies (the cost model's peak has one set)
    return local_loss.detach()


def train_step(
    config,
    model,
    optimizer,
    scheduler,
    timer,
    device,
    ahead,
    step,
    watch,
    before,
    late,
    *,
    speeds: SpeedEstimate | None = None,
    slow: SlowRank | None = None,
) -> tuple[list[dict], StepEnd | None]:
    """One optimizer step. Returns the metrics records finished in it (gathered: the same on
    every rank) and, when `late`, this step's StepEnd, which the next call finishes (as
    `before`) after issuing its own forward and backward and before its optimizer step; so the
    host never waits for the device between steps, and a non-finite loss or gradient norm still
    stops the run before the next update is applied. Not late: the step ends with a full sync
    and returns its own record. `ahead` (StepsAhead) holds the step's inputs; the next step's
    are made after this step's optimizer step is issued. `speeds` takes in each finished step's
    measured times; `slow` (a test hook) slows a rank."""
    rank = dist.get_rank()
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
    start = before.end if before is not None else time_mark(device)
    timer.reset()
    checkpointed, full_recompute = _checkpointed_blocks(data.record, rank)
    sync_check = config.metrics.sync_debug and device.type == "cuda"
    if sync_check:
        # every host sync until the next step's inputs are made (the step's end waits)
        torch.cuda.set_sync_debug_mode("warn")
    if isinstance(data, GlobalStepData):
        # gradient accumulation over the planned micro-batches (train/accumulation.py)
        local_loss = accumulate(
            model,
            data.micro_batches,
            step_input,
            rank=rank,
            assemble=ahead.assemble,
            forward_backward=lambda micro_input, micro: forward_backward_step(
                config, model, micro_input, micro.total_tokens, timer
            ),
        )
    else:
        set_checkpointed_blocks(model, checkpointed, full_recompute)
        local_loss = forward_backward_step(config, model, step_input, data.total_tokens, timer)
    injected_s = 0.0
    if slow is not None:  # the test hook: a sleep that stands for a slower device's work
        injected_s = slow.delay_s(rank, busy_seconds(timer.seconds()), data.forecast)
        time.sleep(injected_s)
    # the step's peak split by phase (the cost model's is the larger of the two)
    peak_backward_gib = peak_gib(device, reset=True)
    records = []
    if before is not None:
        # the previous step's values: the device passed them long ago (this step's forward and
        # backward are queued behind them); a non-finite one raises before this step's update
        with record_function("zellige.step.previous_metrics"):
            records.append(finish_step(config, before, device, speeds))
    with record_function("zellige.step.optimizer"):
        grad_norm = clip_and_step(
            model, optimizer, config.optimizer.grad_clip_norm, config.optimizer.clip_in_optimizer
        )
        scheduler.step()
    del step_input  # its tensors are free once the device is done with them
    if step + 1 < config.steps:
        ahead.prepare(step + 1)  # host work while the device runs this step's tail
    if sync_check:
        torch.cuda.set_sync_debug_mode("default")
    with record_function("zellige.step.end"):
        # the allocator's counters first, before the few bytes below
        peak_optimizer_gib = peak_gib(device)  # clipping and the optimizer step
        # the caching allocator's state after the step: a retry frees cached blocks and waits
        # for the device (a stall in the step); reserved: what it holds from the driver
        alloc_retries = allocator_stat(device, "num_alloc_retries")
        reserved = allocator_stat(device, "reserved_bytes.all.peak")
        # the loss and norm go to the host behind the step's work (no wait here); their device
        # tensors are freed now, not held to the next step
        values = torch.stack(
            [local_loss.detach().double(), full_tensor(grad_norm).detach().double()]
        )
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
            end=time_mark(device),
            peak_backward_gib=peak_backward_gib,
            peak_optimizer_gib=peak_optimizer_gib,
            allocated_start_gib=allocated_start_gib,
            alloc_retries=alloc_retries,
            reserved_gib=None if reserved is None else reserved / 2**30,
            lr=scheduler.get_last_lr()[0],
            injected_s=injected_s,
        )
        if late:
            return records, ended
        _synchronize(device)
        records.append(finish_step(config, ended, device, speeds))
    return records, None


def _seed_of(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint32)[0])


def _check_first_step_fits(dataset: StepDataset, step: int, say: Callable[[str], None]) -> None:
    """The first step's plan, made once here before training starts: a batch that no placement
    fits in the GPUs' memory stops the run with one line on every rank (all plan it alike); one
    that fits only as micro-batches of its samples says so (the run's steps then run so where
    they need to)."""
    capacity_gib = dataset.pipeline().cost_model.memory_capacity_bytes() / 2**30
    try:
        plan = dataset.plan(step)
    except zellige.PlanMemoryError as error:
        hint = ""
        if dataset.micro_batch_planner is None and not dataset.uses_global_batch:
            hint = ", cut steps into micro-batches (global_batch, docs/global-batch.md)"
        raise ValueError(
            f"step {step + 1} does not fit in {capacity_gib:.1f} GiB per GPU ({error}); train "
            f"on more ranks, keep activation checkpointing on{hint}, or use a recipe of smaller "
            "buckets"
        ) from None
    if isinstance(plan, zellige.GlobalPlan) and not dataset.uses_global_batch:
        say(
            f"memory: step {step + 1} does not fit in {capacity_gib:.1f} GiB per GPU at once; it "
            f"runs as {len(plan.micro_batches)} micro-batches of its samples (gradient "
            "accumulation: the same optimizer step), as does every step that needs it"
        )


def _profile_note(profile: str | None, device: torch.device) -> str | None:
    """None when the cost model's profile was measured on this kind of device; otherwise the
    line that says its predicted times are not comparable with the measured ones."""
    loaded = zellige.load_profile(profile)
    if device.type == "cuda":
        here = torch.cuda.get_device_name(device)
        same = loaded.device_name == here
    else:
        here = "CPU"
        same = loaded.device_name.startswith("CPU")
    if same:
        return None
    source = profile or "the built-in profile"
    return (
        f"cost model: {source} ({loaded.device_name}); this run is on {here}, so the "
        "predicted step times are the profile's device's, not comparable with the measured "
        "ones (zellige profile measures this machine; pass its file with --profile)"
    )


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


def _checkpointed_blocks(record: StepRecord | GlobalStepRecord, rank: int) -> tuple[int, int]:
    """How many of the first blocks this rank checkpoints this step, and how many of those
    recompute in full, attention included: the cost model's choice (all blocks or none without
    adaptive checkpointing; full recompute where the kept attention outputs do not fit). A
    global batch's micro-batches each set their own; this is the most of any of them."""
    return record.checkpointed_blocks(rank)


def _micro_batch_note(config: TrainConfig, record: dict) -> str:
    """With a global batch, the step line's tail: micro-batches, measured and predicted time."""
    if config.data.global_batch is None and record["micro_batches"] == 1:
        return ""
    return (
        f" micro-batches {record['micro_batches']} step {record['step_s']:.4g} s "
        f"(predicted {record['predicted_makespan_s']:.4g} s)"
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
