"""The Python face of the CLI: `plan(...)` places one step's batch with one planner, `compare(...)`
runs several planners on the same batch. Both take a built-in workload name or a Batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from zellige import _core
from zellige.costs import make_cost_model
from zellige.model_spec import resolve_model
from zellige.pipeline import JOINT, check_planner_name, make_step_plan
from zellige.workload import generate, load_recipe


@dataclass(kw_only=True, slots=True)
class Setup:
    """Everything a planner needs besides its name: the batch and the cost model of the cluster."""

    batch: _core.Batch
    cost_model: _core.CostModel
    model_name: str  # the preset's or the spec's name
    links: str
    profile_path: str | None  # None: the built-in profile
    workload: str | None  # the recipe the batch came from, if any
    seed: int


@dataclass(kw_only=True, slots=True)
class CompareRow:
    """One planner's result on the batch; `error` says why a planner refused (e.g. memory), and
    then the measured fields are None."""

    planner: str
    makespan_s: float | None
    lower_bound_s: float
    imbalance: float | None  # max / mean rank time
    exchange_bytes: float | None  # all ranks, per step
    peak_bytes: float | None  # max over ranks
    fits: bool
    plan_ms: float | None
    error: str | None = None


def _require_int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def make_setup(
    batch_or_workload: str | _core.Batch,
    gpus: int,
    *,
    gpus_per_node: int | None = None,  # None: 8, or gpus when fewer
    model: str | Path | _core.ModelSpec | None = None,
    profile: str | Path | _core.HardwareProfile | None = None,
    seed: int = 0,
    links: str = "nvlink",
    gpu_memory_gib: float | None = None,
) -> Setup:
    """Resolves a workload name (generated for `gpus` ranks with `seed`) or a Batch, the model
    (default: the workload's own; required with a Batch), the profile (default: built-in H200;
    "h100" names the built-in H100 one), each GPU's memory in GiB (default: the profile's device)
    and the cluster into a Setup. Raises ValueError for any unknown name or invalid value."""
    # The documented limits, checked before any int reaches the core (where one beyond int64
    # would be a TypeError, and a huge one a minutes-long allocation).
    _require_int_in("gpus", gpus, 1, _core.MAX_GPUS)
    _require_int_in("seed", seed, 0, (1 << 63) - 1)
    workload = None
    if isinstance(batch_or_workload, str):
        workload = batch_or_workload
        recipe = load_recipe(workload)
        model = model or recipe.model
    elif model is None:
        names = ", ".join(_core.model_preset_names())
        raise ValueError(f"a batch needs a model (one of: {names})")
    spec = resolve_model(model)  # a preset name, a spec file or a ModelSpec
    # The cost model checks the model, cluster and profile before any batch is made.
    memory_bytes = None
    if gpu_memory_gib is not None:
        number = isinstance(gpu_memory_gib, int | float) and not isinstance(gpu_memory_gib, bool)
        if not number or not math.isfinite(gpu_memory_gib):
            raise ValueError(f"GPU memory must be a number of GiB, got {gpu_memory_gib!r}")
        memory_bytes = round(gpu_memory_gib * 2**30)  # make_cost_model checks its range
    cost_model = make_cost_model(
        spec, gpus, gpus_per_node, profile, links, gpu_memory_bytes=memory_bytes
    )
    if workload is not None:
        batch = generate(recipe, gpus, seed)
    else:
        batch = batch_or_workload
        _core.validate_batch(batch, gpus)
    return Setup(
        batch=batch,
        cost_model=cost_model,
        model_name=spec.name,
        links=links,
        profile_path=str(profile) if isinstance(profile, str | Path) else None,
        workload=workload,
        seed=seed,
    )


class NonFinitePrediction(ValueError):
    """A predicted time came out inf or NaN (see require_finite)."""


def require_finite(setup: Setup, what: str, *seconds: float) -> None:
    """Raises NonFinitePrediction (a ValueError) when a predicted time is inf or NaN: the
    profile's tables, extrapolated along their end segments, left double's range for this batch.
    Such a time is never shown as a number."""
    bad = [value for value in seconds if not math.isfinite(value)]
    if bad:
        profile = setup.profile_path or "the built-in profile"
        raise NonFinitePrediction(
            f"{what}: the cost model predicts a non-finite time ({bad[0]}) for this batch with "
            f"{profile}: its tables extrapolate out of range here (measure them over these "
            "lengths)"
        )


def lower_bound(setup: Setup) -> float:
    """The makespan lower bound of the setup's batch, checked finite."""
    bound_s = _core.makespan_lower_bound(setup.batch, setup.cost_model)
    require_finite(setup, "lower bound", bound_s)
    return bound_s


def run_planner(setup: Setup, planner: str, seed: int = 0) -> _core.Plan:
    """One planner on the setup's batch: a validated Plan with its prediction and plan_ms.
    Raises ValueError for a bad planner name or a non-finite prediction, PlanMemoryError when it
    cannot place in memory."""
    check_planner_name(planner)
    try:
        result = make_step_plan(planner, setup.batch, setup.cost_model, seed=seed)
    except _core.PlanMemoryError as error:
        if planner == JOINT:
            raise
        # A profile that predicts inf makes a planner's memory search fail: say the cause.
        lower_bound(setup)
        if str(error):
            raise
        # A planner whose every candidate has an inf or NaN time ends without a reason.
        raise _core.PlanMemoryError(
            f"{planner}: found no placement that fits in memory with a finite predicted time"
        ) from None
    predicted = result.predicted
    require_finite(setup, planner, predicted.makespan_s, *predicted.rank_time_s)
    return result


def plan(
    batch_or_workload: str | _core.Batch,
    gpus: int,
    *,
    gpus_per_node: int | None = None,  # None: 8, or gpus when fewer
    model: str | Path | _core.ModelSpec | None = None,
    profile: str | Path | _core.HardwareProfile | None = None,
    planner: str = "zellige",
    seed: int = 0,
    links: str = "nvlink",
    gpu_memory_gib: float | None = None,
) -> _core.Plan:
    """Places one step's batch (a built-in workload name, or a Batch) on `gpus` GPUs."""
    setup = make_setup(
        batch_or_workload,
        gpus,
        gpus_per_node=gpus_per_node,
        model=model,
        profile=profile,
        seed=seed,
        links=links,
        gpu_memory_gib=gpu_memory_gib,
    )
    return run_planner(setup, planner, seed)


def default_planners(num_gpus: int, gpus_per_node: int = 8) -> list[str]:
    """The baselines worth comparing on this cluster, then zellige (joint is opt-in: slow).

    static-cp with C = 4 and 8 where C divides the cluster; knapformer with the homogeneous g4
    spec and a mixed spec that gives each bag size up to 8 a similar share of the GPUs."""
    names = ["dp-tokens", "dp-cost"]
    names += [f"static-cp:{c}" for c in (4, 8) if c <= num_gpus and num_gpus % c == 0]
    if num_gpus % 4 == 0:
        names.append(f"knapformer:g4n{num_gpus // 4}")
    mixed = _mixed_knapformer_spec(num_gpus, min(8, gpus_per_node))
    if mixed is not None:
        names.append(f"knapformer:{mixed}")
    return [*names, "megatron-dcp", "zellige"]


def _mixed_knapformer_spec(num_gpus: int, max_bag_gpus: int) -> str | None:
    """Bags of 1, 2, 4, ... GPUs (at most half the cluster), largest first, each size taking about
    an equal share and the 1-GPU bags the rest: 32 GPUs -> g1n8+g2n4+g4n2+g8n1."""
    sizes = [s for s in (8, 4, 2, 1) if s <= max_bag_gpus and 2 * s <= num_gpus]
    if len(sizes) < 2:
        return None
    share = num_gpus // len(sizes)
    left = num_gpus
    bags = {}
    for size in sizes[:-1]:
        count = min(max(1, share // size), left // size)
        if count:
            bags[size] = count
            left -= count * size
    if left:
        bags[1] = left
    return "+".join(f"g{size}n{count}" for size, count in sorted(bags.items()))


def compare_setup(setup: Setup, planners: list[str] | None, seed: int = 0) -> list[CompareRow]:
    """Runs each planner (default: default_planners) on the setup's batch; a planner that cannot
    place the batch in memory gets a row with `error` instead of stopping the comparison."""
    if planners is None:
        cluster = setup.cost_model.cluster
        planners = default_planners(cluster.num_ranks(), cluster.gpus_per_node)
    for name in planners:
        check_planner_name(name)
    # A sequence that fits under no placement is the batch's fault, not a planner's: stop here.
    _core.check_sequences_fit(setup.batch, setup.cost_model)
    lower_bound_s = lower_bound(setup)
    rows = []
    for name in planners:
        try:
            result = run_planner(setup, name, seed)
            cost = setup.cost_model.evaluate(setup.batch, result)
            require_finite(setup, name, cost.makespan_s, *(rank.time_s for rank in cost.ranks))
        except (_core.PlanMemoryError, NonFinitePrediction, TimeoutError) as error:
            rows.append(
                CompareRow(
                    planner=name,
                    makespan_s=None,
                    lower_bound_s=lower_bound_s,
                    imbalance=None,
                    exchange_bytes=None,
                    peak_bytes=None,
                    fits=False,
                    plan_ms=None,
                    error=str(error),
                )
            )
            continue
        rank_times_s = [rank.time_s for rank in cost.ranks]
        mean_s = sum(rank_times_s) / len(rank_times_s)
        rows.append(
            CompareRow(
                planner=name,
                makespan_s=cost.makespan_s,
                lower_bound_s=lower_bound_s,
                imbalance=max(rank_times_s) / mean_s,
                exchange_bytes=cost.exchange_bytes,
                peak_bytes=cost.peak_bytes,
                fits=cost.fits,
                plan_ms=result.plan_ms,
            )
        )
    return rows


def compare(
    batch_or_workload: str | _core.Batch,
    gpus: int,
    *,
    gpus_per_node: int | None = None,  # None: 8, or gpus when fewer
    model: str | Path | _core.ModelSpec | None = None,
    profile: str | Path | _core.HardwareProfile | None = None,
    planners: list[str] | None = None,
    seed: int = 0,
    links: str = "nvlink",
    gpu_memory_gib: float | None = None,
) -> list[CompareRow]:
    """Runs `planners` (default: default_planners) on the same batch, one row each."""
    setup = make_setup(
        batch_or_workload,
        gpus,
        gpus_per_node=gpus_per_node,
        model=model,
        profile=profile,
        seed=seed,
        links=links,
        gpu_memory_gib=gpu_memory_gib,
    )
    return compare_setup(setup, planners, seed)
