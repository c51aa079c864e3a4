"""Training: typed configs, parallelize() (FSDP2, checkpointing, precision) and the loop."""

from zellige.train.config import CONFIGS, TrainConfig, get_config
from zellige.train.loop import train

__all__ = ["CONFIGS", "TrainConfig", "get_config", "train"]
