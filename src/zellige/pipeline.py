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

A global batch (one optimizer step's samples, run as several micro-batches with gradient
accumulation; docs/global-batch.md) is an input of the same pipeline: plan_global() cuts it into
micro-batches and places each (a GlobalPlan), and each micro-batch is compiled, loaded and routed
as a step of its own; prepare_global() hands them over as one `PreparedGlobalStep`.
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

if TYPE_CHECKING:
    # a global-batch planner name (zellige.global_batch_planner_names()) or a fixed GlobalPlan
    # that every step uses (tests that need a particular cut into micro-batches)
    GlobalPlanner = str | _core.GlobalPlan


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


def check_global_planner_name(planner: str) -> None:
    """Raises ValueError for a name no global-batch planner answers to."""
    names = _core.global_batch_planner_names()
    if planner not in names:
        raise ValueError(f"unknown global-batch planner '{planner}' (allowed: {', '.join(names)})")


def make_global_plan(
    planner: GlobalPlanner, batch: _core.Batch, cost_model: _core.CostModel, *, seed: int
) -> _core.GlobalPlan:
    """The global batch's micro-batches and their plans: the one place that decides which
    global-batch planner runs. A fixed GlobalPlan keeps its cut; each micro-batch is placed again
    by its plan's placements and predicted here, so every step's prediction is its own."""
    if isinstance(planner, _core.GlobalPlan):
        ids = [[s.id for s in micro.batch.sequences] for micro in planner.micro_batches]
        if sorted(i for cut in ids for i in cut) != sorted(s.id for s in batch.sequences):
            raise ValueError("the fixed global plan does not hold this global batch's sequences")
        by_id = {s.id: s for s in batch.sequences}
        plan = _core.GlobalPlan(planner=planner.planner, chosen=planner.chosen, plan_ms=0.0)
        micro_batches = []
        # a micro-batch of several holds the earlier ones' gradients through its backward
        priced_by = cost_model.accumulating_view() if len(ids) > 1 else cost_model
        for micro, cut in zip(planner.micro_batches, ids, strict=True):
            micro_batch = _core.Batch()
            micro_batch.sequences = [by_id[i] for i in cut]
            placed = make_step_plan(micro.plan, micro_batch, priced_by, seed=seed)
            micro_batches.append(_core.MicroBatch(batch=micro_batch, plan=placed))
        plan.micro_batches = micro_batches
        plan.step_time_s = sum(m.plan.predicted.makespan_s for m in micro_batches)
        return plan
    return _core.plan_global_batch(planner, batch, cost_model, _core.GlobalBatchOptions(seed=seed))


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

    @property
    def num_micro_batches(self) -> int:
        return 1

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

    @classmethod
    def summed(cls, forecasts: Sequence[StepForecast]) -> StepForecast:
        """Micro-batches' forecasts as one optimizer step's: each rank's times added (the
        micro-batches of one step are planned with the same factors)."""
        return cls(
            rank_speed_factors=forecasts[0].rank_speed_factors,
            rank_time_s=tuple(map(sum, zip(*(f.rank_time_s for f in forecasts), strict=True))),
            rank_layers_s=tuple(map(sum, zip(*(f.rank_layers_s for f in forecasts), strict=True))),
        )


@dataclass(frozen=True, slots=True)
class GlobalStepRecord:
    """A global batch's plan, typed: per micro-batch its StepRecord, and the step's prediction.
    It answers what a StepRecord answers about the whole optimizer step, so the trainer's
    metrics read either: makespan_s is the predicted step time (the micro-batches' makespans
    plus their fixed costs), a rank's time is its sum over the micro-batches and its peak the
    largest of theirs."""

    planner: str
    chosen: str
    plan_ms: float
    step_time_s: float
    micro_batches: tuple[StepRecord, ...]

    @classmethod
    def from_plan(cls, plan: _core.GlobalPlan) -> GlobalStepRecord:
        return cls(
            planner=plan.planner,
            chosen=plan.chosen,
            plan_ms=float(plan.plan_ms),
            step_time_s=float(plan.step_time_s),
            micro_batches=tuple(StepRecord.from_plan(m.plan) for m in plan.micro_batches),
        )

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def num_ranks(self) -> int:
        return self.micro_batches[0].num_ranks

    @property
    def makespan_s(self) -> float:
        return self.step_time_s

    @property
    def rank_time_s(self) -> tuple[float, ...]:
        return tuple(
            sum(times) for times in zip(*(m.rank_time_s for m in self.micro_batches), strict=True)
        )

    @property
    def rank_peak_bytes(self) -> tuple[float, ...]:
        return tuple(
            max(peaks)
            for peaks in zip(*(m.rank_peak_bytes for m in self.micro_batches), strict=True)
        )

    @property
    def planned_imbalance(self) -> float:
        """The slowest rank's predicted time over the mean rank's, summed over micro-batches."""
        rank_time_s = self.rank_time_s
        return max(rank_time_s) / (sum(rank_time_s) / len(rank_time_s))

    def checkpointed_blocks(self, rank: int) -> tuple[int, int]:
        """The most blocks `rank` checkpoints in any micro-batch (each sets its own)."""
        counts = [m.checkpointed_blocks(rank) for m in self.micro_batches]
        return max(c for c, _ in counts), max(f for _, f in counts)


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


@dataclass(kw_only=True, slots=True)
class PreparedGlobalStep:
    """One rank's global batch planned and compiled ahead: one PreparedStep per micro-batch, in
    the order they run, and the normalisers of the whole global batch (a micro-batch's loss is
    divided by them, so the accumulated gradient is the global batch's)."""

    index: int  # the optimizer step's index
    rank: int
    micro_batches: tuple[PreparedStep, ...]
    record: GlobalStepRecord
    num_tokens: int  # visual tokens of the whole global batch
    num_samples: int  # sequences of the whole global batch


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
        global_planner: GlobalPlanner = "zellige",
    ) -> None:
        if isinstance(planner, str):
            check_planner_name(planner)  # a typo fails here, not at the first step
        if isinstance(global_planner, str):
            check_global_planner_name(global_planner)
        self.spec = spec
        self.cost_model = cost_model
        self.planner = planner
        self.global_planner = global_planner  # what plan_global() runs
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
        cost_model = self._cost_model_at(speed_factors)
        return make_step_plan(
            self.planner, batch, cost_model, seed=self.seed if seed is None else seed
        )

    def _cost_model_at(self, speed_factors: Sequence[float] | None) -> _core.CostModel:
        """The cost model at `speed_factors` (None: the pipeline's own), kept while the next
        plans use the same ones."""
        if speed_factors is None:
            return self.cost_model
        factors = tuple(float(f) for f in speed_factors)
        if self._sped_cost_model is None or self._sped_cost_model[0] != factors:
            self._sped_cost_model = (factors, with_speed_factors(self.cost_model, factors))
        return self._sped_cost_model[1]

    def plan_global(
        self,
        batch: _core.Batch,
        *,
        seed: int | None = None,
        speed_factors: Sequence[float] | None = None,
    ) -> _core.GlobalPlan:
        """A global batch cut into micro-batches, each placed (`seed`: default the pipeline's),
        with rank r at speed_factors[r] times its cluster speed (None: the cluster's own).
        Raises PlanMemoryError when a sequence fits no placement."""
        cost_model = self._cost_model_at(speed_factors)
        return make_global_plan(
            self.global_planner, batch, cost_model, seed=self.seed if seed is None else seed
        )

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

    def prepare_global(
        self, batch: _core.Batch, rank: int, *, index: int, seed: int | None = None
    ) -> PreparedGlobalStep:
        """plan_global + compile of each micro-batch of optimizer step `index` for `rank`."""
        plan = self.plan_global(batch, seed=seed)
        return self.prepare_micro_batches(batch, plan, rank, index=index)

    def prepare_micro_batches(
        self, batch: _core.Batch, plan: _core.GlobalPlan, rank: int, *, index: int
    ) -> PreparedGlobalStep:
        """Each micro-batch of `plan` compiled for `rank` (as prepare() compiles a step)."""
        micro_batches = []
        for micro in plan.micro_batches:
            program, error = None, None
            try:
                program = self.compile(micro.batch, micro.plan, rank)
            except ValueError as exc:
                error = str(exc)
            micro_batches.append(
                PreparedStep(
                    index=index,
                    rank=rank,
                    program=program,
                    error=error,
                    record=StepRecord.from_plan(micro.plan),
                    sequence_num_tokens=tuple(s.num_tokens for s in micro.batch.sequences),
                )
            )
        return PreparedGlobalStep(
            index=index,
            rank=rank,
            micro_batches=tuple(micro_batches),
            record=GlobalStepRecord.from_plan(plan),
            num_tokens=sum(s.num_tokens for s in batch.sequences),
            num_samples=len(batch.sequences),
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
