"""Mixed image/video latent data driven by the workload recipes, planned one step ahead."""

from zellige.data.loader import (
    TINY_RECIPE,
    StepData,
    StepDataset,
    TextRoute,
    load_training_recipe,
    make_loader,
    model_spec,
    text_route,
)
from zellige.data.synthetic import SequenceSample, SyntheticLatents, grid_positions

__all__ = [
    "TINY_RECIPE",
    "SequenceSample",
    "StepData",
    "StepDataset",
    "SyntheticLatents",
    "TextRoute",
    "grid_positions",
    "load_training_recipe",
    "make_loader",
    "text_route",
    "model_spec",
]
