"""
Zellige planning core (C++20): workload, cost model, planners, plan compiler
"""

from collections.abc import Sequence as _Sequence
import enum

import numpy
from numpy.typing import NDArray


class LatentGeometry:
    """Pixels -> latent tokens: VAE strides and patch sizes."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def temporal_stride(self) -> int: ...

    @temporal_stride.setter
    def temporal_stride(self, arg: int, /) -> None: ...

    @property
    def spatial_stride(self) -> int: ...

    @spatial_stride.setter
    def spatial_stride(self, arg: int, /) -> None: ...

    @property
    def patch_t(self) -> int: ...

    @patch_t.setter
    def patch_t(self, arg: int, /) -> None: ...

    @property
    def patch_hw(self) -> int: ...

    @patch_hw.setter
    def patch_hw(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class Sequence:
    """One sample of the batch, in latent tokens."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def id(self) -> int: ...

    @id.setter
    def id(self, arg: int, /) -> None: ...

    @property
    def kind(self) -> str: ...

    @kind.setter
    def kind(self, arg: str, /) -> None: ...

    @property
    def num_tokens(self) -> int: ...

    @num_tokens.setter
    def num_tokens(self, arg: int, /) -> None: ...

    @property
    def text_tokens(self) -> int: ...

    @text_tokens.setter
    def text_tokens(self, arg: int, /) -> None: ...

    @property
    def source_rank(self) -> int: ...

    @source_rank.setter
    def source_rank(self, arg: int, /) -> None: ...

    @property
    def grid_t(self) -> int: ...

    @grid_t.setter
    def grid_t(self, arg: int, /) -> None: ...

    @property
    def grid_h(self) -> int: ...

    @grid_h.setter
    def grid_h(self, arg: int, /) -> None: ...

    @property
    def grid_w(self) -> int: ...

    @grid_w.setter
    def grid_w(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class Batch:
    """The sequences of one training step."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def sequences(self) -> list[Sequence]: ...

    @sequences.setter
    def sequences(self, arg: _Sequence[Sequence], /) -> None: ...

    def __len__(self) -> int: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class Bucket:
    """A bucketed loader's micro-batch shape."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def resolution(self) -> str: ...

    @resolution.setter
    def resolution(self, arg: str, /) -> None: ...

    @property
    def frames(self) -> int: ...

    @frames.setter
    def frames(self, arg: int, /) -> None: ...

    @property
    def batch(self) -> int: ...

    @batch.setter
    def batch(self, arg: int, /) -> None: ...

    @property
    def tokens_per_latent_frame_min(self) -> int: ...

    @tokens_per_latent_frame_min.setter
    def tokens_per_latent_frame_min(self, arg: int, /) -> None: ...

    @property
    def tokens_per_latent_frame_max(self) -> int: ...

    @tokens_per_latent_frame_max.setter
    def tokens_per_latent_frame_max(self, arg: int, /) -> None: ...

    @property
    def weight(self) -> float: ...

    @weight.setter
    def weight(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class MixEntry:
    """One kind of sample of a mix recipe."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def kind(self) -> str: ...

    @kind.setter
    def kind(self, arg: str, /) -> None: ...

    @property
    def num_tokens(self) -> int: ...

    @num_tokens.setter
    def num_tokens(self, arg: int, /) -> None: ...

    @property
    def frames(self) -> int: ...

    @frames.setter
    def frames(self, arg: int, /) -> None: ...

    @property
    def height(self) -> int: ...

    @height.setter
    def height(self, arg: int, /) -> None: ...

    @property
    def width(self) -> int: ...

    @width.setter
    def width(self, arg: int, /) -> None: ...

    @property
    def share(self) -> float: ...

    @share.setter
    def share(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class RankGroup:
    """Consecutive ranks loading one fixed shape."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def ranks(self) -> int: ...

    @ranks.setter
    def ranks(self, arg: int, /) -> None: ...

    @property
    def batch(self) -> int: ...

    @batch.setter
    def batch(self, arg: int, /) -> None: ...

    @property
    def tokens(self) -> int: ...

    @tokens.setter
    def tokens(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class Recipe:
    """A workload recipe (see zellige.load_recipe)."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def name(self) -> str: ...

    @name.setter
    def name(self, arg: str, /) -> None: ...

    @property
    def model(self) -> str: ...

    @model.setter
    def model(self, arg: str, /) -> None: ...

    @property
    def text_tokens(self) -> int: ...

    @text_tokens.setter
    def text_tokens(self, arg: int, /) -> None: ...

    @property
    def text_tokens_min(self) -> int: ...

    @text_tokens_min.setter
    def text_tokens_min(self, arg: int, /) -> None: ...

    @property
    def text_tokens_max(self) -> int: ...

    @text_tokens_max.setter
    def text_tokens_max(self, arg: int, /) -> None: ...

    @property
    def geometry(self) -> LatentGeometry: ...

    @geometry.setter
    def geometry(self, arg: LatentGeometry, /) -> None: ...

    @property
    def buckets(self) -> list[Bucket]: ...

    @buckets.setter
    def buckets(self, arg: _Sequence[Bucket], /) -> None: ...

    @property
    def mix(self) -> list[MixEntry]: ...

    @mix.setter
    def mix(self, arg: _Sequence[MixEntry], /) -> None: ...

    @property
    def per_rank_groups(self) -> list[RankGroup]: ...

    @per_rank_groups.setter
    def per_rank_groups(self, arg: _Sequence[RankGroup], /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

MAX_SEQUENCE_TOKENS: int = 4294967296

MAX_TEXT_TOKENS: int = 1048576

MAX_PIXELS: int = 1048576

MAX_BATCH_SEQUENCES: int = 1048576

MAX_BATCH_TOKENS: int = 1099511627776

def sequence_from_pixels(id: int, kind: str, frames: int, height: int, width: int, text_tokens: int, source_rank: int, geometry: LatentGeometry = ...) -> Sequence:
    """A sequence from pixels through the latent geometry."""

def sequence_from_tokens(id: int, kind: str, num_tokens: int, text_tokens: int, source_rank: int) -> Sequence:
    """
    A sequence given by its token count (grid 1 x h x w, h the largest divisor <= sqrt).
    """

def validate_batch(batch: Batch, num_ranks: int = 0) -> None:
    """Raises ValueError naming the offending sequence."""

def total_tokens(batch: Batch) -> int: ...

def generate_batch(recipe: Recipe, num_ranks: int, seed: int) -> Batch:
    """The batch of one step on num_ranks ranks; deterministic for seed."""

class ModelSpec:
    """DiT sizes (see zellige.model_preset)."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def name(self) -> str: ...

    @name.setter
    def name(self, arg: str, /) -> None: ...

    @property
    def width(self) -> int: ...

    @width.setter
    def width(self, arg: int, /) -> None: ...

    @property
    def num_layers(self) -> int: ...

    @num_layers.setter
    def num_layers(self, arg: int, /) -> None: ...

    @property
    def num_double_layers(self) -> int: ...

    @num_double_layers.setter
    def num_double_layers(self, arg: int, /) -> None: ...

    @property
    def num_heads(self) -> int: ...

    @num_heads.setter
    def num_heads(self, arg: int, /) -> None: ...

    @property
    def head_dim(self) -> int: ...

    @head_dim.setter
    def head_dim(self, arg: int, /) -> None: ...

    @property
    def ffn_width(self) -> int: ...

    @ffn_width.setter
    def ffn_width(self, arg: int, /) -> None: ...

    @property
    def text_tokens(self) -> int: ...

    @text_tokens.setter
    def text_tokens(self, arg: int, /) -> None: ...

    @property
    def joint_attention(self) -> bool: ...

    @joint_attention.setter
    def joint_attention(self, arg: bool, /) -> None: ...

    @property
    def param_count(self) -> int: ...

    @param_count.setter
    def param_count(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class LayerFlops:
    """Forward FLOPs of one layer for one sequence."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def linear(self) -> float: ...

    @linear.setter
    def linear(self, arg: float, /) -> None: ...

    @property
    def self_attention(self) -> float: ...

    @self_attention.setter
    def self_attention(self, arg: float, /) -> None: ...

    @property
    def cross_attention(self) -> float: ...

    @cross_attention.setter
    def cross_attention(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

MAX_MODEL_WIDTH: int = 65536

MAX_MODEL_HEADS: int = 4096

MAX_MODEL_LAYERS: int = 256

MAX_MODEL_FFN_WIDTH: int = 262144

MAX_MODEL_PARAMS: int = 1125899906842624

def model_preset(name: str) -> ModelSpec: ...

def model_preset_names() -> list[str]: ...

def validate_model_spec(model: ModelSpec) -> None: ...

def make_model_spec(name: str, width: int, num_heads: int, num_layers: int, ffn_width: int, text_tokens: int, joint_attention: bool, num_double_layers: int = 0, head_dim: int = 0, param_count: int = 0) -> ModelSpec: ...

def layer_forward_flops(model: ModelSpec, num_tokens: int, text_tokens: int) -> LayerFlops: ...

def attended_tokens(model: ModelSpec, num_tokens: int, text_tokens: int) -> int: ...

def train_flops(model: ModelSpec, num_tokens: int, text_tokens: int) -> float: ...

class Cluster:
    """Nodes x GPUs, GPU memory and links."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def num_nodes(self) -> int: ...

    @num_nodes.setter
    def num_nodes(self, arg: int, /) -> None: ...

    @property
    def gpus_per_node(self) -> int: ...

    @gpus_per_node.setter
    def gpus_per_node(self, arg: int, /) -> None: ...

    @property
    def gpu_memory_bytes(self) -> int: ...

    @gpu_memory_bytes.setter
    def gpu_memory_bytes(self, arg: int, /) -> None: ...

    @property
    def intra_node_bytes_per_s(self) -> float: ...

    @intra_node_bytes_per_s.setter
    def intra_node_bytes_per_s(self, arg: float, /) -> None: ...

    @property
    def inter_node_bytes_per_s(self) -> float: ...

    @inter_node_bytes_per_s.setter
    def inter_node_bytes_per_s(self, arg: float, /) -> None: ...

    @property
    def intra_node_latency_s(self) -> float: ...

    @intra_node_latency_s.setter
    def intra_node_latency_s(self, arg: float, /) -> None: ...

    @property
    def inter_node_latency_s(self) -> float: ...

    @inter_node_latency_s.setter
    def inter_node_latency_s(self, arg: float, /) -> None: ...

    @property
    def rank_speeds(self) -> list[float]:
        """Per rank: relative speed (1.0 = the profile's device); empty: all 1.0."""

    @rank_speeds.setter
    def rank_speeds(self, arg: _Sequence[float], /) -> None: ...

    @property
    def rank_memory_bytes(self) -> list[int]:
        """Per rank: usable GPU memory; empty: all gpu_memory_bytes."""

    @rank_memory_bytes.setter
    def rank_memory_bytes(self, arg: _Sequence[int], /) -> None: ...

    def num_ranks(self) -> int: ...

    def node_of(self, rank: int) -> int: ...

    def speed_of(self, rank: int) -> float: ...

    def memory_of(self, rank: int) -> int: ...

    def heterogeneous(self) -> bool: ...

    def total_speed(self) -> float: ...

    def validate(self) -> None:
        """
        Raise ValueError unless the per-rank lists are empty or one entry per rank, speeds positive and finite, memory positive.
        """

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

def homogeneous_view(cluster: Cluster) -> Cluster:
    """
    The cluster with every rank alike (no speeds, the smallest rank memory): what a speed-unaware planner sees.
    """

MAX_GPUS: int = 16384

def make_cluster(num_gpus: int, gpus_per_node: int, links: str = 'nvlink') -> Cluster:
    """H200 nodes; links is 'nvlink' or 'pcie'."""

class Table:
    """
    y(x) interpolated in log-log space; source is measured, seeded or analytic.
    """

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def x(self) -> list[float]: ...

    @x.setter
    def x(self, arg: _Sequence[float], /) -> None: ...

    @property
    def y(self) -> list[float]: ...

    @y.setter
    def y(self, arg: _Sequence[float], /) -> None: ...

    @property
    def source(self) -> str: ...

    @source.setter
    def source(self, arg: str, /) -> None: ...

    def empty(self) -> bool: ...

    def validate(self, name: str) -> None: ...

    def __call__(self, at: float) -> float: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class HardwareProfile:
    """Measured (or analytic) time tables of one device; see profile.h."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def device_name(self) -> str: ...

    @device_name.setter
    def device_name(self, arg: str, /) -> None: ...

    @property
    def created(self) -> str: ...

    @created.setter
    def created(self, arg: str, /) -> None: ...

    @property
    def matmul_flops_per_s(self) -> float: ...

    @matmul_flops_per_s.setter
    def matmul_flops_per_s(self, arg: float, /) -> None: ...

    @property
    def attention_flops_per_s(self) -> float: ...

    @attention_flops_per_s.setter
    def attention_flops_per_s(self, arg: float, /) -> None: ...

    @property
    def memory_bytes_per_s(self) -> float: ...

    @memory_bytes_per_s.setter
    def memory_bytes_per_s(self, arg: float, /) -> None: ...

    @property
    def attention_head_dim(self) -> int: ...

    @attention_head_dim.setter
    def attention_head_dim(self, arg: int, /) -> None: ...

    @property
    def attention_forward_s_per_head(self) -> Table: ...

    @attention_forward_s_per_head.setter
    def attention_forward_s_per_head(self, arg: Table, /) -> None: ...

    @property
    def attention_backward_s_per_head(self) -> Table: ...

    @attention_backward_s_per_head.setter
    def attention_backward_s_per_head(self, arg: Table, /) -> None: ...

    @property
    def attention_call_lengths(self) -> list[float]: ...

    @attention_call_lengths.setter
    def attention_call_lengths(self, arg: _Sequence[float], /) -> None: ...

    @property
    def attention_call_forward_s(self) -> list[Table]: ...

    @attention_call_forward_s.setter
    def attention_call_forward_s(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def attention_call_backward_s(self) -> list[Table]: ...

    @attention_call_backward_s.setter
    def attention_call_backward_s(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def launch_s_per_layer(self) -> list[float]: ...

    @launch_s_per_layer.setter
    def launch_s_per_layer(self, arg: _Sequence[float], /) -> None: ...

    @property
    def launch_s_per_attention_call(self) -> list[float]: ...

    @launch_s_per_attention_call.setter
    def launch_s_per_attention_call(self, arg: _Sequence[float], /) -> None: ...

    @property
    def matmul_forward_flops_per_s(self) -> Table: ...

    @matmul_forward_flops_per_s.setter
    def matmul_forward_flops_per_s(self, arg: Table, /) -> None: ...

    @property
    def matmul_backward_flops_per_s(self) -> Table: ...

    @matmul_backward_flops_per_s.setter
    def matmul_backward_flops_per_s(self, arg: Table, /) -> None: ...

    @property
    def exchange_group_sizes(self) -> list[int]: ...

    @exchange_group_sizes.setter
    def exchange_group_sizes(self, arg: _Sequence[int], /) -> None: ...

    @property
    def exchange_intra_node_s(self) -> list[Table]: ...

    @exchange_intra_node_s.setter
    def exchange_intra_node_s(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def exchange_overlap(self) -> float: ...

    @exchange_overlap.setter
    def exchange_overlap(self, arg: float, /) -> None: ...

    @property
    def ulysses_layout_s_per_byte(self) -> float: ...

    @ulysses_layout_s_per_byte.setter
    def ulysses_layout_s_per_byte(self, arg: float, /) -> None: ...

    @property
    def ring_layout_s_per_byte(self) -> float: ...

    @ring_layout_s_per_byte.setter
    def ring_layout_s_per_byte(self, arg: float, /) -> None: ...

    @property
    def memory_models(self) -> list[str]: ...

    @memory_models.setter
    def memory_models(self, arg: _Sequence[str], /) -> None: ...

    @property
    def activation_bytes_per_token_layer(self) -> list[float]: ...

    @activation_bytes_per_token_layer.setter
    def activation_bytes_per_token_layer(self, arg: _Sequence[float], /) -> None: ...

    @property
    def checkpoint_bytes_per_token_layer(self) -> list[float]: ...

    @checkpoint_bytes_per_token_layer.setter
    def checkpoint_bytes_per_token_layer(self, arg: _Sequence[float], /) -> None: ...

    @property
    def backward_bytes_per_token_layer(self) -> list[float]: ...

    @backward_bytes_per_token_layer.setter
    def backward_bytes_per_token_layer(self, arg: _Sequence[float], /) -> None: ...

    @property
    def text_bytes_per_token_layer(self) -> list[float]: ...

    @text_bytes_per_token_layer.setter
    def text_bytes_per_token_layer(self, arg: _Sequence[float], /) -> None: ...

    @property
    def step_fixed_bytes(self) -> list[float]: ...

    @step_fixed_bytes.setter
    def step_fixed_bytes(self, arg: _Sequence[float], /) -> None: ...

    @property
    def reduce_fixed_bytes(self) -> list[float]: ...

    @reduce_fixed_bytes.setter
    def reduce_fixed_bytes(self, arg: _Sequence[float], /) -> None: ...

    @property
    def reduce_bytes_per_token(self) -> list[float]: ...

    @reduce_bytes_per_token.setter
    def reduce_bytes_per_token(self, arg: _Sequence[float], /) -> None: ...

    @property
    def ulysses_bytes_per_token(self) -> list[float]: ...

    @ulysses_bytes_per_token.setter
    def ulysses_bytes_per_token(self, arg: _Sequence[float], /) -> None: ...

    @property
    def ring_bytes_per_token(self) -> list[float]: ...

    @ring_bytes_per_token.setter
    def ring_bytes_per_token(self, arg: _Sequence[float], /) -> None: ...

    @property
    def ulysses_exchanged_bytes_per_token(self) -> list[float]: ...

    @ulysses_exchanged_bytes_per_token.setter
    def ulysses_exchanged_bytes_per_token(self, arg: _Sequence[float], /) -> None: ...

    @property
    def attention_phase_bytes_per_token(self) -> list[float]: ...

    @attention_phase_bytes_per_token.setter
    def attention_phase_bytes_per_token(self, arg: _Sequence[float], /) -> None: ...

    @property
    def model_matmul_forward_flops_per_s(self) -> list[Table]: ...

    @model_matmul_forward_flops_per_s.setter
    def model_matmul_forward_flops_per_s(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def model_matmul_backward_flops_per_s(self) -> list[Table]: ...

    @model_matmul_backward_flops_per_s.setter
    def model_matmul_backward_flops_per_s(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def backward_peak_bytes(self) -> list[Table]: ...

    @backward_peak_bytes.setter
    def backward_peak_bytes(self, arg: _Sequence[Table], /) -> None: ...

    @property
    def runtime_reserved_bytes(self) -> int: ...

    @runtime_reserved_bytes.setter
    def runtime_reserved_bytes(self, arg: int, /) -> None: ...

    @property
    def device_memory_bytes(self) -> int: ...

    @device_memory_bytes.setter
    def device_memory_bytes(self, arg: int, /) -> None: ...

    @property
    def attention_streams(self) -> int: ...

    @attention_streams.setter
    def attention_streams(self, arg: int, /) -> None: ...

    @property
    def attention_stream_overlap(self) -> float: ...

    @attention_stream_overlap.setter
    def attention_stream_overlap(self, arg: float, /) -> None: ...

    @property
    def attention_ragged(self) -> bool: ...

    @attention_ragged.setter
    def attention_ragged(self, arg: bool, /) -> None: ...

    def validate(self) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

def analytic_profile(device_name: str, matmul_flops_per_s: float, attention_flops_per_s: float, memory_bytes_per_s: float) -> HardwareProfile:
    """A profile with no tables: times from the peak rates."""

class Strategy(enum.Enum):
    """How one sequence is spread over its ranks."""

    local = 0

    ulysses = 1

    ring = 2

    hybrid = 3

class Placement:
    """Strategy + ordered ranks of one sequence."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def sequence_id(self) -> int: ...

    @sequence_id.setter
    def sequence_id(self, arg: int, /) -> None: ...

    @property
    def strategy(self) -> Strategy: ...

    @strategy.setter
    def strategy(self, arg: Strategy, /) -> None: ...

    @property
    def ranks(self) -> list[int]: ...

    @ranks.setter
    def ranks(self, arg: _Sequence[int], /) -> None: ...

    @property
    def ulysses_degree(self) -> int: ...

    @ulysses_degree.setter
    def ulysses_degree(self, arg: int, /) -> None: ...

    @property
    def ring_degree(self) -> int: ...

    @ring_degree.setter
    def ring_degree(self, arg: int, /) -> None: ...

    def degree(self) -> int: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class PlanPrediction:
    """What the cost model predicts."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def makespan_s(self) -> float: ...

    @makespan_s.setter
    def makespan_s(self, arg: float, /) -> None: ...

    @property
    def rank_time_s(self) -> list[float]: ...

    @rank_time_s.setter
    def rank_time_s(self, arg: _Sequence[float], /) -> None: ...

    @property
    def rank_peak_bytes(self) -> list[float]: ...

    @rank_peak_bytes.setter
    def rank_peak_bytes(self, arg: _Sequence[float], /) -> None: ...

    @property
    def rank_checkpointed_layers(self) -> list[int]: ...

    @rank_checkpointed_layers.setter
    def rank_checkpointed_layers(self, arg: _Sequence[int], /) -> None: ...

    @property
    def rank_full_recompute_layers(self) -> list[int]: ...

    @rank_full_recompute_layers.setter
    def rank_full_recompute_layers(self, arg: _Sequence[int], /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class Plan:
    """A placement per sequence plus the prediction."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def planner(self) -> str: ...

    @planner.setter
    def planner(self, arg: str, /) -> None: ...

    @property
    def num_ranks(self) -> int: ...

    @num_ranks.setter
    def num_ranks(self, arg: int, /) -> None: ...

    @property
    def placements(self) -> list[Placement]: ...

    @placements.setter
    def placements(self, arg: _Sequence[Placement], /) -> None: ...

    @property
    def predicted(self) -> PlanPrediction: ...

    @predicted.setter
    def predicted(self, arg: PlanPrediction, /) -> None: ...

    @property
    def plan_ms(self) -> float: ...

    @plan_ms.setter
    def plan_ms(self, arg: float, /) -> None: ...

    @property
    def note(self) -> str: ...

    @note.setter
    def note(self, arg: str, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

def make_placement(sequence_id: int, strategy: Strategy, ranks: _Sequence[int], ulysses_degree: int = 0) -> Placement:
    """
    Sets the degrees from the strategy and rank count (ulysses_degree: hybrid only).
    """

def strategy_name(placement: Placement) -> str: ...

def parse_strategy(name: str) -> tuple[Strategy, int, int]:
    """
    (strategy, ulysses_degree, ring_degree); a degree only the rank count knows is 0.
    """

def balanced_split(total: int, parts: int) -> list[int]: ...

def validate_plan(plan: Plan, batch: Batch, num_ranks: int, num_heads: int) -> None:
    """Raises ValueError naming the offending sequence."""

class CostOptions:
    """Knobs of the cost model."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def activation_checkpointing(self) -> bool: ...

    @activation_checkpointing.setter
    def activation_checkpointing(self, arg: bool, /) -> None: ...

    @property
    def bytes_per_element(self) -> int: ...

    @bytes_per_element.setter
    def bytes_per_element(self, arg: int, /) -> None: ...

    @property
    def state_bytes_per_param(self) -> float: ...

    @state_bytes_per_param.setter
    def state_bytes_per_param(self, arg: float, /) -> None: ...

    @property
    def gradient_bytes_per_param(self) -> float: ...

    @gradient_bytes_per_param.setter
    def gradient_bytes_per_param(self, arg: float, /) -> None: ...

    @property
    def memory_headroom(self) -> float: ...

    @memory_headroom.setter
    def memory_headroom(self, arg: float, /) -> None: ...

    @property
    def adaptive_checkpointing(self) -> bool: ...

    @adaptive_checkpointing.setter
    def adaptive_checkpointing(self, arg: bool, /) -> None: ...

    @property
    def weights_kept_to_backward(self) -> bool: ...

    @weights_kept_to_backward.setter
    def weights_kept_to_backward(self, arg: bool, /) -> None: ...

    @property
    def optimizer_copy_bytes_per_param(self) -> float: ...

    @optimizer_copy_bytes_per_param.setter
    def optimizer_copy_bytes_per_param(self, arg: float, /) -> None: ...

    @property
    def accumulating_gradients(self) -> bool: ...

    @accumulating_gradients.setter
    def accumulating_gradients(self, arg: bool, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

    def __getstate__(self) -> tuple[bool, int, float, float, float, bool, bool, float, bool]: ...

    def __setstate__(self, arg: tuple[bool, int, float, float, float, bool, bool, float, bool], /) -> None: ...

class RankShare:
    """What one placement costs one of its ranks."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def rank(self) -> int: ...

    @rank.setter
    def rank(self, arg: int, /) -> None: ...

    @property
    def tokens(self) -> int: ...

    @tokens.setter
    def tokens(self, arg: int, /) -> None: ...

    @property
    def attention_s(self) -> float: ...

    @attention_s.setter
    def attention_s(self, arg: float, /) -> None: ...

    @property
    def exchange_s(self) -> float: ...

    @exchange_s.setter
    def exchange_s(self, arg: float, /) -> None: ...

    @property
    def memory_bytes(self) -> float: ...

    @memory_bytes.setter
    def memory_bytes(self, arg: float, /) -> None: ...

    @property
    def layer_activation_bytes(self) -> float: ...

    @layer_activation_bytes.setter
    def layer_activation_bytes(self, arg: float, /) -> None: ...

    @property
    def layer_checkpoint_bytes(self) -> float: ...

    @layer_checkpoint_bytes.setter
    def layer_checkpoint_bytes(self, arg: float, /) -> None: ...

    @property
    def buffer_bytes(self) -> float: ...

    @buffer_bytes.setter
    def buffer_bytes(self, arg: float, /) -> None: ...

    @property
    def layer_input_bytes(self) -> float: ...

    @layer_input_bytes.setter
    def layer_input_bytes(self, arg: float, /) -> None: ...

    @property
    def recompute_s(self) -> float: ...

    @recompute_s.setter
    def recompute_s(self, arg: float, /) -> None: ...

    @property
    def recompute_exchange_s(self) -> float: ...

    @recompute_exchange_s.setter
    def recompute_exchange_s(self, arg: float, /) -> None: ...

    @property
    def attention_recompute_s(self) -> float: ...

    @attention_recompute_s.setter
    def attention_recompute_s(self, arg: float, /) -> None: ...

    @property
    def attention_recompute_exchange_s(self) -> float: ...

    @attention_recompute_exchange_s.setter
    def attention_recompute_exchange_s(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class RankCost:
    """One rank's time and peak memory in a plan."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def time_s(self) -> float: ...

    @time_s.setter
    def time_s(self, arg: float, /) -> None: ...

    @property
    def peak_bytes(self) -> float: ...

    @peak_bytes.setter
    def peak_bytes(self, arg: float, /) -> None: ...

    @property
    def tokens(self) -> int: ...

    @tokens.setter
    def tokens(self, arg: int, /) -> None: ...

    @property
    def linear_s(self) -> float: ...

    @linear_s.setter
    def linear_s(self, arg: float, /) -> None: ...

    @property
    def attention_s(self) -> float: ...

    @attention_s.setter
    def attention_s(self, arg: float, /) -> None: ...

    @property
    def exchange_s(self) -> float: ...

    @exchange_s.setter
    def exchange_s(self, arg: float, /) -> None: ...

    @property
    def call_s(self) -> float: ...

    @call_s.setter
    def call_s(self, arg: float, /) -> None: ...

    @property
    def stream_s(self) -> float: ...

    @stream_s.setter
    def stream_s(self, arg: float, /) -> None: ...

    @property
    def launch_floor_s(self) -> float: ...

    @launch_floor_s.setter
    def launch_floor_s(self, arg: float, /) -> None: ...

    @property
    def attention_calls(self) -> int: ...

    @attention_calls.setter
    def attention_calls(self, arg: int, /) -> None: ...

    @property
    def checkpointed_layers(self) -> int: ...

    @checkpointed_layers.setter
    def checkpointed_layers(self, arg: int, /) -> None: ...

    @property
    def full_recompute_layers(self) -> int: ...

    @full_recompute_layers.setter
    def full_recompute_layers(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class PlanCost:
    """Every rank's cost, makespan, bytes and fit."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def ranks(self) -> list[RankCost]: ...

    @ranks.setter
    def ranks(self, arg: _Sequence[RankCost], /) -> None: ...

    @property
    def makespan_s(self) -> float: ...

    @makespan_s.setter
    def makespan_s(self, arg: float, /) -> None: ...

    @property
    def peak_bytes(self) -> float: ...

    @peak_bytes.setter
    def peak_bytes(self, arg: float, /) -> None: ...

    @property
    def exchange_bytes(self) -> float: ...

    @exchange_bytes.setter
    def exchange_bytes(self, arg: float, /) -> None: ...

    @property
    def fits(self) -> bool: ...

    @fits.setter
    def fits(self, arg: bool, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class CostModel:
    """Time and memory of any placement of a sequence, and of a whole plan."""

    def __init__(self, model: ModelSpec, profile: HardwareProfile, cluster: Cluster, options: CostOptions = ...) -> None: ...

    @property
    def model(self) -> ModelSpec: ...

    @property
    def profile(self) -> HardwareProfile: ...

    @property
    def cluster(self) -> Cluster: ...

    @property
    def options(self) -> CostOptions: ...

    def shares(self, sequence: Sequence, placement: Placement) -> list[RankShare]: ...

    def linear_time_s(self, tokens: int) -> float: ...

    def min_linear_time_per_token_s(self) -> float: ...

    def fixed_bytes(self) -> float: ...

    def gradient_bytes(self) -> float: ...

    def rank_peak_bytes(self, layer_activation_bytes: float, layer_checkpoint_bytes: float, buffer_bytes: float, checkpointed_layers: int, layer_input_bytes: float = 0.0, full_layers: int = 0, held_tokens: int = 0) -> float: ...

    def linear_recompute_s(self, tokens: int) -> float: ...

    def memory_capacity_bytes(self, rank: int | None = None) -> float:
        """
        Usable bytes of `rank`; without one, the bytes every rank has (the smallest rank's).
        """

    def homogeneous_view(self) -> CostModel:
        """
        This cost model with every rank alike (no speeds, the smallest rank memory): what the speed-blind baselines plan with.
        """

    def accumulating_view(self) -> CostModel:
        """
        This cost model pricing a micro-batch of a step of several (gradient accumulation: the gradients of the earlier micro-batches held through its backward).
        """

    def rank_time_s(self, tokens: int, attention_s: float, exchange_s: float) -> float: ...

    def evaluate(self, batch: Batch, plan: Plan) -> PlanCost: ...

    def exchange_bytes(self, sequence: Sequence, placement: Placement) -> float: ...

    def __repr__(self) -> str: ...

RAGGED_MIN_CALLS: int = 1

RAGGED_MAX_SEGMENT_TOKENS: int = 16384

def stream_assignment(works: _Sequence[int], streams: int) -> list[int]:
    """
    The stream of each attention call of one table (calls most work first): the one with the least work queued so far, the lowest index on ties. The engine and the cost model both use this.
    """

def streamed_calls_s(works: _Sequence[int], seconds: _Sequence[float], streams: int, overlap: float) -> float:
    """
    Seconds of one table's calls on `streams` streams as the cost model prices them.
    """

def makespan_lower_bound(batch: Batch, cost_model: CostModel) -> float:
    """A makespan no placement of the batch can beat under this cost model."""

class PlanMemoryError(ValueError):
    pass

class PlannerOptions:
    def __init__(self, *, seed: int = 0, time_limit_s: float = 10.0) -> None: ...

    @property
    def seed(self) -> int: ...

    @seed.setter
    def seed(self, arg: int, /) -> None: ...

    @property
    def time_limit_s(self) -> float: ...

    @time_limit_s.setter
    def time_limit_s(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

def make_plan(planner: str, batch: Batch, cost_model: CostModel, options: PlannerOptions = ...) -> Plan:
    """
    Place every sequence of `batch` with the named planner; the plan is validated and carries the cost model's prediction and plan_ms. Names: dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp, zellige.
    """

def planner_names() -> list[str]:
    """The planner name forms make_plan accepts."""

def covered_baselines(batch: Batch, cost_model: CostModel) -> list[str]:
    """
    The baselines zellige is never worse than on this batch and cluster (docs/planner.md).
    """

def predict(plan: Plan, batch: Batch, cost_model: CostModel) -> None:
    """Fill plan.predicted in place from the cost model."""

def check_sequences_fit(batch: Batch, cost_model: CostModel) -> None:
    """
    Raise PlanMemoryError for the first sequence that fits under no placement.
    """

def plan_dp_tokens(batch: Batch, cost_model: CostModel) -> Plan: ...

def plan_dp_cost(batch: Batch, cost_model: CostModel) -> Plan: ...

def plan_static_cp(batch: Batch, cost_model: CostModel, group_size: int) -> Plan: ...

def plan_knapformer(batch: Batch, cost_model: CostModel, spec: str, gamma: float = 0.4) -> Plan: ...

def plan_megatron_dcp(batch: Batch, cost_model: CostModel) -> Plan: ...

def plan_zellige(batch: Batch, cost_model: CostModel, options: PlannerOptions = ...) -> Plan: ...

def candidate_placements(sequence: Sequence, cost_model: CostModel, max_windows_per_shape: int, max_degree: int = 0) -> list[Placement]: ...

class TimelineSegment:
    """One Gantt bar: a rank, a sequence, a phase, [start, end)."""

    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def rank(self) -> int: ...

    @rank.setter
    def rank(self, arg: int, /) -> None: ...

    @property
    def sequence_id(self) -> int: ...

    @sequence_id.setter
    def sequence_id(self, arg: int, /) -> None: ...

    @property
    def phase(self) -> str: ...

    @phase.setter
    def phase(self, arg: str, /) -> None: ...

    @property
    def start_s(self) -> float: ...

    @start_s.setter
    def start_s(self, arg: float, /) -> None: ...

    @property
    def end_s(self) -> float: ...

    @end_s.setter
    def end_s(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

def simulate(batch: Batch, plan: Plan, cost_model: CostModel) -> list[TimelineSegment]:
    """Per-rank timeline of a plan; ends equal the cost model's rank times."""

class SegmentKind(enum.Enum):
    """What one attention segment of a rank is."""

    local = 0

    ulysses = 1

    ring = 2

    hybrid = 3

class SegmentGroup:
    """
    Segments of one shape, attended in one dense kernel call (see plan_compiler.h).
    """

    @property
    def q_len(self) -> int: ...

    @property
    def k_len(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def count(self) -> int: ...

    def __repr__(self) -> str: ...

    @property
    def q_row_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def k_row_offset(self) -> NDArray[numpy.int64]: ...

class TokenRoute:
    """
    One all_to_all of rows: send row i = source row send_index[i], send_splits[r] rows to rank r; destination row p = received row recv_index[p].
    """

    @property
    def num_source(self) -> int: ...

    @property
    def num_held(self) -> int: ...

    @property
    def send_index(self) -> NDArray[numpy.int64]: ...

    @property
    def send_splits(self) -> NDArray[numpy.int64]: ...

    @property
    def recv_splits(self) -> NDArray[numpy.int64]: ...

    @property
    def recv_index(self) -> NDArray[numpy.int64]: ...

class RingStep:
    """
    Ring step s >= 1: messages per peer (compact rows sent, receive-buffer slices) and the attention groups.
    """

    @property
    def num_recv_rows(self) -> int: ...

    @property
    def groups(self) -> list[SegmentGroup]: ...

    @property
    def sends(self) -> list: ...

    @property
    def recvs(self) -> list: ...

class StepProgram:
    """
    One rank's step program for the runtime (see plan_compiler.h and docs/formats.md). Integer arrays are numpy int64 copies; pickles through its binary form (to_bytes / from_bytes).
    """

    @property
    def rank(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def joint_attention(self) -> bool: ...

    @property
    def fingerprint(self) -> int: ...

    @property
    def num_held_tokens(self) -> int: ...

    @property
    def num_cross_text_rows(self) -> int: ...

    @property
    def world_has_exchange(self) -> bool: ...

    @property
    def num_exchange_rows(self) -> int: ...

    @property
    def ring_num_rows(self) -> int: ...

    @property
    def route(self) -> TokenRoute: ...

    @property
    def visual_route(self) -> TokenRoute: ...

    @property
    def text_route(self) -> TokenRoute: ...

    @property
    def cross_text_route(self) -> TokenRoute: ...

    @property
    def local_groups(self) -> list[SegmentGroup]: ...

    @property
    def exchange_groups(self) -> list[SegmentGroup]: ...

    @property
    def ring_step0_groups(self) -> list[SegmentGroup]: ...

    @property
    def ring_steps(self) -> list[RingStep]: ...

    @property
    def cross_groups(self) -> list[SegmentGroup]: ...

    @property
    def num_source_tokens(self) -> int: ...

    @property
    def num_segments(self) -> int: ...

    @property
    def token_position_thw(self) -> NDArray[numpy.int64]: ...

    def to_bytes(self) -> bytes:
        """The program's binary form (versioned)."""

    @staticmethod
    def from_bytes(data: bytes) -> StepProgram:
        """A program from to_bytes; ValueError for bytes that are not one."""

    def __getstate__(self) -> bytes: ...

    def __setstate__(self, arg: bytes, /) -> None: ...

    def __eq__(self, arg: StepProgram, /) -> bool: ...

    @property
    def chunk_sequence_index(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_token_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_num_tokens(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_num_text_tokens(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_cross_text_tokens(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_held_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def chunk_cross_text_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def token_sequence_index(self) -> NDArray[numpy.int64]: ...

    @property
    def token_chunk_index(self) -> NDArray[numpy.int64]: ...

    @property
    def token_modality(self) -> NDArray[numpy.int64]: ...

    @property
    def held_visual_index(self) -> NDArray[numpy.int64]: ...

    @property
    def held_text_index(self) -> NDArray[numpy.int64]: ...

    @property
    def exchange_send_index(self) -> NDArray[numpy.int64]: ...

    @property
    def exchange_send_splits(self) -> NDArray[numpy.int64]: ...

    @property
    def exchange_recv_splits(self) -> NDArray[numpy.int64]: ...

    @property
    def exchange_recv_index(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_sequence_index(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_kind(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_in_exchange(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_row_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_num_tokens(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_num_heads(self) -> NDArray[numpy.int64]: ...

    @property
    def segment_head_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_segment(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_degree(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_position(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_peer_offset(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_peers(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_block_tokens(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_own_rows(self) -> NDArray[numpy.int64]: ...

    @property
    def ring_exchange_rows(self) -> NDArray[numpy.int64]: ...

    def __repr__(self) -> str: ...

def compile_step_program(batch: Batch, plan: Plan, rank: int, num_heads: int, joint_attention: bool = False) -> StepProgram:
    """
    One rank's step program for the runtime; raises ValueError when the plan does not match the batch or the head count, or the rank would hold more than 2^31 rows.
    """

def group_segments(q_row_offset: _Sequence[int], k_row_offset: _Sequence[int], q_len: _Sequence[int], k_len: _Sequence[int], num_heads: _Sequence[int]) -> list[SegmentGroup]:
    """
    Segments grouped by shape (q_len, k_len, num_heads) into dense calls, largest first; empty segments dropped. The one grouping engine of every attention.
    """

class GlobalBatchOptions:
    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def seed(self) -> int: ...

    @seed.setter
    def seed(self, arg: int, /) -> None: ...

    @property
    def time_limit_s(self) -> float: ...

    @time_limit_s.setter
    def time_limit_s(self, arg: float, /) -> None: ...

    @property
    def micro_batch_overhead_s(self) -> float: ...

    @micro_batch_overhead_s.setter
    def micro_batch_overhead_s(self, arg: float, /) -> None: ...

    @property
    def extra_micro_batches(self) -> int: ...

    @extra_micro_batches.setter
    def extra_micro_batches(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class MicroBatch:
    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def batch(self) -> Batch: ...

    @batch.setter
    def batch(self, arg: Batch, /) -> None: ...

    @property
    def plan(self) -> Plan: ...

    @plan.setter
    def plan(self, arg: Plan, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

class GlobalPlan:
    def __init__(self, **kwargs) -> None:
        """
        Keyword constructor: every field is optional and named as the attribute.
        """

    @property
    def planner(self) -> str: ...

    @planner.setter
    def planner(self, arg: str, /) -> None: ...

    @property
    def chosen(self) -> str: ...

    @chosen.setter
    def chosen(self, arg: str, /) -> None: ...

    @property
    def micro_batches(self) -> list[MicroBatch]: ...

    @micro_batches.setter
    def micro_batches(self, arg: _Sequence[MicroBatch], /) -> None: ...

    @property
    def step_time_s(self) -> float: ...

    @step_time_s.setter
    def step_time_s(self, arg: float, /) -> None: ...

    @property
    def plan_ms(self) -> float: ...

    @plan_ms.setter
    def plan_ms(self, arg: float, /) -> None: ...

    def __repr__(self) -> str: ...

    def __eq__(self, arg: object, /) -> object: ...

    __hash__: None = None

def plan_global_batch(planner: str, batch: Batch, cost_model: CostModel, options: GlobalBatchOptions = ...) -> GlobalPlan:
    """
    Cut one optimizer step's batch into micro-batches and place each; names: zellige, megatron-dcp, knapformer, static-cp, wlb-llm (docs/global-batch.md).
    """

def global_batch_planner_names() -> list[str]: ...

def global_batch_baseline_names() -> list[str]: ...

def place_micro_batches(planner: str, batch: Batch, micro_batch_ids: _Sequence[_Sequence[int]], cost_model: CostModel, options: GlobalBatchOptions = ...) -> GlobalPlan:
    """
    Place the given micro-batches (lists of sequence ids) with a make_plan planner.
    """
