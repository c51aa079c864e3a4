"""AdamW that also writes each updated weight's compute-dtype copy, in the same pass.

On one rank without FSDP (parallelize.LoneRankWeights) every step casts the fp32 master weights
to bf16 copies at the forward's start: a pass that reads 4 and writes 2 bytes a parameter
(2.7 ms for wan-14b width's 1.64 B parameters on an H200) after the optimizer has just read and
written every master. CopyingAdamW writes the copy from the updated value while it is still in
registers: the update reads weight, gradient and both moments (16 bytes a parameter) and writes
weight, moments and copy (14 bytes), against torch's fused AdamW's 16 read and 16 written (it
writes the clipping-scaled gradient back) plus the cast's 6. Its kernels are torch.compile'd
per chunk of parameters (a chunk: the root's, or one block's, so every block reuses one graph);
the step's scalars are device tensors, so no step compiles again and none syncs the host.

The arithmetic is torch.optim.AdamW's (the single-tensor form: decoupled weight decay, lerp of
the first moment, bias corrections), in float32 for float32 masters, the gradient divided by the
clipping's grad_scale first, as torch's fused AdamW does. Compiled code may contract multiplies
and adds differently: tests/python/test_optimizer.py bounds the difference against
torch.optim.AdamW. The state (step, exp_avg, exp_avg_sq per parameter) is torch's, so
checkpoints load into either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def adamw_chunk_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    copies: list[Tensor],
    decay: Tensor,
    step_size: Tensor,
    bias_correction2_sqrt: Tensor,
    grad_scale: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One AdamW update of a chunk, in place; copies[i] receives params[i]'s new value in its
    own dtype. decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^step),
    bias_correction2_sqrt = sqrt(1 - beta2^step): 0-dim device tensors in the masters' dtype;
    grad_scale: 0-dim float32."""
    for param, grad, exp_avg, exp_avg_sq, copy in zip(
        params, grads, exp_avgs, exp_avg_sqs, copies, strict=True
    ):
        grad = grad.to(param.dtype) / grad_scale
        updated = param * decay
        exp_avg_new = exp_avg.lerp(grad, 1 - beta1)
        exp_avg_sq_new = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
        denom = exp_avg_sq_new.sqrt() / bias_correction2_sqrt + eps
        updated = updated + -step_size * (exp_avg_new / denom)
        param.copy_(updated)
        exp_avg.copy_(exp_avg_new)
        exp_avg_sq.copy_(exp_avg_sq_new)
        copy.copy_(updated)


class CopyingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step writes the copies given in `copies_out` (id of a parameter
    -> its copy; set before step(), cleared by it; None: no copies, the same update), and reads
    the gradients from `gradients_in` where it is set (id of a parameter -> its gradient, in any
    float dtype: each is widened to its parameter's as it is read; cleared by step()). chunks:
    the parameters split into lists that each compiled call updates together (None: one chunk a
    parameter group); compiled: torch.compile the chunk update (True: inductor, or a
    torch.compile backend; False: eager, the same arithmetic); tuned (with inductor): its
    kernels' launch configurations (block size, warps) are chosen by timing candidates on the
    device when they compile (inductor's max_autotune_pointwise and coordinate descent), not
    by its size heuristics; each element's arithmetic is the same, so are the results.
    grad_scale (attribute, as
    torch's fused AdamW reads it): each gradient is divided by it. Only plain AdamW: no
    amsgrad, maximize, capturable or differentiable."""

    def __init__(
        self,
        params: Iterable,
        *,
        chunks: Sequence[Sequence[Tensor]] | None = None,
        compiled=False,
        tuned: bool = False,
        **kwargs,
    ) -> None:
        for option in ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused"):
            if kwargs.get(option):
                raise ValueError(f"CopyingAdamW does not support {option}=True")
        super().__init__(params, **kwargs)
        self._chunks = None if chunks is None else [list(chunk) for chunk in chunks]
        self._update = adamw_chunk_
        if compiled:
            backend = "inductor" if compiled is True else compiled
            # the update is memory-bound (28 bytes a parameter at about 4.05 TB/s on an H200):
            # the launch configuration is what is left to tune
            options = (
                {"max_autotune_pointwise": True, "coordinate_descent_tuning": True}
                if tuned and backend == "inductor"
                else None
            )
            self._update = torch.compile(
                adamw_chunk_, backend=backend, dynamic=False, options=options
            )
        self._ones: dict[torch.device, Tensor] = {}
        self.copies_out: dict[int, Tensor] | None = None
        self.gradients_in: dict[int, Tensor] | None = None
        self.grad_scale: Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CopyingAdamW.step takes no closure")
        copies_out, self.copies_out = self.copies_out, None
        gradients_in, self.gradients_in = self.gradients_in, None
        if gradients_in is None:
            gradient = lambda p: p.grad  # noqa: E731
        else:
            gradient = lambda p: gradients_in.get(id(p))  # noqa: E731
        for group in self.param_groups:
            chosen = [p for p in group["params"] if gradient(p) is not None]
            if not chosen:
                continue
            step = self._advance(chosen)
            lr, weight_decay = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            # the scalars in double on the host, as torch's AdamW forms them, then fills in the
            # masters' dtype on the device (a fill kernel takes the value: no copy, no sync)
            device, dtype = chosen[0].device, chosen[0].dtype
            scalars = [
                1 - lr * weight_decay,
                lr / (1 - beta1**step),
                (1 - beta2**step) ** 0.5,
            ]
            decay, step_size, bias_correction2_sqrt = (
                torch.full((), value, dtype=dtype, device=device) for value in scalars
            )
            grad_scale = self.grad_scale if self.grad_scale is not None else self._one(device)
            in_group = {id(p) for p in chosen}
            chunks = self._chunks if self._chunks is not None else [group["params"]]
            for chunk in chunks:
                params = [p for p in chunk if id(p) in in_group]
                if not params:
                    continue
                states = [self.state[p] for p in params]
                copies = (
                    [copies_out[id(p)] for p in params]
                    if copies_out is not None
                    else [torch.empty_like(p) for p in params]  # written, then dropped
                )
                with _graphs_per_model():
                    self._update(
                        params,
                        [gradient(p) for p in params],
                        [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states],
                        copies,
                        decay,
                        step_size,
                        bias_correction2_sqrt,
                        grad_scale,
                        beta1,
                        beta2,
                        group["eps"],
                    )
        return None

    def _advance(self, params: list[Tensor]) -> int:
        """Creates missing state as torch's AdamW does, adds one to every step count (host
        scalars) and returns the new count, which the chunk's parameters must share."""
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step = state["step"]
            if step.is_cuda or step.dim() != 0:  # a checkpoint of torch's fused AdamW
                state["step"] = step = step.detach().reshape(()).cpu()
            steps.append(step)
        torch._foreach_add_(steps, 1.0)
        counts = torch.stack(steps)
        if bool(counts.min() != counts.max()):
            raise ValueError(
                "CopyingAdamW: the parameters' step counts differ (some skipped steps without a "
                "gradient); use torch.optim.AdamW"
            )
        return int(counts[0])

    def _one(self, device: torch.device) -> Tensor:
        if device not in self._ones:
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]


def _graphs_per_model():
    """torch.compile stops compiling a function after 8 graphs (its recompile limit) and runs
    it eagerly from then on; the chunk update has about three a model and gradient dtype (the
    root's chunk, a full run of blocks, a shorter last run), and one process may train several
    models (a benchmark), so the limit is raised for its calls."""
    config = torch._dynamo.config
    if hasattr(config, "recompile_limit"):
        return config.patch(recompile_limit=64)
    return contextlib.nullcontext()
