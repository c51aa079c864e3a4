"""The profile's attention_ragged: one place decides it from the engine (backends.
engine_runs_ragged), a run prices its plans with it (profile.priced_as_engine_runs, StepDataset),
and the profiler records it while timing its launch rows as dense calls."""

from __future__ import annotations

import pytest
import torch

import zellige
from zellige.profile import load_profile, priced_as_engine_runs, profile_from_dict, profile_to_dict
from zellige.runtime import EngineConfig, backends


class _Kernel:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def kernel_named(monkeypatch):
    """Makes ragged_kernel_for return a checked kernel of this name (None: no kernel)."""

    def install(name: str | None) -> None:
        kernel = None if name is None else _Kernel(name)
        monkeypatch.setattr(backends, "ragged_kernel_for", lambda *args, **kwargs: kernel)

    return install


@pytest.mark.parametrize(
    ("kernel", "merge", "ragged"),
    [
        ("cudnn-fe", None, True),  # the frontend installed and checked: automatic
        ("cudnn-fe", "auto", True),
        ("cudnn-fe", "groups", False),  # the user asked for dense calls
        ("cudnn-fe", "ragged", True),
        ("math", "auto", False),  # a kernel not trusted for automatic use
        ("math", "ragged", True),
        (None, "auto", False),  # no checked kernel (no package, a CPU)
        (None, "ragged", False),
    ],
)
def test_engine_runs_ragged_follows_the_merge_policy(
    kernel_named, monkeypatch, kernel, merge, ragged
):
    kernel_named(kernel)
    if merge is None:
        monkeypatch.delenv("ZELLIGE_ATTENTION_MERGE", raising=False)
    else:
        monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", merge)
    assert backends.engine_runs_ragged("cuda", torch.bfloat16, 128) is ragged


def test_a_cpu_engine_runs_dense_calls(monkeypatch):
    monkeypatch.delenv("ZELLIGE_ATTENTION_MERGE", raising=False)
    assert backends.engine_runs_ragged("cpu", torch.float32, 16) is False


def test_an_unknown_merge_policy_is_a_value_error(monkeypatch):
    monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", "padded")
    with pytest.raises(ValueError, match="ZELLIGE_ATTENTION_MERGE='padded' .*allowed: auto"):
        backends.engine_runs_ragged("cpu", torch.float32, 16)


def test_the_engine_config_reads_the_environment_in_one_place(monkeypatch):
    monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", "ragged")
    assert EngineConfig.from_env().merge == "ragged"
    assert EngineConfig.from_env().replace(merge="groups").merge == "groups"
    assert EngineConfig.from_env({}) == EngineConfig()
    assert (
        backends.engine_runs_ragged("cpu", torch.float32, 16, EngineConfig(merge="groups")) is False
    )
    with pytest.raises(ValueError, match="allowed: auto, groups, ragged"):
        EngineConfig(merge="fast")


def test_a_profile_is_priced_as_the_engine_runs():
    said: list[str] = []
    profile = load_profile()
    assert priced_as_engine_runs(profile, False, said.append) is profile and said == []
    ragged = priced_as_engine_runs(profile, True, said.append)
    assert ragged.attention_ragged is True and profile.attention_ragged is False  # a copy
    assert len(said) == 1 and "ragged" in said[0] and "\n" not in said[0]
    data = profile_to_dict(ragged)
    data["attention_ragged"] = False
    assert profile_from_dict(data) == profile  # nothing else changed
    back = priced_as_engine_runs(ragged, False, said.append)
    assert back.attention_ragged is False and "dense calls" in said[1]


def test_a_profile_without_the_field_reads_as_dense_calls():
    data = profile_to_dict(load_profile())
    del data["attention_ragged"]
    assert profile_from_dict(data).attention_ragged is False


def test_ragged_pricing_lowers_a_rank_of_many_lengths():
    """Through the Python API: a rank of many distinct lengths is cheaper and issues fewer calls
    under attention_ragged; a rank of one sequence is priced alike."""
    from zellige import Strategy, _core, make_placement, sequence_from_tokens

    batch = _core.Batch()
    batch.sequences = [sequence_from_tokens(i, "video", 2000 + 700 * i, 512, 0) for i in range(8)]
    batch.sequences = [*batch.sequences, sequence_from_tokens(8, "video", 30000, 512, 1)]
    plan = _core.Plan(planner="hand", num_ranks=2)
    plan.placements = [make_placement(i, Strategy.local, [0 if i < 8 else 1]) for i in range(9)]
    dense_profile = load_profile()
    ragged_profile = priced_as_engine_runs(dense_profile, True)
    dense = zellige.make_cost_model("wan-14b", 2, profile=dense_profile)
    ragged = zellige.make_cost_model("wan-14b", 2, profile=ragged_profile)
    dense_cost, ragged_cost = dense.evaluate(batch, plan), ragged.evaluate(batch, plan)
    assert dense_cost.ranks[0].attention_calls == 16 and ragged_cost.ranks[0].attention_calls == 2
    assert ragged_cost.ranks[0].time_s < dense_cost.ranks[0].time_s
    assert ragged_cost.ranks[0].launch_floor_s < dense_cost.ranks[0].launch_floor_s
    assert ragged_cost.ranks[1].time_s == dense_cost.ranks[1].time_s


def test_the_step_dataset_prices_as_its_engine_runs():
    from zellige.data.loader import StepDataset
    from zellige.model import model_preset

    def profile_of(attention_ragged):
        dataset = StepDataset(
            model=model_preset("tiny-cpu"), recipe="wan-stage2", planner="dp-cost", rank=0,
            num_ranks=1, gpus_per_node=1, seed=0, attention_ragged=attention_ragged,
        )  # fmt: skip
        return dataset.pipeline().cost_model.profile

    assert profile_of(None).attention_ragged is False  # as the profile says
    assert profile_of(True).attention_ragged is True
    assert profile_of(False).attention_ragged is False


def test_launch_rows_time_dense_calls_whatever_the_policy(monkeypatch):
    """The launch rows are per dense call (the cost model counts a ragged call as several), so
    the profiler times its tiny ranks under merge "groups" even where the policy is ragged."""
    from zellige.profiler import launch, measure, rank_work

    policies: list[str] = []
    monkeypatch.setenv("ZELLIGE_ATTENTION_MERGE", "ragged")
    plan_rank_inputs = rank_work.plan_rank_inputs

    def recorded(**kwargs):
        inputs = plan_rank_inputs(**kwargs)
        policies.append(kwargs["engine"].merge)
        return inputs

    monkeypatch.setattr(rank_work, "plan_rank_inputs", recorded)
    monkeypatch.setattr(rank_work, "train_step", lambda *args, **kwargs: None)

    def step_times(fns, device, rounds, per_round):
        for fn in fns:
            fn()
        return [[0.010], [0.018]]

    monkeypatch.setattr(launch, "interleaved_step_times", step_times)
    options = measure.ProfileOptions(model="tiny", quick=True, device="cpu")
    rows = launch.profile_launch(options, torch.device("cpu"), torch.float32, lambda line: None)
    assert policies and set(policies) == {"groups"}
    assert rows["launch_s_per_attention_call"] > 0
    assert EngineConfig.from_env().merge == "ragged"  # the run's own policy is untouched
