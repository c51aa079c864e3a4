"""One step pipeline: every consumer of a step goes through the same four calls.

    batch --plan()--> Plan --compile()--> StepProgram --load()--> Step --route()--> tensors
          C++ planner,      C++ plan                 runtime: index      runtime: one
          cost model        compiler                 tensors, engine     exchange

`StepPipeline` is built once from a ModelSpec, a CostModel, a planner (a name, a function or a
fixed Plan) and a seed. plan() and compile() are pure (C++, no GPU, no process group), so a loader
worker runs them one step ahead; load() and route() are the runtime's and run in the training
process. The loader worker (zellige.data), the public Balancer (and through it zellige.train)
and the CLI's plan/compare (zellige.api) all use it; `make_step_plan` is the one function that
decides which planner runs.

What a consumer needs from a plan besides the program (checkpointed layers, predicted times and
peaks, plan_ms) travels as a `StepRecord` (frozen, picklable), never as a plan dict; a step
planned and compiled ahead crosses processes as a `PreparedStep`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zellige import _core

if TYPE_CHECKING:
    # the runtime needs torch; planning does not. The aliases are for type checkers only: a
    # module-level object that refers to the core's types keeps them alive past the core's
    # teardown, and nanobind then reports them as leaks.
    import torch
    from torch import Tensor, distributed

    from zellige import runtime
    from zellige.runtime import Step

    PlanFn = Callable[[_core.Batch, _core.CostModel], _core.Plan]
    # a planner name (zellige.planner_names() or "joint"), a function (batch, cost_model) ->
    # Plan, or a fixed Plan that every step uses (tests that need a particular placement)
    Planner = str | PlanFn | _core.Plan

JOINT = "joint"  # the MILP reference, in Python (zellige.joint); every other name is make_plan's


def check_planner_name(planner: str) -> None:
    """Raises ValueError for a name no planner answers to; make_plan still checks the part after
    the colon (e.g. "static-cp:3" on 8 ranks)."""
    forms = [*_core.planner_names(), JOINT]
    if planner.split(":", 1)[0] not in {form.split(":", 1)[0] for form in forms}:
        allowed = ", ".join(forms)
        raise ValueError(f"unknown planner '{planner}' (allowed: {allowed})")


def with_speed_factors(
    cost_model: _core.CostModel, speed_factors: Sequence[float]
) -> _core.CostModel:
    """`cost_model` on a cluster whose rank speeds are its own times `speed_factors` (one per
    rank: measured feedback, zellige.train.speeds); the model, profile and options unchanged."""
    cluster = _copy_cluster(cost_model.cluster)  # the property is the cost model's own
    num_ranks = cluster.num_ranks()
    if len(speed_factors) != num_ranks:
        raise ValueError(f"{len(speed_factors)} speed factors for a cluster of {num_ranks} ranks")
    base = list(cluster.rank_speeds) or [1.0] * num_ranks
    cluster.rank_speeds = [float(b) * float(f) for b, f in zip(base, speed_factors, strict=True)]
    return _core.CostModel(cost_model.model, cost_model.profile, cluster, cost_model.options)


_CLUSTER_FIELDS = (
    "num_nodes",
    "gpus_per_node",
    "gpu_memory_bytes",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
    "rank_speeds",
    "rank_memory_bytes",
)


def _copy_cluster(cluster: _core.Cluster) -> _core.Cluster:
    copy = _core.Cluster(**{name: getattr(cluster, name) for name in _CLUSTER_FIELDS})
    assert copy == cluster, "a Cluster field is missing from _CLUSTER_FIELDS"
    return copy


def make_step_plan(
    planner: Planner, batch: _core.Batch, cost_model: _core.CostModel, *, seed: int
) -> _core.Plan:
    """The plan of one step's batch, with the cost model's prediction: the one place that decides
    which planner runs. A function's plan and a fixed plan are predicted here (the planners
    predict their own); a fixed plan is copied, so every step's prediction is its own."""
    if isinstance(planner, _core.Plan):
        plan = _core.Plan(
            planner=planner.planner,
            num_ranks=planner.num_ranks,
            plan_ms=planner.plan_ms,
            note=planner.note,
        )
        plan.placements = list(planner.placements)
        _core.predict(plan, batch, cost_model)
        return plan
    if callable(planner):
        plan = planner(batch, cost_model)
        _core.predict(plan, batch, cost_model)
        return plan
    if planner == JOINT:
        # imported on demand: the MILP reference pulls in highspy
        from zellige import joint

        return joint.plan_joint(batch, cost_model, seed=seed)
    return _core.make_plan(planner, batch, cost_model, _core.PlannerOptions(seed=seed))


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What a step's consumer needs from its plan, typed (picklable: it crosses from a loader
    worker beside the step program). Per-rank tuples have one entry per rank of the plan.

    rank_checkpointed_layers / rank_full_recompute_layers: the cost model's choice per rank (the
    first this many layers recompute in the backward / of those, recompute attention too); with
    activation checkpointing off both are 0, without adaptive checkpointing every layer."""

    planner: str
    num_ranks: int
    plan_ms: float
    makespan_s: float
    rank_time_s: tuple[float, ...]
    rank_peak_bytes: tuple[float, ...]
    rank_checkpointed_layers: tuple[int, ...]
    rank_full_recompute_layers: tuple[int, ...]

    @classmethod
    def from_plan(cls, plan: _core.Plan) -> StepRecord:
        predicted = plan.predicted
        return cls(
            planner=plan.planner,
            num_ranks=plan.num_ranks,
            plan_ms=float(plan.plan_ms),
            makespan_s=float(predicted.makespan_s),
            rank_time_s=tuple(float(t) for t in predicted.rank_time_s),
            rank_peak_bytes=tuple(float(b) for b in predicted.rank_peak_bytes),
            rank_checkpointed_layers=tuple(int(k) for k in predicted.rank_checkpointed_layers),
            rank_full_recompute_layers=tuple(int(f) for f in predicted.rank_full_recompute_layers),
        )

    @property
    def planned_imbalance(self) -> float:
        """The slowest rank's predicted time over the mean rank's."""
        return max(self.rank_time_s) / (sum(self.rank_time_s) / len(self.rank_time_s))

    def checkpointed_blocks(self, rank: int) -> tuple[int, int]:
        """(blocks `rank` checkpoints, of those the ones that recompute in full) this step."""
        count = self.rank_checkpointed_layers[rank]
        return count, min(count, self.rank_full_recompute_layers[rank])


@dataclass(frozen=True, slots=True)
class StepForecast:
    """The speed factors a step's plan used (measured feedback, zellige.train.speeds) and the
    cost model's per-rank times for the plan at the cluster's own speeds (nominal: without the
    factors), which measured times compare with. Picklable: a loader worker makes it.

    rank_speed_factors: the factors the plan used (empty: none).
    rank_time_s: each rank's nominal time; rank_layers_s: its per-token layers' part (the rest
    is attention and its exchanges)."""

    rank_speed_factors: tuple[float, ...]
    rank_time_s: tuple[float, ...]
    rank_layers_s: tuple[float, ...]

    @classmethod
    def from_plan(
        cls,
        cost_model: _core.CostModel,
        batch: _core.Batch,
        plan: _core.Plan,
        speed_factors: Sequence[float] | None = None,
    ) -> StepForecast:
        """`plan` priced by `cost_model` (the pipeline's, without the factors)."""
        ranks = cost_model.evaluate(batch, plan).ranks
        return cls(
            rank_speed_factors=tuple(float(f) for f in speed_factors or ()),
            rank_time_s=tuple(float(r.time_s) for r in ranks),
            rank_layers_s=tuple(float(r.linear_s) for r in ranks),
        )


@dataclass(kw_only=True, slots=True)
class PreparedStep:
    """One rank's step planned and compiled ahead (picklable: a loader worker makes it).

    program: this rank's StepProgram, or None with `error` saying why it could not be compiled;
    load() hands the error to every rank, so all raise it together. record: the plan's typed
    record. sequence_num_tokens: each sequence's visual tokens, in batch order (the loss's
    normalisers)."""

    index: int  # the step's index
    rank: int
    program: _core.StepProgram | None
    error: str | None
    record: StepRecord
    sequence_num_tokens: tuple[int, ...]


class StepPipeline:
    """plan -> compile -> load -> route for one model, cost model and planner.

    Example:
        >>> pipeline = StepPipeline(spec, cost_model, "zellige", seed=0)
        >>> plan = pipeline.plan(batch, seed=0)
        >>> program = pipeline.compile(batch, plan, rank)
        >>> step = pipeline.load(program, device)           # every rank of the group
        >>> held_TD = pipeline.route(source_SD, step, tokens="visual")
    """

    def __init__(
        self,
        spec: _core.ModelSpec,
        cost_model: _core.CostModel,
        planner: Planner = "zellige",
        *,
        seed: int = 0,
    ) -> None:
        if isinstance(planner, str):
            check_planner_name(planner)  # a typo fails here, not at the first step
        self.spec = spec
        self.cost_model = cost_model
        self.planner = planner
        self.seed = seed
        self._sped_cost_model: tuple[tuple[float, ...], _core.CostModel] | None = None

    @property
    def num_ranks(self) -> int:
        return self.cost_model.cluster.num_ranks()

    @property
    def planner_name(self) -> str:
        planner = self.planner
        if isinstance(planner, str):
            return planner
        if isinstance(planner, _core.Plan):
            return planner.planner
        return getattr(planner, "__name__", "fn")

    def plan(
        self,
        batch: _core.Batch,
        *,
        seed: int | None = None,
        speed_factors: Sequence[float] | None = None,
    ) -> _core.Plan:
        """The batch's plan with its prediction (`seed`: the planner's; default the pipeline's).
        speed_factors: per rank, multiply the cluster's speeds for this plan (measured feedback;
        every rank must pass the same ones for their plans to agree)."""
        cost_model = self.cost_model if speed_factors is None else self._sped(speed_factors)
        return make_step_plan(
            self.planner, batch, cost_model, seed=self.seed if seed is None else seed
        )

    def _sped(self, speed_factors: Sequence[float]) -> _core.CostModel:
        """The cost model at `speed_factors`, kept while the next plans use the same ones."""
        factors = tuple(float(f) for f in speed_factors)
        if self._sped_cost_model is None or self._sped_cost_model[0] != factors:
            self._sped_cost_model = (factors, with_speed_factors(self.cost_model, factors))
        return self._sped_cost_model[1]

    def compile(self, batch: _core.Batch, plan: _core.Plan, rank: int) -> _core.StepProgram:
        """`rank`'s StepProgram (C++ plan compiler). Raises ValueError when the plan does not
        match the batch or the model's heads."""
        from zellige import runtime

        return runtime.compile_step(
            batch, plan, self.spec.num_heads, rank, joint_attention=self.spec.joint_attention
        )

    def prepare(
        self,
        batch: _core.Batch,
        rank: int,
        *,
        index: int,
        seed: int | None = None,
        plan: _core.Plan | None = None,
    ) -> PreparedStep:
        """plan + compile of step `index` for `rank`, ahead of the step (`plan`: one made
        already, by plan()); a plan that does not compile becomes the PreparedStep's error
        (raised by load(), on every rank alike)."""
        if plan is None:
            plan = self.plan(batch, seed=seed)
        program, error = None, None
        try:
            program = self.compile(batch, plan, rank)
        except ValueError as exc:
            error = str(exc)
        return PreparedStep(
            index=index,
            rank=rank,
            program=program,
            error=error,
            record=StepRecord.from_plan(plan),
            sequence_num_tokens=tuple(s.num_tokens for s in batch.sequences),
        )

    @staticmethod
    def load(
        program: _core.StepProgram | None,
        device: torch.device | str,
        group: distributed.ProcessGroup | None = None,
        *,
        error: str | None = None,
        engine: runtime.EngineConfig | None = None,
    ) -> Step:
        """The program on `device` (runtime.load_step) run by `engine` (default: from the
        environment's documented overrides): every rank of `group` calls it, and all raise the
        same ValueError when any rank has an error or the ranks' programs differ."""
        from zellige import runtime

        return runtime.load_step(program, device, group, error=error, engine=engine)

    @staticmethod
    def route(x_SD: Tensor, step: Step, tokens: str = "all") -> Tensor:
        """Source rows -> held rows (runtime.route: one all_to_all)."""
        from zellige import runtime

        return runtime.route(x_SD, step, tokens=tokens)
