"""Mixed image/video latent data driven by the workload recipes, planned one step ahead."""

from zellige.data.loader import (
    TINY_RECIPE,
    GlobalStepData,
    StepData,
    StepDataset,
    load_training_recipe,
    make_loader,
    model_spec,
)
from zellige.data.synthetic import SequenceSample, SyntheticLatents, grid_positions

__all__ = [
    "TINY_RECIPE",
    "GlobalStepData",
    "SequenceSample",
    "StepData",
    "StepDataset",
    "SyntheticLatents",
    "grid_positions",
    "load_training_recipe",
    "make_loader",
    "model_spec",
]
