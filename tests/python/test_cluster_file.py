"""Cluster files (zellige.cluster_file) and `zellige plan/compare --cluster FILE`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zellige import _core
from zellige.cluster_file import load_cluster, node_speed, read_cluster_file
from zellige.profile import load_profile

MIXED = """
gpus_per_node = 4

[[nodes]]
count = 2
profile = "h100"

[[nodes]]
profile = "h200"
speed = 1.5
memory_gib = 100
"""


def write(tmp_path, text: str, name: str = "cluster.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_reads_nodes_in_rank_order_with_speeds_and_memory(tmp_path):
    spec = _core.model_preset("wan-14b")
    h200 = load_profile("h200")
    cluster = load_cluster(write(tmp_path, MIXED), spec, h200)
    assert (cluster.num_nodes, cluster.gpus_per_node, cluster.num_ranks()) == (3, 4, 12)
    h100_speed = node_speed(spec, load_profile("h100"), h200)
    assert cluster.rank_speeds == [h100_speed] * 8 + [1.5] * 4
    h100_bytes = load_profile("h100").device_memory_bytes
    assert cluster.rank_memory_bytes == [h100_bytes] * 8 + [100 * 2**30] * 4
    assert cluster.gpu_memory_bytes == h100_bytes  # the smallest: what speed-blind planners see
    assert cluster.heterogeneous()


def test_speed_from_the_profiles_is_the_ratio_of_predicted_times():
    spec = _core.model_preset("mmdit-11b")
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert node_speed(spec, h200, h200) == 1.0
    # The ratio both ways multiplies to one.
    assert node_speed(spec, h100, h200) * node_speed(spec, h200, h100) == pytest.approx(1, 1e-12)


def test_like_nodes_leave_the_per_rank_lists_empty_and_json_reads_the_same(tmp_path):
    data = {"gpus_per_node": 8, "links": "pcie", "nodes": [{"count": 2, "profile": "h200"}]}
    path = write(tmp_path, json.dumps(data), "cluster.json")
    cluster = load_cluster(path, _core.model_preset("wan-14b"))
    assert cluster.rank_speeds == [] and cluster.rank_memory_bytes == []
    assert cluster.num_ranks() == 16
    pcie = _core.make_cluster(16, 8, "pcie")
    assert cluster.intra_node_bytes_per_s == pcie.intra_node_bytes_per_s


def test_per_rank_factors_multiply_the_node_speed(tmp_path):
    text = 'gpus_per_node = 2\nrank_speeds = [1, 0.5, 1, 1]\n[[nodes]]\ncount = 2\nprofile = "h200"'
    text += "\n"
    cluster = load_cluster(write(tmp_path, text), _core.model_preset("wan-14b"))
    assert cluster.rank_speeds == [1.0, 0.5, 1.0, 1.0]


def test_a_profile_path_is_relative_to_the_cluster_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    source = load_profile("h100")
    from zellige.profile import save_profile

    save_profile(source, tmp_path / "profiles" / "mine.json")
    text = 'gpus_per_node = 2\n[[nodes]]\nprofile = "profiles/mine.json"\nspeed = 0.5\n'
    cluster = load_cluster(write(tmp_path, text), _core.model_preset("wan-14b"))
    assert cluster.rank_speeds == [0.5, 0.5]
    assert cluster.gpu_memory_bytes == source.device_memory_bytes


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[nodes]]\nprofile = "h200"\n', "missing field 'gpus_per_node'"),
        ("gpus_per_node = 8\nnodes = []\n", "lists no node"),
        ('gpus_per_node = 8\ncolour = 1\n[[nodes]]\nprofile = "h200"\n', "unknown field"),
        ('gpus_per_node = 8\n[[nodes]]\nprofile = "h200"\nspeed = 0\n', "must be positive"),
        ('gpus_per_node = 8\n[[nodes]]\nprofile = "h200"\nspeed = -1\n', "must be positive"),
        ('gpus_per_node = 8\n[[nodes]]\nprofile = "h200"\ncount = 0\n', "'count'"),
        ('gpus_per_node = 8\n[[nodes]]\nprofile = "tpu"\n', "tpu"),
        ('gpus_per_node = 8\nlinks = "wifi"\n[[nodes]]\nprofile = "h200"\n', "nvlink or pcie"),
        (
            'gpus_per_node = 2\nrank_speeds = [1, 1, 1]\n[[nodes]]\nprofile = "h200"\n',
            "one per rank (2)",
        ),
        (
            'gpus_per_node = 2\nrank_speeds = [1, inf]\n[[nodes]]\nprofile = "h200"\n',
            "positive and finite",
        ),
        (
            'gpus_per_node = 2\nrank_memory_gib = [80, 0.1]\n[[nodes]]\nprofile = "h200"\n',
            "rank 1's GPU memory",
        ),
        ("gpus_per_node = [\n", "not valid TOML"),
    ],
    ids=[
        "no-gpus-per-node",
        "no-nodes",
        "unknown-key",
        "zero-speed",
        "negative-speed",
        "zero-count",
        "unknown-profile",
        "unknown-links",
        "rank-speeds-size",
        "rank-speed-inf",
        "rank-memory-small",
        "malformed",
    ],
)
def test_bad_files_give_one_line_value_errors(tmp_path, text, needle):
    with pytest.raises(ValueError) as error:
        load_cluster(write(tmp_path, text), _core.model_preset("wan-14b"))
    message = str(error.value)
    assert needle.lower() in message.lower()
    assert "\n" not in message


def test_suffix_must_be_toml_or_json(tmp_path):
    with pytest.raises(ValueError, match="must end in .toml or .json"):
        read_cluster_file(write(tmp_path, MIXED, "cluster.yaml"))


def zellige_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zellige.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


MIXED_8 = """
gpus_per_node = 4
[[nodes]]
profile = "h100"
[[nodes]]
profile = "h200"
speed = 1.4
"""


def test_plan_and_compare_take_a_cluster_file(tmp_path):
    path = write(tmp_path, MIXED_8)
    out = tmp_path / "plan.json"
    result = zellige_cli(
        "plan",
        "--workload",
        "opensora2-stage2",
        "--cluster",
        path,
        "--planner",
        "zellige",
        "--out",
        out,
    )
    assert result.returncode == 0, result.stderr
    assert "on 8 GPUs (2 x 4)" in result.stdout
    assert json.loads(out.read_text())["num_ranks"] == 8
    result = zellige_cli("compare", "--workload", "opensora2-stage2", "--cluster", path, "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["planner"]: row for row in json.loads(result.stdout)}
    assert rows["zellige"]["fits"]
    fitting = [row["makespan_s"] for row in rows.values() if row.get("makespan_s") is not None]
    assert rows["zellige"]["makespan_s"] == min(fitting)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpus", "8"], "--gpus does not combine with --cluster"),
        (["--gpu-memory-gib", "80"], "--gpu-memory-gib does not combine"),
    ],
    ids=["gpus", "memory"],
)
def test_cluster_refuses_the_flags_it_replaces(tmp_path, extra, needle):
    path = write(tmp_path, MIXED_8)
    result = zellige_cli("compare", "--workload", "wan-stage2", "--cluster", path, *extra)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_gpus_or_cluster_is_required():
    result = zellige_cli("plan", "--workload", "wan-stage2", "--planner", "zellige")
    assert result.returncode == 2
    assert "--gpus N or --cluster FILE" in result.stderr
