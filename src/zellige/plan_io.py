"""Plan JSON (docs/formats.md), read and written exactly (floats keep their repr).

A plan file may carry a "context" object (what the CLI needs to rebuild the plan's batch and cost
model: model, cluster, workload + seed or the batch itself, and the batch's fingerprint, so that
`show` and `check` refuse the plan for any other batch); the Plan ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zellige import _core
from zellige._files import write_output
from zellige._json import (
    parse_json,
    read_text,
    reject_unknown,
    require_int,
    require_list,
    require_number,
    require_object,
    require_str,
    shown,
)
from zellige.workload import batch_fingerprint

_PLAN_FIELDS = ("planner", "num_ranks", "placements", "predicted", "plan_ms", "note", "context")
_PLACEMENT_FIELDS = ("id", "strategy", "ranks")
_PREDICTED_FIELDS = (
    "makespan_s",
    "rank_time_s",
    "rank_peak_bytes",
    "rank_checkpointed_layers",
    "rank_full_recompute_layers",
)


def plan_to_dict(plan: _core.Plan) -> dict:
    predicted = plan.predicted
    return {
        "planner": plan.planner,
        "num_ranks": plan.num_ranks,
        "placements": [
            {"id": p.sequence_id, "strategy": _core.strategy_name(p), "ranks": list(p.ranks)}
            for p in plan.placements
        ],
        "predicted": {
            "makespan_s": predicted.makespan_s,
            "rank_time_s": list(predicted.rank_time_s),
            "rank_peak_bytes": list(predicted.rank_peak_bytes),
            "rank_checkpointed_layers": list(predicted.rank_checkpointed_layers),
            "rank_full_recompute_layers": list(predicted.rank_full_recompute_layers),
        },
        "plan_ms": plan.plan_ms,
        "note": plan.note,
    }


def _rank_list(obj: dict, key: str, where: str) -> list[int]:
    values = require_list(obj, key, where)
    if len(values) > _core.MAX_GPUS:
        raise ValueError(f"{where}: '{key}' lists more than {_core.MAX_GPUS} ranks (the limit)")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: '{key}' must hold integers, got {shown(value)}")
        if not 0 <= value < _core.MAX_GPUS:
            raise ValueError(
                f"{where}: rank {shown(value)} is outside [0, {_core.MAX_GPUS}) (the GPU limit)"
            )
    return values


def _int_list(obj: dict, key: str, where: str) -> list[int]:
    """A per-rank list of counts: at most MAX_GPUS integers in [0, 2^31)."""
    values = require_list(obj, key, where)
    if len(values) > _core.MAX_GPUS:
        raise ValueError(f"{where}: '{key}' has more than {_core.MAX_GPUS} entries (the limit)")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: '{key}' must hold integers, got {shown(value)}")
        if not 0 <= value < 1 << 31:
            raise ValueError(f"{where}: '{key}' holds {shown(value)}, outside [0, 2^31)")
    return values


def _number_list(obj: dict, key: str, where: str) -> list[float]:
    values = require_list(obj, key, where, [])
    if len(values) > _core.MAX_GPUS:
        raise ValueError(f"{where}: '{key}' has more than {_core.MAX_GPUS} entries (the limit)")
    numbers = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: '{key}' must hold numbers, got {shown(value)}")
        numbers.append(require_number({key: value}, key, where))  # finite
    return numbers


def _placement_from_dict(raw: Any, index: int) -> _core.Placement:
    entry = require_object(raw, f"placement #{index}")
    seq_id = require_int(entry, "id", f"placement #{index}")
    where = f"placement of sequence {seq_id}"
    reject_unknown(entry, _PLACEMENT_FIELDS, where)
    name = require_str(entry, "strategy", where)
    strategy, ulysses_degree, ring_degree = _core.parse_strategy(name)
    ranks = _rank_list(entry, "ranks", where)
    placement = _core.make_placement(seq_id, strategy, ranks, ulysses_degree)
    if strategy == _core.Strategy.hybrid and placement.ring_degree != ring_degree:
        raise ValueError(f"{where}: strategy {name} does not match its {len(ranks)} ranks")
    return placement


def plan_from_dict(data: Any) -> _core.Plan:
    """A Plan from its JSON object; `predicted`, `plan_ms` and `note` are optional."""
    data = require_object(data, "plan")
    reject_unknown(data, _PLAN_FIELDS, "plan")
    plan = _core.Plan(
        planner=require_str(data, "planner", "plan"),
        num_ranks=require_int(data, "num_ranks", "plan", low=1, high=_core.MAX_GPUS),
        plan_ms=require_number(data, "plan_ms", "plan", 0.0),
        note=require_str(data, "note", "plan", ""),
    )
    raw_placements = require_list(data, "placements", "plan")
    if len(raw_placements) > _core.MAX_BATCH_SEQUENCES:
        raise ValueError(
            f"plan: more than {_core.MAX_BATCH_SEQUENCES:,} placements (the sequence limit)"
        )
    plan.placements = [_placement_from_dict(raw, i) for i, raw in enumerate(raw_placements)]
    if "predicted" in data:
        raw = require_object(data["predicted"], "plan predicted")
        reject_unknown(raw, _PREDICTED_FIELDS, "plan predicted")
        plan.predicted = _core.PlanPrediction(
            makespan_s=require_number(raw, "makespan_s", "plan predicted"),
            rank_time_s=_number_list(raw, "rank_time_s", "plan predicted"),
            rank_peak_bytes=_number_list(raw, "rank_peak_bytes", "plan predicted"),
            **{
                key: _int_list(raw, key, "plan predicted")
                for key in ("rank_checkpointed_layers", "rank_full_recompute_layers")
                if key in raw
            },
        )
    return plan


def plan_to_json(plan: _core.Plan, indent: int | None = None) -> str:
    """Plan JSON; Python's float repr makes every float round-trip exactly. A non-finite number
    (which JSON cannot hold) raises ValueError instead of writing NaN or Infinity."""
    return json.dumps(plan_to_dict(plan), indent=indent, allow_nan=False)


def plan_from_json(text: str, source: str = "plan") -> _core.Plan:
    """A Plan from JSON text; errors are one-line ValueErrors prefixed with `source`."""
    data = parse_json(text, source)
    try:
        return plan_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_plan(path: str | Path) -> _core.Plan:
    """The Plan in a Plan JSON file (docs/formats.md); raises ValueError with one line naming the
    file for a missing, malformed or invalid plan."""
    return plan_from_json(read_text(path), source=str(path))


def load_plan_with_context(path: str | Path) -> tuple[_core.Plan, dict]:
    """A plan file's Plan and its "context" object ({} when it has none)."""
    data = parse_json(read_text(path), str(path))
    try:
        plan = plan_from_dict(data)
        context = require_object(data.get("context", {}), "plan context")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return plan, context


def require_plan_for_batch(
    plan: _core.Plan, context: dict, batch: _core.Batch, num_ranks: int, where: str
) -> None:
    """Raises ValueError when the plan is for another number of ranks, or "this plan is not for
    this batch" when the plan file records another batch's fingerprint (plans written by
    `zellige plan` do) or, for a plan without one, when its placements name other sequences."""
    if plan.num_ranks != num_ranks:
        raise ValueError(f"{where}: the plan is for {plan.num_ranks} ranks, not {num_ranks}")
    recorded = context.get("batch_fingerprint")
    if recorded is not None and recorded != batch_fingerprint(batch):
        raise ValueError(
            f"{where}: this plan is not for this batch (it was made for batch {str(recorded)[:40]}"
            f", this one is {batch_fingerprint(batch)}); give the --workload and --seed, or the "
            "--batch, it was made with"
        )
    placed = {p.sequence_id for p in plan.placements}
    if recorded is None and placed != {s.id for s in batch.sequences}:
        raise ValueError(
            f"{where}: this plan is not for this batch (its placements name other sequences)"
        )


def save_plan(plan: _core.Plan, path: str | Path, context: dict | None = None) -> None:
    """Writes Plan JSON (with `context`, if given) atomically: a temporary file renamed over
    `path`."""
    data = plan_to_dict(plan)
    if context is not None:
        data["context"] = context
    write_output(path, json.dumps(data, indent=1, allow_nan=False) + "\n")
