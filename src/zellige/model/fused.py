"""The per-token layers of a block as plain functions over tensors (weights passed in), so that
torch.compile can fuse everything between two GEMMs, forward and backward: modulated norms, gated
residuals, QK norm with RoPE, bias adds, GELU.

Two levels: the elementwise pieces (modulated_layer_norm, gated_residual, rms_norm_heads,
rms_norm_rope), and the block's regions between attention calls (self_attention_in,
self_attention_out_cross_in, cross_attention_kv, cross_attention_out_ffn), which the blocks call;
the MMDiT's (mmdit.py) likewise: joint_stream_in (joint_text_stream_in for the unrotated text)
and joint_stream_out_ffn per stream of a double-stream block, single_stream_in and
single_stream_out around a single-stream block's attention.
Eager, each piece is a chain of memory-bound passes over [T, D] (several in float32); compiled
(use_compiled(True); CompiledRegion: once per dtype, never per step), a region is its GEMMs
plus a few fused kernels, and the partitioner keeps fewer, bf16 activations for the backward.
Both compute the same thing in float32 (float64 for float64 activations) and return the
activation dtype. Legend in config.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.experimental._config
import torch.nn.functional as F
from torch import Tensor

from zellige.model.conditioning import gathered_pieces
from zellige.model.rope import rope_tables


def modulated_layer_norm(x_TD: Tensor, shift_TD: Tensor, scale_TD: Tensor, eps: float) -> Tensor:
    """LayerNorm(x) * (1 + scale) + shift."""
    wide = _wide(x_TD)
    y_TD = F.layer_norm(x_TD.to(wide), x_TD.shape[-1:], eps=eps)
    return (y_TD * (1 + scale_TD.to(wide)) + shift_TD.to(wide)).to(x_TD.dtype)


def gated_residual(x_TD: Tensor, y_TD: Tensor, gate_TD: Tensor) -> Tensor:
    """x + gate * y."""
    return x_TD + gate_TD * y_TD


def rms_norm_heads(x_TD: Tensor, weight_D: Tensor, eps: float, num_heads: int) -> Tensor:
    """RMSNorm over the whole width (QK norm), then split into heads: [T, N, H]."""
    wide = _wide(x_TD)
    y_TD = F.rms_norm(x_TD.to(wide), x_TD.shape[-1:], weight_D.to(wide), eps)
    return y_TD.to(x_TD.dtype).unflatten(1, (num_heads, -1))


def rms_norm_rope(
    x_TD: Tensor, weight_D: Tensor, eps: float, num_heads: int, cos_T1P: Tensor, sin_T1P: Tensor
) -> Tensor:
    """QK norm then 3D RoPE on interleaved pairs, in float32: [T, N, H]."""
    wide = _wide(x_TD)
    y_TD = F.rms_norm(x_TD.to(wide), x_TD.shape[-1:], weight_D.to(wide), eps)
    pairs = y_TD.unflatten(1, (num_heads, -1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_T1P.to(wide), sin_T1P.to(wide)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).to(x_TD.dtype)


def self_attention_in(
    x_TD: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    qk_eps: float,
    num_heads: int,
    cos_T1P: Tensor,
    sin_T1P: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Modulated LayerNorm, then q, k (QK norm + RoPE) and v [T, N, H]. weights: q, k, v weight
    and bias, q and k norm weights."""
    q_w, q_b, k_w, k_b, v_w, v_b, norm_q_w, norm_k_w = weights
    h_TD = modulated_layer_norm(x_TD, shift_TD, scale_TD, eps)
    q_TNH = rms_norm_rope(F.linear(h_TD, q_w, q_b), norm_q_w, qk_eps, num_heads, cos_T1P, sin_T1P)
    k_TNH = rms_norm_rope(F.linear(h_TD, k_w, k_b), norm_k_w, qk_eps, num_heads, cos_T1P, sin_T1P)
    v_TNH = F.linear(h_TD, v_w, v_b).unflatten(1, (num_heads, -1))
    return q_TNH, k_TNH, v_TNH


def self_attention_out_cross_in(
    x_TD: Tensor,
    attended_TNH: Tensor,
    gate_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    qk_eps: float,
    num_heads: int,
) -> tuple[Tensor, Tensor]:
    """Output projection and gated residual of self-attention, then the cross-attention's
    LayerNorm (affine) and its query [T, N, H] (QK norm). Returns (x, q). weights: self o
    weight and bias, cross norm weight and bias, cross q weight and bias, its q norm weight."""
    o_w, o_b, norm_w, norm_b, q_w, q_b, norm_q_w = weights
    x_TD = gated_residual(x_TD, F.linear(attended_TNH.flatten(1), o_w, o_b), gate_TD)
    wide = _wide(x_TD)
    h_TD = F.layer_norm(x_TD.to(wide), x_TD.shape[-1:], norm_w.to(wide), norm_b.to(wide), eps)
    q_TNH = rms_norm_heads(F.linear(h_TD.to(x_TD.dtype), q_w, q_b), norm_q_w, qk_eps, num_heads)
    return x_TD, q_TNH


def cross_attention_kv(
    text_XD: Tensor, weights: tuple[Tensor, ...], qk_eps: float, num_heads: int
) -> tuple[Tensor, Tensor]:
    """The text's keys (QK norm) and values [X, N, H]. weights: k and v weight and bias, k norm
    weight."""
    k_w, k_b, v_w, v_b, norm_k_w = weights
    k_XNH = rms_norm_heads(F.linear(text_XD, k_w, k_b), norm_k_w, qk_eps, num_heads)
    v_XNH = F.linear(text_XD, v_w, v_b).unflatten(1, (num_heads, -1))
    return k_XNH, v_XNH


def cross_attention_out_ffn(
    x_TD: Tensor,
    attended_TNH: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    gate_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
) -> Tensor:
    """Cross-attention's output projection and residual, then the modulated LayerNorm, the
    tanh-GELU FFN and its gated residual. weights: cross o weight and bias, FFN up and down
    weight and bias."""
    o_w, o_b, *ffn_weights = weights
    x_TD = x_TD + F.linear(attended_TNH.flatten(1), o_w, o_b)
    return _modulated_ffn(x_TD, shift_TD, scale_TD, gate_TD, eps, ffn_weights)


def _modulated_ffn(
    x_TD: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    gate_TD: Tensor,
    eps: float,
    ffn_weights: list[Tensor],
) -> Tensor:
    """The FFN half of a block: modulated LayerNorm, tanh-GELU FFN, gated residual (traced into
    the regions that end with it). ffn_weights: up weight and bias, down weight and bias."""
    up_w, up_b, down_w, down_b = ffn_weights
    h_TD = modulated_layer_norm(x_TD, shift_TD, scale_TD, eps)
    hidden_TF = F.gelu(F.linear(h_TD, up_w, up_b), approximate="tanh")
    return gated_residual(x_TD, F.linear(hidden_TF, down_w, down_b), gate_TD)


def joint_stream_in(
    x_TD: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    qk_eps: float,
    num_heads: int,
    cos_T1P: Tensor | None = None,
    sin_T1P: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One stream of an MMDiT double-stream block before the joint attention: modulated
    LayerNorm, the fused QKV projection, QK norm, RoPE on q and k when cos/sin are given (the
    text stream is not rotated). Returns q, k, v [T, N, H]. weights: qkv weight and bias, q and
    k norm weights."""
    qkv_w, qkv_b, norm_q_w, norm_k_w = weights
    h_TD = modulated_layer_norm(x_TD, shift_TD, scale_TD, eps)
    qkv_T3D = F.linear(h_TD, qkv_w, qkv_b)
    return qkv_heads(qkv_T3D, norm_q_w, norm_k_w, qk_eps, num_heads, cos_T1P, sin_T1P)


def joint_text_stream_in(
    x_TD: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    qk_eps: float,
    num_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """joint_stream_in for the text stream (no RoPE): a function of its own, so that compiled it
    is a graph of its own, not a second variant of the visual stream's."""
    return joint_stream_in(x_TD, shift_TD, scale_TD, eps, weights, qk_eps, num_heads)


def qkv_heads(
    qkv_T3D: Tensor,
    norm_q_w: Tensor,
    norm_k_w: Tensor,
    qk_eps: float,
    num_heads: int,
    cos_T1P: Tensor | None,
    sin_T1P: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A fused [T, 3D] projection -> q, k, v [T, N, H]: QK norm, then RoPE on q and k when
    cos/sin are given."""
    q_TD, k_TD, v_TD = qkv_T3D.chunk(3, dim=1)
    if cos_T1P is None:
        q_TNH = rms_norm_heads(q_TD, norm_q_w, qk_eps, num_heads)
        k_TNH = rms_norm_heads(k_TD, norm_k_w, qk_eps, num_heads)
    else:
        q_TNH = rms_norm_rope(q_TD, norm_q_w, qk_eps, num_heads, cos_T1P, sin_T1P)
        k_TNH = rms_norm_rope(k_TD, norm_k_w, qk_eps, num_heads, cos_T1P, sin_T1P)
    return q_TNH, k_TNH, v_TD.unflatten(1, (num_heads, -1))


def joint_stream_out_ffn(
    x_TD: Tensor,
    attended_TD: Tensor,
    gate_a_TD: Tensor,
    shift_f_TD: Tensor,
    scale_f_TD: Tensor,
    gate_f_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
) -> Tensor:
    """One stream of an MMDiT double-stream block after the joint attention: output projection
    and gated residual, modulated LayerNorm, tanh-GELU FFN and its gated residual. weights:
    o weight and bias, FFN up and down weight and bias."""
    o_w, o_b, *ffn_weights = weights
    x_TD = gated_residual(x_TD, F.linear(attended_TD, o_w, o_b), gate_a_TD)
    return _modulated_ffn(x_TD, shift_f_TD, scale_f_TD, gate_f_TD, eps, ffn_weights)


def single_stream_in(
    x_TD: Tensor,
    shift_TD: Tensor,
    scale_TD: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    qk_eps: float,
    num_heads: int,
    cos_T1P: Tensor,
    sin_T1P: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An MMDiT single-stream block before the joint attention: modulated LayerNorm, the one
    input projection, split into QKV (QK norm, RoPE) and the MLP's pre-activation [T, F].
    Returns q, k, v [T, N, H] and the pre-activation. weights: input weight and bias, q and k
    norm weights."""
    in_w, in_b, norm_q_w, norm_k_w = weights
    h_TE = F.linear(modulated_layer_norm(x_TD, shift_TD, scale_TD, eps), in_w, in_b)
    width = x_TD.shape[1]
    qkv_T3D, mlp_TF = h_TE.split((3 * width, h_TE.shape[1] - 3 * width), dim=1)
    qkv = qkv_heads(qkv_T3D, norm_q_w, norm_k_w, qk_eps, num_heads, cos_T1P, sin_T1P)
    return (*qkv, mlp_TF)


def single_stream_out(
    x_TD: Tensor,
    attended_TNH: Tensor,
    mlp_TF: Tensor,
    gate_TD: Tensor,
    weights: tuple[Tensor, ...],
) -> Tensor:
    """An MMDiT single-stream block after the joint attention: the attention output and the
    tanh-GELU of the MLP pre-activation through one output projection, one gated residual.
    weights: output weight and bias."""
    out_w, out_b = weights
    joined_TE = torch.cat((attended_TNH.flatten(1), F.gelu(mlp_TF, approximate="tanh")), dim=1)
    return gated_residual(x_TD, F.linear(joined_TE, out_w, out_b), gate_TD)


def output_head(
    x_TD: Tensor, modulation_T2D: Tensor, eps: float, weights: tuple[Tensor, ...]
) -> Tensor:
    """The Wan output head after its modulation lookup (each token's shift and scale, [T, 2, D]:
    taken apart here, so that compiled, the backward writes their gradients as one tensor and
    no stack copies them together): modulated LayerNorm, then the linear map to the token
    channels [T, C]. weights: linear weight and bias."""
    weight, bias = weights
    shift_TD, scale_TD = modulation_T2D.unbind(dim=1)
    return F.linear(modulated_layer_norm(x_TD, shift_TD, scale_TD, eps), weight, bias)


def output_head_gathered(
    x_TD: Tensor,
    rows_S2D: Tensor,
    sequence_index_T: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    row_multiple: int,
) -> Tensor:
    """output_head with each token's shift and scale read from its sequence's rows [S, 2, D]
    (conditioning.gathered_pieces: compiled, the norm's kernel reads the rows in place; no
    [T, 2, D] tensor is written in the forward, and the backward's one-hot GEMMs, over sequences
    padded to `row_multiple`, take the shift's gradient, the linear map's input gradient, as it
    is)."""
    weight, bias = weights
    shift_TD, scale_TD = gathered_pieces(rows_S2D, sequence_index_T, row_multiple)
    return F.linear(modulated_layer_norm(x_TD, shift_TD, scale_TD, eps), weight, bias)


def squared_error_sum(predicted_TC: Tensor, target_TC: Tensor) -> Tensor:
    """Sum over tokens of each token's mean squared error over its channels, in float32 at
    least (the rectified-flow loss before the division by the global token count)."""
    wide = _wide(predicted_TC)
    error_TC = predicted_TC.to(wide) - target_TC.to(wide)
    return error_TC.square().mean(dim=1).sum()


def _wide(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


_EAGER = {
    "modulated_layer_norm": modulated_layer_norm,
    "gated_residual": gated_residual,
    "rms_norm_heads": rms_norm_heads,
    "rms_norm_rope": rms_norm_rope,
    "self_attention_in": self_attention_in,
    "self_attention_out_cross_in": self_attention_out_cross_in,
    "cross_attention_kv": cross_attention_kv,
    "cross_attention_out_ffn": cross_attention_out_ffn,
    "joint_stream_in": joint_stream_in,
    "joint_text_stream_in": joint_text_stream_in,
    "joint_stream_out_ffn": joint_stream_out_ffn,
    "single_stream_in": single_stream_in,
    "single_stream_out": single_stream_out,
    "rope_tables": rope_tables,
    "output_head": output_head,
    "output_head_gathered": output_head_gathered,
    "squared_error_sum": squared_error_sum,
}
# the model's work outside its blocks (RoPE tables, output head, loss): compiled or not with the
# blocks unless use_compiled says otherwise
_OUTSIDE = ("rope_tables", "output_head", "output_head_gathered", "squared_error_sum")
kernels = dict(_EAGER)  # what the models and the loss call
_compiled: dict[str, dict] = {}  # by backend


class _Alias(torch.autograd.Function):
    """Identity whose outputs share their inputs' memory but are not views of them: a compiled
    region then sees each argument as a plain tensor, whatever it was cut from (a view's base
    is part of what torch.compile specialises on, and it differs between steps: the attention
    output of one kernel call is a view of that call's buffer, of several calls a fresh one)."""

    @staticmethod
    def forward(ctx, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor, ...]:
        return grads


class CompiledRegion:
    """A per-token function under torch.compile that compiles once per dtype and layout and
    never per step. The graph's only varying sizes are the token counts: every tensor argument
    has its tokens on dim 0, marked dynamic; the weights (the tuple arguments) and every other
    dim are static, so kernels are generated for the model's widths. Each step's arguments are
    made to look alike before the call: attention outputs ([T, N, H], the 3-D arguments) are
    made contiguous (a transposed one was copied by the region's flatten anyway), views are
    passed as plain tensors (_Alias), sizes are not "duck shaped" (an equality of two sizes
    that holds by chance on the first step, a text count equal to an offset, say, would become
    a guard that a later step fails), and the calling thread has the thread count of the first
    call. Other sizes are never made dynamic (no "automatic dynamic"): a model of another width
    gets its own graphs. What still compiles again: a token count of 0 or 1, and, on a GPU, the
    first step whose buffers pass 2^31 elements (inductor guards its 32-bit indexing).
    tests/python/test_model.py and test_mmdit.py count the compilations over steps of new
    shapes."""

    # the host thread count torch.compile saw first: torch.compile guards on it, and the thread
    # that runs the backward on a GPU (recomputing checkpointed blocks) may have another
    threads: int | None = None

    def __init__(self, fn, backend: str) -> None:
        self.__name__ = fn.__name__
        self._compiled = torch.compile(fn, backend=backend, dynamic=None)

    def __call__(self, *args):
        if CompiledRegion.threads is None:
            CompiledRegion.threads = torch.get_num_threads()
        elif torch.get_num_threads() != CompiledRegion.threads:
            torch.set_num_threads(CompiledRegion.threads)  # this thread's; kernels run on the GPU
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        tensors = [args[i].contiguous() if args[i].dim() == 3 else args[i] for i in positions]
        args = list(args)
        for i, tensor in zip(positions, _Alias.apply(*tensors), strict=True):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            args[i] = tensor
        with _no_duck_shapes(), _no_automatic_dynamic():
            return self._compiled(*args)


def _no_duck_shapes():
    config = torch.fx.experimental._config
    if hasattr(config, "use_duck_shape"):
        return config.patch(use_duck_shape=False)
    return contextlib.nullcontext()


def _no_automatic_dynamic():
    # Only the token dims (marked above) are dynamic. Left on, torch.compile would make every
    # size that changed between two calls dynamic: a second model of another width in the same
    # process (a benchmark, the profiler) got width-generic graphs, slower and with more memory
    # (measured on an H200: wan-14b width after wan-1.3b, +5 GiB and +20% per-token time).
    if hasattr(torch._dynamo.config, "automatic_dynamic_shapes"):
        return torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()


def use_compiled(enabled: bool, backend: str = "inductor", outside: bool | None = None) -> None:
    """Switches the blocks' per-token functions to compiled ones (CompiledRegion) or back;
    `outside` (None: as `enabled`) does the same for the work outside the blocks (_OUTSIDE)."""
    outside = enabled if outside is None else outside
    if enabled:
        import torch._inductor.config

        # inductor fuses a norm's row and column reductions ("mix order") only above size
        # thresholds, which it guards on the token count: a step across one compiled again.
        # The non-strict mode skips those checks (fuses at any size, no guard).
        triton = torch._inductor.config.triton
        if hasattr(triton, "mix_order_reduction_non_strict_mode"):
            triton.mix_order_reduction_non_strict_mode = True
        elif hasattr(triton, "mix_order_reduction"):
            triton.mix_order_reduction = False
    if (enabled or outside) and backend not in _compiled:
        _compiled[backend] = {name: CompiledRegion(fn, backend) for name, fn in _EAGER.items()}
    for name, fn in _EAGER.items():
        compiled = outside if name in _OUTSIDE else enabled
        kernels[name] = _compiled[backend][name] if compiled else fn
