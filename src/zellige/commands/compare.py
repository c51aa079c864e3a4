"""`zellige compare`: run several planners on the same batch; one row each."""

from __future__ import annotations

import argparse
import dataclasses
import json

from zellige import _core
from zellige._json import output_line
from zellige.api import JOINT, CompareRow, compare_setup
from zellige.commands._cluster import add_cluster_file_argument, on_cluster, read_cluster_args
from zellige.commands._inputs import (
    add_batch_arguments,
    add_cluster_arguments,
    add_global_batch_argument,
    global_setup_from_args,
    setup_from_args,
)
from zellige.global_batch import compare_global, compare_lines

GIB = 1 << 30
JSON_FIELDS = (
    "planner",
    "makespan_s",
    "lower_bound_s",
    "imbalance",
    "exchange_bytes",
    "peak_bytes",
    "fits",
    "plan_ms",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_batch_arguments(parser)
    add_cluster_arguments(parser, gpus_required=False)  # or --cluster
    add_cluster_file_argument(parser)
    parser.add_argument(
        "--planners",
        metavar="A,B,...",
        help="comma-separated planner names (default: the baselines tuned to the cluster, then "
        f"zellige); forms: {', '.join([*_core.planner_names(), JOINT])}",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_global_batch_argument(parser)


def row_to_dict(row: CompareRow) -> dict:
    """The --json object: JSON_FIELDS, plus `error` when the planner refused."""
    data = {field: getattr(row, field) for field in JSON_FIELDS}
    if row.error is not None:
        data["error"] = row.error
    return data


HEADER = (
    "planner",
    "makespan s",
    "x bound",
    "imbalance",
    "exchanged",
    "peak GiB",
    "fits",
    "plan ms",
)


def _cells(row: CompareRow) -> tuple[str, ...]:
    return (
        row.planner,
        f"{row.makespan_s:.4f}",
        f"{row.makespan_s / row.lower_bound_s:.3f}",
        f"{row.imbalance:.3f}",
        f"{row.exchange_bytes / 1e9:,.1f} GB",
        f"{row.peak_bytes / GIB:.1f}",
        "yes" if row.fits else "NO",
        f"{row.plan_ms:.2f}",
    )


def format_table(rows: list[CompareRow]) -> list[str]:
    """An aligned table; a refused planner's row carries its reason instead of numbers."""
    table = [HEADER, *(_cells(row) for row in rows if row.error is None)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(HEADER))]

    def line(cells: tuple[str, ...]) -> str:
        numbers = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([cells[0].ljust(widths[0]), *numbers])

    lines = [line(HEADER)]
    for row in rows:
        if row.error is None:
            lines.append(line(_cells(row)))
        else:
            lines.append(f"{row.planner.ljust(widths[0])}  refused: {row.error}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.global_batch is not None:
        return run_global(args)
    cluster_file = read_cluster_args(args)  # sets --gpus from the file first
    setup = on_cluster(setup_from_args(args), cluster_file)
    planners = None
    if args.planners is not None:
        planners = [name.strip() for name in args.planners.split(",") if name.strip()]
        if not planners:
            raise ValueError("--planners lists no planner")
    rows = compare_setup(setup, planners, setup.seed)
    if args.json:
        print(json.dumps([row_to_dict(row) for row in rows], indent=1, allow_nan=False))
        return 0
    cluster = setup.cost_model.cluster
    source = f"{setup.workload} (seed {setup.seed})" if setup.workload else args.batch
    header = (
        f"{source}: {len(setup.batch.sequences)} sequences, "
        f"{_core.total_tokens(setup.batch):,} tokens, {setup.model_name} on "
        f"{cluster.num_ranks()} GPUs ({cluster.num_nodes} x {cluster.gpus_per_node}, "
        f"{setup.links}); lower bound {rows[0].lower_bound_s:.4f} s"
    )
    for line in [header, *format_table(rows)]:
        print(output_line(line))
    return 0


def run_global(args: argparse.Namespace) -> int:
    """--global-batch: every global-batch planner (or --planners) on one global batch."""
    cluster_file = read_cluster_args(args)  # sets --gpus from the file first
    setup = on_cluster(global_setup_from_args(args), cluster_file)
    planners = None
    if args.planners is not None:
        planners = [name.strip() for name in args.planners.split(",") if name.strip()]
        if not planners:
            raise ValueError("--planners lists no planner")
    options = _core.GlobalBatchOptions(seed=setup.seed)
    rows = compare_global(setup.batch, setup.cost_model, planners, options)
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1, allow_nan=False))
        return 0
    cluster = setup.cost_model.cluster
    print(
        f"global batch: {len(setup.batch.sequences)} sequences, "
        f"{_core.total_tokens(setup.batch):,} tokens, {setup.model_name} on "
        f"{cluster.num_ranks()} GPUs ({cluster.num_nodes} x {cluster.gpus_per_node})"
    )
    for line in compare_lines(rows):
        print(line)
    return 0
