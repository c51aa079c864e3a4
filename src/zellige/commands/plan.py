"""`zellige plan`: place one step's batch with one planner, print a summary, write Plan JSON."""

from __future__ import annotations

import argparse
from collections import Counter

from zellige import _core
from zellige._files import check_outputs, write_output
from zellige._json import output_line
from zellige.api import JOINT, Setup, lower_bound, run_planner
from zellige.commands._cluster import add_cluster_file_argument, on_cluster, read_cluster_args
from zellige.commands._inputs import (
    add_batch_arguments,
    add_cluster_arguments,
    add_global_batch_argument,
    global_setup_from_args,
    setup_from_args,
)
from zellige.global_batch import global_plan_lines, global_plan_to_json
from zellige.model_spec import model_spec_to_dict
from zellige.plan_io import save_plan
from zellige.workload import batch_fingerprint, batch_to_dict

GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_batch_arguments(parser)
    add_cluster_arguments(parser, gpus_required=False)  # or --cluster
    add_cluster_file_argument(parser)
    parser.add_argument(
        "--planner",
        required=True,
        metavar="P",
        help=f"one of: {', '.join([*_core.planner_names(), JOINT])}; with --global-batch one "
        f"of: {', '.join(_core.global_batch_planner_names())}",
    )
    add_global_batch_argument(parser)
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the plan JSON here (atomically; never over an input; a symlink is replaced)",
    )


def plan_context(setup: Setup) -> dict:
    """What `zellige show` needs to rebuild the batch and cost model of a plan file: the workload
    and seed (generation is deterministic) or, for a batch file, the batch itself."""
    context = {
        "model": setup.model_name,
        "gpus_per_node": setup.cost_model.cluster.gpus_per_node,
        "links": setup.links,
        # `show` and `check` refuse the plan for any other batch, even one reusing the ids.
        "batch_fingerprint": batch_fingerprint(setup.batch),
    }
    spec = setup.cost_model.model
    if spec.name not in _core.model_preset_names() or spec != _core.model_preset(spec.name):
        context["model_spec"] = model_spec_to_dict(spec)  # a spec file's model: keep its sizes
    if setup.profile_path is not None:
        context["profile"] = setup.profile_path
    if setup.workload is not None:
        context.update(workload=setup.workload, seed=setup.seed)
    else:
        context["batch"] = batch_to_dict(setup.batch)
    return context


def summary(setup: Setup, plan: _core.Plan) -> list[str]:
    cluster = setup.cost_model.cluster
    cost = setup.cost_model.evaluate(setup.batch, plan)
    lower_bound_s = lower_bound(setup)
    source = f"workload {setup.workload} (seed {setup.seed})" if setup.workload else "batch"
    strategies = Counter(p.strategy.name for p in plan.placements)
    memory = "fits" if cost.fits else "DOES NOT FIT"
    capacity_gib = setup.cost_model.memory_capacity_bytes() / GIB
    return [
        f"{plan.planner}: {len(setup.batch.sequences)} sequences, "
        f"{_core.total_tokens(setup.batch):,} tokens of {source} on {cluster.num_ranks()} GPUs "
        f"({cluster.num_nodes} x {cluster.gpus_per_node}), {setup.model_name}",
        f"makespan {cost.makespan_s:.4f} s, lower bound {lower_bound_s:.4f} s "
        f"(x{cost.makespan_s / lower_bound_s:.3f}); planned in {plan.plan_ms:.2f} ms",
        f"peak memory {cost.peak_bytes / GIB:.1f} GiB of {capacity_gib:.1f} GiB ({memory}); "
        f"exchanged {cost.exchange_bytes / 1e9:,.1f} GB per step",
        "placements: " + ", ".join(f"{name} {count}" for name, count in strategies.most_common()),
    ]


def run(args: argparse.Namespace) -> int:
    check_outputs(
        {"--out": args.out},
        {
            "--batch": args.batch,
            "--profile": args.profile,
            "--model-spec": args.model_spec,
            "--cluster": args.cluster,
        },
    )
    if args.global_batch is not None:
        return run_global(args)
    cluster_file = read_cluster_args(args)  # sets --gpus from the file first
    setup = on_cluster(setup_from_args(args), cluster_file)
    plan = run_planner(setup, args.planner, setup.seed)
    for line in summary(setup, plan):
        print(output_line(line))
    if args.out:
        save_plan(plan, args.out, context=plan_context(setup))
        print(output_line(f"wrote {args.out}"))
    return 0


def run_global(args: argparse.Namespace) -> int:
    """--global-batch: the step's micro-batches, each placed, printed one a line; --out writes
    the global plan's JSON (zellige.global_batch.global_plan_to_dict)."""
    cluster_file = read_cluster_args(args)  # sets --gpus from the file first
    setup = on_cluster(global_setup_from_args(args), cluster_file)
    options = _core.GlobalBatchOptions(seed=setup.seed)
    plan = _core.plan_global_batch(args.planner, setup.batch, setup.cost_model, options)
    cluster = setup.cost_model.cluster
    source = f"workload {setup.workload} (seeds from {setup.seed})" if setup.workload else "batch"
    print(
        f"global batch: {len(setup.batch.sequences)} sequences, "
        f"{_core.total_tokens(setup.batch):,} tokens of {source} on {cluster.num_ranks()} GPUs, "
        f"{setup.model_name}"
    )
    for line in global_plan_lines(plan):
        print(line)
    if args.out:
        write_output(args.out, global_plan_to_json(plan, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0
