"""Cluster files: a cluster of unlike nodes (docs/formats.md, "Cluster file"), as TOML or JSON.

    gpus_per_node = 8
    links = "nvlink"              # optional: nvlink (default) or pcie

    [[nodes]]                     # node groups, in rank order
    count = 2                     # optional (1): nodes of this group
    profile = "h100"              # built-in h100 / h200, or a profile JSON path (relative to
                                  # this file)
    memory_gib = 80               # optional: each GPU's memory (default: the profile's device)
    speed = 0.7                   # optional: the nodes' speed relative to the planning profile
                                  # (default: from the profiles, see node_speed)

    [[nodes]]
    count = 2
    profile = "h200"

    rank_speeds = [...]           # optional: one factor per rank, multiplying its node's speed
    rank_memory_gib = [...]       # optional: one per rank, in place of its node's memory

The planner prices every rank with one planning profile (`--profile`, default the built-in
H200); a rank of another device runs its work at `speed` times that profile's rate, so its time
is the planning profile's time divided by its speed (zellige.Cluster.rank_speeds).

Example:
    >>> spec = read_cluster_file("mixed.toml")
    >>> cluster = spec.to_cluster(model_spec, load_profile("h200"))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from zellige import _core
from zellige._files import MAX_TOML_BYTES, read_input
from zellige._json import (
    parse_json,
    parse_toml,
    reject_unknown,
    require_int,
    require_list,
    require_number,
    require_object,
    require_str,
    shown,
)
from zellige.costs import MAX_GPU_MEMORY_BYTES, MIN_GPU_MEMORY_BYTES
from zellige.profile import BUILTIN_PROFILES, load_profile

CLUSTER_SUFFIXES = (".toml", ".json")
# A node's speed from the profiles: the planning profile's predicted time over the node's, for
# one sequence of each of these lengths (latent tokens, the model's text), each whole on one
# rank: short, medium and long, so that neither the GEMMs nor attention alone decide.
REFERENCE_TOKENS = (4096, 16384, 65536)
_TOP_KEYS = ("gpus_per_node", "links", "nodes", "rank_speeds", "rank_memory_gib")
_NODE_KEYS = ("count", "profile", "memory_gib", "speed")


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeGroup:
    """`count` nodes alike: their device's profile (a built-in name or a path), and the GPU
    memory and speed given in the file (None: from the profile)."""

    count: int
    profile: str
    memory_gib: float | None
    speed: float | None


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterFile:
    """A parsed, validated cluster file; to_cluster turns it into a zellige.Cluster."""

    path: str
    gpus_per_node: int
    links: str
    nodes: tuple[NodeGroup, ...]
    rank_speeds: tuple[float, ...] | None
    rank_memory_gib: tuple[float, ...] | None

    @property
    def num_nodes(self) -> int:
        return sum(group.count for group in self.nodes)

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def to_cluster(
        self, model: _core.ModelSpec, planning_profile: _core.HardwareProfile
    ) -> _core.Cluster:
        """The Cluster, each node's speed relative to `planning_profile` for `model` (see
        node_speed) unless the file gives it, each rank's memory from its node's profile unless
        the file gives it. The per-rank lists stay empty where every rank is alike."""
        cluster = _core.make_cluster(self.num_ranks, self.gpus_per_node, self.links)
        speeds: list[float] = []
        memory_bytes: list[int] = []
        profiles: dict[str, _core.HardwareProfile] = {}
        for index, group in enumerate(self.nodes):
            where = f"{self.path}: nodes[{index}]"
            if group.profile not in profiles:
                try:
                    profiles[group.profile] = load_profile(group.profile)
                except ValueError as error:
                    raise ValueError(f"{where}: {error}") from None
            profile = profiles[group.profile]
            speed = group.speed
            if speed is None:
                speed = node_speed(model, profile, planning_profile)
            if group.memory_gib is not None:
                gpu_bytes = round(group.memory_gib * 2**30)
            elif profile.device_memory_bytes:
                gpu_bytes = profile.device_memory_bytes
            else:
                raise ValueError(
                    f"{where}: profile {group.profile} names no device memory; give memory_gib"
                )
            ranks = group.count * self.gpus_per_node
            speeds += [speed] * ranks
            memory_bytes += [gpu_bytes] * ranks
        if self.rank_speeds is not None:
            speeds = [
                speed * factor for speed, factor in zip(speeds, self.rank_speeds, strict=True)
            ]
        if self.rank_memory_gib is not None:
            memory_bytes = [round(gib * 2**30) for gib in self.rank_memory_gib]
        for rank, gpu_bytes in enumerate(memory_bytes):
            if not MIN_GPU_MEMORY_BYTES <= gpu_bytes <= MAX_GPU_MEMORY_BYTES:
                raise ValueError(
                    f"{self.path}: rank {rank}'s GPU memory must be "
                    f"{MIN_GPU_MEMORY_BYTES / 2**30:g} to {MAX_GPU_MEMORY_BYTES / 2**30:g} GiB, "
                    f"got {gpu_bytes / 2**30:g} GiB"
                )
        cluster.gpu_memory_bytes = min(memory_bytes)
        if any(speed != 1.0 for speed in speeds):
            cluster.rank_speeds = speeds
        if any(gpu_bytes != cluster.gpu_memory_bytes for gpu_bytes in memory_bytes):
            cluster.rank_memory_bytes = memory_bytes
        cluster.validate()
        return cluster


def node_speed(
    model: _core.ModelSpec,
    profile: _core.HardwareProfile,
    planning_profile: _core.HardwareProfile,
) -> float:
    """How fast a GPU of `profile` runs `model` against one of `planning_profile`: the ratio of
    their predicted times (planning / node) for one sequence of each REFERENCE_TOKENS length,
    whole on one rank, summed (1.0 for the same profile)."""

    def reference_s(hardware: _core.HardwareProfile) -> float:
        cost_model = _core.CostModel(model, hardware, _core.make_cluster(1, 1))
        total_s = 0.0
        for tokens in REFERENCE_TOKENS:
            sequence = _core.sequence_from_tokens(0, "video", tokens, model.text_tokens, 0)
            placement = _core.make_placement(0, _core.Strategy.local, [0])
            (share,) = cost_model.shares(sequence, placement)
            total_s += cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s)
        return total_s

    return reference_s(planning_profile) / reference_s(profile)


def read_cluster_file(path: str | Path) -> ClusterFile:
    """Reads and checks a TOML or JSON cluster file (by suffix); ValueError with a one-line
    message naming the file for anything unreadable, unknown or out of range."""
    path = Path(path)
    if path.suffix not in CLUSTER_SUFFIXES:
        raise ValueError(f"{path}: a cluster file must end in .toml or .json")
    try:
        text = read_input(path, MAX_TOML_BYTES, "cluster file")
    except ValueError as error:
        raise ValueError(f"cannot read cluster file {error}") from None
    where = str(path)
    if path.suffix == ".toml":
        data = parse_toml(text, where)
    else:
        try:
            data = parse_json(text, "JSON")
        except ValueError as error:
            raise ValueError(f"{path}: not valid {error}") from None
    data = require_object(data, where)
    reject_unknown(data, _TOP_KEYS, where)
    gpus_per_node = require_int(data, "gpus_per_node", where, low=1, high=_core.MAX_GPUS)
    links = require_str(data, "links", where, default="nvlink")
    if links not in ("nvlink", "pcie"):
        raise ValueError(f"{where}: field 'links' must be nvlink or pcie, got {shown(links)}")
    groups = require_list(data, "nodes", where)
    if not groups:
        raise ValueError(f"{where}: field 'nodes' lists no node")
    nodes = tuple(
        _node_group(item, f"{where}: nodes[{index}]", path.parent)
        for index, item in enumerate(groups)
    )
    num_ranks = sum(group.count for group in nodes) * gpus_per_node
    if num_ranks > _core.MAX_GPUS:
        raise ValueError(f"{where}: {num_ranks} GPUs, more than the {_core.MAX_GPUS} allowed")
    return ClusterFile(
        path=where,
        gpus_per_node=gpus_per_node,
        links=links,
        nodes=nodes,
        rank_speeds=_per_rank(data, "rank_speeds", where, num_ranks),
        rank_memory_gib=_per_rank(data, "rank_memory_gib", where, num_ranks),
    )


def load_cluster(
    path: str | Path,
    model: _core.ModelSpec,
    planning_profile: _core.HardwareProfile | str | Path | None = None,
) -> _core.Cluster:
    """The Cluster a cluster file describes, speeds relative to `planning_profile` (a profile,
    a built-in name or path; None: the built-in H200) for `model`. ValueError for a bad file."""
    profile = (
        planning_profile
        if isinstance(planning_profile, _core.HardwareProfile)
        else load_profile(planning_profile)
    )
    return read_cluster_file(path).to_cluster(model, profile)


def _positive(value: float, key: str, where: str) -> float:
    if not value > 0:
        raise ValueError(f"{where}: field '{key}' must be positive, got {shown(value)}")
    return value


def _node_group(item: object, where: str, folder: Path) -> NodeGroup:
    node = require_object(item, where)
    reject_unknown(node, _NODE_KEYS, where)
    count = require_int(node, "count", where, default=1, low=1, high=_core.MAX_GPUS)
    profile = require_str(node, "profile", where)
    if profile not in BUILTIN_PROFILES:
        profile = str(folder / profile)  # a path, relative to the cluster file
    memory_gib = None
    if "memory_gib" in node:
        memory_gib = _positive(require_number(node, "memory_gib", where), "memory_gib", where)
    speed = None
    if "speed" in node:
        speed = _positive(require_number(node, "speed", where), "speed", where)
    return NodeGroup(count=count, profile=profile, memory_gib=memory_gib, speed=speed)


def _per_rank(data: dict, key: str, where: str, num_ranks: int) -> tuple[float, ...] | None:
    if key not in data:
        return None
    values = require_list(data, key, where)
    if len(values) != num_ranks:
        raise ValueError(
            f"{where}: field '{key}' has {len(values)} entries, want one per rank ({num_ranks})"
        )
    checked = []
    for rank, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {key}[{rank}] must be a number, got {shown(value)}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"{where}: {key}[{rank}] must be positive and finite, got {shown(value)}"
            )
        checked.append(float(value))
    return tuple(checked)
