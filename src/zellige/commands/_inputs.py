"""Arguments shared by the commands: where the batch comes from and what cluster it runs on."""

from __future__ import annotations

import argparse

from zellige import _core
from zellige.api import Setup, make_setup
from zellige.commands._args import MAX_GPUS, SEED_MAX, int_in
from zellige.costs import default_gpus_per_node
from zellige.workload import load_batch, recipe_names


def add_batch_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument(
        "--workload",
        metavar="NAME",
        help=f"a built-in recipe, one of: {', '.join(recipe_names())}",
    )
    source.add_argument("--batch", metavar="FILE", help="a Batch JSON file (needs --model)")
    parser.add_argument(
        "--seed",
        type=int_in(0, SEED_MAX),
        default=None,
        metavar="S",
        help="generator and planner seed, 0 <= S < 2^63 (0)",
    )


def add_cluster_arguments(parser: argparse.ArgumentParser, gpus_required: bool = True) -> None:
    parser.add_argument(
        "--gpus",
        type=int_in(1, MAX_GPUS),
        required=gpus_required,
        metavar="N",
        help=f"GPU count, 1 to {MAX_GPUS}",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int_in(1, MAX_GPUS),
        default=None,
        metavar="G",
        help="GPUs per node, dividing --gpus (8, or --gpus when fewer)",
    )
    parser.add_argument(
        "--model",
        metavar="M",
        help=f"model preset ({', '.join(_core.model_preset_names())}); "
        "default: the workload's model",
    )
    parser.add_argument("--profile", metavar="FILE", help="hardware profile JSON (built-in H200)")
    parser.add_argument("--links", default=None, metavar="nvlink|pcie", help="link class (nvlink)")


def setup_from_args(args: argparse.Namespace) -> Setup:
    """The Setup the flags describe; flags left unset take their defaults."""
    gpus_per_node = args.gpus_per_node
    if gpus_per_node is None:
        gpus_per_node = default_gpus_per_node(args.gpus)
    links = args.links or "nvlink"
    seed = args.seed or 0
    if args.workload is not None:
        source = args.workload
    else:
        if args.model is None:
            names = ", ".join(_core.model_preset_names())
            raise ValueError(f"--batch needs --model (one of: {names})")
        # Checked before reading the batch, so a bad cluster is reported as such.
        _core.make_cluster(args.gpus, gpus_per_node, links)
        source = load_batch(args.batch, model=args.model, num_ranks=args.gpus)
    return make_setup(
        source,
        args.gpus,
        gpus_per_node=gpus_per_node,
        model=args.model,
        profile=args.profile,
        seed=seed,
        links=links,
    )
