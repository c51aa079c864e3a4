"""--cluster FILE: plan on a cluster of unlike nodes (zellige.cluster_file) instead of --gpus."""

from __future__ import annotations

import argparse
import dataclasses

from zellige import _core
from zellige.api import Setup
from zellige.cluster_file import ClusterFile, read_cluster_file

# Flags the cluster file replaces: its nodes give the GPU count, node size, memory and links.
_REPLACED = (
    ("gpus", "--gpus"),
    ("gpus_per_node", "--gpus-per-node"),
    ("gpu_memory_gib", "--gpu-memory-gib"),
    ("links", "--links"),
)


def add_cluster_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        help="a cluster of unlike nodes (devices, memory, speeds) as a TOML or JSON cluster file "
        "(docs/formats.md), in place of --gpus; --profile is the profile it is priced with",
    )


def read_cluster_args(args: argparse.Namespace) -> ClusterFile | None:
    """The --cluster file, read and checked, with args.gpus and args.gpus_per_node set from it
    (so the batch is drawn for its ranks); None without --cluster. ValueError when neither
    --gpus nor --cluster is given, or --cluster comes with a flag it replaces."""
    if args.cluster is None:
        if args.gpus is None:
            raise ValueError("give --gpus N or --cluster FILE")
        return None
    for name, flag in _REPLACED:
        if getattr(args, name, None) is not None:
            raise ValueError(f"{flag} does not combine with --cluster (the cluster file gives it)")
    cluster_file = read_cluster_file(args.cluster)
    args.gpus = cluster_file.num_ranks
    args.gpus_per_node = cluster_file.gpus_per_node
    args.links = cluster_file.links
    return cluster_file


def on_cluster(setup: Setup, cluster_file: ClusterFile | None) -> Setup:
    """The setup with its cost model on the file's cluster: each node's speed relative to the
    setup's profile, each rank's own memory. The setup itself without a file."""
    if cluster_file is None:
        return setup
    cost_model = setup.cost_model
    cluster = cluster_file.to_cluster(cost_model.model, cost_model.profile)
    priced = _core.CostModel(cost_model.model, cost_model.profile, cluster, cost_model.options)
    return dataclasses.replace(setup, cost_model=priced)
