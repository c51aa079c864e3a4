"""Arguments shared by the commands: where the batch comes from and what cluster it runs on."""

from __future__ import annotations

import argparse
import dataclasses

from zellige import _core
from zellige.api import Setup, make_setup
from zellige.commands._args import MAX_GPUS, SEED_MAX, int_in
from zellige.costs import default_gpus_per_node
from zellige.global_batch import draw_global_batch, parse_global_batch_size, take_global_batch
from zellige.model_spec import load_model_spec
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
    add_model_arguments(parser, "default: the workload's model")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="hardware profile JSON, or a built-in one: h200 (the default) or h100",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="each GPU's memory the plans must fit (default: the profile's device's)",
    )
    parser.add_argument("--links", default=None, metavar="nvlink|pcie", help="link class (nvlink)")


def add_model_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """--model PRESET or --model-spec FILE: the two ways of naming a model (one of them)."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        metavar="M",
        help=f"model preset ({', '.join(_core.model_preset_names())}); {default}",
    )
    model.add_argument(
        "--model-spec",
        metavar="FILE",
        help="your model's sizes as a TOML or JSON model spec file (see docs/model-spec.md)",
    )


def model_from_args(args: argparse.Namespace) -> str | _core.ModelSpec | None:
    """The preset name, the spec file's ModelSpec, or None when neither flag is given."""
    if getattr(args, "model_spec", None) is not None:
        return load_model_spec(args.model_spec)
    return args.model


def setup_from_args(args: argparse.Namespace) -> Setup:
    """The Setup the flags describe; flags left unset take their defaults."""
    gpus_per_node = args.gpus_per_node
    if gpus_per_node is None:
        gpus_per_node = default_gpus_per_node(args.gpus)
    links = args.links or "nvlink"
    seed = args.seed or 0
    model = model_from_args(args)
    if args.workload is not None:
        source = args.workload
    else:
        if model is None:
            names = ", ".join(_core.model_preset_names())
            raise ValueError(f"--batch needs --model (one of: {names}) or --model-spec FILE")
        # Checked before reading the batch, so a bad cluster is reported as such.
        _core.make_cluster(args.gpus, gpus_per_node, links)
        source = load_batch(args.batch, model=model, num_ranks=args.gpus)
    return make_setup(
        source,
        args.gpus,
        gpus_per_node=gpus_per_node,
        model=model,
        profile=args.profile,
        seed=seed,
        links=links,
        gpu_memory_gib=getattr(args, "gpu_memory_gib", None),
    )


def add_global_batch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--global-batch",
        metavar="SIZE",
        help="plan one optimizer step cut into micro-batches: a sample count (1024) or a token "
        "budget with k, M or B (50M), drawn from --workload over consecutive seeds or taken "
        "from the start of --batch; 'all' takes the whole --batch file (docs/global-batch.md)",
    )


def global_setup_from_args(args: argparse.Namespace) -> Setup:
    """setup_from_args with the batch replaced by the --global-batch the flags describe."""
    setup = setup_from_args(args)
    if args.global_batch.strip() == "all":
        if setup.workload is not None:
            raise ValueError("--global-batch all takes a --batch file; give a size for a workload")
        return setup
    size = parse_global_batch_size(args.global_batch)
    if setup.workload is not None:
        batch = draw_global_batch(setup.workload, args.gpus, size, setup.seed)
    else:
        batch = take_global_batch(list(setup.batch.sequences), size)
    return dataclasses.replace(setup, batch=batch)
