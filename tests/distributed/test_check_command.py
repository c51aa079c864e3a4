"""`zellige check` end to end on gloo processes: a planner's plan, joint attention for an MMDiT
preset with the hand-built distributed plans added to an all-local plan, and refusals."""

from __future__ import annotations

from zellige import cli
from zellige.api import make_setup, run_planner
from zellige.plan_io import save_plan


def test_check_passes_for_a_planned_workload(capsys) -> None:
    argv = ["check", "--nproc", "2", "--workload", "wan-stage1", "--planner", "static-cp:2"]
    assert cli.main([*argv, "--max-tokens", "1500", "--head-dim", "8", "--only-plan"]) == 0
    out = capsys.readouterr().out
    assert "strategies ulysses" in out and "scaled down" in out
    assert "cross-attention" in out and "cross.dk" in out
    assert "hand-built" not in out  # --only-plan: the plan alone, though it uses no ring
    assert "u is float64's unit roundoff (1.1e-16)" in out  # the bound says what u is
    assert out.strip().endswith("PASS")


def test_check_of_an_all_local_plan_also_checks_distributed_plans(capsys) -> None:
    # zellige keeps every sequence whole at 2 ranks: the check adds Ulysses and ring plans.
    argv = ["check", "--nproc", "2", "--workload", "opensora2-stage2", "--planner", "zellige"]
    assert cli.main([*argv, "--model", "mmdit-11b", "--max-tokens", "600", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "strategies local" in out and "places every sequence locally" in out
    assert "hand-built plans" in out and "joint attention" in out
    assert "Ulysses over 2 ranks (25 heads split 13,12)" in out  # 24 heads split evenly
    assert all(f"hand-{k} (" in out for k in (1, 2, 3)) and "dk.text" in out
    assert out.strip().endswith("PASS")


def test_check_rejects_a_plan_for_another_world_size(tmp_path, capsys) -> None:
    plan = run_planner(make_setup("wan-stage1", 2, gpus_per_node=2), "dp-tokens")
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert cli.main(["check", "--nproc", "4", "--workload", "wan-stage1", "--plan", str(path)]) == 2
    assert "2 ranks" in capsys.readouterr().err


def test_check_rejects_non_positive_sizes(capsys) -> None:
    base = ["check", "--nproc", "2", "--workload", "wan-stage1", "--planner", "dp-cost"]
    for extra in (["--heads", "0"], ["--head-dim", "0"], ["--max-tokens", "-5"]):
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        # argparse refuses them (bounded types, issue 17): its prefix names the subcommand
        assert err.startswith("zellige check: error:") and "positive" in err, err


def test_check_only_plan_warns_when_nothing_is_distributed(capsys) -> None:
    argv = ["check", "--nproc", "2", "--workload", "wan-stage1", "--planner", "dp-cost"]
    assert cli.main([*argv, "--max-tokens", "300", "--head-dim", "8", "--only-plan"]) == 0
    out = capsys.readouterr().out
    assert "strategies local" in out and "warning" in out and "hand-built" not in out
