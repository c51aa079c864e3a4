"""3D rotary position embedding from each token's own (t, h, w).

The angles depend only on a token's latent-grid position, never on where the token sits in this
rank's buffer, so RoPE is right under any sharding or packing. Split of the head dim as in Wan:
t gets H - 4 * (H // 6) dims, h and w get 2 * (H // 6) each; pairs are interleaved (x0, x1) and
rotated by fused.rms_norm_rope together with the QK norm.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    hw_dims = 2 * (head_dim // 6)
    return head_dim - 2 * hw_dims, hw_dims, hw_dims


def rope_tables(
    positions_T3: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [T, 1, H/2] for positions (t, h, w) per token.

    Angles are computed in float64 (long videos reach positions where float32 angles lose
    precision) and returned in `dtype`, once per step, shared by every layer.
    """
    angles = []
    for axis, axis_dims in enumerate(rope_axis_dims(head_dim)):
        exponents = torch.arange(0, axis_dims, 2, dtype=torch.float64, device=positions_T3.device)
        inv_freq = theta ** (-exponents / axis_dims)
        angles.append(positions_T3[:, axis, None].to(torch.float64) * inv_freq)
    angles_TP = torch.cat(angles, dim=-1)
    return angles_TP.cos().to(dtype)[:, None, :], angles_TP.sin().to(dtype)[:, None, :]
