"""The joint placement reference (after FlexSP, REFERENCE.md): one MILP over the whole batch.

Binary x[i, c] picks candidate placement c of sequence i (`_core.candidate_placements`:
node-aligned rank windows, every strategy); T >= every rank's load; each sequence is placed exactly
once; each rank's memory stays within capacity; minimise T. A rank's load is the sum of its shares,
with the per-token layers linearised at their per-token rate at the mean token count per rank (the
one non-additive term of the cost model). HiGHS solves it under a time limit; the plan it returns is
then priced exactly by the cost model, and `Plan.note` reports the MIP gap and whether the MILP
proved optimality (over its candidate set and linearised loads).

Sequences of equal lengths are interchangeable, so they share integer variables (how many of them
take each candidate) instead of one binary each. Candidate pruning, so 16-32 GPUs with 64-256
sequences stay solvable: every sequence may run locally on any rank; a sequence may also be
sharded over up to ceil(4 x its local load / mean load per rank) ranks, widened (doubling, up to
the whole cluster) until some shape fits in memory, on at most `max_windows_per_shape` windows per
degree, keeping per window the strategy with the lowest busiest-rank load (and the one with the
least memory when memory is tight). The zellige planner's own placements join the candidates and
its plan is the MILP's first incumbent (a warm start), so the reference is never a worse plan than
zellige under the linearised loads, and can only improve on it.

`time_limit_s` covers everything: the warm-start plan, building the candidates and the solve; when
it runs out before the MILP has a plan, `plan_joint` raises TimeoutError saying which stage ran out.
The zellige call cannot be interrupted, so the warm start is skipped (the note says
`warm_start=skipped`) when its estimated CPU time (`warm_start_estimate_s`) exceeds a quarter of
the limit.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import highspy
import numpy as np

from zellige import _core

_GIB = float(1 << 30)


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Sends file descriptor 1 to /dev/null: HiGHS prints its banner from the constructor, before
    output_flag can be set, and it would corrupt `zellige compare --json`."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One placement of one sequence with its linearised load and memory on each of its ranks."""

    placement: _core.Placement
    ranks: tuple[int, ...]
    load_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]


@dataclass(kw_only=True, slots=True)
class JointProblem:
    """The MILP's data. Sequences with equal lengths cost the same under every placement, so they
    form one group whose integer variables count how many of them take each candidate: the same
    optimum as one binary per sequence, without the symmetry between interchangeable sequences."""

    groups: list[list[int]]  # batch indices of each group's sequences, in batch order
    candidates: list[list[Candidate]]  # per group; placements carry the group's first id
    num_ranks: int
    free_bytes: float  # memory per rank for sequences: capacity minus the fixed bytes
    warm_counts: list[list[int]] | None = None  # a plan to start from: counts per candidate

    def per_sequence(self, num_sequences: int) -> list[list[Candidate]]:
        """Each sequence's candidates, in batch order."""
        result: list[list[Candidate]] = [[] for _ in range(num_sequences)]
        for members, options in zip(self.groups, self.candidates, strict=True):
            for index in members:
                result[index] = options
        return result


@dataclass(kw_only=True, slots=True)
class JointResult:
    plan: _core.Plan  # priced exactly by the cost model
    objective_s: float  # the MILP's makespan (linearised loads)
    dual_bound_s: float  # no plan over these candidates has a lower linearised makespan
    mip_gap: float
    optimal: bool
    num_candidates: int


def linear_rate_s_per_token(batch: _core.Batch, cost_model: _core.CostModel) -> float:
    """Per-token seconds of the per-token layers at the batch's mean token count per rank."""
    num_ranks = cost_model.cluster.num_ranks()
    tokens = max(1, _core.total_tokens(batch) // num_ranks)
    return cost_model.linear_time_s(tokens) / tokens


def _free_bytes(cost_model: _core.CostModel) -> float:
    return cost_model.memory_capacity_bytes() - cost_model.fixed_bytes()


def _candidate(
    sequence: _core.Sequence, placement: _core.Placement, cost_model, rate_s: float
) -> Candidate:
    shares = cost_model.shares(sequence, placement)
    return Candidate(
        placement=placement,
        ranks=tuple(share.rank for share in shares),
        load_s=tuple(
            rate_s * share.tokens + share.attention_s + share.exchange_s for share in shares
        ),
        memory_bytes=tuple(share.memory_bytes for share in shares),
    )


# what a user can do when the MILP does not finish: the CLI has no time-limit flag
_TOO_LARGE = (
    "the joint reference is for small clusters (tens of GPUs, hundreds of sequences); from "
    "Python, zellige.joint.plan_joint takes time_limit_s, max_windows_per_shape and max_degree"
)


class _Deadline:
    """Raises TimeoutError naming the stage once `time_limit_s` (from `start`) has passed."""

    def __init__(self, start: float, time_limit_s: float) -> None:
        self.start = start
        self.time_limit_s = time_limit_s

    def remaining_s(self) -> float:
        return self.time_limit_s - (time.perf_counter() - self.start)

    def check(self, stage: str) -> None:
        if self.remaining_s() <= 0:
            raise TimeoutError(
                f"joint MILP: the {self.time_limit_s:g} s time limit ran out while {stage}; "
                f"{_TOO_LARGE}"
            )


def _placement_key(placement: _core.Placement) -> tuple:
    return (tuple(placement.ranks), placement.strategy.name, placement.ulysses_degree)


def joint_problem(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    *,
    max_windows_per_shape: int = 4,
    max_degree: int | None = None,
    all_strategies: bool = False,
    warm_plan: _core.Plan | None = None,
    deadline: _Deadline | None = None,
) -> JointProblem:
    """Groups and their candidates. `max_degree` overrides the per-group degree cap;
    `all_strategies` keeps every strategy per window instead of the best one (for tests);
    `warm_plan`'s placements join the candidates and become the warm start (problem.warm_counts);
    `deadline` stops the construction with TimeoutError."""
    num_ranks = cost_model.cluster.num_ranks()
    rate_s = linear_rate_s_per_token(batch, cost_model)
    free_bytes = _free_bytes(cost_model)
    members: dict[tuple[int, int], list[int]] = {}
    for index, sequence in enumerate(batch.sequences):
        members.setdefault((sequence.num_tokens, sequence.text_tokens), []).append(index)
    groups = list(members.values())
    local = []
    for group in groups:
        sequence = batch.sequences[group[0]]
        placement = _core.make_placement(sequence.id, _core.Strategy.local, [0])
        local.append(_candidate(sequence, placement, cost_model, rate_s))
    mean_load_s = sum(c.load_s[0] * len(g) for c, g in zip(local, groups, strict=True)) / num_ranks
    warm_of: dict[int, _core.Placement] = {}
    if warm_plan is not None:
        warm_of = {p.sequence_id: p for p in warm_plan.placements}

    candidates: list[list[Candidate]] = []
    warm_counts: list[list[int]] | None = [] if warm_plan is not None else None
    for number, (group, local0) in enumerate(zip(groups, local, strict=True)):
        if deadline is not None:
            deadline.check(f"building candidates ({number} of {len(groups)} length groups done)")
        sequence = batch.sequences[group[0]]
        options: list[Candidate] = []
        if local0.memory_bytes[0] <= free_bytes:
            for rank in range(num_ranks):
                placement = _core.make_placement(sequence.id, _core.Strategy.local, [rank])
                options.append(Candidate(placement, (rank,), local0.load_s, local0.memory_bytes))
        cap = max_degree
        if cap is None:
            cap = math.ceil(4 * local0.load_s[0] / mean_load_s) if mean_load_s > 0 else 1
        cap = max(1, min(num_ranks, cap))
        if cap >= 2 or not options:
            by_window: dict[tuple[int, ...], list[Candidate]] = {}
            low = 2
            while True:  # widen (doubling) while nothing fits in memory yet
                for placement in _core.candidate_placements(
                    sequence, cost_model, max_windows_per_shape, cap
                ):
                    if deadline is not None:  # each costs O(degree): thousands add up
                        deadline.check(f"pricing the candidates of sequence {sequence.id}")
                    if placement.degree() < low:
                        continue
                    candidate = _candidate(sequence, placement, cost_model, rate_s)
                    if max(candidate.memory_bytes) > free_bytes:
                        continue
                    by_window.setdefault(candidate.ranks, []).append(candidate)
                if options or by_window or cap >= num_ranks:
                    break
                if deadline is not None:
                    deadline.check(f"widening the degrees of sequence {sequence.id}")
                low, cap = cap + 1, min(num_ranks, 2 * cap)
            for window in by_window.values():
                if all_strategies:
                    options.extend(window)
                    continue
                fastest = min(window, key=lambda c: max(c.load_s))
                options.append(fastest)
                leanest = min(window, key=lambda c: max(c.memory_bytes))
                if leanest is not fastest and max(fastest.memory_bytes) > free_bytes / 2:
                    options.append(leanest)
        if warm_counts is not None:
            index_of = {_placement_key(c.placement): k for k, c in enumerate(options)}
            counts = [0] * len(options)
            for index in group:
                if deadline is not None:
                    deadline.check("adding the warm start's placements to the candidates")
                warm = warm_of[batch.sequences[index].id]
                p = _core.make_placement(
                    sequence.id,
                    warm.strategy,
                    list(warm.ranks),
                    warm.ulysses_degree if warm.strategy == _core.Strategy.hybrid else 0,
                )
                key = _placement_key(p)
                if key not in index_of:
                    index_of[key] = len(options)
                    options.append(_candidate(sequence, p, cost_model, rate_s))
                    counts.append(0)
                counts[index_of[key]] += 1
            warm_counts.append(counts)
        if not options:
            raise _core.PlanMemoryError(
                f"sequence {sequence.id} fits in memory under no joint candidate placement"
            )
        candidates.append(options)
    return JointProblem(
        groups=groups,
        candidates=candidates,
        num_ranks=num_ranks,
        free_bytes=free_bytes,
        warm_counts=warm_counts,
    )


def _warm_start(problem: JointProblem, deadline: _Deadline | None = None) -> list[list[int]] | None:
    """Longest group first, one sequence at a time onto its least-loaded candidate among the
    single-rank ones (or the first multi-rank one that fits): counts per group and candidate for
    HiGHS's first incumbent; None when memory blocks it."""
    loads = np.zeros(problem.num_ranks)
    memory = np.zeros(problem.num_ranks)
    counts = [[0] * len(options) for options in problem.candidates]
    order = sorted(
        range(len(problem.groups)), key=lambda g: -min(c.load_s[0] for c in problem.candidates[g])
    )
    for g in order:
        for _ in problem.groups[g]:
            if deadline is not None:  # each sequence scans every rank's candidate
                deadline.check("placing the MILP's first incumbent")
            best, best_load = None, math.inf
            for k, cand in enumerate(problem.candidates[g]):
                fits = all(
                    memory[r] + m <= problem.free_bytes
                    for r, m in zip(cand.ranks, cand.memory_bytes, strict=True)
                )
                if not fits:
                    continue
                load = max(loads[r] + t for r, t in zip(cand.ranks, cand.load_s, strict=True))
                if load < best_load:
                    best, best_load = k, load
                if len(cand.ranks) > 1:
                    break  # multi-rank candidates come after the single-rank ones
            if best is None:
                return None
            counts[g][best] += 1
            cand = problem.candidates[g][best]
            for r, t, m in zip(cand.ranks, cand.load_s, cand.memory_bytes, strict=True):
                loads[r] += t
                memory[r] += m
    return counts


def solve_joint(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    problem: JointProblem,
    *,
    time_limit_s: float = 10.0,
    seed: int = 0,
    deadline: _Deadline | None = None,
) -> JointResult:
    """Solves the MILP with HiGHS (one thread) and prices the chosen plan exactly. `deadline`
    (plan_joint's) also bounds building the model, which takes seconds at thousands of ranks."""
    start = time.perf_counter()
    deadline = deadline or _Deadline(start, time_limit_s)
    num_ranks = problem.num_ranks
    free_bytes = problem.free_bytes
    num_groups = len(problem.groups)
    sizes = [len(group) for group in problem.groups]
    num_z = sum(len(options) for options in problem.candidates)
    load_row = num_groups
    memory_row = num_groups + num_ranks
    # A rank needs a memory row only if its candidates could overflow it together.
    worst_memory = np.zeros(num_ranks)
    for size, options in zip(sizes, problem.candidates, strict=True):
        per_rank = np.zeros(num_ranks)
        for cand in options:
            for r, m in zip(cand.ranks, cand.memory_bytes, strict=True):
                per_rank[r] = max(per_rank[r], m)
        worst_memory += size * per_rank
    memory_rows = np.flatnonzero(worst_memory > free_bytes)
    memory_row_of = {int(r): memory_row + k for k, r in enumerate(memory_rows)}
    num_rows = memory_row + len(memory_rows)

    starts, rows, values = [0], [], []
    for g, options in enumerate(problem.candidates):
        deadline.check("building the MILP's rows")
        for cand in options:
            rows.append(g)
            values.append(1.0)
            for r, load, m in zip(cand.ranks, cand.load_s, cand.memory_bytes, strict=True):
                rows.append(load_row + r)
                values.append(load)
                if r in memory_row_of:
                    rows.append(memory_row_of[r])
                    values.append(m / _GIB)
            starts.append(len(rows))
    for r in range(num_ranks):  # T
        rows.append(load_row + r)
        values.append(-1.0)
    starts.append(len(rows))

    inf = highspy.kHighsInf
    group_sizes = np.asarray(sizes, dtype=np.float64)
    lp = highspy.HighsLp()
    lp.num_col_ = num_z + 1
    lp.num_row_ = num_rows
    lp.col_cost_ = np.r_[np.zeros(num_z), 1.0]
    lp.col_lower_ = np.zeros(num_z + 1)
    lp.col_upper_ = np.r_[
        np.concatenate(
            [
                np.full(len(o), s, dtype=np.float64)
                for s, o in zip(sizes, problem.candidates, strict=True)
            ]
        ),
        inf,
    ]
    lp.row_lower_ = np.r_[group_sizes, np.full(num_rows - num_groups, -inf)]
    lp.row_upper_ = np.r_[
        group_sizes, np.zeros(num_ranks), np.full(len(memory_rows), free_bytes / _GIB)
    ]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(rows, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(values, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_z + [highspy.HighsVarType.kContinuous]

    with _stdout_silenced():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("random_seed", int(seed) % (1 << 31))
    highs.setOptionValue("mip_rel_gap", 1e-6)
    highs.setOptionValue("mip_abs_gap", 1e-9)
    highs.passModel(lp)
    warm = problem.warm_counts
    if warm is None:
        warm = _warm_start(problem, deadline)
    if warm is not None:
        z = np.zeros(num_z + 1)
        loads = np.zeros(num_ranks)
        offset = 0
        for counts, options in zip(warm, problem.candidates, strict=True):
            for k, count in enumerate(counts):
                z[offset + k] = count
                for r, t in zip(options[k].ranks, options[k].load_s, strict=True):
                    loads[r] += count * t
            offset += len(options)
        z[num_z] = loads.max()
        solution = highspy.HighsSolution()
        solution.col_value = z
        solution.value_valid = True
        highs.setSolution(solution)
    deadline.check("starting the solve")
    highs.setOptionValue("time_limit", max(1e-3, deadline.remaining_s()))
    highs.run()

    status = highs.getModelStatus()
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # no feasible point found within the limit
        raise TimeoutError(
            f"joint MILP found no plan within {deadline.time_limit_s:g} s: "
            f"{highs.modelStatusToString(status)}; {_TOO_LARGE}"
        )
    z = np.rint(np.asarray(highs.getSolution().col_value[:num_z])).astype(int)
    placements: list[_core.Placement | None] = [None] * len(batch.sequences)
    offset = 0
    for members, options in zip(problem.groups, problem.candidates, strict=True):
        pending = iter(members)
        for k, cand in enumerate(options):
            for _ in range(z[offset + k]):
                index = next(pending)
                p = cand.placement
                placements[index] = _core.make_placement(
                    batch.sequences[index].id,
                    p.strategy,
                    list(p.ranks),
                    p.ulysses_degree if p.strategy == _core.Strategy.hybrid else 0,
                )
        offset += len(options)
    optimal = status == highspy.HighsModelStatus.kOptimal
    objective_s = float(info.objective_function_value)
    dual_bound_s = objective_s if optimal else float(info.mip_dual_bound)
    gap = 0.0 if optimal else float(info.mip_gap)

    plan = _core.Plan(planner="joint", num_ranks=num_ranks, placements=placements)
    _core.predict(plan, batch, cost_model)
    plan.plan_ms = (time.perf_counter() - start) * 1e3
    plan.note = (
        f"mip_gap={gap:.6g} optimal={str(optimal).lower()} milp_makespan_s={objective_s:.6g} "
        f"dual_bound_s={dual_bound_s:.6g} groups={num_groups} candidates={num_z} "
        f"status={highs.modelStatusToString(status).replace(' ', '_')}"
    )
    return JointResult(
        plan=plan,
        objective_s=objective_s,
        dual_bound_s=dual_bound_s,
        mip_gap=gap,
        optimal=optimal,
        num_candidates=num_z,
    )


# CPU seconds of one zellige plan per sequence, with the rank count's share on top (x (1 + ranks /
# 4096)): bench/results/planning_time_cpu2_202612.md measures 35 ms for 4096 sequences at 1024
# GPUs, 436 ms for 36k at 4096 and 872 ms for 71k at 8192, so this keeps a margin of three to five.
_WARM_START_S_PER_SEQUENCE = 20e-6
# The share of time_limit_s the warm start may take.
_WARM_START_SHARE = 0.25


def warm_start_estimate_s(batch: _core.Batch, cost_model: _core.CostModel) -> float:
    """A generous estimate of the zellige planner's CPU time on this batch (seconds)."""
    num_ranks = cost_model.cluster.num_ranks()
    return _WARM_START_S_PER_SEQUENCE * len(batch.sequences) * (1.0 + num_ranks / 4096.0)


def plan_joint(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    time_limit_s: float = 10.0,
    seed: int = 0,
    *,
    max_windows_per_shape: int = 4,
    max_degree: int | None = None,
    warm_start: bool = True,
) -> _core.Plan:
    """The joint reference plan; its note reports mip_gap and optimal (see the module doc).
    `time_limit_s` covers the warm-start plan (zellige's), the candidates and the solve; raises
    TimeoutError naming the stage when it runs out before the MILP has a plan."""
    _core.validate_batch(batch, cost_model.cluster.num_ranks())
    _core.check_sequences_fit(batch, cost_model)
    start = time.perf_counter()
    deadline = _Deadline(start, time_limit_s)
    warm_plan = None
    # The zellige call runs to its end once started: start it only when it should leave most of
    # the limit to the candidates and the solve.
    skip_warm_start = warm_start and (
        warm_start_estimate_s(batch, cost_model) > _WARM_START_SHARE * time_limit_s
    )
    if warm_start and not skip_warm_start:
        options = _core.PlannerOptions(seed=seed, time_limit_s=max(0.0, time_limit_s / 4))
        warm_plan = _core.make_plan("zellige", batch, cost_model, options)
        deadline.check("running the zellige planner for the warm start")
    problem = joint_problem(
        batch,
        cost_model,
        max_windows_per_shape=max_windows_per_shape,
        max_degree=max_degree,
        warm_plan=warm_plan,
        deadline=deadline,
    )
    deadline.check("building candidates (all done, none left for the solve)")
    result = solve_joint(batch, cost_model, problem, seed=seed, deadline=deadline)
    result.plan.plan_ms = (time.perf_counter() - start) * 1e3
    if skip_warm_start:
        result.plan.note += " warm_start=skipped"
    return result.plan
