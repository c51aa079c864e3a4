"""Mixed image/video latent data driven by the workload recipes."""

from zellige.data.synthetic import SequenceSample, SyntheticLatents, grid_positions

__all__ = ["SequenceSample", "SyntheticLatents", "grid_positions"]
