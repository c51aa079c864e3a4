"""`zellige check` end to end: a planner's plan on 2 gloo processes, and a mismatched plan."""

from __future__ import annotations

from zellige import cli
from zellige.api import make_setup, run_planner
from zellige.plan_io import save_plan


def test_check_passes_for_a_planned_workload(capsys) -> None:
    argv = ["check", "--nproc", "2", "--workload", "wan-stage1", "--planner", "static-cp:2"]
    assert cli.main([*argv, "--max-tokens", "1500", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "strategies ulysses" in out and "scaled down" in out
    assert out.strip().endswith("PASS")


def test_check_rejects_a_plan_for_another_world_size(tmp_path, capsys) -> None:
    plan = run_planner(make_setup("wan-stage1", 2, gpus_per_node=2), "dp-tokens")
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert cli.main(["check", "--nproc", "4", "--workload", "wan-stage1", "--plan", str(path)]) == 2
    assert "2 ranks" in capsys.readouterr().err
