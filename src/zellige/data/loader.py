"""One rank's data for each training step, planned one step ahead in a loader worker.

Every rank generates the same batch description for a step from (recipe, seed, step) — what
all-gathering the loaders' lengths would give — so every rank's worker makes the same plan and
compiles its own step program (the step pipeline's plan() and compile(), zellige.pipeline) while
the main process trains on the previous step; the PreparedStep crosses to the training process
as is (the program pickles through its C++ binary form, the plan's record is a dataclass). Only
the tensors of the sequences this rank loads (source_rank == rank) are materialised here.

With a global batch (docs/global-batch.md) an item is a `GlobalStepData`: the worker draws the
whole optimizer step's samples, plans its micro-batches (StepPipeline.prepare_global) while the
previous global batch trains, and hands over one StepData per micro-batch, in the order they run.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor

import zellige
from zellige import _core
from zellige.cluster_file import read_cluster_file
from zellige.data.latents import LatentDataError, LatentSource, open_latent_dataset
from zellige.data.synthetic import SourceTensors, SyntheticLatents
from zellige.global_batch import (
    GlobalBatchSize,
    check_global_batch_source,
    draw_global_batch,
    global_plan_from_dict,
)
from zellige.model import DiTConfig
from zellige.pipeline import (
    GlobalStepRecord,
    PreparedStep,
    StepForecast,
    StepPipeline,
    StepRecord,
)
from zellige.profile import priced_as_engine_runs

# A mix of 64x64 images (16 tokens each) and short 64x96 / 64x128 clips (120 and 288 tokens):
# lengths spread 18x like the real recipes, small enough for seconds per step on two CPU cores.
TINY_RECIPE = {
    "model": "tiny-cpu",
    "text_tokens": 8,
    "temporal_stride": 4,
    "mix": [
        {"kind": "image", "height": 64, "width": 64, "share": 0.4},
        {"kind": "video", "frames": 17, "height": 64, "width": 96, "share": 0.3},
        {"kind": "video", "frames": 33, "height": 64, "width": 128, "share": 0.3},
    ],
}


def on_cluster_file(cost_model: _core.CostModel, path: str) -> _core.CostModel:
    """`cost_model` on the cluster file's ranks: each at its node's speed (relative to the cost
    model's profile) and memory, which replaces the cost model's GPU memory."""
    cluster = read_cluster_file(path).to_cluster(cost_model.model, cost_model.profile)
    return _core.CostModel(cost_model.model, cost_model.profile, cluster, cost_model.options)


def load_training_recipe(name: str) -> _core.Recipe:
    """A recipe of shared/workloads/recipes.json by name, or "tiny" (TINY_RECIPE)."""
    if name == "tiny":
        return zellige.workload.recipe_from_dict("tiny", TINY_RECIPE)
    return zellige.load_recipe(name)


def param_count(config: DiTConfig) -> int:
    from zellige.model import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config).parameters())


def model_spec(config: DiTConfig, num_params: int | None = None) -> _core.ModelSpec:
    """The planning core's view of this model (sizes and parameter count), for costs and FLOPs."""
    return _core.ModelSpec(
        name=config.name,
        width=config.width,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        ffn_width=config.ffn_width,
        text_tokens=config.text_tokens,
        joint_attention=config.joint_attention,
        num_double_layers=config.num_double_layers,
        param_count=param_count(config) if num_params is None else num_params,
    )


@dataclass(kw_only=True, slots=True)
class StepData:
    """What one rank needs for one step (picklable: it crosses from the loader worker).

    prepared: this rank's step planned and compiled here, one step ahead (its StepProgram, or the
    error that every rank raises together when the training process loads it, and the plan's
    typed record); the training process loads it as is (Balancer.start)."""

    step: int
    rank: int
    prepared: PreparedStep
    forecast: StepForecast  # the speed factors the plan used and its nominal per-rank times
    num_sequences: int
    total_tokens: int  # over all ranks: the loss normaliser
    train_flops: float  # forward + backward FLOPs of the whole batch (for MFU)
    # Tensors of the sequences this rank loaded, whole, concatenated in batch order.
    source_noisy_TC: Tensor
    source_velocity_TC: Tensor
    source_timestep_T: Tensor  # the sequence's flow time, repeated per token
    source_text_XE: Tensor  # the text rows of the same sequences, concatenated in batch order
    source_text_timestep_X: Tensor  # the sequence's flow time, repeated per text row
    source_text_tokens: list[int] = field(default_factory=list)  # per source sequence

    @property
    def program(self) -> _core.StepProgram | None:
        return self.prepared.program

    @property
    def error(self) -> str | None:
        return self.prepared.error

    @property
    def record(self) -> StepRecord:
        return self.prepared.record

    def pin_memory(self) -> StepData:
        """The tensors in pinned memory (the DataLoader calls this with pin_memory=True), so the
        step copies them to the GPU with non_blocking=True: no host sync."""
        pinned = {
            f.name: value.pin_memory()
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), Tensor)
        }
        return replace(self, **pinned)


@dataclass(kw_only=True, slots=True)
class GlobalStepData:
    """One rank's global batch for one optimizer step (picklable): a StepData per micro-batch,
    in the order they run. Each micro-batch's total_tokens is the whole global batch's (its loss
    normaliser), so the micro-batches' gradients add up to the global batch's."""

    step: int
    rank: int
    micro_batches: tuple[StepData, ...]
    record: GlobalStepRecord
    num_sequences: int
    total_tokens: int  # over all ranks and micro-batches: the loss normaliser
    train_flops: float  # forward + backward FLOPs of the whole global batch (for MFU)

    @property
    def forecast(self) -> StepForecast:
        """The optimizer step's forecast: each rank's times summed over the micro-batches."""
        return StepForecast.summed([m.forecast for m in self.micro_batches])

    def pin_memory(self) -> GlobalStepData:
        return replace(self, micro_batches=tuple(m.pin_memory() for m in self.micro_batches))


def _release_planning_state(dataset_ref: weakref.ref) -> None:
    dataset = dataset_ref()
    if dataset is not None:
        dataset._state = None


class StepDataset(torch.utils.data.Dataset):
    """Map-style: item `step` is this rank's StepData for that step.

    `sequences` fixes the batch of every step (a Batch JSON object's "sequences"), for tests;
    otherwise each step's batch comes from the recipe with seed (seed, step), drawn for
    `data_ranks` loader ranks (default num_ranks). A run resumed on another number of ranks keeps
    its data_ranks, so its steps see the same batches; their sequences are then loaded round
    robin by the num_ranks ranks. `data_dir`: a latent dataset (zellige.data.latents) gives each
    step's batch and latents instead of the recipe and the synthetic latents; a sample that
    cannot be read becomes the step's error, raised on every rank together (never skipped).
    `plan` (a Plan JSON object) replaces the planner, for tests
    that need a particular placement. pipeline() builds the StepPipeline that plans and compiles
    each step (in the process that calls it; the dataset pickles without it) with a cost model
    of `cost_options` (a CostOptions, zellige.train.optimizer_builder.cost_options for a
    training run; None: its defaults).

    `global_batch`: each item is a GlobalStepData, the optimizer step's global batch of that size
    drawn from the recipe (draw_global_batch, for `data_ranks` loader ranks; with `sequences`,
    those are the global batch) cut into micro-batches by `planner`, a global-batch planner
    (zellige.global_batch_planner_names()). `global_plan` (a global plan JSON object of the
    `sequences`, global_plan_to_dict's form) replaces that planner, for tests that need a
    particular cut.

    text_dtype: the dtype of the text rows (SyntheticLatents.source_tensors).

    A step that fits the GPUs' memory only in parts is an item of micro-batches (GlobalStepData)
    of its own samples, cut by the global-batch planner of `planner`'s name
    (micro_batch_planner; gradient accumulation over them gives the same optimizer step), unless
    `micro_batches_when_needed` is off or the planner has no global-batch form: then its plan
    raises PlanMemoryError.
    """

    def __init__(
        self,
        *,
        model: DiTConfig,
        recipe: str,
        planner: str,
        rank: int,
        num_ranks: int,
        gpus_per_node: int,
        seed: int,
        profile: str | None = None,
        cost_options: _core.CostOptions | None = None,
        sequences: list[dict] | None = None,
        plan: dict | None = None,
        data_ranks: int | None = None,
        attention_ragged: bool | None = None,
        gpu_memory_bytes: int | None = None,
        cluster: str | None = None,
        global_batch: GlobalBatchSize | None = None,
        global_plan: dict | None = None,
        data_dir: str | None = None,
        text_dtype: torch.dtype = torch.float32,
        micro_batches_when_needed: bool = True,
    ) -> None:
        if global_plan is not None and sequences is None:
            raise ValueError("a fixed global plan needs the fixed sequences it cuts")
        self.model = model
        self.recipe_name = recipe
        self.planner = planner
        self.rank = rank
        self.num_ranks = num_ranks
        self.gpus_per_node = min(gpus_per_node, num_ranks)
        self.seed = seed
        self.profile = profile
        # what training holds and recomputes (pickles whole to a worker); None: the defaults
        self.cost_options = cost_options
        self.sequences = sequences
        self.fixed_plan = plan
        self.data_ranks = data_ranks or num_ranks
        # whether the engine of the training process runs ragged calls (None: as the profile
        # says); decided there (coalesced.engine_runs_ragged), not in a loader worker, which
        # must not start CUDA
        self.attention_ragged = attention_ragged
        # each GPU's memory the plans must fit (the training device's; None: the profile's)
        self.gpu_memory_bytes = gpu_memory_bytes
        # a cluster file: each rank priced at its node's speed and memory (zellige.cluster_file)
        self.cluster = cluster
        if cluster is not None:
            self.gpus_per_node = read_cluster_file(cluster).gpus_per_node
        self.fixed_global_plan = global_plan
        # a global batch per item (GlobalStepData) instead of one step's batch
        self.global_batch = global_batch
        # a latent dataset (zellige encode) the batches and latents come from; None: the recipe's
        self.data_dir = data_dir
        check_global_batch_source(self.uses_global_batch, data_dir)
        # the text rows' dtype: the model's compute dtype where it casts text to that first
        # (half the bytes to share, pin and copy; the same values after the model's cast)
        self.text_dtype = text_dtype
        # whether a step too large for the GPUs' memory at once may run as micro-batches (off
        # where the optimizer cannot add micro-batches' gradients up)
        self.micro_batches_when_needed = micro_batches_when_needed
        self.num_params = param_count(model)  # here, not in the worker: it builds a meta model
        self._state = None  # built lazily in the process that loads (nanobind objects)

    def __getstate__(self) -> dict:
        # the core objects do not pickle: a spawned worker builds its own
        return {**self.__dict__, "_state": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def pipeline(self) -> StepPipeline:
        """The step pipeline this dataset plans and compiles with (built once per process)."""
        return self._planning_state()[0]

    def _planning_state(self):
        if self._state is None:
            spec = model_spec(self.model, self.num_params)
            profile = zellige.load_profile(self.profile)
            if self.attention_ragged is not None:
                profile = priced_as_engine_runs(profile, self.attention_ragged)
            cost_model = zellige.make_cost_model(
                spec,
                self.num_ranks,
                self.gpus_per_node,
                profile,
                options=self.cost_options,
                gpu_memory_bytes=self.gpu_memory_bytes,
            )
            if self.cluster is not None:
                cost_model = on_cluster_file(cost_model, self.cluster)
            planner = self.planner
            if self.fixed_plan is not None:
                planner = zellige.plan_from_dict(self.fixed_plan)
            if self.uses_global_batch:
                # the planner names the global-batch planner; a micro-batch is placed by it
                global_planner = planner
                if self.fixed_global_plan is not None:
                    fixed = self._fixed_batch()
                    global_planner = global_plan_from_dict(self.fixed_global_plan, fixed)
                pipeline = StepPipeline(
                    spec, cost_model, seed=self.seed, global_planner=global_planner
                )
            else:
                # a step that fits no placement at once runs as micro-batches of its own samples,
                # cut by the global-batch planner of the same name where there is one
                fallback = self.micro_batch_planner
                pipeline = StepPipeline(
                    spec, cost_model, planner, seed=self.seed, global_planner=fallback or "zellige"
                )
            recipe = None if self.sequences is not None else load_training_recipe(self.recipe_name)
            latents = SyntheticLatents(
                token_channels=self.model.token_channels,
                text_dim=self.model.text_dim,
                seed=self.seed,
            )
            if self.data_dir is not None:  # the dataset's batches and latents, not the recipe's
                recipe = None
                latents = LatentSource(
                    open_latent_dataset(self.data_dir),
                    self.model,
                    seed=self.seed,
                    data_ranks=self.data_ranks,
                )
            self._state = (pipeline, recipe, latents)
            # A DataLoader worker keeps its dataset in a torch module global until interpreter
            # teardown, where nanobind reports the core objects still alive as leaks: drop them
            # at exit, before teardown.
            atexit.register(_release_planning_state, weakref.ref(self))
        return self._state

    @property
    def uses_global_batch(self) -> bool:
        return self.global_batch is not None or self.fixed_global_plan is not None

    @property
    def micro_batch_planner(self) -> str | None:
        """The global-batch planner that cuts a step too large for the GPUs' memory at once into
        micro-batches of its own samples (the step's planner's own name; None: the planner has
        no global-batch form, and such a step is refused)."""
        cut_or_placed = self.uses_global_batch or self.fixed_plan is not None  # runs as given
        if cut_or_placed or not self.micro_batches_when_needed:
            return None
        return self.planner if self.planner in _core.global_batch_planner_names() else None

    def _fixed_batch(self) -> _core.Batch:
        return zellige.batch_from_dict({"sequences": self.sequences}, num_ranks=self.num_ranks)

    def batch(self, step: int) -> _core.Batch:
        """Step `step`'s batch (with a global batch: the whole global batch)."""
        _, recipe, latents = self._planning_state()
        if self.sequences is not None:
            return self._fixed_batch()
        if recipe is None:
            batch = latents.batch(step)
        elif self.uses_global_batch:
            batch = draw_global_batch(
                recipe, self.data_ranks, self.global_batch, seed=_step_seed(self.seed, step)
            )
        else:
            batch = zellige.generate_batch(recipe, self.data_ranks, _step_seed(self.seed, step))
        if self.data_ranks == self.num_ranks:
            return batch
        data = zellige.batch_to_dict(batch)
        for index, sequence in enumerate(data["sequences"]):
            sequence["source_rank"] = index % self.num_ranks
        return zellige.batch_from_dict(data, num_ranks=self.num_ranks)

    def __len__(self) -> int:
        return 2**62

    def plan(self, step: int) -> _core.Plan | _core.GlobalPlan:
        """Step `step`'s plan (with a global batch its GlobalPlan), as the loader makes it for
        that step (every rank alike)."""
        return self._plan(self.pipeline(), self.batch(step), _step_seed(self.seed, step), None)

    def _plan(
        self,
        pipeline: StepPipeline,
        batch: _core.Batch,
        seed: int,
        factors: Sequence[float] | None,
    ) -> _core.Plan | _core.GlobalPlan:
        """The plan of a step's batch: a GlobalPlan with a global batch, or when the step fits
        the GPUs' memory only as micro-batches (gradient accumulation over them gives the same
        optimizer step); otherwise a Plan. Raises PlanMemoryError when neither fits."""
        if self.uses_global_batch:
            return pipeline.plan_global(batch, seed=seed, speed_factors=factors)
        try:
            return pipeline.plan(batch, seed=seed, speed_factors=factors)
        except _core.PlanMemoryError:
            if self.micro_batch_planner is None:
                raise
            return pipeline.plan_global(batch, seed=seed, speed_factors=factors)

    def __getitem__(self, index: int | StepRequest) -> StepData | GlobalStepData:
        request = index if isinstance(index, StepRequest) else StepRequest(step=index)
        step, factors = request.step, request.speed_factors
        pipeline = self.pipeline()
        batch = self.batch(step)
        seed = _step_seed(self.seed, step)
        total_tokens = zellige.total_tokens(batch)
        plan = self._plan(pipeline, batch, seed, factors)
        if isinstance(plan, _core.Plan):
            prepared = pipeline.prepare(batch, self.rank, index=step, plan=plan)
            forecast = StepForecast.from_plan(pipeline.cost_model, batch, plan, factors)
            return self._step_data(step, batch, prepared, forecast, total_tokens)
        prepared = pipeline.prepare_micro_batches(batch, plan, self.rank, index=step)
        micro_batches = tuple(
            self._step_data(
                step,
                micro.batch,
                micro_prepared,
                StepForecast.from_plan(pipeline.cost_model, micro.batch, micro.plan, factors),
                total_tokens,
            )
            for micro, micro_prepared in zip(
                plan.micro_batches, prepared.micro_batches, strict=True
            )
        )
        return GlobalStepData(
            step=step,
            rank=self.rank,
            micro_batches=micro_batches,
            record=prepared.record,
            num_sequences=len(batch.sequences),
            total_tokens=total_tokens,
            train_flops=sum(m.train_flops for m in micro_batches),
        )

    def _step_data(
        self,
        step: int,
        batch: _core.Batch,
        prepared: PreparedStep,
        forecast: StepForecast,
        total_tokens: int,
    ) -> StepData:
        """This rank's tensors of `batch` (a step's, or a micro-batch's) beside its prepared
        program and its plan's forecast; `total_tokens` is the loss normaliser."""
        pipeline, _, latents = self._planning_state()
        spec = pipeline.spec
        channels, text_dim = self.model.token_channels, self.model.text_dim
        mine = [s for s in batch.sequences if s.source_rank == self.rank]
        try:
            source = latents.source_tensors(step=step, sequences=mine, text_dtype=self.text_dtype)
        except LatentDataError as error:  # every rank raises it with the step (load)
            prepared = replace(prepared, error=f"rank {self.rank}: {error}")
            source = SourceTensors(
                noisy_TC=torch.empty(0, channels),
                velocity_TC=torch.empty(0, channels),
                timestep_T=torch.empty(0),
                text_XE=torch.empty(0, text_dim, dtype=self.text_dtype),
                text_timestep_X=torch.empty(0),
            )
        return StepData(
            step=step,
            rank=self.rank,
            prepared=prepared,
            forecast=forecast,
            num_sequences=len(batch.sequences),
            total_tokens=total_tokens,
            train_flops=float(
                sum(zellige.train_flops(spec, s.num_tokens, s.text_tokens) for s in batch.sequences)
            ),
            source_noisy_TC=source.noisy_TC,
            source_velocity_TC=source.velocity_TC,
            source_timestep_T=source.timestep_T,
            source_text_XE=source.text_XE,
            source_text_timestep_X=source.text_timestep_X,
            source_text_tokens=source.text_tokens,
        )


@dataclass(frozen=True, slots=True)
class StepRequest:
    """What the training process asks of the loader for one step: its index and the speed
    factors its plan uses (None: the cluster's own speeds)."""

    step: int
    speed_factors: tuple[float, ...] | None = None


class _StepRequests:
    """The loader's sampler: one StepRequest per step, in order. The DataLoader draws a request
    in the training process when it hands the step to a worker (its prefetch depth ahead of the
    step that trains), so the request carries the speed factors `speed_factors()` returns then:
    the channel from the training loop's measurements to the worker's planner."""

    def __init__(
        self,
        first_step: int,
        num_steps: int,
        speed_factors: Callable[[], tuple[float, ...] | None] | None,
    ) -> None:
        self._steps = range(first_step, first_step + num_steps)
        self._speed_factors = speed_factors

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepRequest]:
        for step in self._steps:
            factors = None if self._speed_factors is None else self._speed_factors()
            yield StepRequest(step=step, speed_factors=factors)


def make_loader(
    dataset: StepDataset,
    first_step: int,
    num_steps: int,
    num_workers: int,
    cuda: bool,
    speed_factors: Callable[[], tuple[float, ...] | None] | None = None,
) -> torch.utils.data.DataLoader:
    """Steps first_step .. first_step + num_steps - 1 in order; with workers, step k + 1 (and
    k + 2) is generated and planned while step k trains. With CUDA the workers are spawned, not
    forked: a fork of a process that has initialised CUDA must not touch it, and torch may.
    speed_factors: called in this process as each step is handed to the loader; what it returns
    is the speed factors that step's plan uses (the same on every rank: their plans agree)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=_StepRequests(first_step, num_steps, speed_factors),
        num_workers=num_workers,
        prefetch_factor=2 if num_workers > 0 else None,
        persistent_workers=False,
        pin_memory=cuda,
        multiprocessing_context="spawn" if cuda and num_workers > 0 else None,
    )


def _step_seed(seed: int, step: int) -> int:
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint32)[0])
