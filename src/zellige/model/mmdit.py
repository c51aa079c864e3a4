"""The MMDiT reference model (FLUX / Open-Sora 2.0 / HunyuanVideo style): text joins attention.

Each sequence's text tokens and visual tokens attend jointly (no cross-attention). The first
num_double_layers blocks are double-stream: text and visual tokens keep separate weights (AdaLN
modulation, QKV, QK norm, output projection, FFN) and meet only in the joint attention. The rest
are single-stream: one set of weights over the joint token list, attention and MLP in parallel
from one input projection. Every block is modulated per sequence (AdaLN) from the flow time.

The model works on one rank's held tokens: a flat buffer mixing text and visual tokens of whole or
partial sequences in any order, each with a modality tag and a sequence index. Parallelism enters
only through the attention callable (joint attention over the held tokens, text included; see
attention.py); without one, every local sequence attends whole.

Positions: visual tokens get 3D RoPE from their (t, h, w); text tokens are not rotated (FLUX and
Open-Sora 2.0 give text the all-zero position, which is the identity rotation; HunyuanVideo skips
RoPE on text), so the runtime's (k, 0, 0) text positions are ignored. QK norm is the Wan-style
RMSNorm over the whole width (fused.rms_norm_*), shared with blocks.py. No pooled text vector: a
rank may hold a chunk of a sequence without its text, so conditioning is the flow time alone.
Legend in config.py (X here: held text tokens, V: held visual tokens, T = X + V).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from zellige.model import fused
from zellige.model.attention import AttentionFn, local_attention
from zellige.model.blocks import FeedForward, FloatRMSNorm
from zellige.model.conditioning import (
    DEFAULT_NUMERICS,
    TIMESTEP_SCALE,
    TextEmbedding,
    per_token_pieces,
    sinusoidal_embedding,
)
from zellige.model.config import DiTConfig, ModelNumerics
from zellige.runtime.coalesced import to_device

VISUAL, TEXT = 0, 1  # modality tags, as the runtime's step.modality


@dataclass(kw_only=True, slots=True)
class JointTokens:
    """One rank's held tokens of a joint-attention step, in held order (the runtime's).

    The per-token tables cover all T held tokens; the features come per modality (their widths
    differ), each in held order among the tokens of that modality."""

    latents_VC: Tensor  # noisy latents x_t of the held visual tokens
    text_XE: Tensor  # text-encoder features of the held text tokens
    modality_T: Tensor  # int64, VISUAL or TEXT
    sequence_index_T: Tensor  # int64 in [0, S): row of timesteps_S
    positions_T3: Tensor  # int64 (t, h, w) in the sequence's latent grid (text rows ignored)
    timesteps_S: Tensor  # flow time t in [0, 1] of each sequence held here
    # where each modality sits, when the caller built it from host tables (no host sync);
    # None: the model derives it from modality_T (which reads the text count back)
    streams: StreamOrder | None = None

    def __post_init__(self) -> None:
        num_tokens = self.modality_T.shape[0]
        if self.latents_VC.shape[0] + self.text_XE.shape[0] != num_tokens:
            raise ValueError(
                f"{self.latents_VC.shape[0]} visual + {self.text_XE.shape[0]} text feature rows "
                f"for {num_tokens} held tokens"
            )
        if self.sequence_index_T.shape[0] != num_tokens or self.positions_T3.shape[0] != num_tokens:
            raise ValueError("sequence_index_T and positions_T3 need one row per held token")


@dataclass(slots=True)
class StreamOrder:
    """Where each modality sits among the held tokens. Activations pass between blocks in held
    order (the runtime's, which attention needs); a double-stream block splits them into its
    streams (text rows, then visual rows, each in held order) and merges them back.

    `order` lists the held positions of the text tokens, then of the visual ones (so
    x_held[order] is cat(x_text, x_visual)); per-stream tables are in that order."""

    num_text: int
    order: Tensor
    sequence_index_X: Tensor
    sequence_index_V: Tensor

    @staticmethod
    def of(modality_T: Tensor, sequence_index_T: Tensor) -> StreamOrder:
        # stable sort on "is visual": text positions first, each modality keeping held order
        order = torch.argsort(modality_T != TEXT, stable=True)
        num_text = int((modality_T == TEXT).sum())
        sorted_index = sequence_index_T[order]
        return StreamOrder(
            num_text=num_text,
            order=order,
            sequence_index_X=sorted_index[:num_text],
            sequence_index_V=sorted_index[num_text:],
        )

    @staticmethod
    def from_host(
        text_positions: np.ndarray,
        visual_positions: np.ndarray,
        sequence_index_T: np.ndarray,
        device: torch.device,
    ) -> StreamOrder:
        """The same order from host (numpy) tables, each modality's held positions in ascending
        order: built on the host and copied to the device (pinned, non-blocking), so nothing is
        read back. Equal to of() for the same tokens."""
        order = np.concatenate((text_positions, visual_positions)).astype(np.int64)
        sorted_index = np.asarray(sequence_index_T, dtype=np.int64)[order]
        num_text = len(text_positions)

        def move(array: np.ndarray) -> Tensor:
            return to_device(torch.from_numpy(np.ascontiguousarray(array)), device)

        return StreamOrder(
            num_text=num_text,
            order=move(order),
            sequence_index_X=move(sorted_index[:num_text]),
            sequence_index_V=move(sorted_index[num_text:]),
        )

    @property
    def text_positions(self) -> Tensor:
        return self.order[: self.num_text]

    @property
    def visual_positions(self) -> Tensor:
        return self.order[self.num_text :]

    def split(self, x_T: Tensor) -> tuple[Tensor, Tensor]:
        """Held rows -> (text rows, visual rows): one gather."""
        both = x_T[self.order]
        return both[: self.num_text], both[self.num_text :]

    def merge(self, text_X: Tensor, visual_V: Tensor) -> Tensor:
        """(text rows, visual rows) -> held rows: one write of each part."""
        held = text_X.new_empty((text_X.shape[0] + visual_V.shape[0], *text_X.shape[1:]))
        held.index_copy_(0, self.text_positions, text_X)  # in place: no copy of `held` first
        return held.index_copy_(0, self.visual_positions, visual_V)


def rope_without_text(
    positions_T3: Tensor, modality_T: Tensor, config: DiTConfig, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """RoPE tables of the held tokens, in float32 at least (bf16 angles would blur neighbouring
    positions); text rows get position (0, 0, 0): the identity rotation."""
    positions_T3 = positions_T3 * (modality_T != TEXT)[:, None]
    rope_dtype = torch.promote_types(dtype, torch.float32)
    return fused.kernels["rope_tables"](
        positions_T3, config.head_dim, config.rope_theta, rope_dtype
    )


def whole_sequence_attention(sequence_index_T: Tensor) -> AttentionFn:
    """Joint attention of each sequence's held tokens among themselves (single process: every
    sequence held whole). Attention is order-free, so tokens are grouped by sequence in any
    order and put back."""
    order = torch.argsort(sequence_index_T, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    lengths = torch.bincount(sequence_index_T).tolist() if order.numel() else []
    segments = local_attention(lengths, lengths, sequence_index_T.device)

    def attend(q_TNH: Tensor, k_TNH: Tensor, v_TNH: Tensor) -> Tensor:
        return segments(q_TNH[order], k_TNH[order], v_TNH[order])[inverse]

    return attend


class TimeVector(nn.Module):
    """Flow time -> the conditioning vector vec_SD that every block's AdaLN reads."""

    def __init__(self, freq_dim: int, width: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.embed = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, timesteps_S: Tensor) -> Tensor:
        # t * 1000 in float64 (float32 would round), as conditioning.TimestepEmbedding
        timesteps_S = timesteps_S.to(torch.float64) * TIMESTEP_SCALE
        frequencies_SF = sinusoidal_embedding(timesteps_S, self.freq_dim)
        return self.embed(frequencies_SF.to(self.embed[0].weight.dtype))


class Modulation(nn.Module):
    """AdaLN: silu(vec) -> K vectors of width D per sequence, expanded to tokens last."""

    def __init__(self, width: int, count: int, numerics: ModelNumerics = DEFAULT_NUMERICS) -> None:
        super().__init__()
        self.count, self.numerics = count, numerics
        self.linear = nn.Linear(width, count * width)

    def forward(self, vec_SD: Tensor, sequence_index_T: Tensor) -> tuple[Tensor, ...]:
        rows_SKD = self.linear(nn.functional.silu(vec_SD)).unflatten(1, (self.count, -1))
        return per_token_pieces(rows_SKD, sequence_index_T, self.numerics)


class StreamAttentionIn(nn.Module):
    """One stream's fused QKV projection and QK norm weights (fused.joint_stream_in applies
    them, with RoPE where the stream is rotated)."""

    def __init__(self, width: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.norm_q = FloatRMSNorm(width, eps=eps)
        self.norm_k = FloatRMSNorm(width, eps=eps)


class Stream(nn.Module):
    """The weights one modality owns in a double-stream block."""

    def __init__(
        self, width: int, num_heads: int, ffn_width: int, eps: float, numerics: ModelNumerics
    ) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = Modulation(width, 6, numerics)  # shift, scale, gate: attention, FFN
        self.attention_in = StreamAttentionIn(width, num_heads, eps)
        self.attention_out = nn.Linear(width, width)
        self.ffn = FeedForward(width, ffn_width)


class DoubleStreamBlock(nn.Module):
    """Separate text and visual weights; one joint attention over the held tokens."""

    def __init__(
        self,
        width: int,
        num_heads: int,
        ffn_width: int,
        eps: float,
        numerics: ModelNumerics = DEFAULT_NUMERICS,
    ) -> None:
        super().__init__()
        self.text = Stream(width, num_heads, ffn_width, eps, numerics)
        self.visual = Stream(width, num_heads, ffn_width, eps, numerics)

    def forward(
        self,
        x_TD: Tensor,
        vec_SD: Tensor,
        streams: StreamOrder,
        rope_V: tuple[Tensor, Tensor],
        attention: AttentionFn,
    ) -> Tensor:
        """x_TD and `attention` in held order; rope_V: the visual stream's RoPE tables (text is
        not rotated, see the module docstring). The per-token layers run as fused.kernels'
        regions (per stream: joint_stream_in before the attention, joint_stream_out_ffn after)."""
        kernels = fused.kernels
        x_XD, x_VD = streams.split(x_TD)
        parts = (  # (stream, x, modulation, rope) of text, then visual
            (self.text, x_XD, self.text.modulation(vec_SD, streams.sequence_index_X), ()),
            (self.visual, x_VD, self.visual.modulation(vec_SD, streams.sequence_index_V), rope_V),
        )
        qkv = []
        for stream, x, mod, rope in parts:
            attention_in = stream.attention_in
            qkv.append(
                kernels["joint_stream_in" if rope else "joint_text_stream_in"](
                    x,
                    mod[0],
                    mod[1],
                    stream.eps,
                    (
                        attention_in.qkv.weight,
                        attention_in.qkv.bias,
                        attention_in.norm_q.weight,
                        attention_in.norm_k.weight,
                    ),
                    attention_in.norm_q.eps,
                    attention_in.num_heads,
                    *rope,
                )
            )
        q, k, v = (streams.merge(text, visual) for text, visual in zip(*qkv, strict=True))
        o_pair = streams.split(attention(q, k, v).flatten(1))
        out = []
        for (stream, x, mod, _), o in zip(parts, o_pair, strict=True):
            _, _, gate_a, shift_f, scale_f, gate_f = mod
            ffn = stream.ffn
            out.append(
                kernels["joint_stream_out_ffn"](
                    x,
                    o,
                    gate_a,
                    shift_f,
                    scale_f,
                    gate_f,
                    stream.eps,
                    (
                        stream.attention_out.weight,
                        stream.attention_out.bias,
                        ffn.up.weight,
                        ffn.up.bias,
                        ffn.down.weight,
                        ffn.down.bias,
                    ),
                )
            )
        return streams.merge(*out)


class SingleStreamBlock(nn.Module):
    """Shared weights over the joint token list: one projection feeds attention (QKV) and the
    MLP (tanh-GELU) in parallel, one projection maps both back, one gated residual."""

    def __init__(
        self,
        width: int,
        num_heads: int,
        ffn_width: int,
        eps: float,
        numerics: ModelNumerics = DEFAULT_NUMERICS,
    ) -> None:
        super().__init__()
        self.num_heads, self.width, self.eps = num_heads, width, eps
        self.modulation = Modulation(width, 3, numerics)  # shift, scale, gate
        self.linear_in = nn.Linear(width, 3 * width + ffn_width)
        self.norm_q = FloatRMSNorm(width, eps=eps)
        self.norm_k = FloatRMSNorm(width, eps=eps)
        self.linear_out = nn.Linear(width + ffn_width, width)

    def forward(
        self,
        x_TD: Tensor,
        vec_SD: Tensor,
        sequence_index_T: Tensor,
        rope_T: tuple[Tensor, Tensor],
        attention: AttentionFn,
    ) -> Tensor:
        """Every argument in held order. The per-token layers run as fused.kernels' regions
        (single_stream_in before the attention, single_stream_out after)."""
        kernels = fused.kernels
        shift, scale, gate = self.modulation(vec_SD, sequence_index_T)
        q, k, v, mlp = kernels["single_stream_in"](
            x_TD,
            shift,
            scale,
            self.eps,
            (self.linear_in.weight, self.linear_in.bias, self.norm_q.weight, self.norm_k.weight),
            self.norm_q.eps,
            self.num_heads,
            *rope_T,
        )
        return kernels["single_stream_out"](
            x_TD, attention(q, k, v), mlp, gate, (self.linear_out.weight, self.linear_out.bias)
        )


class FinalLayer(nn.Module):
    """AdaLN-modulated norm and the linear map to the velocity, visual tokens only."""

    def __init__(
        self, width: int, out_channels: int, eps: float, numerics: ModelNumerics = DEFAULT_NUMERICS
    ) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = Modulation(width, 2, numerics)
        self.linear = nn.Linear(width, out_channels)

    def forward(self, x_VD: Tensor, vec_SD: Tensor, sequence_index_V: Tensor) -> Tensor:
        shift, scale = self.modulation(vec_SD, sequence_index_V)
        return self.linear(fused.kernels["modulated_layer_norm"](x_VD, shift, scale, self.eps))


class MMDiT(nn.Module):
    """Predicts the rectified-flow velocity of every held visual token (text tokens have none).

    `blocks` holds the double-stream blocks then the single-stream ones, so parallelize() wraps
    both kinds as it wraps VideoDiT's blocks. Activations pass between blocks in held order."""

    def __init__(self, config: DiTConfig, numerics: ModelNumerics = DEFAULT_NUMERICS) -> None:
        super().__init__()
        if not config.joint_attention:
            raise ValueError(f"MMDiT needs a joint-attention config; {config.name} is not one")
        self.config, self.numerics = config, numerics
        width, heads, ffn, eps = config.width, config.num_heads, config.ffn_width, config.eps
        self.patch_embedding = nn.Linear(config.token_channels, width)
        self.text_embedding = TextEmbedding(config.text_dim, width)
        self.time_embedding = TimeVector(config.freq_dim, width)
        self.blocks = nn.ModuleList(
            [
                DoubleStreamBlock(width, heads, ffn, eps, numerics)
                for _ in range(config.num_double_layers)
            ]
            + [
                SingleStreamBlock(width, heads, ffn, eps, numerics)
                for _ in range(config.num_single_layers)
            ]
        )
        self.head = FinalLayer(width, config.token_channels, eps, numerics)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As VideoDiT: Xavier-uniform linears with zero bias, unit norm weights, N(0, 0.02) for
        the text and time embeddings, and a zero output layer (training starts from v = 0). The
        AdaLN linears keep Xavier (not adaLN-zero), so every weight gets a gradient at step 0.
        Works on sharded (DTensor) parameters too."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for embedding in (self.text_embedding, self.time_embedding):
            for module in embedding.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(self.head.linear.weight)

    def forward(self, tokens: JointTokens, attention: AttentionFn | None = None) -> Tensor:
        """Velocity [V, C] of the held visual tokens, in their held order."""
        streams = tokens.streams
        if streams is None:
            streams = StreamOrder.of(tokens.modality_T, tokens.sequence_index_T)
        if streams.num_text != tokens.text_XE.shape[0]:
            raise ValueError(
                f"{streams.num_text} held tokens are tagged text but {tokens.text_XE.shape[0]} "
                "text feature rows were given"
            )
        if attention is None:
            attention = whole_sequence_attention(tokens.sequence_index_T)
        dtype = self.patch_embedding.weight.dtype
        rope_T = rope_without_text(tokens.positions_T3, tokens.modality_T, self.config, dtype)
        rope_V = tuple(table[streams.visual_positions] for table in rope_T)
        x_TD = streams.merge(
            self.text_embedding(tokens.text_XE.to(dtype)),
            self.patch_embedding(tokens.latents_VC.to(dtype)),
        )
        vec_SD = self.time_embedding(tokens.timesteps_S)
        for block in self.blocks:
            if _is_double(block):
                x_TD = block(x_TD, vec_SD, streams, rope_V, attention)
            else:
                x_TD = block(x_TD, vec_SD, tokens.sequence_index_T, rope_T, attention)
        # Text tokens have no velocity. The gather keeps the text rows in the graph (zero
        # gradient), so with only double blocks the last one's text weights still get a
        # gradient on every rank, as FSDP needs.
        x_VD = x_TD[streams.visual_positions]
        return self.head(x_VD, vec_SD, streams.sequence_index_V)


def _is_double(block: nn.Module) -> bool:
    """A block of `blocks`, possibly wrapped by parallelize()'s runner (which has `.block`)."""
    return isinstance(getattr(block, "block", block), DoubleStreamBlock)
