"""Test tiers. `bash scripts/test.sh` runs the fast tier, `pytest -m "not slow"`; `--full` (and CI)
runs every test. The slow tests are listed here, in one place, rather than marked in their
modules.

Slow means it took 5 s or more under `pytest --durations=0` on a 2-core machine loaded by other
builds (where the whole suite took 42 minutes), or shares a module or a multi-process fixture
with such tests: end-to-end profiler runs, torch.compile checks, multi-process training and CLI
runs. A few such tests stay fast so that the fast tier still covers every layer: one distributed
training run (the float64 loss identity across placements), distributed attention against a
single process on two ranks, one example under torchrun with the Balancer checked against a
single process, and the ragged kernel's check."""

from __future__ import annotations

import pytest

# Modules (paths from the repository root) whose every test is slow.
SLOW_MODULES: set[str] = {
    "tests/distributed/test_diffusers_examples.py",
    "tests/distributed/test_no_host_sync.py",
    "tests/distributed/test_speed_feedback.py",
    "tests/distributed/test_train_faults.py",
    "tests/distributed/test_train_late_metrics.py",
    "tests/distributed/test_train_one_rank.py",
    "tests/distributed/test_train_latents.py",
}

# Module -> its slow tests: a function's name marks all its parametrisations, `name[id]` one.
SLOW_TESTS: dict[str, set[str]] = {
    "tests/python/test_device_capacity.py": {
        "test_a_step_that_fits_only_in_parts_runs_as_micro_batches",
    },
    "tests/distributed/test_attention_distributed.py": {
        "test_ragged_tables_match_single_process_attention",
    },
    "tests/distributed/test_balancer.py": {
        "test_example_runs_under_torchrun[mmdit_joint_attention.py-4]",
    },
    "tests/distributed/test_check_command.py": {
        "test_check_of_an_all_local_plan_also_checks_distributed_plans",
        "test_check_only_plan_warns_when_nothing_is_distributed",
        "test_check_passes_for_a_planned_workload",
    },
    "tests/distributed/test_train.py": {
        "test_mmdit_hybrid_and_overlapping_placements_on_four_ranks",
        "test_mmdit_loss_and_gradients_agree_across_placements",
        "test_mmdit_resume_gives_identical_next_losses",
        "test_mmdit_tiny_loss_falls_over_50_steps",
        "test_rank_without_tokens_does_not_hang",
        "test_resume_continues_the_loss_curve",
        "test_tiny_model_loss_falls_over_50_steps",
    },
    "tests/distributed/test_train_cli.py": {
        "test_corrupt_checkpoint_is_refused",
        "test_non_finite_loss_stops_and_keeps_the_last_checkpoint",
        "test_resume_runs_no_code_of_a_crafted_rank_file",
        "test_toml_file_with_overrides_and_run_output",
    },
    "tests/python/test_data.py": {
        "test_spawned_loader_worker_exits_without_nanobind_leak_reports",
    },
    "tests/python/test_diffusers_integration.py": {
        "test_one_rank_matches_the_unmodified_model[checkpointed-flux]",
        "test_one_rank_matches_the_unmodified_model[checkpointed-wan]",
    },
    "tests/python/test_joint.py": {
        "test_plan_joint_reports_gap_and_optimality",
        "test_warm_start_is_the_planners_plan",
        "test_warm_start_skipped_when_it_would_take_the_limit",
    },
    "tests/python/test_mmdit.py": {
        "test_compiled_regions_equal_eager_and_compile_once",
        "test_split_modulation_leaves_loss_and_gradients",
    },
    "tests/python/test_model.py": {
        "test_compiled_regions_equal_eager_and_compile_once",
        "test_split_modulation_and_gathered_head_leave_loss_and_gradients",
    },
    "tests/python/test_model_spec.py": {
        "test_check_takes_a_spec_file",
        "test_cli_spec_errors",
        "test_profile_measures_a_users_block",
    },
    "tests/python/test_plan_io.py": {
        "test_random_plans_round_trip_exactly",
    },
    "tests/python/test_profile_model_tables.py": {
        "test_a_model_rows_run_hands_over_each_part_as_it_is_measured",
        "test_quick_profile_on_a_base_adds_the_models_own_rows",
        "test_validate_measures_the_models_rows_then_validates_them_in_one_run",
    },
    "tests/python/test_profiler.py": {
        "test_a_joint_spec_file_profiles_on_the_mmdit_blocks",
        "test_fsdp_blocks_compute_the_plain_blocks_step",
        "test_host_issue_time_ends_before_the_final_synchronize",
        "test_memory_probes_run_through_fsdp_blocks",
        "test_quick_profile_and_validate_run_the_mmdit",
        "test_quick_profile_writes_a_valid_measured_profile",
        "test_quick_validate_runs_ranks_through_the_engine",
        "test_time_only_profile_replaces_the_time_rows_and_keeps_the_memory_rows",
        "test_validate_measures_only_the_launch_rows_in_its_own_process",
        "test_validate_measures_the_time_rows_in_its_own_process",
        "test_validate_records_the_hosts_issue_time_and_facts",
        "test_validate_runs_a_rank_with_the_full_recompute_its_cost_chose",
        "test_validate_times_ranks_with_the_collector_frozen_as_training_does",
    },
    "tests/python/test_readme.py": {
        "test_readme_commands_run_as_written",
    },
    "tests/python/test_recompute.py": {
        "test_the_recompute_runs_no_attention_kernel[mmdit]",
    },
    "tests/python/test_runtime_key_split.py": {
        "test_split_forward_equals_per_segment_attention[math]",
    },
    "tests/python/test_train_parts.py": {
        "test_end_rank_process_keeps_output_and_exit_code[3]",
        "test_forward_copies_are_freed_before_the_optimizer_writes_the_next",
    },
}

# Module -> (fixture, its parameters whose tests are slow). A module-scoped fixture that starts
# processes is paid for by the first of its tests that runs, so all of them go to one tier.
SLOW_FIXTURE_PARAMS: dict[str, tuple[str, set[object]]] = {
    "tests/distributed/test_attention_distributed.py": ("report", {3, 4}),  # world sizes
    "tests/distributed/test_balancer.py": ("report", {2, 4}),  # each a minute or two
}


# tryfirst: mark before `-m`/`-k` deselect, so the check below sees every collected test.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names_by_module: dict[str, set[str]] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        names = names_by_module.setdefault(module, set())
        function_name = getattr(item, "originalname", item.name)
        names.update((item.name, function_name, *getattr(item, "fixturenames", ())))
        slow = SLOW_TESTS.get(module, set())
        fixture, slow_params = SLOW_FIXTURE_PARAMS.get(module, ("", set()))
        callspec = getattr(item, "callspec", None)
        slow_fixture = callspec is not None and callspec.params.get(fixture) in slow_params
        if module in SLOW_MODULES or item.name in slow or function_name in slow or slow_fixture:
            item.add_marker(pytest.mark.slow)
    # A renamed or moved slow test would silently join the fast tier: refuse the run instead.
    listed = SLOW_MODULES | SLOW_TESTS.keys() | SLOW_FIXTURE_PARAMS.keys()
    gone = sorted(module for module in listed if not (config.rootpath / module).is_file())
    if gone:
        raise pytest.UsageError(
            f"tests/conftest.py lists slow tests in modules that do not exist: {', '.join(gone)}"
        )
    # Names are checked only where whole modules were collected (no `file::test` argument).
    if any("::" in arg for arg in config.args):
        return
    for module, names in names_by_module.items():
        expected = set(SLOW_TESTS.get(module, ()))
        if module in SLOW_FIXTURE_PARAMS:
            expected.add(SLOW_FIXTURE_PARAMS[module][0])
        missing = sorted(expected - names)
        if missing:
            raise pytest.UsageError(
                f"tests/conftest.py lists slow tests or fixtures that {module} does not have: "
                f"{', '.join(missing)}; update it to their current names"
            )
