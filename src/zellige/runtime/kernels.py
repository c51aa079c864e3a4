"""Attention kernels on dense batches, with the log-sum-exp that ring merging needs.

Legend: B problems in the batch, n heads, Lq / Lk query / key tokens, H head dim.
forward(q_BnLH, k_BnLH, v_BnLH, scale) -> (o_BnLH, lse_BnL); backward(do, q, k, v, o, lse, scale)
-> (dq, dk, dv). Both take an optional key mask `bias_B11L`: an additive bias in q's dtype, 0 on
the keys a problem has and -inf on padding, so problems of different key lengths share one call
(the coalesced engine's padded merges); kernels without mask support raise NotImplementedError.
Inputs may be strided views whose last dimension is contiguous. The backward
takes o and lse of the final (possibly ring-merged) result, which is what makes per-block
backward passes of a ring add up to the gradient of the whole attention.

Each kernel is checked once per (device, dtype, head dim) against the math kernel on a tiny
problem before first use (`kernel_for`), so a kernel whose private ATen signature differs in the
installed torch falls back to the next one instead of failing mid-step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

aten = torch.ops.aten

Tensor = torch.Tensor


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Kernel:
    name = "base"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        scale: float,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def prepare_bias(self, bias_B11L: Tensor, q_len: int) -> Tensor:
        """The key mask as this kernel takes it in every call of q_len queries (callers cache
        it: a padded call's mask serves every layer)."""
        return bias_B11L


def _no_mask(kernel: Kernel, bias: Tensor | None) -> None:
    if bias is not None:
        raise NotImplementedError(f"the {kernel.name} kernel takes no key mask")


_zeros: dict[torch.device, Tensor] = {}


def _zero_long(device: torch.device) -> Tensor:
    """A cached int64 zero on `device` (the philox seed / offset of dropout-free backwards): one
    allocation and fill per device instead of two tiny kernels per call."""
    if device not in _zeros:
        _zeros[device] = torch.zeros((), dtype=torch.long, device=device)
    return _zeros[device]


class MathKernel(Kernel):
    """Explicit softmax(q k^T) v: any device and dtype; the oracle for the other kernels."""

    name = "math"

    def forward(self, q, k, v, scale, bias=None):
        acc = lse_dtype(q.dtype)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias.to(acc)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        return torch.matmul(probs, v.to(acc)).to(q.dtype), lse

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        acc = lse_dtype(q.dtype)
        q32, k32, v32, do32 = q.to(acc), k.to(acc), v.to(acc), do.to(acc)
        scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias.to(acc)
        probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
        dv = torch.matmul(probs.transpose(-1, -2), do32)
        dprobs = torch.matmul(do32, v32.transpose(-1, -2))
        delta = (do32 * o.to(acc)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k32)
        dk = torch.matmul(dscores.transpose(-1, -2), q32)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashKernel(Kernel):
    """ATen's CPU flash attention (float64, float32, bfloat16, float16)."""

    name = "cpu"

    def forward(self, q, k, v, scale, bias=None):
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return o, lse

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse.contiguous(), 0.0, False, attn_mask=bias, scale=scale
        )


class CudnnKernel(Kernel):
    """cuDNN fused attention (bf16/fp16); dense per batch, the fastest on H100/H200 class GPUs."""

    name = "cudnn"
    # How the key mask reaches cuDNN: "expand" (the [B, 1, 1, Lk] mask seen as [B, n, Lq, Lk]
    # with zero strides) or "rows" (materialized over queries, [B, 1, Lq, Lk], expanded over
    # heads). masked_kernel_ok sets the first that agrees with the math kernel on this build.
    bias_layout = "expand"

    def prepare_bias(self, bias_B11L, q_len):
        if self.bias_layout == "rows":
            batch, _, _, k_len = bias_B11L.shape
            return bias_B11L.expand(batch, 1, q_len, k_len).contiguous()
        return bias_B11L

    def _bias(self, bias, q, k):
        """[B, 1, 1 or Lq, Lk] -> [B, n, Lq, Lk] (zero strides where broadcast)."""
        if bias is None:
            return None
        if self.bias_layout == "rows" and bias.shape[2] != q.shape[2]:
            bias = self.prepare_bias(bias, q.shape[2])
        return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

    def forward(self, q, k, v, scale, bias=None):
        out = aten._scaled_dot_product_cudnn_attention(
            q, k, v, self._bias(bias, q, k), True, 0.0, False, False, scale=scale
        )
        o, lse = out[0], out[1]
        return o, lse.reshape(q.shape[0], q.shape[1], q.shape[2])

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        batch, heads, q_len, _ = q.shape
        zero = _zero_long(q.device)
        lse4 = lse.reshape(batch, heads, q_len, 1).contiguous()
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse4, zero, zero, self._bias(bias, q, k), None, None,
            q_len, k.shape[2], 0.0, False, scale=scale,
        )  # fmt: skip


class CudnnContiguousKernel(CudnnKernel):
    """cuDNN on [B, n, L, H]-contiguous copies: a fallback for builds where the strided call
    disagrees with the math kernel (the check below decides)."""

    name = "cudnn-bnlh"

    def forward(self, q, k, v, scale, bias=None):
        return super().forward(q.contiguous(), k.contiguous(), v.contiguous(), scale, bias)

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        return super().backward(
            do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(), lse,
            scale, bias,
        )  # fmt: skip


class FlashKernel(Kernel):
    """FlashAttention-2 as shipped in torch (bf16/fp16), dense per batch."""

    name = "flash"

    def forward(self, q, k, v, scale, bias=None):
        _no_mask(self, bias)
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        return out[0], out[1]

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        _no_mask(self, bias)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.zeros((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse.contiguous(), None, None, q.shape[2], k.shape[2],
            0.0, False, rng_state, unused, scale=scale,
        )  # fmt: skip


class EfficientKernel(Kernel):
    """Memory-efficient attention (CUDA, any float dtype incl. float32)."""

    name = "efficient"

    def forward(self, q, k, v, scale, bias=None):
        _no_mask(self, bias)
        o, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale
        )
        return o, lse[..., : q.shape[2]]  # the kernel pads lse to a multiple of 32

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        _no_mask(self, bias)
        q_len = q.shape[2]
        padded = F.pad(lse, (0, (-q_len) % 32)).contiguous()
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, o, padded, zero, zero, 0.0, [True, True, True, False], False,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


KERNELS: dict[str, Callable[[], Kernel]] = {
    "cudnn": CudnnKernel,
    "cudnn-bnlh": CudnnContiguousKernel,
    "flash": FlashKernel,
    "efficient": EfficientKernel,
    "cpu": CpuFlashKernel,
    "math": MathKernel,
}


def _preference(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type != "cuda":
        return ["cpu", "math"]
    if dtype in (torch.bfloat16, torch.float16):
        return ["cudnn", "cudnn-bnlh", "flash", "efficient", "math"]
    return ["efficient", "math"]


def close_to_math(got: Tensor, want: Tensor, dtype: torch.dtype) -> bool:
    """The kernel checks' test against the math kernel: the same shape, and the largest
    difference within the dtype's tolerance of want's largest value (1e-9 float64, 2e-3 float32,
    5e-2 bf16 / fp16), compared in float32."""
    if got.shape != want.shape:
        return False
    tolerance = {torch.float64: 1e-9, torch.float32: 2e-3}.get(dtype, 5e-2)
    err = (got.float() - want.float()).abs().max()
    return bool(err <= tolerance * want.float().abs().max().clamp_min(1e-6))


_verified: dict[tuple, bool] = {}


def _agrees_with_math(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int):
    """Forward, lse and backward of a tiny uneven problem against the math kernel."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    # Strided like the runtime's views: [B, L, n, H] storage seen as [B, n, L, H].
    q, do = (rand(2, 37, 3, head_dim).transpose(1, 2) for _ in range(2))
    k, v = (rand(2, 53, 3, head_dim).transpose(1, 2) for _ in range(2))
    scale = head_dim**-0.5
    oracle = MathKernel()
    try:
        o, lse = kernel.forward(q, k, v, scale)
        grads = kernel.backward(do, q, k, v, o, lse, scale)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    o_ref, lse_ref = oracle.forward(q, k, v, scale)
    grads_ref = oracle.backward(do, q, k, v, o_ref, lse_ref, scale)
    pairs = [(o, o_ref), (lse, lse_ref), *zip(grads, grads_ref, strict=True)]
    return all(close_to_math(got, want, dtype) for got, want in pairs)


def kernel_for(
    device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None = None
) -> Kernel:
    """The kernel for this device/dtype: `backend` if given (EngineConfig.backend), else the
    first of the preference list that passes the check against the math kernel."""
    if backend is not None:
        if backend not in KERNELS:
            raise ValueError(
                f"unknown attention backend '{backend}' (allowed: {', '.join(KERNELS)})"
            )
        return KERNELS[backend]()
    for name in _preference(device, dtype):
        key = (name, device.type, dtype, head_dim)
        if key not in _verified:
            _verified[key] = name == "math" or _agrees_with_math(
                KERNELS[name](), device, dtype, head_dim
            )
        if _verified[key]:
            return KERNELS[name]()
    raise AssertionError("the math kernel always works")


class ContiguousKernel(Kernel):
    """`kernel` handed plain contiguous [B, n, L, H] tensors (EngineConfig.
    contiguous_kernel_inputs: a workaround for kernels that mishandle the runtime's strided
    views; one copy per call)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.name = f"{kernel.name}+contiguous"

    def forward(self, q, k, v, scale, bias=None):
        _no_mask(self, bias)
        return self.kernel.forward(q.contiguous(), k.contiguous(), v.contiguous(), scale)

    def backward(self, do, q, k, v, o, lse, scale, bias=None):
        _no_mask(self, bias)
        tensors = (t.contiguous() for t in (do, q, k, v, o, lse))
        return self.kernel.backward(*tensors, scale)


def key_mask(valid_BL: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive key mask [B, 1, 1, Lk] of `valid_BL` (bool [B, Lk]): 0 where valid, -inf on
    padding. Stored with the key axis rounded up to 8 entries so that every row starts 16-byte
    aligned (cuDNN's requirement for a bias), then sliced back."""
    batch, length = valid_BL.shape
    aligned = torch.full(
        (batch, 1, 1, -(-length // 8) * 8), float("-inf"), dtype=dtype, device=valid_BL.device
    )
    mask = aligned[..., :length]
    mask.masked_fill_(valid_BL[:, None, None, :], 0.0)
    return mask


def _masked_agrees_with_math(kernel: Kernel, device, dtype, head_dim: int) -> bool:
    """Forward, lse and backward of two problems padded to one length (keys masked, padded
    queries given zero output gradients) against the math kernel on each problem unpadded."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    lengths, padded, heads = (29, 41), 48, 3

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    q, k, v, do = (rand(2, padded, heads, head_dim).transpose(1, 2) for _ in range(4))
    valid = (
        torch.arange(padded, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    )
    do = do * valid[:, None, :, None].to(dtype)
    scale = head_dim**-0.5
    try:
        bias = key_mask(valid, dtype)
        o, lse = kernel.forward(q, k, v, scale, bias)
        grads = kernel.backward(do, q, k, v, o, lse, scale, bias)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    oracle = MathKernel()
    for b, length in enumerate(lengths):
        part = [t[b : b + 1, :, :length] for t in (q, k, v, do)]
        o_ref, lse_ref = oracle.forward(*part[:3], scale)
        grads_ref = oracle.backward(part[3], *part[:3], o_ref, lse_ref, scale)
        got = [o[b : b + 1, :, :length], lse[b : b + 1, :, :length]]
        got += [g[b : b + 1, :, :length] for g in grads]
        for x, want in zip(got, [o_ref, lse_ref, *grads_ref], strict=True):
            if not close_to_math(x, want, dtype):
                return False
    return True


_masked_verified: dict[tuple, Kernel | None] = {}


def masked_kernel_for(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int):
    """`kernel` configured to take a key mask, or None where it cannot (checked once per device,
    dtype and head dim against the math kernel; cuDNN tries each way of passing the mask)."""
    key = (kernel.name, device.type, dtype, head_dim)
    if key not in _masked_verified:
        _masked_verified[key] = None
        layouts = ("expand", "rows") if isinstance(kernel, CudnnKernel) else (None,)
        for layout in layouts:
            candidate = type(kernel)()
            if layout is not None:
                candidate.bias_layout = layout
            if kernel.name == "math" or _masked_agrees_with_math(
                candidate, device, dtype, head_dim
            ):
                _masked_verified[key] = candidate
                break
    return _masked_verified[key]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
