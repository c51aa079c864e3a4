"""Global batches: one optimizer step's samples, cut into micro-batches (docs/global-batch.md).

Example (50 million latent tokens; "1024" would be 1024 samples)::

    >>> size = parse_global_batch_size("50M")
    >>> batch = draw_global_batch("opensora2-stage2", 256, size, seed=0)
    >>> plan = zellige.plan_global_batch("zellige", batch, cost_model)
    >>> print(plan.step_time_s, len(plan.micro_batches))
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from zellige import _core
from zellige._json import (
    parse_json,
    reject_unknown,
    require_int,
    require_list,
    require_number,
    require_object,
    require_str,
)
from zellige.plan_io import plan_from_dict, plan_to_dict
from zellige.workload import generate, load_recipe

_TOKEN_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbBgG]?)\s*$")
# Steps a draw may concatenate: a budget the recipe cannot reach in this many is a user error.
_MAX_DRAWN_STEPS = 4096


@dataclass(kw_only=True, slots=True, frozen=True)
class GlobalBatchSize:
    """A global batch's size: `samples` sequences, or latent `tokens` (exactly one is set)."""

    samples: int | None = None
    tokens: int | None = None

    def __str__(self) -> str:
        return f"{self.samples} samples" if self.samples is not None else f"{self.tokens:,} tokens"


def parse_global_batch_size(text: str) -> GlobalBatchSize:
    """A plain integer counts samples ("1024"); a number with k, M or B (G) counts latent tokens
    ("50M", "2.5B", "800k"). Raises ValueError for anything else or a size below 1."""
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise ValueError(
            f"global batch size {text!r}: give a sample count (1024) or a token budget with "
            "k, M or B (50M)"
        )
    number, suffix = match.groups()
    if not suffix:
        if "." in number or int(number) < 1:
            raise ValueError(f"global batch size {text!r}: a sample count is a whole number >= 1")
        return GlobalBatchSize(samples=int(number))
    tokens = round(float(number) * _TOKEN_SUFFIXES[suffix.lower()])
    if tokens < 1:
        raise ValueError(f"global batch size {text!r}: a token budget is at least 1 token")
    return GlobalBatchSize(tokens=tokens)


def check_global_batch_source(global_batch: bool, data_dir: str | None) -> None:
    """ValueError when a global batch would come from a latent dataset (`data_dir`): a global
    batch is drawn from a recipe, and a latent dataset gives one step's batch at a time."""
    if global_batch and data_dir is not None:
        raise ValueError(
            "a global batch from a latent dataset is not supported: a latent dataset gives one "
            "step's batch at a time (drop global_batch or data_dir)"
        )


def take_global_batch(sequences: list[_core.Sequence], size: GlobalBatchSize) -> _core.Batch:
    """The first sequences up to `size`: that many samples, or until the tokens reach the budget
    (the sequence that reaches it included). Ids are kept. Raises ValueError when too few."""
    taken: list[_core.Sequence] = []
    tokens = 0
    for sequence in sequences:
        if size.samples is not None and len(taken) == size.samples:
            break
        if size.tokens is not None and tokens >= size.tokens:
            break
        taken.append(sequence)
        tokens += sequence.num_tokens
    short = (size.samples is not None and len(taken) < size.samples) or (
        size.tokens is not None and tokens < size.tokens
    )
    if short:
        raise ValueError(f"the source holds {len(taken)} samples, {tokens:,} tokens: below {size}")
    batch = _core.Batch()
    batch.sequences = taken
    return batch


def draw_global_batch(
    workload: str | _core.Recipe, num_ranks: int, size: GlobalBatchSize, seed: int = 0
) -> _core.Batch:
    """A global batch of `size` from a recipe: its steps on `num_ranks` loader ranks for seeds
    seed, seed + 1, ... concatenated (ids renumbered 0, 1, ...; each sample keeps its loader
    rank) and cut at `size`. Deterministic for the seed."""
    recipe = load_recipe(workload) if isinstance(workload, str) else workload
    sequences: list[_core.Sequence] = []
    tokens = 0
    for step in range(_MAX_DRAWN_STEPS):
        for sequence in generate(recipe, num_ranks, seed + step).sequences:
            sequence.id = len(sequences)
            sequences.append(sequence)
            tokens += sequence.num_tokens
        enough_samples = size.samples is not None and len(sequences) >= size.samples
        if enough_samples or (size.tokens is not None and tokens >= size.tokens):
            return take_global_batch(sequences, size)
    raise ValueError(f"{_MAX_DRAWN_STEPS} steps of the recipe do not reach {size}")


def global_plan_to_dict(plan: _core.GlobalPlan) -> dict:
    """JSON-ready: per micro-batch its sequence ids and Plan (plan_io's form), and the totals."""
    return {
        "planner": plan.planner,
        "chosen": plan.chosen,
        "step_time_s": plan.step_time_s,
        "plan_ms": plan.plan_ms,
        "micro_batches": [
            {
                "sequence_ids": [sequence.id for sequence in micro_batch.batch.sequences],
                "plan": plan_to_dict(micro_batch.plan),
            }
            for micro_batch in plan.micro_batches
        ],
    }


def global_plan_to_json(plan: _core.GlobalPlan, indent: int | None = None) -> str:
    return json.dumps(global_plan_to_dict(plan), indent=indent, allow_nan=False)


_GLOBAL_PLAN_FIELDS = ("planner", "chosen", "step_time_s", "plan_ms", "micro_batches")
_MICRO_BATCH_FIELDS = ("sequence_ids", "plan")


def global_plan_from_dict(data: Any, batch: _core.Batch) -> _core.GlobalPlan:
    """The GlobalPlan of `batch` that global_plan_to_dict wrote. Raises ValueError when the
    micro-batches do not hold each sequence of the batch exactly once or a plan does not match
    its micro-batch."""
    data = require_object(data, "global plan")
    reject_unknown(data, _GLOBAL_PLAN_FIELDS, "global plan")
    by_id = {sequence.id: sequence for sequence in batch.sequences}
    seen: set[int] = set()
    micro_batches = []
    for index, raw in enumerate(require_list(data, "micro_batches", "global plan")):
        where = f"micro-batch {index}"
        raw = require_object(raw, where)
        reject_unknown(raw, _MICRO_BATCH_FIELDS, where)
        sequences = []
        for seq_id in require_list(raw, "sequence_ids", where):
            seq_id = require_int({"id": seq_id}, "id", where)
            if seq_id not in by_id:
                raise ValueError(f"{where}: sequence {seq_id} is not in the batch")
            if seq_id in seen:
                raise ValueError(f"{where}: sequence {seq_id} is in more than one micro-batch")
            seen.add(seq_id)
            sequences.append(by_id[seq_id])
        micro_batch = _core.MicroBatch(batch=_core.Batch(), plan=plan_from_dict(raw.get("plan")))
        micro_batch.batch.sequences = sequences
        _core.validate_plan(micro_batch.plan, micro_batch.batch, micro_batch.plan.num_ranks, 0)
        micro_batches.append(micro_batch)
    missing = sorted(set(by_id) - seen)
    if missing:
        raise ValueError(f"global plan: sequence {missing[0]} is in no micro-batch")
    plan = _core.GlobalPlan(
        planner=require_str(data, "planner", "global plan"),
        chosen=require_str(data, "chosen", "global plan", ""),
        step_time_s=require_number(data, "step_time_s", "global plan"),
        plan_ms=require_number(data, "plan_ms", "global plan", 0.0),
    )
    plan.micro_batches = micro_batches
    return plan


def global_plan_from_json(
    text: str, batch: _core.Batch, source: str = "global plan"
) -> _core.GlobalPlan:
    """global_plan_from_dict of JSON text; errors are ValueErrors prefixed with `source`."""
    data = parse_json(text, source)
    try:
        return global_plan_from_dict(data, batch)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def micro_batch_tokens(micro_batch: _core.MicroBatch) -> int:
    return sum(sequence.num_tokens for sequence in micro_batch.batch.sequences)


_GIB = 1 << 30


def global_plan_lines(plan: _core.GlobalPlan) -> list[str]:
    """One line per micro-batch and one for the step: what `zellige plan --global-batch` prints."""
    lines = []
    for index, micro_batch in enumerate(plan.micro_batches):
        predicted = micro_batch.plan.predicted
        peak_bytes = max(predicted.rank_peak_bytes, default=0.0)
        lines.append(
            f"micro-batch {index}: {len(micro_batch.batch.sequences)} sequences, "
            f"{micro_batch_tokens(micro_batch):,} tokens, makespan {predicted.makespan_s:.4f} s, "
            f"peak {peak_bytes / _GIB:.1f} GiB ({micro_batch.plan.planner})"
        )
    lines.append(
        f"step: {len(plan.micro_batches)} micro-batches, predicted {plan.step_time_s:.4f} s "
        f"({plan.planner}, chosen {plan.chosen}); planned in {plan.plan_ms:.1f} ms"
    )
    return lines


@dataclass(kw_only=True, slots=True)
class GlobalCompareRow:
    """One global-batch planner's result; `error` says why it refused (then the rest is None)."""

    planner: str
    step_time_s: float | None
    micro_batches: int | None
    chosen: str | None
    plan_ms: float | None
    error: str | None = None


def compare_global(
    batch: _core.Batch,
    cost_model: _core.CostModel,
    planners: list[str] | None = None,
    options: _core.GlobalBatchOptions | None = None,
) -> list[GlobalCompareRow]:
    """Every global-batch planner (default: the baselines, then zellige) on one global batch."""
    names = [*_core.global_batch_baseline_names(), "zellige"] if planners is None else planners
    known = _core.global_batch_planner_names()
    for name in names:
        if name not in known:
            raise ValueError(f"unknown global-batch planner '{name}' (allowed: {', '.join(known)})")
    rows = []
    for name in names:
        try:
            plan = _core.plan_global_batch(
                name, batch, cost_model, options or _core.GlobalBatchOptions()
            )
        except _core.PlanMemoryError as error:
            rows.append(
                GlobalCompareRow(
                    planner=name,
                    step_time_s=None,
                    micro_batches=None,
                    chosen=None,
                    plan_ms=None,
                    error=str(error),
                )
            )
            continue
        rows.append(
            GlobalCompareRow(
                planner=name,
                step_time_s=plan.step_time_s,
                micro_batches=len(plan.micro_batches),
                chosen=plan.chosen,
                plan_ms=plan.plan_ms,
            )
        )
    return rows


def compare_lines(rows: list[GlobalCompareRow]) -> list[str]:
    """An aligned table: step time, speed-up of the best row over each, micro-batch count."""
    best_s = min((row.step_time_s for row in rows if row.step_time_s is not None), default=None)
    header = ("planner", "step s", "best x", "micro-batches", "plan ms", "chosen")
    table = [header]
    for row in rows:
        if row.error is None:
            table.append(
                (
                    row.planner,
                    f"{row.step_time_s:.4f}",
                    f"{row.step_time_s / best_s:.3f}",
                    str(row.micro_batches),
                    f"{row.plan_ms:.1f}",
                    row.chosen or "",
                )
            )
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
        for cells in table
    ]
    lines += [f"{row.planner}  refused: {row.error}" for row in rows if row.error is not None]
    return lines
