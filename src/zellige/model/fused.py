"""The elementwise parts of a block (modulated norms, gated residuals, QK norm with RoPE) as plain
functions. Eager, each is a chain of memory-bound passes over [T, D] (several in float32); under
torch.compile (use_compiled(True)) each becomes one or two fused kernels. Both compute the same
thing in float32 (float64 for float64 activations) and return the activation dtype. Legend in
config.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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


def _wide(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


_EAGER = {
    "modulated_layer_norm": modulated_layer_norm,
    "gated_residual": gated_residual,
    "rms_norm_heads": rms_norm_heads,
    "rms_norm_rope": rms_norm_rope,
}
kernels = dict(_EAGER)  # what the blocks call
_compiled: dict = {}


def use_compiled(enabled: bool) -> None:
    """Switches the blocks' elementwise functions to torch.compile'd ones (dynamic shapes: the
    token count changes every step) or back."""
    if enabled and not _compiled:
        _compiled.update({name: torch.compile(fn, dynamic=True) for name, fn in _EAGER.items()})
    kernels.update(_compiled if enabled else _EAGER)
