"""`zellige validate-profile`: predicted against measured step time and peak memory of ranks.

For plans drawn from the recipes by several planners on several cluster sizes, each chosen rank's
compute runs for real on the one GPU (rank_work.py: real DiT blocks cut to a few layers,
the engine's distributed attention with exchanges replaced by local copies), and the cost model,
asked about the same layer count, predicts its time without exchanges and its peak memory. The
local copies that stand in for the exchanges are part of the measured step, so the prediction
adds them (`local_copy_s`: the bytes the rank would send, read and written at the profile's
memory bandwidth); the planner's cost model never sees them.

The blocks run as training runs them: their per-token regions torch.compile'd on a GPU
(zellige.model.fused; `--eager` for training without), an MMDiT cut to its fewest layers with
its own double/single split (models.stack_layers), as `zellige profile` measures it.
Time is measured on plain bf16 blocks. Memory is measured on a second step of the rank on
blocks sharded as zellige.train shards them (FSDP2 over a group of one: gathered weights,
weight gradients and reduce-scatter buffers live and die as in training; the output's gradient
comes from a loss). A rank's FSDP shard of weights, gradients and optimizer state cannot be
sharded on one GPU: the harness's own weights and kept gradients (both block sets) are left
out of the measured peak and the modelled shard is put in their place (`rank_peak_bytes`);
everything else, library workspaces and the CUDA context included, is real. Both the MAPE of
the whole peak and of its step part (peak minus the modelled shard) are reported.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import json
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from zellige import _core
from zellige.costs import make_cost_model, set_gradient_bytes
from zellige.plan_io import plan_from_json, plan_to_json
from zellige.profile import load_profile, priced_as_engine_runs
from zellige.profiler import fit, rank_work
from zellige.profiler.models import dit_config, model_name, model_spec
from zellige.profiler.timing import (
    gc_collections,
    host_facts,
    median_time_s,
    peak_allocated_bytes,
    release_burn,
    reset_peak,
    synchronize,
)
from zellige.runtime import EngineConfig, engine_runs_ragged
from zellige.workload import load_recipe

Progress = Callable[[str], None]

# (recipe, GPUs, planner): different workloads, cluster sizes and planners, cycled.
PLAN_SOURCES = (
    ("wan-stage2", 8, "dp-cost"),
    ("wan-stage3", 8, "zellige"),
    ("opensora2-stage2", 16, "static-cp:4"),
    ("wan-stage1", 16, "knapformer:g1n8+g2n4"),
    ("opensora2-stage1", 8, "megatron-dcp"),
    ("knapformer-mixed-images", 8, "dp-tokens"),
    ("wan-stage2", 16, "zellige"),
    ("wan-stage3", 16, "static-cp:8"),
    ("opensora2-stage2", 8, "zellige"),
    ("knapformer-joint", 32, "knapformer:g4n8"),
    ("wan-stage1", 8, "megatron-dcp"),
    ("opensora2-stage1", 16, "zellige"),
    ("wan-stage3", 32, "dp-cost"),
    ("wan-stage2", 32, "static-cp:2"),
)
FORWARD_LATENCY_LENGTHS = (256, 1024, 4096, 16384, 32768, 65536)
# The report's rank sizes, by held tokens: (label, at least this many tokens), largest first.
SIZE_CLASSES = ((">= 20k tokens", 20_000), ("2k-20k tokens", 2_000), ("< 2k tokens", 0))
MAX_TIMED_STEPS = 200  # at most this many timed steps of a rank, however short its steps
SLOW_STEP_S = 1.0  # a rank whose warm-up step takes longer times at least 2 steps, not --repeats
QUICK_LENGTH_RANGE = (16, 160)  # CPU smoke batches: token counts drawn in this range


@dataclass(kw_only=True, slots=True)
class ValidationOptions:
    num_plans: int = 21
    profile: str | None = None  # profile JSON; None: the built-in one
    model: str | _core.ModelSpec = "wan-14b"  # a preset name or a spec file's ModelSpec
    num_layers: int = 2
    ranks_per_plan: int = 2  # the plan's slowest rank and its median rank
    repeats: int = 3  # timed steps of a rank at least (2 for steps over SLOW_STEP_S)
    # ... and at least this many seconds of timed steps (timed_steps): a host-bound rank of tens
    # of ms scatters by +-25% from one step to the next, so its median needs many of them
    min_timed_s: float = 2.0
    seed: int = 0
    activation_checkpointing: bool = True
    device: str = "cuda"
    quick: bool = False  # CPU smoke: tiny model, small synthetic batches, no memory
    time_budget_s: float = 0.0  # stop drawing plans after this many seconds (0: no limit)
    # run only plans first..last (1-based, inclusive) of the num_plans drawn, so one validation
    # can be split over several processes (the same seed draws the same plans); None: all
    plan_range: tuple[int, int] | None = None
    exclude_strategies: tuple[str, ...] = ()  # skip plans that use these ("ring", "hybrid")
    contiguous_kernel_inputs: bool = False  # see EngineConfig.contiguous_kernel_inputs
    results_jsonl: str | None = None  # append each rank's result as it is measured
    compiled: bool = False  # the per-token regions compiled (the command sets fused.kernels)

    def cost_options(self) -> _core.CostOptions:
        """The cost model's options for the harness's training step: its checkpointing, the
        rest the defaults (fp32 gradients, weights gathered again for the backward)."""
        options = _core.CostOptions()
        options.activation_checkpointing = self.activation_checkpointing
        return options


@dataclass(kw_only=True, slots=True)
class RankResult:
    plan: str  # "recipe/GPUs/planner/seed"
    rank: int
    tokens: int
    num_sequences: int
    # cost model without exchanges: max(per-token layers + attention + calls + predicted_copy_s,
    # launch floor)
    predicted_s: float
    measured_s: float
    predicted_peak_bytes: float
    measured_peak_bytes: float
    modelled_state_bytes: float  # the modelled FSDP shard (part of both peaks)
    knapformer_work: float  # W summed over the rank's shares
    predicted_copy_s: float = 0.0  # the exchanges' local stand-in copies (see local_copy_s)
    predicted_call_s: float = 0.0  # RankCost.call_s: what one call per equal group saves (<= 0)
    predicted_launch_floor_s: float = 0.0  # host issue time (RankCost.launch_floor_s)
    predicted_busy_s: float = 0.0  # the GPU work predicted_s is the larger of, with the floor
    strategies: str = ""  # the rank's placements by strategy, e.g. "local x3, ring x1"
    # the first this many blocks ran a full recompute, attention included: the cost model's
    # choice for the rank (RankCost.full_recompute_layers), as training follows the plan's
    full_recompute_layers: int = 0
    timed_steps: int = 0  # steps timed (timed_steps(); measured_s is their median)
    measured_spread: float = 0.0  # their (75th - 25th percentile) / median (relative_spread)
    # median over the same steps of the host's wall seconds from a step's start until its last
    # kernel was queued (before the final synchronize): the issue time a launch-floor rank is
    # bound by; None in results written before it was recorded
    host_issue_s: float | None = None
    # garbage collections of each generation during the timed steps
    timed_gc_collections: list[int] | None = None
    host: dict | None = None  # timing.host_facts() just before the rank's steps


@dataclass(kw_only=True, slots=True)
class ValidationReport:
    ranks: list[RankResult] = field(default_factory=list)
    time_mape_percent: float = 0.0
    memory_mape_percent: float | None = None
    step_memory_mape_percent: float | None = None
    gamma: float = 0.0
    gamma_forward_fit: dict = field(default_factory=dict)
    knapformer_time_mape_percent: float = 0.0
    time_mape_best_scale_percent: float = 0.0
    num_plans: int = 0
    # per SIZE_CLASSES label: {"ranks", "time_mape_percent", "memory_mape_percent" (or None)}
    by_size: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host: dict | None = None  # timing.host_facts() as the ranks began (None: --summarise)


def _route_bytes_per_token(cost_model: _core.CostModel, num_ranks: int) -> float:
    """Bytes the cost model counts per token for routing a sequence from its source rank and
    back (part of exchange_bytes; the one-GPU run builds inputs in place, so no copy stands in
    for it): a local placement away from its source sends nothing else."""
    if num_ranks < 2:
        return 0.0
    probe_tokens = 1024
    probe = _core.Sequence(id=0, num_tokens=probe_tokens, text_tokens=0, source_rank=0)
    away = _core.Placement(sequence_id=0, strategy=_core.Strategy.local, ranks=[1])
    return cost_model.exchange_bytes(probe, away) / probe_tokens


def local_copy_s(
    cost_model: _core.CostModel,
    batch: _core.Batch,
    plan: _core.Plan,
    rank: int,
    memory_bytes_per_s: float,
) -> float:
    """Seconds of the local copies that replace the rank's exchanges in the measured step
    (rank_work.LocalTransport): every message becomes a copy of the same size, read and
    written once. Bytes per rank: the placement's exchange bytes (every layer and pass, routing
    left out) times the rank's share of its tokens."""
    by_id = {s.id: s for s in batch.sequences}
    route_bytes_per_token = _route_bytes_per_token(cost_model, plan.num_ranks)
    copied_bytes = 0.0
    for placement in plan.placements:
        if rank not in placement.ranks or len(placement.ranks) < 2:
            continue
        sequence = by_id[placement.sequence_id]
        shares = cost_model.shares(sequence, placement)
        routed_tokens = sum(s.tokens for s in shares if s.rank != sequence.source_rank)
        sent_bytes = (
            cost_model.exchange_bytes(sequence, placement) - route_bytes_per_token * routed_tokens
        )
        held = sum(s.tokens for s in shares if s.rank == rank)
        copied_bytes += max(0.0, sent_bytes) * held / sequence.num_tokens
    return 2.0 * copied_bytes / memory_bytes_per_s


def harness_peak_model(
    spec: _core.ModelSpec,
    gpus: int,
    profile: _core.HardwareProfile,
    cost_options: _core.CostOptions,
) -> _core.CostModel:
    """The cost model that predicts the peak the harness measures (rank_peak_bytes), for the
    cost options of its training step (ValidationOptions.cost_options). Its FSDP blocks keep
    their sharded gradients from one step to the next and they are taken out of the measured
    peak with the weights, so the measured peak holds no weight gradient: the gradients that
    training's backward adds layer by layer (1/gpus of each layer's, see
    CostModel.rank_peak_bytes) are left out of this prediction too (gradient bytes 0, the FSDP
    state without them). The modelled shard put into the measured peak is this model's state.
    Only the peak comes from it; time does not depend on these options."""
    options = copy.copy(cost_options)
    set_gradient_bytes(options, 0.0)
    return make_cost_model(spec, gpus=gpus, profile=profile, options=options)


def predicted_busy_s(rank_cost: _core.RankCost, copy_s: float) -> float:
    """The GPU work of a rank run on one GPU as the cost model prices it: its evaluate() time
    without exchanges, plus the local copies that stand in for them."""
    return rank_cost.linear_s + rank_cost.attention_s + rank_cost.call_s + copy_s


def predicted_rank_s(rank_cost: _core.RankCost, copy_s: float) -> float:
    """The cost model's time of a rank run on one GPU: its GPU work (predicted_busy_s) or, when
    the host takes longer to issue it, the launch floor."""
    return max(predicted_busy_s(rank_cost, copy_s), rank_cost.launch_floor_s)


def rank_strategies(plan: _core.Plan, rank: int) -> str:
    """The rank's placements counted by strategy, e.g. "local x3, ring x1"."""
    counts: dict[str, int] = {}
    for placement in plan.placements:
        if rank in placement.ranks:
            name = _core.strategy_name(placement).split("(")[0]
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))


def summarise(ranks: list[RankResult], gamma: float) -> ValidationReport:
    """MAPEs of a list of rank results (pure arithmetic, tested on synthetic numbers)."""
    predicted = [r.predicted_s for r in ranks]
    measured = [r.measured_s for r in ranks]
    report = ValidationReport(ranks=ranks, gamma=gamma)
    report.time_mape_percent = fit.mape_percent(predicted, measured)
    scale = fit.fit_scale(predicted, measured)
    report.time_mape_best_scale_percent = fit.mape_percent([scale * p for p in predicted], measured)
    work = [r.knapformer_work for r in ranks]
    knap_scale = fit.fit_scale(work, measured)
    report.knapformer_time_mape_percent = fit.mape_percent([knap_scale * w for w in work], measured)
    if all(r.measured_peak_bytes > 0 for r in ranks):
        report.memory_mape_percent = fit.mape_percent(
            [r.predicted_peak_bytes for r in ranks], [r.measured_peak_bytes for r in ranks]
        )
        report.step_memory_mape_percent = fit.mape_percent(
            [r.predicted_peak_bytes - r.modelled_state_bytes for r in ranks],
            [r.measured_peak_bytes - r.modelled_state_bytes for r in ranks],
        )
    report.num_plans = len({r.plan for r in ranks})
    for label, members in _by_size(ranks).items():
        report.by_size[label] = {
            "ranks": len(members),
            "time_mape_percent": fit.mape_percent(
                [r.predicted_s for r in members], [r.measured_s for r in members]
            ),
            "memory_mape_percent": (
                fit.mape_percent(
                    [r.predicted_peak_bytes for r in members],
                    [r.measured_peak_bytes for r in members],
                )
                if report.memory_mape_percent is not None
                else None
            ),
        }
    return report


def launch_floor(predicted_s: float, predicted_busy_s: float) -> bool:
    """Whether a rank's prediction is its launch floor (the host's issue time) rather than its
    GPU work; results written before predicted_busy_s was recorded (0) are not marked."""
    return 0.0 < predicted_busy_s < predicted_s


def host_line(facts: dict) -> str:
    """timing.host_facts() in one line, for the log's header."""
    return ", ".join(f"{key} {value}" for key, value in facts.items())


def _by_size(ranks: list[RankResult]) -> dict[str, list[RankResult]]:
    groups: dict[str, list[RankResult]] = {}
    for rank in ranks:
        label = next(label for label, least in SIZE_CLASSES if rank.tokens >= least)
        groups.setdefault(label, []).append(rank)
    return {label: groups[label] for label, _ in SIZE_CLASSES if label in groups}


def _quick_batch(num_ranks: int, seed: int, text_tokens: int) -> _core.Batch:
    generator = torch.Generator().manual_seed(seed)
    batch = _core.Batch()
    sequences = []
    for rank in range(num_ranks):
        for _ in range(int(torch.randint(1, 3, (1,), generator=generator))):
            tokens = int(torch.randint(*QUICK_LENGTH_RANGE, (1,), generator=generator))
            sequences.append(
                _core.sequence_from_tokens(len(sequences), "video", tokens, text_tokens, rank)
            )
    batch.sequences = sequences
    return batch


def plan_in_child(
    planner: str, batch: _core.Batch, cost_model: _core.CostModel
) -> tuple[_core.Plan | None, str]:
    """make_plan in a forked process, so a planner that crashes costs its plan, not the run.
    Returns (plan, "") or (None, why). Call it before CUDA is initialised in this process."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def target() -> None:
        try:
            sender.send(("plan", plan_to_json(_core.make_plan(planner, batch, cost_model))))
        except ValueError as error:  # PlanMemoryError included: no plan for this batch
            sender.send(("refused", f"planner refused: {error}"))

    process = context.Process(target=target)
    process.start()
    sender.close()
    try:
        kind, text = receiver.recv()
    except EOFError:
        kind, text = "crashed", ""
    process.join()
    if kind == "plan":
        return plan_from_json(text), ""
    if kind == "crashed":
        return None, f"planner {planner} crashed (exit code {process.exitcode})"
    return None, text


def draw_plans(options: ValidationOptions, profile: _core.HardwareProfile, skipped: list[str]):
    """Yields (name, batch, plan) for plan i = 0, 1, ...: recipe batches on a GPU; small
    synthetic batches on 4 ranks in quick mode. A source whose planner refuses the batch is
    skipped and named in `skipped`."""
    full_spec = model_spec(options.model)
    index = 0
    while index < 5 * max(options.num_plans, len(PLAN_SOURCES)):  # every source failing ends it
        source = PLAN_SOURCES[index % len(PLAN_SOURCES)]
        seed = options.seed + index // len(PLAN_SOURCES)
        recipe_name, num_gpus, planner = source
        if options.quick:
            num_gpus = 4
            planner = ("dp-cost", "static-cp:2", "zellige", "dp-tokens")[index % 4]
            recipe_name = "synthetic"
            batch = _quick_batch(num_gpus, seed * 100 + index, full_spec.text_tokens)
        else:
            batch = _core.generate_batch(load_recipe(recipe_name), num_gpus, seed)
        cost_model = make_cost_model(
            full_spec, gpus=num_gpus, profile=profile, options=options.cost_options()
        )
        name = f"{recipe_name}/{num_gpus}/{planner}/{seed}"
        index += 1
        plan, failure = plan_in_child(planner, batch, cost_model)
        if plan is None:
            skipped.append(f"{name}: {failure}")
            continue
        used = {_core.strategy_name(p).split("(")[0] for p in plan.placements}
        excluded = used & set(options.exclude_strategies)
        if excluded:
            skipped.append(f"{name}: uses excluded {', '.join(sorted(excluded))}")
            continue
        yield name, batch, plan


def knapformer_rank_work(
    batch: _core.Batch, plan: _core.Plan, rank: int, width: int, gamma: float
) -> float:
    """KnapFormer's W of a rank: each sequence's W(L) split evenly over its ranks."""
    lengths = {s.id: s.num_tokens for s in batch.sequences}
    work = 0.0
    for placement in plan.placements:
        if rank in placement.ranks:
            work += fit.knapformer_work(lengths[placement.sequence_id], width, gamma) / len(
                placement.ranks
            )
    return work


def chosen_ranks(cost: _core.PlanCost, count: int) -> list[int]:
    """The slowest rank first, then ranks spread evenly down the order of predicted time."""
    order = sorted(
        (r for r, rank in enumerate(cost.ranks) if rank.tokens > 0),
        key=lambda r: -cost.ranks[r].time_s,
    )
    if len(order) <= count:
        return order
    step = len(order) / count
    return [order[int(i * step)] for i in range(count)]


def _engine(options: ValidationOptions) -> EngineConfig:
    """The run's engine (the environment's overrides), kernel inputs copied to contiguous
    tensors where the options ask for it."""
    return EngineConfig.from_env().replace(
        contiguous_kernel_inputs=options.contiguous_kernel_inputs
    )


def measure_forward_latencies(
    options: ValidationOptions, device, dtype, progress: Progress
) -> tuple[list[int], list[float]]:
    """Forward seconds of one real block over one sequence of L tokens (self + cross-attention),
    at the lengths KnapFormer's gamma is fitted on."""
    config = dit_config(options.model, num_layers=1)
    blocks = rank_work.make_blocks(config, 1, device, dtype)
    lengths = [64, 128, 256] if options.quick else list(FORWARD_LATENCY_LENGTHS)
    latencies = []
    for length in lengths:
        batch, plan = rank_work.local_plan([(length, config.text_tokens)])
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype
        )
        # compiled regions: the training graphs, not a second (inference) compilation
        with torch.enable_grad() if options.compiled else torch.no_grad():
            latencies.append(
                median_time_s(
                    lambda inputs=inputs: rank_work.forward_blocks(blocks, inputs, False),
                    device,
                    warmup=1,
                    repeats=options.repeats,
                )
            )
    progress(
        "forward latency of one block: "
        + ", ".join(f"L={n}: {s * 1e3:.2f} ms" for n, s in zip(lengths, latencies, strict=True))
    )
    return lengths, latencies


def _outside_allocator_bytes(device: torch.device) -> int:
    """CUDA context and library handles: device bytes in use that the caching allocator does not
    hold (this process alone on the GPU)."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return int(total_bytes - free_bytes - torch.cuda.memory_reserved(device))


@dataclass(kw_only=True, slots=True)
class StepTimes:
    measured_s: float  # median of steps_s
    steps_s: list[float]  # every timed step (device busy time on CUDA, wall time on a CPU)
    issue_s: list[float]  # the host's issue time of each (timing.median_time_s issue_samples)
    gc_collections: list[int]  # collections of each generation during the timed steps


def run_rank(
    *,
    batch: _core.Batch,
    plan: _core.Plan,
    rank: int,
    blocks,
    config,
    options: ValidationOptions,
    device: torch.device,
    dtype: torch.dtype,
    full_recompute_layers: int = 0,
) -> StepTimes:
    """Median step seconds of the rank's compute on plain blocks (checkpointed as training
    checkpoints the rank: rank_work.train_step), the seconds of every timed step and the host's
    issue time of each."""
    inputs = rank_work.plan_rank_inputs(
        batch=batch, plan=plan, rank=rank, config=config, device=device, dtype=dtype,
        engine=_engine(options),
    )  # fmt: skip

    def step(inputs=inputs):
        rank_work.train_step(
            blocks, inputs, options.activation_checkpointing, full_recompute_layers
        )

    synchronize(device)
    start_s = time.perf_counter()
    step()  # warm-up: kernels chosen, workspaces allocated
    synchronize(device)
    step_s = time.perf_counter() - start_s
    if step_s <= SLOW_STEP_S:  # a second warm-up sizes the timing (the first builds plans)
        start_s = time.perf_counter()
        step()
        synchronize(device)
        step_s = time.perf_counter() - start_s
    # a CPU smoke run (--quick) times --repeats steps only: its numbers mean nothing
    min_timed_s = 0.0 if options.quick else options.min_timed_s
    repeats = timed_steps(step_s, options.repeats, min_timed_s)
    steps_s: list[float] = []
    issue_s: list[float] = []
    collections = gc_collections()
    seconds = median_time_s(
        step, device, warmup=0, repeats=repeats, samples=steps_s, issue_samples=issue_s
    )
    collections = [
        after - before for after, before in zip(gc_collections(), collections, strict=True)
    ]
    return StepTimes(
        measured_s=seconds, steps_s=steps_s, issue_s=issue_s, gc_collections=collections
    )


def relative_spread(steps_s: list[float]) -> float:
    """(75th - 25th percentile) / median of a rank's timed steps: how far they scatter."""
    if len(steps_s) < 2:
        return 0.0
    q25, q50, q75 = np.percentile(np.asarray(steps_s), [25, 50, 75])
    return float((q75 - q25) / q50) if q50 > 0 else 0.0


def timed_steps(step_s: float, repeats: int, min_timed_s: float) -> int:
    """How many steps of `step_s` seconds a rank is timed over (their median is its time): at
    least `repeats` (2 for steps over SLOW_STEP_S: steps of seconds are steady, and more would
    cost minutes of device time) and enough to last `min_timed_s`, at most MAX_TIMED_STEPS."""
    least = repeats if step_s <= SLOW_STEP_S else min(repeats, 2)
    enough = math.ceil(min_timed_s / max(step_s, 1e-4))
    return max(1, min(MAX_TIMED_STEPS, max(least, enough)))


def _warm_up(blocks, fsdp_blocks, config, options: ValidationOptions, device, dtype) -> None:
    """Steps of small local packs on both block sets: torch.compile compiles the per-token
    regions' training graphs (dynamic shapes: once) here, not inside the first rank's timed
    warm-up. Two packs: sequences with the model's text, and (an MMDiT) without, as a rank that
    holds ring or Ulysses chunks of visual tokens only runs them (an empty text stream is a
    graph of its own)."""
    texts = (config.text_tokens, 0) if config.joint_attention else (config.text_tokens,)
    plan = _core.Plan()
    plan.planner = "validate"
    plan.num_ranks = 1
    plan.placements = [_core.make_placement(i, _core.Strategy.local, [0]) for i in range(2)]
    for text_tokens in texts:
        batch = _core.Batch()
        batch.sequences = [  # sizes unlike the weights' (see measure.per_token_inputs)
            _core.sequence_from_tokens(i, "video", 257 + 66 * i, text_tokens, 0) for i in range(2)
        ]
        for block_set, output_grad in ((blocks, True), (fsdp_blocks, False)):
            inputs = rank_work.plan_rank_inputs(
                batch=batch,
                plan=plan,
                rank=0,
                config=config,
                device=device,
                dtype=dtype,
                output_grad=output_grad,
                engine=_engine(options),
            )
            rank_work.train_step(block_set, inputs, options.activation_checkpointing)
    synchronize(device)


def rank_peak_bytes(
    *,
    batch: _core.Batch,
    plan: _core.Plan,
    rank: int,
    fsdp_blocks,
    plain_blocks,
    shard_bytes: float,
    config,
    options: ValidationOptions,
    device: torch.device,
    dtype: torch.dtype,
    full_recompute_layers: int = 0,
) -> float:
    """Peak device bytes of the rank's step on FSDP blocks, as the rank would hold them: the
    allocator's peak without the harness's own weights and kept gradients (of both block sets,
    rank_work.persistent_bytes), plus `shard_bytes` (the modelled FSDP shard that stands in for
    them) and the CUDA context outside the allocator. 0 on a CPU (no allocator statistics)."""
    inputs = rank_work.plan_rank_inputs(
        batch=batch,
        plan=plan,
        rank=rank,
        config=config,
        device=device,
        dtype=dtype,
        output_grad=False,
        engine=_engine(options),
    )
    checkpointing = options.activation_checkpointing
    rank_work.train_step(fsdp_blocks, inputs, checkpointing, full_recompute_layers)  # warm-up
    harness_bytes = rank_work.persistent_bytes(fsdp_blocks) + rank_work.persistent_bytes(
        plain_blocks
    )  # after a step: FSDP's sharded gradients exist from the first one on
    reset_peak(device)
    rank_work.train_step(fsdp_blocks, inputs, checkpointing, full_recompute_layers)
    peak = peak_allocated_bytes(device)
    del inputs
    if device.type != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    return peak - harness_bytes + shard_bytes + _outside_allocator_bytes(device)


def measure_rank(
    *,
    name: str,
    batch: _core.Batch,
    plan: _core.Plan,
    rank: int,
    cost_model: _core.CostModel,
    cost: _core.PlanCost,
    peak_model: _core.CostModel,
    peak_cost: _core.PlanCost,
    blocks,
    fsdp_blocks,
    config,
    options: ValidationOptions,
    device: torch.device,
    dtype: torch.dtype,
    gamma: float,
) -> RankResult:
    """One rank of a plan, predicted (time: `cost`, cost_model.evaluate of the plan; peak:
    `peak_cost` of harness_peak_model) and measured: its time on the plain blocks, its peak on
    the FSDP blocks, both run as training would run the rank, i.e. with the cost model's
    per-rank choice (`cost`): without adaptive checkpointing every block recomputes or none
    does, and the first full_recompute_layers recompute in full where the rank does not fit
    with their attention outputs kept."""
    rank_cost = cost.ranks[rank]
    assert rank_cost.checkpointed_layers == (
        options.num_layers if options.activation_checkpointing else 0
    )
    full_recompute_layers = rank_cost.full_recompute_layers
    # the shard that stands in for the harness's weights: no gradient (harness_peak_model)
    shard_bytes = (
        peak_model.model.param_count * peak_model.options.state_bytes_per_param / plan.num_ranks
    )
    copy_s = local_copy_s(cost_model, batch, plan, rank, cost_model.profile.memory_bytes_per_s)
    host = host_facts()
    times = run_rank(
        batch=batch,
        plan=plan,
        rank=rank,
        blocks=blocks,
        config=config,
        options=options,
        device=device,
        dtype=dtype,
        full_recompute_layers=full_recompute_layers,
    )
    peak = rank_peak_bytes(
        batch=batch,
        plan=plan,
        rank=rank,
        fsdp_blocks=fsdp_blocks,
        plain_blocks=blocks,
        shard_bytes=shard_bytes,
        config=config,
        options=options,
        device=device,
        dtype=dtype,
        full_recompute_layers=full_recompute_layers,
    )
    return RankResult(
        plan=name,
        rank=rank,
        tokens=rank_cost.tokens,
        num_sequences=sum(rank in p.ranks for p in plan.placements),
        predicted_s=predicted_rank_s(rank_cost, copy_s),
        measured_s=times.measured_s,
        predicted_peak_bytes=peak_cost.ranks[rank].peak_bytes,
        measured_peak_bytes=peak,
        modelled_state_bytes=shard_bytes,
        knapformer_work=knapformer_rank_work(batch, plan, rank, config.width, gamma),
        predicted_copy_s=copy_s,
        predicted_call_s=rank_cost.call_s,
        predicted_launch_floor_s=rank_cost.launch_floor_s,
        predicted_busy_s=predicted_busy_s(rank_cost, copy_s),
        strategies=rank_strategies(plan, rank),
        full_recompute_layers=full_recompute_layers,
        timed_steps=len(times.steps_s),
        measured_spread=relative_spread(times.steps_s),
        host_issue_s=statistics.median(times.issue_s),
        timed_gc_collections=times.gc_collections,
        host=host,
    )


def validate(
    options: ValidationOptions,
    progress: Progress = print,
    measure_rows: Callable[[], _core.HardwareProfile] | None = None,
) -> ValidationReport:
    """measure_rows: measures the model's own profile rows on this GPU (`zellige profile --base`)
    after the plans are drawn with options.profile and returns the profile the ranks are then
    predicted with; one process, so torch.compile compiles the per-token regions once."""
    device = torch.device(options.device)
    if device.type != "cuda" and not options.quick:
        raise ValueError(
            "zellige validate-profile runs ranks' work on a GPU and found none; use --quick for a "
            "CPU smoke run (time only, numbers mean nothing)"
        )
    if options.num_plans < 1:
        raise ValueError("--plans must be at least 1")
    if options.plan_range is not None:
        first, last = options.plan_range
        if not 1 <= first <= last <= options.num_plans:
            raise ValueError(
                f"--plan-range {first}-{last} must lie within plans 1-{options.num_plans}"
            )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.monotonic()
    profile = load_profile(options.profile)
    config = dit_config(options.model, num_layers=options.num_layers)
    spec = model_spec(options.model, num_layers=options.num_layers)
    # Plans first: planners run in forked processes, which must not inherit a CUDA context.
    skipped: list[str] = []
    plans = list(itertools.islice(draw_plans(options, profile, skipped), options.num_plans))
    progress(f"{len(plans)} plans drawn" + (f", {len(skipped)} sources skipped" if skipped else ""))
    if measure_rows is not None:
        profile = measure_rows()
        release_burn()  # nothing of the measurement stays allocated under the ranks' peaks
        gc.collect()
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            progress(
                f"rows measured; {torch.cuda.memory_allocated(device) / 2**20:.0f} MiB still "
                "allocated before the ranks run"
            )
    # Attention priced as the engine runs it here; after drawing the plans (their planners fork,
    # and the ragged kernel's check starts CUDA).
    profile = priced_as_engine_runs(
        profile, engine_runs_ragged(device, dtype, config.head_dim), progress
    )
    blocks = rank_work.make_blocks(config, options.num_layers, device, dtype)

    lengths, latencies = measure_forward_latencies(options, device, dtype, progress)
    try:
        gamma, seconds_per_unit = fit.fit_knapformer_gamma(lengths, latencies, config.width)
        progress(f"KnapFormer gamma fitted on forward latencies: {gamma:.3f}")
    except ValueError as error:
        if not options.quick:
            raise
        # a loaded CPU's millisecond latencies can defeat the fit; a smoke run goes on
        gamma, seconds_per_unit = 0.0, 0.0
        progress(f"KnapFormer gamma: {error} (quick run: gamma 0)")

    results: list[RankResult] = []
    notes = [
        "exchanges excluded: all-to-alls and ring messages ran as local copies of the same size; "
        "predictions exclude exchange time and add those copies at the profile's memory bandwidth",
        f"{options.num_layers} of {model_spec(options.model).num_layers} layers of "
        f"{model_name(options.model)}, activation checkpointing "
        f"{'on' if options.activation_checkpointing else 'off'}",
    ]
    notes.append(
        "attention priced as the engine runs it here: "
        + (
            "one ragged call per table of several calls"
            if profile.attention_ragged
            else "dense calls"
        )
        + " (attention_ragged)"
    )
    if options.contiguous_kernel_inputs:
        notes.append("attention kernel inputs copied to contiguous tensors (workaround switch)")
    if device.type == "cuda":
        notes.append(
            "time on plain bf16 blocks; peak memory on a second step on blocks sharded as in "
            "training (FSDP2 units over a group of one, fp32 master weights, bf16 compute, fp32 "
            "gradient reduction), the harness's weights replaced by the modelled FSDP shard"
        )
    notes.append(
        "per-token regions compiled (torch.compile), as training runs them on a GPU"
        if options.compiled
        else "per-token regions eager"
    )
    if measure_rows is not None:
        notes.append(
            f"plans drawn with {options.profile or 'the built-in profile'}; predictions from "
            f"the {model_name(options.model)} rows measured in this run"
        )
    with rank_work.process_group_of_one(device):
        fsdp_blocks = rank_work.make_fsdp_blocks(config, options.num_layers, device, dtype)
        if options.compiled:  # compile the regions' training graphs before any rank is timed
            _warm_up(blocks, fsdp_blocks, config, options, device, dtype)
        # Python's collector as training runs it (runtime.collector.QuietCollector): the objects
        # torch.compile left are collected once and frozen, so no full collection of them
        # falls in a timed step
        from zellige.runtime.collector import QuietCollector

        collector = QuietCollector()
        host = host_facts()  # what may slow the host's issue in this process (each rank: .host)
        progress(f"host: {host_line(host)}")
        for plan_index, (name, batch, plan) in enumerate(plans):
            if options.plan_range is not None and not (
                options.plan_range[0] <= plan_index + 1 <= options.plan_range[1]
            ):
                continue
            if options.time_budget_s and time.monotonic() - started > options.time_budget_s:
                notes.append(f"time budget reached: {plan_index} plans of {len(plans)}")
                progress(notes[-1])
                break
            cost_model = make_cost_model(
                spec, gpus=plan.num_ranks, profile=profile, options=options.cost_options()
            )
            cost = cost_model.evaluate(batch, plan)
            peak_model = harness_peak_model(spec, plan.num_ranks, profile, options.cost_options())
            peak_cost = peak_model.evaluate(batch, plan)
            for rank in chosen_ranks(cost, options.ranks_per_plan):
                result = measure_rank(
                    name=name,
                    batch=batch,
                    plan=plan,
                    rank=rank,
                    cost_model=cost_model,
                    cost=cost,
                    peak_model=peak_model,
                    peak_cost=peak_cost,
                    blocks=blocks,
                    fsdp_blocks=fsdp_blocks,
                    config=config,
                    options=options,
                    device=device,
                    dtype=dtype,
                    gamma=gamma,
                )
                results.append(result)
                floor = launch_floor(result.predicted_s, result.predicted_busy_s)
                if options.results_jsonl:
                    with open(options.results_jsonl, "a") as stream:
                        stream.write(json.dumps(dataclasses.asdict(result)) + "\n")
                progress(
                    f"plan {plan_index + 1:>2}/{options.num_plans} {name:<40} rank {rank:>2} "
                    f"{result.tokens:>7} tokens: time {result.predicted_s * 1e3:9.2f} / "
                    f"{result.measured_s * 1e3:9.2f} ms"
                    f"{' (launch floor)' if floor else ''}, host issue "
                    f"{result.host_issue_s * 1e3:.2f} ms"
                    f" (median of {result.timed_steps}, spread {100 * result.measured_spread:.1f}%)"
                    f", peak {result.predicted_peak_bytes / 2**30:7.2f} / "
                    f"{result.measured_peak_bytes / 2**30:7.2f} GiB (predicted / measured); "
                    f"{result.strategies}"
                    + (
                        f"; first {result.full_recompute_layers} layers recomputed in full"
                        if result.full_recompute_layers
                        else ""
                    )
                )
                collector.after_step()  # a rank that compiled (a new size guard): settle it
        collector.close()
        del fsdp_blocks  # before its process group goes
    notes.extend(f"skipped {line}" for line in skipped)
    report = summarise(results, gamma)
    report.gamma_forward_fit = {
        "lengths": lengths,
        "forward_latency_s": latencies,
        "gamma": gamma,
        "seconds_per_unit": seconds_per_unit,
    }
    report.notes = notes
    report.host = host
    return report


def report_dict(report: ValidationReport) -> dict:
    return dataclasses.asdict(report)
