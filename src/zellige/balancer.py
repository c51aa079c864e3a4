"""Balancer: Zellige in a training loop that has its own model, data loader and optimiser.

Each rank hands the balancer the samples its own loader drew. The balancer gathers their sizes
across the ranks (one all_gather_object), places the step's sequences with a planner, and gives
back a `BalancedStep`: the rank's share of the step (tokens routed to where the plan put them),
the attention callables the model calls instead of its own attention, the way back for outputs,
and the loss normalisation that makes loss and gradients those of data parallelism.

    balancer = zellige.Balancer("my_dit.toml", planner="zellige", device=device)
    for samples in loader:                          # this rank's samples: list[zellige.Sample]
        step = balancer.step(samples)
        held = step.inputs()                        # dicts of held tensors (below)
        v_TC = model(held.tokens["latents"], held.samples["timestep"], held.text["text"],
                     step.attention, step.cross_attention, step.chunk_index, step.position_ids)
        loss = step.loss((v_TC - held.tokens["target"]).square().mean(-1))
        (loss * step.num_ranks).backward()          # DDP / FSDP average gradients over ranks

A global batch (one optimizer step's samples, more than the GPUs hold at once) runs as planned
micro-batches with gradient accumulation (docs/global-batch.md, "Training with micro-batches"):

    for samples in loader:                          # this rank's share of the global batch
        for step in balancer.global_step(samples):  # its micro-batches, in order
            ...                                     # as above: inputs, model, step.loss
            (loss * step.num_ranks).backward()      # step.loss divides by the GLOBAL batch's
        optimizer.step()                            # counts: the gradients add up to its own

Each micro-batch's backward reduces its gradients (FSDP2's default), which add into the sharded
gradients: the plans price a micro-batch after the first as holding them from its backward's
start. Deferring the reduction (set_requires_gradient_sync(False) before the last) holds every
parameter's unsharded gradient on every rank, which the plans do not price.

One step ahead: `pending = balancer.schedule(samples)` gathers the sizes now and plans in a
background thread; `pending.start()` (the next iteration) waits for the plan and loads it. A loop
whose loader worker already knows every rank's sizes (zellige.train's) plans and compiles there
with the balancer's StepPipeline (`pipeline.prepare`, zellige.pipeline) and hands the result to
`balancer.start(prepared)`: the Balancer then only loads it.

Legend: T held tokens (joint models: text and visual), T_vis / T_txt their visual / text part,
X cross-attention text rows, C held chunks (a sequence's part on this rank), N heads, H head dim.
Layouts, formats and the flow of a step: docs/architecture.md, docs/formats.md, docs/training.md.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from zellige import _core, runtime
from zellige._json import cut
from zellige.costs import device_memory_bytes, make_cost_model, planning_device
from zellige.model_spec import model_spec_to_dict, resolve_model
from zellige.pipeline import (
    JOINT,
    GlobalStepRecord,
    PreparedGlobalStep,
    PreparedStep,
    StepPipeline,
    StepRecord,
)
from zellige.runtime.ops import StepOps

if TYPE_CHECKING:
    from zellige.pipeline import PlanFn
# step k plans with seed + k (a uint64 in the core): far below 2**64 for any run's step count
_MAX_SEED = (1 << 63) - 1


@dataclass(kw_only=True)
class Sample:
    """One sample this rank's loader drew, and its tensors (all optional).

    grid_thw: its latent token grid (t, h, w) after VAE and patchify: t*h*w visual tokens.
    text_tokens: its text length (0: no text).
    tokens: per visual token, [t*h*w, ...] each (latents, targets, noise, masks ...), tokens in
        (t, h, w) raster order.
    text: per text token, [text_tokens, ...] each (text-encoder features ...).
    values: per sample, any shape (flow time, class label, pooled text embedding ...).
    Every rank's samples must carry the same keys, dtypes and trailing shapes (checked).
    """

    grid_thw: tuple[int, int, int]
    text_tokens: int = 0
    tokens: dict[str, Tensor] = field(default_factory=dict)
    text: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(kw_only=True, slots=True)
class HeldInputs:
    """The samples' tensors as this rank holds them for the step.

    tokens[k]: [T_vis, ...] held visual tokens (order of step.visual_index in the joint list).
    text[k]: joint models: [T_txt, ...] held text tokens (order of step.text_index);
        cross-attention models: [X, ...] the whole text of each held chunk's sequence, the rows
        step.cross_attention expects as keys and values.
    samples[k]: [C, ...] the value of each held chunk's sample (zeros for an empty chunk).
    """

    tokens: dict[str, Tensor]
    text: dict[str, Tensor]
    samples: dict[str, Tensor]


# field kind -> {name: (trailing shape, dtype name)}; identical on every rank that has samples
Schema = dict[str, dict[str, tuple[tuple[int, ...], str]]]


def _schema(samples: list[Sample]) -> Schema | None:
    """The samples' tensor layout; ValueError if two samples of this rank disagree."""
    if not samples:
        return None

    def layout(sample: Sample) -> Schema:
        return {
            kind: {
                name: (tuple(t.shape[0 if kind == "values" else 1 :]), str(t.dtype))
                for name, t in sorted(getattr(sample, kind).items())
            }
            for kind in ("tokens", "text", "values")
        }

    first = layout(samples[0])
    for index, sample in enumerate(samples[1:], start=1):
        if layout(sample) != first:
            raise ValueError(
                f"sample {index} carries tensors {layout(sample)}, sample 0 {first}: every "
                "sample needs the same keys, dtypes and trailing shapes"
            )
    return first


def _check_sample(index: int, sample: object) -> None:
    """ValueError naming what is wrong with one sample: its sizes are ints inside the core's
    limits (docs/formats.md, "Limits") and its tensors have one row per token."""
    if not isinstance(sample, Sample):
        raise ValueError(f"sample {index}: expected a zellige.Sample, got {type(sample).__name__}")
    grid = sample.grid_thw
    if (
        not isinstance(grid, tuple | list)
        or len(grid) != 3
        or any(type(n) is not int or not 1 <= n <= _core.MAX_SEQUENCE_TOKENS for n in grid)
        or grid[0] * grid[1] * grid[2] > _core.MAX_SEQUENCE_TOKENS
    ):
        raise ValueError(
            f"sample {index}: grid_thw must be 3 positive ints whose product is at most "
            f"{_core.MAX_SEQUENCE_TOKENS:,}, got {cut(repr(grid))}"
        )
    text_tokens = sample.text_tokens
    if type(text_tokens) is not int or not 0 <= text_tokens <= _core.MAX_TEXT_TOKENS:
        raise ValueError(
            f"sample {index}: text_tokens must be an int in [0, {_core.MAX_TEXT_TOKENS:,}], "
            f"got {cut(repr(text_tokens))}"
        )
    for kind, rows in (("tokens", sample.num_tokens), ("text", text_tokens), ("values", None)):
        tensors = getattr(sample, kind)
        if not isinstance(tensors, dict):
            raise ValueError(f"sample {index}: {kind} must be a dict of tensors")
        for name, tensor in tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, Tensor):
                raise ValueError(
                    f"sample {index}: {kind}[{cut(repr(name))}] must be a tensor under a str "
                    f"key, got {type(tensor).__name__}"
                )
            if rows is not None and (tensor.dim() == 0 or tensor.shape[0] != rows):
                raise ValueError(
                    f"sample {index}: {kind}[{name!r}] has shape {tuple(tensor.shape)}, "
                    f"expected {rows} rows ({'t*h*w' if kind == 'tokens' else 'text_tokens'})"
                )


def _check_samples(samples: object) -> Schema | None:
    """The samples' schema; ValueError for anything malformed (never another exception, which
    would leave the other ranks waiting in the collective)."""
    if not isinstance(samples, list | tuple):
        raise ValueError(f"samples must be a list of zellige.Sample, got {type(samples).__name__}")
    for index, sample in enumerate(samples):
        _check_sample(index, sample)
    return _schema(list(samples))


@dataclass(kw_only=True, slots=True)
class _RankReport:
    """What each rank contributes to the one metadata all_gather."""

    error: str | None
    step_index: int
    config: dict[str, object]  # what every rank must agree on, by field (_agreed_fields)
    sizes: list[tuple[int, int, int, int]]  # (t, h, w, text_tokens) per sample
    schema: Schema | None


class PendingStep:
    """A step whose sizes are gathered and whose plan is being made; `start()` it in order."""

    def __init__(self, balancer, index, samples, batch, schema, future) -> None:
        self._balancer = balancer
        self.index = index
        self.samples = samples
        self.batch = batch
        self._schema = schema
        self._future: Future = future

    def start(self) -> BalancedStep:
        """Waits for the plan and loads this rank's step program (every rank calls it; one small
        all_gather checks that all ranks start the same step with the same plan)."""
        return self._balancer._start(self)


class Balancer:
    """Plans every training step's placement and executes it for the user's model.

    Every rank of the process group builds an equal Balancer and calls `step()` (or `schedule()`
    then `start()`) the same number of times, in the same order. A loop whose loader worker plans
    and compiles each step itself builds it with `from_pipeline` and calls `start(prepared)`.

    Args:
        model: a preset name, a model spec file (.toml / .json) or a ModelSpec: the cost model's
            sizes and the head count of the attention callables.
        planner: a planner name (`zellige.planner_names()`: "zellige", "dp-cost",
            "static-cp:2", "knapformer:g2n2", ...) or a function (batch, cost_model) -> Plan
            for a placement of your own.
        device: where the step's tables and routed tensors live.
        group: the process group (default: the world); it must be initialised.
        gpus_per_node: GPUs per node (default 8, or the world when smaller).
        profile: a hardware profile (path, built-in name or HardwareProfile; default: on a GPU
            the built-in profile of its kind, by its name; elsewhere the H200 one).
        links: the link class between GPUs of a node, "nvlink" or "pcie".
        cost_options: what training holds and recomputes, which the plans' memory must fit
            (a CostOptions, e.g. with activation_checkpointing off; default: its defaults).
        seed: the planners' seed (step k plans with seed + k).
        plan_ahead: plan in a background thread, so that `schedule()` returns at once.
        engine: how the attention engine runs (zellige.runtime.EngineConfig), chosen once for
            the run; default: EngineConfig.from_env() (the documented overrides).
        gpu_memory_bytes: each GPU's memory the plans must fit; default: on a CUDA device, what
            this process can use of it (costs.device_memory_bytes), else the profile's device's.
        global_planner: the global-batch planner of global_step()
            (`zellige.global_batch_planner_names()`: "zellige", "megatron-dcp", "knapformer",
            "static-cp", "wlb-llm").

    Example:
        >>> balancer = zellige.Balancer("my_dit.toml", planner="zellige", device="cuda")
        >>> step = balancer.step(samples)  # this rank's samples
    """

    def __init__(
        self,
        model: str | Path | _core.ModelSpec,
        *,
        planner: str | PlanFn = "zellige",
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        gpus_per_node: int | None = None,
        profile: str | Path | _core.HardwareProfile | None = None,
        links: str = "nvlink",
        cost_options: _core.CostOptions | None = None,
        seed: int = 0,
        plan_ahead: bool = True,
        engine: runtime.EngineConfig | None = None,
        gpu_memory_bytes: int | None = None,
        global_planner: str = "zellige",
    ) -> None:
        _require_process_group()
        if type(seed) is not int or not 0 <= seed <= _MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**63), got {cut(repr(seed))}")
        spec = resolve_model(model)
        device = torch.device(device)
        if device.type == "cuda":
            usable = device_memory_bytes(device) if gpu_memory_bytes is None else gpu_memory_bytes
            name = torch.cuda.get_device_name(device)
            profile, gpu_memory_bytes, _ = planning_device(profile, name, usable)
        cost_model = make_cost_model(
            spec,
            dist.get_world_size(group),
            gpus_per_node,
            profile,
            links,
            options=cost_options,
            gpu_memory_bytes=gpu_memory_bytes,
        )
        # checks the names
        pipeline = StepPipeline(spec, cost_model, planner, seed=seed, global_planner=global_planner)
        if planner == JOINT:  # time-limited: ranks could stop at different incumbents
            raise ValueError("the joint MILP reference is for comparisons, not training")
        self._setup(pipeline, device, group, plan_ahead, engine)

    @classmethod
    def from_pipeline(
        cls,
        pipeline: StepPipeline,
        *,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        plan_ahead: bool = True,
        engine: runtime.EngineConfig | None = None,
    ) -> Balancer:
        """A Balancer that plans with a StepPipeline built by the caller: a cost model with
        options of its own (zellige.train's prices its optimizer and checkpointing choices), a
        fixed plan. The pipeline's cost model must be for the group's size."""
        _require_process_group()
        balancer = cls.__new__(cls)
        balancer._setup(pipeline, device, group, plan_ahead, engine)
        return balancer

    def _setup(self, pipeline: StepPipeline, device, group, plan_ahead: bool, engine) -> None:
        self.pipeline = pipeline
        self.engine = runtime.EngineConfig.from_env() if engine is None else engine
        self.spec = pipeline.spec
        self.cost_model = pipeline.cost_model
        self.planner = pipeline.planner
        self.seed = pipeline.seed
        self.device = torch.device(device)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        if pipeline.num_ranks != self.num_ranks:
            raise ValueError(
                f"the step pipeline's cost model is for {pipeline.num_ranks} ranks, the process "
                f"group has {self.num_ranks}"
            )
        self._executor = ThreadPoolExecutor(1, "zellige-plan") if plan_ahead else None
        self._scheduled = 0  # steps scheduled so far (the next one's index)
        self._started = 0  # steps started so far
        self._lock = threading.Lock()
        self._speed_factors: tuple[float, ...] | None = None
        self._config = {
            **{f"model.{key}": value for key, value in model_spec_to_dict(self.spec).items()},
            "planner": pipeline.planner_name,
            "global planner": _global_planner_name(pipeline),
            "seed": self.seed,
            "world size": self.num_ranks,
        }

    @property
    def joint_attention(self) -> bool:
        return self.spec.joint_attention

    def set_speed_factors(self, speed_factors: Sequence[float] | None) -> None:
        """The steps scheduled from now on plan with rank r at its cluster speed times
        speed_factors[r] (measured feedback, e.g. zellige.train.speeds.SpeedEstimate over
        all-gathered step times: docs/training.md); None: the cluster's own speeds. Every rank
        sets the same factors before the same schedule(), which checks it like the Balancer's
        settings. ValueError unless one positive, finite number per rank."""
        if speed_factors is not None:
            factors = tuple(speed_factors)
            if len(factors) != self.num_ranks or not all(
                isinstance(f, int | float)
                and not isinstance(f, bool)
                and math.isfinite(f)
                and f > 0
                for f in factors
            ):
                raise ValueError(
                    f"speed factors must be {self.num_ranks} positive finite numbers (one per "
                    f"rank), got {cut(repr(factors))}"
                )
            speed_factors = tuple(float(f) for f in factors)
        self._speed_factors = speed_factors

    def step(self, samples: list[Sample]) -> BalancedStep:
        """schedule(samples).start(): the step planned and loaded now."""
        return self.schedule(samples).start()

    def schedule(self, samples: list[Sample]) -> PendingStep:
        """Gathers the samples' sizes from every rank now (one all_gather_object; every rank
        calls it) and plans the step, in the background when plan_ahead. Start pending steps in
        the order they were scheduled. Raises the same ValueError on every rank when a rank's
        samples are malformed or the ranks disagree (different Balancers, different steps)."""
        index, batch, schema = self._gather(samples)
        factors = self._speed_factors
        if self._executor is not None:
            future = self._executor.submit(self._plan_and_compile, batch, index, factors)
        else:
            future = Future()
            try:
                future.set_result(self._plan_and_compile(batch, index, factors))
            except Exception as exc:  # noqa: BLE001 - raised by start(), on every rank
                future.set_exception(exc)
        return PendingStep(self, index, samples, batch, schema, future)

    def global_step(self, samples: list[Sample]) -> GlobalStep:
        """One optimizer step over a global batch: every rank's samples are gathered (one
        all_gather_object, as schedule()), cut into micro-batches and each placed by the
        global-batch planner (every rank alike, now). Iterate the returned GlobalStep for its
        micro-batches in order: each is loaded as it is reached and is a BalancedStep whose
        loss() divides by the whole global batch's token (or sample) count, so the gradients of
        the micro-batches' backwards add up to the global batch's. Every rank iterates every
        micro-batch. Raises the same ValueError on every rank as schedule() does, and
        PlanMemoryError when a sample fits no placement."""
        index, batch, schema = self._gather(samples)
        plan = self.pipeline.plan_global(
            batch, seed=self.seed + index, speed_factors=self._speed_factors
        )
        first = sum(
            1 for s in batch.sequences if s.source_rank < self.rank
        )  # ids are in rank order
        return GlobalStep(self, index, list(samples), first, batch, schema, plan)

    def start_global(self, prepared: PreparedGlobalStep) -> Iterator[BalancedStep]:
        """The micro-batches of a global batch planned and compiled ahead
        (StepPipeline.prepare_global in a loader worker), each loaded as it is reached, as
        start() loads a step; their loss() divides by the whole global batch's counts."""
        count = len(prepared.micro_batches)
        for position, micro in enumerate(prepared.micro_batches):
            step = self.start(micro)
            step._in_global_batch(prepared.num_tokens, prepared.num_samples, position, count)
            yield step

    def _gather(self, samples: list[Sample]) -> tuple[int, _core.Batch, Schema | None]:
        """The step's index, the batch of every rank's samples and their tensors' schema."""
        error, sizes = None, []
        try:
            schema = _check_samples(samples)
            sizes = [(*s.grid_thw, s.text_tokens) for s in samples]
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there alike
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            error, schema = f"rank {self.rank}: {cut(message, 300)}", None
        report = _RankReport(
            error=error,
            step_index=self._scheduled,
            config={**self._config, "speed factors": self._speed_factors},
            sizes=sizes,
            schema=schema,
        )
        reports: list[_RankReport | None] = [None] * self.num_ranks
        dist.all_gather_object(reports, report, group=self.group)
        index = self._scheduled
        self._scheduled += 1
        error = _agreement_error(reports)
        if error is not None:  # every rank holds the same reports: all raise it, none waits
            raise ValueError(error)
        schema = next((r.schema for r in reports if r.schema is not None), None)
        return index, self._batch(reports), schema

    def _batch(self, reports: list[_RankReport]) -> _core.Batch:
        batch = _core.Batch()
        sequences = []
        for rank, report in enumerate(reports):
            for t, h, w, text_tokens in report.sizes:
                sequence = _core.Sequence()
                sequence.id = len(sequences)
                sequence.kind = "video" if t > 1 else "image"
                sequence.num_tokens = t * h * w
                sequence.text_tokens = text_tokens
                sequence.source_rank = rank
                sequence.grid_t, sequence.grid_h, sequence.grid_w = t, h, w
                sequences.append(sequence)
        batch.sequences = sequences
        return batch

    def make_plan(
        self,
        batch: _core.Batch,
        step_index: int = 0,
        speed_factors: Sequence[float] | None = None,
    ) -> _core.Plan:
        """The plan of one step's batch (what every rank computes alike)."""
        return self.pipeline.plan(batch, seed=self.seed + step_index, speed_factors=speed_factors)

    def _plan_and_compile(self, batch: _core.Batch, index: int, speed_factors=None):
        plan = self.make_plan(batch, index, speed_factors)
        return plan, self.pipeline.compile(batch, plan, self.rank)

    def start(self, prepared: PreparedStep) -> BalancedStep:
        """Loads a step planned and compiled ahead of it (StepPipeline.prepare in a loader worker
        whose batch every rank knows) and returns it as this rank executes it. Every rank calls
        it for the same step; a rank's `prepared.error`, or ranks whose programs differ, raise the
        same ValueError on every rank. The step carries no Sample tensors: route your own
        (route_tokens, route_text, ...). Use it or schedule(), not both, in one loop."""
        step = self.pipeline.load(
            prepared.program, self.device, self.group, error=prepared.error, engine=self.engine
        )
        return BalancedStep(
            self,
            index=prepared.index,
            samples=[],
            schema=None,
            batch=None,
            plan=None,
            record=prepared.record,
            sequence_num_tokens=prepared.sequence_num_tokens,
            step=step,
        )

    def _start(self, pending: PendingStep) -> BalancedStep:
        error = plan = program = None
        with self._lock:
            if pending.index != self._started:
                error = (
                    f"rank {self.rank}: started step {pending.index} but step {self._started} "
                    "is the next one (start pending steps once each, in schedule order)"
                )
            else:
                self._started += 1
        if error is None:
            try:
                plan, program = pending._future.result()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by load_step
                error = f"rank {self.rank}: planning step {pending.index} failed: {exc}"
        step = self.pipeline.load(program, self.device, self.group, error=error, engine=self.engine)
        return BalancedStep(
            self,
            index=pending.index,
            samples=pending.samples,
            schema=pending._schema,
            batch=pending.batch,
            plan=plan,
            record=StepRecord.from_plan(plan),
            sequence_num_tokens=tuple(s.num_tokens for s in pending.batch.sequences),
            step=step,
        )

    def close(self) -> None:
        """Stops the planning thread (also at interpreter exit)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _global_planner_name(pipeline: StepPipeline) -> str:
    planner = pipeline.global_planner
    return planner if isinstance(planner, str) else planner.planner


class GlobalStep:
    """One optimizer step's global batch, planned: iterate it for its micro-batches in order
    (each a BalancedStep, loaded when reached; every rank iterates all of them).

    plan: the GlobalPlan (micro-batches, their plans, the predicted step time); record: its
    typed record; batch: the whole global batch; num_micro_batches."""

    def __init__(self, balancer, index, samples, first, batch, schema, plan) -> None:
        self._balancer = balancer
        self.index = index
        self.batch = batch
        self.plan: _core.GlobalPlan = plan
        self.record = GlobalStepRecord.from_plan(plan)
        self.num_micro_batches = len(plan.micro_batches)
        self._samples = samples
        self._first = first  # the global id of this rank's first sample
        self._schema = schema

    def __len__(self) -> int:
        return self.num_micro_batches

    def __iter__(self) -> Iterator[BalancedStep]:
        balancer = self._balancer
        num_tokens = sum(s.num_tokens for s in self.batch.sequences)
        for position, micro in enumerate(self.plan.micro_batches):
            error = program = None
            try:
                program = balancer.pipeline.compile(micro.batch, micro.plan, balancer.rank)
            except ValueError as exc:  # raised by load_step on every rank
                error = f"rank {balancer.rank}: micro-batch {position}: {exc}"
            loaded = balancer.pipeline.load(
                program, balancer.device, balancer.group, error=error, engine=balancer.engine
            )
            mine = [  # this rank's samples of the micro-batch, in its order (the routes')
                self._samples[s.id - self._first]
                for s in micro.batch.sequences
                if s.source_rank == balancer.rank
            ]
            step = BalancedStep(
                balancer,
                index=self.index,
                samples=mine,
                schema=self._schema,
                batch=micro.batch,
                plan=micro.plan,
                record=StepRecord.from_plan(micro.plan),
                sequence_num_tokens=tuple(s.num_tokens for s in micro.batch.sequences),
                step=loaded,
            )
            step._in_global_batch(
                num_tokens, len(self.batch.sequences), position, self.num_micro_batches
            )
            yield step


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("Balancer needs an initialised process group (torchrun)")


def _agreement_error(reports: list[_RankReport]) -> str | None:
    """The same message on every rank (all hold the same reports) or None."""
    for report in reports:
        if report.error:
            return report.error
    first = reports[0].config
    for rank, report in enumerate(reports[1:], start=1):
        differ = [
            key
            for key in first.keys() | report.config.keys()
            if report.config.get(key) != first.get(key)
        ]
        if differ:
            key = min(differ)
            return (
                f"ranks built different Balancers: {key} is {cut(repr(first.get(key)))} on rank 0 "
                f"and {cut(repr(report.config.get(key)))} on rank {rank}"
            )
    if not any(r.sizes for r in reports):
        return "no rank has a sample for this step: skip it on every rank, or give samples"
    if len({r.step_index for r in reports}) > 1:
        by_rank = ", ".join(f"rank {i}: {r.step_index}" for i, r in enumerate(reports))
        return f"ranks are at different steps ({by_rank}): every rank schedules every step"
    with_schema = [(rank, r.schema) for rank, r in enumerate(reports) if r.schema is not None]
    first_rank, first_schema = with_schema[0] if with_schema else (0, None)
    for rank, schema in with_schema[1:]:
        for kind in ("tokens", "text", "values"):
            for name in sorted(first_schema[kind].keys() | schema[kind].keys()):
                if first_schema[kind].get(name) != schema[kind].get(name):
                    return (
                        f"ranks' samples carry different tensors: {kind}[{name!r}] is "
                        f"{_layout(first_schema[kind].get(name))} on rank {first_rank} and "
                        f"{_layout(schema[kind].get(name))} on rank {rank}"
                    )
    return None


def _layout(field: tuple[tuple[int, ...], str] | None) -> str:
    if field is None:
        return "missing"
    shape, dtype = field
    return f"{dtype.removeprefix('torch.')} with trailing shape {list(shape)}"


class BalancedStep:
    """One step as this rank executes it (see the module docstring).

    Model-facing tables (device tensors): position_ids [T, 3] (t, h, w) of each held token (text
    token k: (k, 0, 0)), chunk_index [T] (held chunk of each token), sequence_index [T] (index
    into batch.sequences), modality [T] (0 visual, 1 text), visual_index [T_vis] / text_index
    [T_txt] (positions in the joint held list). attention / cross_attention: the callables
    (q_TNH, k_TNH, v_TNH) -> o_TNH. Every rank calls every collective method (inputs, route*,
    reverse*, attention) the same number of times.
    """

    def __init__(
        self,
        balancer: Balancer,
        *,
        index: int,
        samples: list[Sample],
        schema: Schema | None,
        batch: _core.Batch | None,
        plan: _core.Plan | None,
        record: StepRecord,
        sequence_num_tokens: tuple[int, ...],
        step: runtime.Step,
    ) -> None:
        self._balancer = balancer
        self.index = index
        self.samples: list[Sample] = samples
        self.batch: _core.Batch | None = batch  # None for a step started from a PreparedStep
        self.plan: _core.Plan | None = plan  # likewise
        self.record = record  # the plan's predictions, typed
        self.runtime_step = step
        self._schema = schema
        self._sequence_num_tokens = sequence_num_tokens
        self.rank = balancer.rank
        self.num_ranks = balancer.num_ranks
        self.joint_attention = balancer.joint_attention
        self.device = balancer.device
        self.position_ids = step.position_ids
        self.chunk_index = step.chunk_index
        self.sequence_index = step.sequence_index
        self.modality = step.modality
        self.visual_index = step.visual_index
        self.text_index = step.text_index
        self.num_chunks = len(step.chunk_num_tokens)
        # custom ops (zellige.runtime.ops): a compiled model traces through them
        self.ops = StepOps(step)
        self.attention = self.ops.attention
        self.cross_attention = None if self.joint_attention else self.ops.cross_attention
        # loss() divides by these: the step's, or a micro-batch's whole global batch's
        self.num_global_tokens = sum(sequence_num_tokens)
        self.num_global_samples = len(sequence_num_tokens)
        self.micro_batch = 0  # its position among its global batch's micro-batches
        self.num_micro_batches = 1

    @property
    def is_last(self) -> bool:
        """Whether this is its optimizer step's last micro-batch (after whose backward the
        optimizer steps)."""
        return self.micro_batch == self.num_micro_batches - 1

    def _in_global_batch(
        self, num_tokens: int, num_samples: int, micro_batch: int, num_micro_batches: int
    ) -> None:
        self.num_global_tokens = num_tokens
        self.num_global_samples = num_samples
        self.micro_batch = micro_batch
        self.num_micro_batches = num_micro_batches

    # The per-chunk tables come from the program's host arrays when first used (a loop that
    # routes and normalises on its own never builds them; none reads the device back).
    @functools.cached_property
    def chunk_sequence_index(self) -> Tensor:
        """[C] index into batch.sequences of each held chunk."""
        chunks = torch.tensor(self.runtime_step.chunk_sequence_index, dtype=torch.int64)
        return runtime.to_device(chunks, self.device)

    @functools.cached_property
    def _chunk_tokens(self) -> Tensor:
        tokens = self._sequence_num_tokens
        chunk_tokens = [tokens[i] for i in self.runtime_step.chunk_sequence_index]
        return runtime.to_device(torch.tensor(chunk_tokens, dtype=torch.float64), self.device)

    @functools.cached_property
    def _chunk_first(self) -> Tensor:
        """First held position of each chunk (T for an empty chunk: a zero row is appended)."""
        token_chunk = self.runtime_step.program.token_chunk_index
        first = np.full(self.num_chunks, token_chunk.size, dtype=np.int64)
        np.minimum.at(first, token_chunk, np.arange(token_chunk.size, dtype=np.int64))
        return runtime.to_device(torch.from_numpy(first), self.device)

    # ---- tensors in
    def inputs(self) -> HeldInputs:
        """Routes every tensor the samples carry (Sample.tokens / text / values) to the ranks
        that hold them: one all_to_all per field."""
        schema = self._schema or {"tokens": {}, "text": {}, "values": {}}
        tokens, text, samples = {}, {}, {}
        for name, (shape, dtype) in schema["tokens"].items():
            tokens[name] = self.route_tokens(self._source("tokens", name, shape, dtype))
        for name, (shape, dtype) in schema["text"].items():
            text[name] = self.route_text(self._source("text", name, shape, dtype))
        for name, (shape, dtype) in schema["values"].items():
            source = self._source("values", name, shape, dtype)
            samples[name] = self.route_samples(source)
        return HeldInputs(tokens=tokens, text=text, samples=samples)

    def _source(self, kind: str, name: str, shape, dtype: str) -> Tensor:
        parts = [getattr(s, kind)[name] for s in self.samples]
        if kind == "values":
            parts = [p[None] for p in parts]
        if not parts:
            return torch.zeros((0, *shape), dtype=getattr(torch, dtype.split(".")[-1]))
        return torch.cat(parts).to(self.device, non_blocking=True)

    def route_tokens(self, x_SD: Tensor) -> Tensor:
        """This rank's samples' visual tokens [S_vis, ...] (samples in order, each t*h*w rows) ->
        held visual tokens [T_vis, ...]. Differentiable (backward: the way back)."""
        return self.ops.route(x_SD, "visual")

    def route_text(self, text_SE: Tensor) -> Tensor:
        """This rank's samples' text rows [S_txt, ...] (samples in order) -> joint models: held
        text tokens [T_txt, ...]; cross-attention models: [X, ...] each held chunk's whole text."""
        if self.joint_attention:
            return self.ops.route(text_SE, "text")
        return self.ops.route_text(text_SE)

    def route_samples(self, values_B: Tensor) -> Tensor:
        """Per-sample values [B, ...] of this rank's B samples -> [C, ...] the value of each held
        chunk's sample (zeros for an empty chunk). They travel with the sample's tokens."""
        if values_B.shape[0] != len(self.samples):
            raise ValueError(
                f"route_samples expects {len(self.samples)} rows (this rank's samples), got "
                f"{values_B.shape[0]}"
            )
        rows = [s.num_tokens + (s.text_tokens if self.joint_attention else 0) for s in self.samples]
        repeats = torch.tensor(rows, dtype=torch.int64, device=values_B.device)
        per_token = values_B.repeat_interleave(repeats, dim=0)
        held = self.ops.route(per_token, "all")
        padded = torch.cat([held, held.new_zeros((1, *held.shape[1:]))])
        return padded.index_select(0, self._chunk_first)

    # ---- joint token lists
    def join(self, visual_TD: Tensor, text_TD: Tensor) -> Tensor:
        """Joint models: the held joint token list [T, ...] from its visual [T_vis, ...] and text
        [T_txt, ...] parts (the order attention expects). Differentiable."""
        if not self.joint_attention and text_TD.shape[0] != self.text_index.shape[0]:
            raise ValueError(
                f"join got {text_TD.shape[0]} text rows, but the model spec says "
                "joint_attention = false (text attended by cross-attention: no text tokens are "
                "held); set joint_attention = true for a model whose text joins self-attention"
            )
        out = visual_TD.new_empty((visual_TD.shape[0] + text_TD.shape[0], *visual_TD.shape[1:]))
        out = out.index_copy(0, self.visual_index, visual_TD)
        return out.index_copy(0, self.text_index, text_TD)

    def split(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """The inverse of join: (visual [T_vis, ...], text [T_txt, ...])."""
        return x_TD.index_select(0, self.visual_index), x_TD.index_select(0, self.text_index)

    # ---- outputs back
    def reverse_tokens(self, x_TD: Tensor) -> Tensor:
        """Held visual tokens [T_vis, ...] -> this rank's samples' tokens [S_vis, ...] (the
        inverse of route_tokens; e.g. predictions for logging or a loss computed at the source)."""
        return self.ops.reverse_route(x_TD, "visual")

    def unpack(self, x_SD: Tensor) -> list[Tensor]:
        """[S_vis, ...] -> one tensor per sample of this rank, [t*h*w, ...] each."""
        return list(x_SD.split([s.num_tokens for s in self.samples]))

    # ---- loss
    def loss(self, loss_T: Tensor, *, per: str = "token") -> Tensor:
        """This rank's share of the step's loss from a loss per held visual token [T_vis]: summed
        over ranks it is the loss data parallelism computes on the whole batch, whatever the
        placement, so gradients summed over ranks are its gradients. DDP and FSDP average
        gradients over ranks: backpropagate `loss * step.num_ranks`.

        per="token": the mean over every visual token of the batch (tokens weigh alike);
        per="sample": the mean over samples of each sample's mean over its tokens.
        A micro-batch of a global batch (global_step) divides by the whole global batch's
        counts: summed over its micro-batches and ranks it is the global batch's loss."""
        if loss_T.shape[0] != self.visual_index.shape[0]:
            raise ValueError(
                f"loss expects one value per held visual token ({self.visual_index.shape[0]}), "
                f"got {loss_T.shape[0]}"
            )
        if per == "token":
            return loss_T.sum() / self.num_global_tokens
        if per == "sample":
            chunk_T = self.chunk_index.index_select(0, self.visual_index)
            tokens_T = self._chunk_tokens.index_select(0, chunk_T).to(loss_T.dtype)
            return (loss_T / tokens_T).sum() / self.num_global_samples
        raise ValueError(f"per must be 'token' or 'sample', got {per!r}")

    def reduce(self, value: Tensor) -> float:
        """The sum over ranks of a rank's share (e.g. loss), for logging (one all_reduce)."""
        total = value.detach().to(torch.float64).clone()
        dist.all_reduce(total, group=self._balancer.group)
        return float(total)
