"""The joint placement reference (after FlexSP, REFERENCE.md): one MILP over the whole batch.

Binary x[i, c] picks candidate placement c of sequence i (`_core.candidate_placements`:
node-aligned rank windows, every strategy); T >= every rank's load; each sequence is placed exactly
once; each rank's memory stays within capacity; minimise T. A rank's load is the sum of its shares,
with the per-token layers linearised at their per-token rate at the mean token count per rank (the
one non-additive term of the cost model). HiGHS solves it under a time limit; the plan it returns is
then priced exactly by the cost model, and `Plan.note` reports the MIP gap and whether the MILP
proved optimality (over its candidate set and linearised loads).

Candidate pruning, so 16-32 GPUs with 64-256 sequences stay solvable: every sequence may run
locally on any rank; a sequence may also be sharded over up to ceil(4 x its local load / mean load
per rank) ranks (at least the smallest degree that fits in memory), on at most
`max_windows_per_shape` windows per degree, keeping per window the strategy with the lowest
busiest-rank load (and the one with the least memory when memory is tight).
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


def joint_candidates(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    *,
    max_windows_per_shape: int = 4,
    max_degree: int | None = None,
    all_strategies: bool = False,
) -> list[list[Candidate]]:
    """Candidates per sequence (batch order). `max_degree` overrides the per-sequence degree cap;
    `all_strategies` keeps every strategy per window instead of the best one (for tests)."""
    num_ranks = cost_model.cluster.num_ranks()
    rate_s = linear_rate_s_per_token(batch, cost_model)
    free_bytes = _free_bytes(cost_model)
    local = [
        _candidate(s, _core.make_placement(s.id, _core.Strategy.local, [0]), cost_model, rate_s)
        for s in batch.sequences
    ]
    mean_load_s = sum(c.load_s[0] for c in local) / num_ranks

    candidates: list[list[Candidate]] = []
    for sequence, local0 in zip(batch.sequences, local, strict=True):
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
            for placement in _core.candidate_placements(sequence, cost_model, max_windows_per_shape):
                if placement.degree() < 2:
                    continue
                # Past the cap only while nothing fits yet (memory-bound sequences).
                if placement.degree() > cap and (options or by_window):
                    continue
                candidate = _candidate(sequence, placement, cost_model, rate_s)
                if max(candidate.memory_bytes) > free_bytes:
                    continue
                by_window.setdefault(candidate.ranks, []).append(candidate)
            for window in by_window.values():
                if all_strategies:
                    options.extend(window)
                    continue
                fastest = min(window, key=lambda c: max(c.load_s))
                options.append(fastest)
                leanest = min(window, key=lambda c: max(c.memory_bytes))
                if leanest is not fastest and max(fastest.memory_bytes) > free_bytes / 2:
                    options.append(leanest)
        if not options:
            raise _core.PlanMemoryError(
                f"sequence {sequence.id} fits in memory under no joint candidate placement"
            )
        candidates.append(options)
    return candidates


def _warm_start(candidates: list[list[Candidate]], num_ranks: int, free_bytes: float):
    """Longest-first onto the least-loaded rank among each sequence's single-rank candidates
    (or its first candidate), for HiGHS's first incumbent; None when memory blocks it."""
    loads = np.zeros(num_ranks)
    memory = np.zeros(num_ranks)
    choice = [0] * len(candidates)
    order = sorted(range(len(candidates)), key=lambda i: -min(c.load_s[0] for c in candidates[i]))
    for i in order:
        best, best_load = None, math.inf
        for k, cand in enumerate(candidates[i]):
            if any(memory[r] + m > free_bytes for r, m in zip(cand.ranks, cand.memory_bytes)):
                continue
            load = max(loads[r] + t for r, t in zip(cand.ranks, cand.load_s))
            if load < best_load:
                best, best_load = k, load
            if len(cand.ranks) > 1:
                break  # multi-rank candidates come after the single-rank ones
        if best is None:
            return None
        choice[i] = best
        cand = candidates[i][best]
        for r, t, m in zip(cand.ranks, cand.load_s, cand.memory_bytes, strict=True):
            loads[r] += t
            memory[r] += m
    return choice, float(loads.max())


def solve_joint(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    candidates: list[list[Candidate]],
    *,
    time_limit_s: float = 10.0,
    seed: int = 0,
) -> JointResult:
    """Solves the MILP over `candidates` with HiGHS (one thread) and prices the plan exactly."""
    start = time.perf_counter()
    num_ranks = cost_model.cluster.num_ranks()
    free_bytes = _free_bytes(cost_model)
    num_sequences = len(candidates)
    num_x = sum(len(options) for options in candidates)
    load_row = num_sequences
    memory_row = num_sequences + num_ranks
    # A rank needs a memory row only if its candidates could overflow it together.
    worst_memory = np.zeros(num_ranks)
    for options in candidates:
        per_rank = np.zeros(num_ranks)
        for cand in options:
            for r, m in zip(cand.ranks, cand.memory_bytes, strict=True):
                per_rank[r] = max(per_rank[r], m)
        worst_memory += per_rank
    memory_rows = np.flatnonzero(worst_memory > free_bytes)
    memory_row_of = {int(r): memory_row + k for k, r in enumerate(memory_rows)}
    num_rows = memory_row + len(memory_rows)

    starts, rows, values = [0], [], []
    for i, options in enumerate(candidates):
        for cand in options:
            rows.append(i)
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
    lp = highspy.HighsLp()
    lp.num_col_ = num_x + 1
    lp.num_row_ = num_rows
    lp.col_cost_ = np.r_[np.zeros(num_x), 1.0]
    lp.col_lower_ = np.zeros(num_x + 1)
    lp.col_upper_ = np.r_[np.ones(num_x), inf]
    lp.row_lower_ = np.r_[np.ones(num_sequences), np.full(num_rows - num_sequences, -inf)]
    lp.row_upper_ = np.r_[
        np.ones(num_sequences), np.zeros(num_ranks), np.full(len(memory_rows), free_bytes / _GIB)
    ]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(rows, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(values, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_x + [highspy.HighsVarType.kContinuous]

    with _stdout_silenced():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", 1)
    highs.setOptionValue("random_seed", int(seed) % (1 << 31))
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", 1e-6)
    highs.setOptionValue("mip_abs_gap", 1e-9)
    highs.passModel(lp)
    warm = _warm_start(candidates, num_ranks, free_bytes)
    if warm is not None:
        choice, makespan_s = warm
        x = np.zeros(num_x + 1)
        offset = 0
        for i, options in enumerate(candidates):
            x[offset + choice[i]] = 1.0
            offset += len(options)
        x[num_x] = makespan_s
        solution = highspy.HighsSolution()
        solution.col_value = x
        solution.value_valid = True
        highs.setSolution(solution)
    highs.run()

    status = highs.getModelStatus()
    info = highs.getInfo()
    if info.primal_solution_status != 2:  # no feasible point found within the limit
        raise RuntimeError(f"joint MILP found no plan: {highs.modelStatusToString(status)}")
    x = np.asarray(highs.getSolution().col_value)
    placements = []
    offset = 0
    for options in candidates:
        chosen = int(np.argmax(x[offset : offset + len(options)]))
        placements.append(options[chosen].placement)
        offset += len(options)
    optimal = status == highspy.HighsModelStatus.kOptimal
    objective_s = float(info.objective_function_value)
    dual_bound_s = float(info.mip_dual_bound) if not optimal else objective_s
    gap = 0.0 if optimal else float(info.mip_gap)

    plan = _core.Plan(planner="joint", num_ranks=num_ranks, placements=placements)
    _core.predict(plan, batch, cost_model)
    plan.plan_ms = (time.perf_counter() - start) * 1e3
    plan.note = (
        f"mip_gap={gap:.6g} optimal={str(optimal).lower()} milp_makespan_s={objective_s:.6g} "
        f"dual_bound_s={dual_bound_s:.6g} candidates={num_x} "
        f"status={highs.modelStatusToString(status).replace(' ', '_')}"
    )
    return JointResult(
        plan=plan,
        objective_s=objective_s,
        dual_bound_s=dual_bound_s,
        mip_gap=gap,
        optimal=optimal,
        num_candidates=num_x,
    )


def plan_joint(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    time_limit_s: float = 10.0,
    seed: int = 0,
    *,
    max_windows_per_shape: int = 4,
    max_degree: int | None = None,
) -> _core.Plan:
    """The joint reference plan; its note reports mip_gap and optimal (see the module doc)."""
    _core.validate_batch(batch, cost_model.cluster.num_ranks())
    _core.check_sequences_fit(batch, cost_model)
    start = time.perf_counter()
    candidates = joint_candidates(
        batch, cost_model, max_windows_per_shape=max_windows_per_shape, max_degree=max_degree
    )
    result = solve_joint(batch, cost_model, candidates, time_limit_s=time_limit_s, seed=seed)
    result.plan.plan_ms = (time.perf_counter() - start) * 1e3
    return result.plan
