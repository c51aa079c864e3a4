"""CostOptions as one value: it pickles whole (a loader worker receives it so), and the trainer
makes its run's options in one function (optimizer_builder.cost_options)."""

from __future__ import annotations

import pickle

import pytest

import zellige
from zellige.train.config import get_config
from zellige.train.optimizer_builder import cost_options

# A value for every field, none of them the default (a valid cost model's options)
NON_DEFAULT = {
    "activation_checkpointing": False,
    "bytes_per_element": 4,
    "state_bytes_per_param": 18.5,
    "gradient_bytes_per_param": 3.0,
    "memory_headroom": 0.125,
    "adaptive_checkpointing": True,
    "weights_kept_to_backward": True,
    "optimizer_copy_bytes_per_param": 2.5,
    "accumulating_gradients": True,
}


def _options(**fields) -> zellige.CostOptions:
    options = zellige.CostOptions()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def _fields(options: zellige.CostOptions) -> dict:
    return {name: getattr(options, name) for name in NON_DEFAULT}


def test_non_default_values_cover_every_field() -> None:
    properties = {
        name
        for name, value in vars(zellige.CostOptions).items()
        if isinstance(value, property) and not name.startswith("_")
    }
    assert properties == set(NON_DEFAULT)  # a new field needs a value here
    defaults = _fields(zellige.CostOptions())
    assert all(defaults[name] != value for name, value in NON_DEFAULT.items())


def test_cost_options_round_trip_through_pickle_with_every_field() -> None:
    options = _options(**NON_DEFAULT)
    copy = pickle.loads(pickle.dumps(options))
    assert _fields(copy) == NON_DEFAULT
    assert copy == options
    assert copy != zellige.CostOptions()


def test_a_pickled_dataset_plans_with_its_cost_options() -> None:
    """What a spawned loader worker receives: the dataset pickled with its options, whose
    cost model then prices with every one of them."""
    from zellige.data import StepDataset

    options = _options(**NON_DEFAULT)
    config = get_config("tiny-cpu")
    dataset = StepDataset(
        model=config.model.dit,
        recipe="tiny",
        planner="dp-cost",
        rank=0,
        num_ranks=2,
        gpus_per_node=2,
        seed=0,
        cost_options=options,
    )
    worker_copy = pickle.loads(pickle.dumps(dataset))
    assert _fields(worker_copy.pipeline().cost_model.options) == NON_DEFAULT
    default = StepDataset(
        model=config.model.dit,
        recipe="tiny",
        planner="dp-cost",
        rank=0,
        num_ranks=2,
        gpus_per_node=2,
        seed=0,
    )
    assert default.pipeline().cost_model.options == zellige.CostOptions()


def test_make_cost_model_uses_the_options_as_given() -> None:
    options = _options(**NON_DEFAULT)
    assert _fields(zellige.make_cost_model("wan-1.3b", 2, options=options).options) == NON_DEFAULT
    assert zellige.make_cost_model("wan-1.3b", 2).options == zellige.CostOptions()
    with pytest.raises(ValueError, match="gradient_bytes_per_param"):
        zellige.make_cost_model("wan-1.3b", 2, options=_options(gradient_bytes_per_param=17.0))


def test_set_gradient_bytes_keeps_the_rest_of_the_state() -> None:
    from zellige.costs import set_gradient_bytes

    options = zellige.CostOptions()
    set_gradient_bytes(options, 2.0)
    assert (options.gradient_bytes_per_param, options.state_bytes_per_param) == (2.0, 14.0)
    set_gradient_bytes(options, 0.0)
    assert (options.gradient_bytes_per_param, options.state_bytes_per_param) == (0.0, 12.0)
    set_gradient_bytes(options, 4.0)
    assert options == zellige.CostOptions()


# The trainer's options: (checkpointing, adaptive, weights kept, gradient bytes, state bytes,
# optimizer copy bytes), as the per-field helpers the loop called before made them
TRAINER_OPTIONS = {
    "tiny-cpu, one rank": ("tiny-cpu", {}, 1, (False, False, True, 4.0, 16.0, 0.0)),
    "tiny-cpu, two ranks": ("tiny-cpu", {}, 2, (False, False, False, 4.0, 16.0, 0.0)),
    "bf16 cuda, one rank": ("wan14b-width-h200", {}, 1, (True, True, True, 2.0, 14.0, 2.0)),
    "bf16 cuda, two ranks": ("wan14b-width-h200", {}, 2, (True, True, False, 4.0, 16.0, 0.0)),
    "bf16 cuda, fsdp on one rank": (
        "wan14b-width-h200",
        {"fsdp_on_one_rank": True},
        1,
        (True, True, True, 4.0, 16.0, 0.0),
    ),
    "bf16 cuda, no checkpointing": (
        "wan14b-width-h200",
        {"activation_checkpointing": False},
        1,
        (False, False, True, 2.0, 14.0, 2.0),
    ),
    "bf16 cuda, kept weights on 8 ranks": (
        "wan14b-width-h200",
        {"reshard_after_forward": False},
        8,
        (True, True, True, 4.0, 16.0, 0.0),
    ),
    "fp32 cuda, one rank": (
        "wan14b-width-h200",
        {"dtype": "float32"},
        1,
        (True, True, True, 4.0, 16.0, 0.0),
    ),
}


@pytest.mark.parametrize("case", TRAINER_OPTIONS, ids=list(TRAINER_OPTIONS))
def test_the_trainers_cost_options(case: str) -> None:
    name, changes, num_ranks, expected = TRAINER_OPTIONS[case]
    checkpointing, adaptive, kept, gradient_bytes, state_bytes, copy_bytes = expected
    config = get_config(name).with_fields(**changes)
    wanted = _options(
        activation_checkpointing=checkpointing,
        adaptive_checkpointing=adaptive,
        weights_kept_to_backward=kept,
        gradient_bytes_per_param=gradient_bytes,
        state_bytes_per_param=state_bytes,
        optimizer_copy_bytes_per_param=copy_bytes,
    )
    assert cost_options(config, num_ranks) == wanted
    assert cost_options(config.resolved(num_ranks), num_ranks) == wanted  # as the loop calls it
