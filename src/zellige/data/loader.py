"""One rank's data for each training step, planned one step ahead in a loader worker.

Every rank generates the same batch description for a step from (recipe, seed, step) — what
all-gathering the loaders' lengths would give — so every rank's worker makes the same plan and
compiles its own step program (the step pipeline's plan() and compile(), zellige.pipeline) while
the main process trains on the previous step; the PreparedStep crosses to the training process
as is (the program pickles through its C++ binary form, the plan's record is a dataclass). Only
the tensors of the sequences this rank loads (source_rank == rank) are materialised here.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor

import zellige
from zellige import _core
from zellige.cluster_file import read_cluster_file
from zellige.data.synthetic import SyntheticLatents
from zellige.model import DiTConfig
from zellige.pipeline import PreparedStep, StepForecast, StepPipeline, StepRecord
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
    robin by the num_ranks ranks. `plan` (a Plan JSON object) replaces the planner, for tests
    that need a particular placement. pipeline() builds the StepPipeline that plans and compiles
    each step (in the process that calls it; the dataset pickles without it).
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
        activation_checkpointing: bool = True,
        adaptive_checkpointing: bool = False,
        weights_kept_to_backward: bool = False,
        gradient_bytes_per_param: float = 4.0,
        optimizer_copy_bytes_per_param: float = 0.0,
        sequences: list[dict] | None = None,
        plan: dict | None = None,
        data_ranks: int | None = None,
        attention_ragged: bool | None = None,
        gpu_memory_bytes: int | None = None,
        cluster: str | None = None,
    ) -> None:
        self.model = model
        self.recipe_name = recipe
        self.planner = planner
        self.rank = rank
        self.num_ranks = num_ranks
        self.gpus_per_node = min(gpus_per_node, num_ranks)
        self.seed = seed
        self.profile = profile
        self.activation_checkpointing = activation_checkpointing
        self.adaptive_checkpointing = adaptive_checkpointing
        self.weights_kept_to_backward = weights_kept_to_backward
        self.gradient_bytes_per_param = gradient_bytes_per_param
        self.optimizer_copy_bytes_per_param = optimizer_copy_bytes_per_param
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
                activation_checkpointing=self.activation_checkpointing,
                adaptive_checkpointing=self.adaptive_checkpointing,
                weights_kept_to_backward=self.weights_kept_to_backward,
                gradient_bytes_per_param=self.gradient_bytes_per_param,
                optimizer_copy_bytes_per_param=self.optimizer_copy_bytes_per_param,
                gpu_memory_bytes=self.gpu_memory_bytes,
            )
            if self.cluster is not None:
                cost_model = on_cluster_file(cost_model, self.cluster)
            planner = self.planner
            if self.fixed_plan is not None:
                planner = zellige.plan_from_dict(self.fixed_plan)
            pipeline = StepPipeline(spec, cost_model, planner, seed=self.seed)
            recipe = None if self.sequences is not None else load_training_recipe(self.recipe_name)
            latents = SyntheticLatents(
                token_channels=self.model.token_channels,
                text_dim=self.model.text_dim,
                seed=self.seed,
            )
            self._state = (pipeline, recipe, latents)
            # A DataLoader worker keeps its dataset in a torch module global until interpreter
            # teardown, where nanobind reports the core objects still alive as leaks: drop them
            # at exit, before teardown.
            atexit.register(_release_planning_state, weakref.ref(self))
        return self._state

    def batch(self, step: int) -> _core.Batch:
        _, recipe, _ = self._planning_state()
        if self.sequences is not None:
            return zellige.batch_from_dict({"sequences": self.sequences}, num_ranks=self.num_ranks)
        batch = zellige.generate_batch(recipe, self.data_ranks, _step_seed(self.seed, step))
        if self.data_ranks == self.num_ranks:
            return batch
        data = zellige.batch_to_dict(batch)
        for index, sequence in enumerate(data["sequences"]):
            sequence["source_rank"] = index % self.num_ranks
        return zellige.batch_from_dict(data, num_ranks=self.num_ranks)

    def __len__(self) -> int:
        return 2**62

    def plan(self, step: int) -> _core.Plan:
        """Step `step`'s plan, as the loader makes it for that step (every rank alike)."""
        return self.pipeline().plan(self.batch(step), seed=_step_seed(self.seed, step))

    def __getitem__(self, index: int | StepRequest) -> StepData:
        request = index if isinstance(index, StepRequest) else StepRequest(step=index)
        step = request.step
        pipeline, _, latents = self._planning_state()
        spec = pipeline.spec
        batch = self.batch(step)
        seed = _step_seed(self.seed, step)
        plan = pipeline.plan(batch, seed=seed, speed_factors=request.speed_factors)
        prepared = pipeline.prepare(batch, self.rank, index=step, plan=plan)

        noisy, velocity, timestep, text, text_timestep, text_tokens = [], [], [], [], [], []
        for sequence in batch.sequences:
            if sequence.source_rank != self.rank:
                continue
            sample = latents.sample(
                step=step,
                sequence_id=sequence.id,
                grid_thw=(sequence.grid_t, sequence.grid_h, sequence.grid_w),
                text_tokens=sequence.text_tokens,
            )
            noisy.append(sample.noisy_LC)
            velocity.append(sample.velocity_LC)
            timestep.append(torch.full((sequence.num_tokens,), sample.timestep))
            text.append(sample.text_XE)
            text_timestep.append(torch.full((sequence.text_tokens,), sample.timestep))
            text_tokens.append(sequence.text_tokens)
        channels, text_dim = self.model.token_channels, self.model.text_dim
        return StepData(
            step=step,
            rank=self.rank,
            prepared=prepared,
            forecast=StepForecast.from_plan(
                pipeline.cost_model, batch, plan, request.speed_factors
            ),
            num_sequences=len(batch.sequences),
            total_tokens=zellige.total_tokens(batch),
            train_flops=float(
                sum(zellige.train_flops(spec, s.num_tokens, s.text_tokens) for s in batch.sequences)
            ),
            source_noisy_TC=_cat(noisy, (0, channels)),
            source_velocity_TC=_cat(velocity, (0, channels)),
            source_timestep_T=_cat(timestep, (0,)),
            source_text_XE=_cat(text, (0, text_dim)),
            source_text_timestep_X=_cat(text_timestep, (0,)),
            source_text_tokens=text_tokens,
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


def _cat(tensors: list[Tensor], empty_shape: tuple[int, ...]) -> Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(empty_shape)
