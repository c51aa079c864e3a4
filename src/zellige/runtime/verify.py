"""Distributed attention against single-process attention (what `zellige check` and
tests/distributed run).

Every rank draws q, k, v and an upstream gradient dO for the sequences its loader produced
(seeded by sequence id, so any process can redraw any sequence), routes them to the plan's
layout, runs distributed attention, routes the output back and backpropagates dO. On the source
rank each sequence is then compared, whole, with single-process attention.

Error bound. The reference is torch's own scaled_dot_product_attention on the whole sequence, in
the run dtype, with autograd. Its own rounding eps_ref is measured by evaluating it a second time
with the keys (and values) in a random order, which attention does not depend on: the difference
is rounding only, of exactly the kind a different evaluation order produces. For each of o, dq,
dk, dv: err = max |x - x_ref| / max |x_ref| over all sequences, eps_ref the same for the permuted
reference, and PASS iff err <= 8 * eps_ref + 4 * u (u: unit roundoff of the dtype, a floor for
when both orders happen to round alike). Why 8: the distributed path sums in yet other orders
(dense batches of other shapes, ring blocks merged by log-sum-exp, half-precision partial outputs
and dk/dv partials added across ring steps), a few roundings of the reference's size; a misrouted
token or head gives errors of order 1.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from zellige import _core
from zellige.runtime.attention import distributed_attention
from zellige.runtime.exchange import reverse_route, route
from zellige.runtime.kernels import kernel_for
from zellige.runtime.layout import StepLayout, prepare_step

Tensor = torch.Tensor
TENSORS = ("o", "dq", "dk", "dv")
BOUND_FACTOR = 8.0
ROUNDOFF_FACTOR = 4.0


@dataclass(kw_only=True, slots=True)
class CheckConfig:
    num_heads: int = 4
    head_dim: int = 16
    dtype: str = "float64"
    device: str = "cpu"
    backend: str | None = None
    seed: int = 0


@dataclass(slots=True)
class CheckResult:
    """Per tensor: distributed error, the reference's own rounding error, the bound."""

    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    kernel: str = ""

    @property
    def passed(self) -> bool:
        return all(err <= bound for err, _, bound in self.errors.values())


def _draw(seq: _core.Sequence, cfg: CheckConfig, device: torch.device) -> list[Tensor]:
    """q, k, v, dO of one whole sequence, [L, N, H] float32 on `device`, seeded by its id."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + seq.id)
    shape = (seq.num_tokens, cfg.num_heads, cfg.head_dim)
    return [torch.randn(shape, generator=gen, device=device) for _ in range(4)]


def _reference(q, k, v, do, key_order: Tensor | None = None) -> list[Tensor]:
    """o, dq, dk, dv of single-process attention of one sequence [L, N, H] (torch SDPA +
    autograd), optionally with the keys/values taken in `key_order` (gradients put back)."""
    q, k, v = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k, v))
    k_in, v_in = (k, v) if key_order is None else (k[:, key_order], v[:, key_order])
    o = F.scaled_dot_product_attention(q[None], k_in[None], v_in[None])[0]
    o.backward(do.transpose(0, 1))
    return [t.transpose(0, 1) for t in (o.detach(), q.grad, k.grad, v.grad)]


def check_rank(batch: _core.Batch, plan: _core.Plan, cfg: CheckConfig) -> CheckResult:
    """Runs on every rank of the initialised default group; returns the same result everywhere."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    step: StepLayout = prepare_step(batch, plan, cfg.num_heads, device)
    rank = dist.get_rank()
    mine = [s for s in batch.sequences if s.source_rank == rank]
    drawn = [_draw(s, cfg, device) for s in mine]
    empty = torch.zeros((0, cfg.num_heads, cfg.head_dim), device=device)

    def source(i: int) -> Tensor:
        parts = [d[i] for d in drawn]
        return (torch.cat(parts) if parts else empty).to(dtype)

    q_src, k_src, v_src = (source(i).requires_grad_() for i in range(3))
    do_src = source(3)
    q, k, v = (route(t, step) for t in (q_src, k_src, v_src))
    o = distributed_attention(q, k, v, step, backend=cfg.backend)
    o_src = reverse_route(o, step)
    o_src.backward(do_src)
    got = [o_src.detach(), q_src.grad, k_src.grad, v_src.grad]

    numer = torch.zeros(8, dtype=torch.float64, device=device)  # dist err, ref err per tensor
    denom = torch.zeros(4, dtype=torch.float64, device=device)
    start = 0
    for seq, tensors in zip(mine, drawn, strict=True):
        length = seq.num_tokens
        inputs = [t.to(dtype) for t in tensors]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + seq.id)
        ref = _reference(*inputs)
        ref_permuted = _reference(
            *inputs, key_order=torch.randperm(length, generator=gen).to(device)
        )
        for i in range(4):
            want = ref[i].double()
            part = got[i][start : start + length].double()
            numer[i] = torch.maximum(numer[i], (part - want).abs().max())
            numer[4 + i] = torch.maximum(
                numer[4 + i], (ref_permuted[i].double() - want).abs().max()
            )
            denom[i] = torch.maximum(denom[i], want.abs().max())
        start += length
    dist.all_reduce(numer, op=dist.ReduceOp.MAX)
    dist.all_reduce(denom, op=dist.ReduceOp.MAX)
    roundoff = torch.finfo(dtype).eps / 2
    result = CheckResult()
    for i, name in enumerate(TENSORS):
        scale = max(denom[i].item(), 1e-300)
        err, ref_err = numer[i].item() / scale, numer[4 + i].item() / scale
        result.errors[name] = (err, ref_err, BOUND_FACTOR * ref_err + ROUNDOFF_FACTOR * roundoff)
    result.kernel = kernel_for(device, dtype, cfg.head_dim, cfg.backend).name
    return result


def init_process_group(
    rank: int, world_size: int, port: int, device: str, timeout: timedelta | None = None
) -> None:
    """The default group on localhost: gloo for cpu, NCCL for cuda (one GPU per rank). A timeout
    turns a hang into an error."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, batch_json, plan_json, cfg, queue) -> None:
    from zellige.plan_io import plan_from_json
    from zellige.workload import batch_from_json

    torch.set_num_threads(1)
    init_process_group(rank, world_size, port, cfg.device)
    try:
        cfg.device = f"cuda:{torch.cuda.current_device()}" if cfg.device == "cuda" else cfg.device
        result = check_rank(batch_from_json(batch_json), plan_from_json(plan_json), cfg)
        if rank == 0:
            queue.put(("ok", result.errors, result.kernel))
    except ValueError as exc:  # a plan/batch mismatch: the same message on every rank
        if rank == 0:
            queue.put(("error", str(exc), ""))
    finally:
        dist.destroy_process_group()


def spawn_check(
    batch: _core.Batch, plan: _core.Plan, cfg: CheckConfig, num_processes: int
) -> CheckResult:
    """check_rank on `num_processes` fresh processes (gloo on CPU, NCCL on CUDA)."""
    from zellige.plan_io import plan_to_json
    from zellige.workload import batch_to_json

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(
        _worker,
        args=(num_processes, free_port(), batch_to_json(batch), plan_to_json(plan), cfg, queue),
        nprocs=num_processes,
        join=True,
    )
    status, payload, kernel = queue.get()
    if status == "error":
        raise ValueError(payload)
    return CheckResult(errors=payload, kernel=kernel)
