"""Distributed attention against single-process attention (what `zellige check` and
tests/distributed run).

Every rank draws q, k, v and an upstream gradient dO for the sequences its loader produced
(seeded by sequence id, so any process can redraw any sequence), routes them to the plan's
layout, runs distributed attention, routes the output back and backpropagates dO. On the source
rank each sequence is then compared, whole, with single-process attention. Joint attention
(MMDiT): a sequence is its text tokens followed by its visual tokens; text rows and visual rows
are compared separately (o.text, dq.text, ...), so a text gradient summed over shards shows.
Cross-attention (Wan): each sequence's visual queries against its own text, which route_text
delivers to every rank holding a chunk (cross.o, cross.dq, ...).

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
from zellige.runtime.attention import cross_attention, distributed_attention
from zellige.runtime.exchange import reverse_route, route, route_text
from zellige.runtime.kernels import kernel_for
from zellige.runtime.layout import Step, prepare_step
from zellige.runtime.teardown import end_rank_process

Tensor = torch.Tensor
TENSORS = ("o", "dq", "dk", "dv")
BOUND_FACTOR = 8.0
ROUNDOFF_FACTOR = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of rounding one number to `dtype` (half its epsilon)."""
    return torch.finfo(dtype).eps / 2


@dataclass(kw_only=True, slots=True)
class CheckConfig:
    """joint_attention: each sequence attends over [text, visual] (MMDiT); otherwise
    self-attention over its visual tokens and, with cross_attention, cross-attention of its
    visual tokens to its text (Wan)."""

    num_heads: int = 4
    head_dim: int = 16
    dtype: str = "float64"
    device: str = "cpu"
    backend: str | None = None
    seed: int = 0
    joint_attention: bool = False
    cross_attention: bool = False


@dataclass(slots=True)
class CheckResult:
    """Per tensor: distributed error, the reference's own rounding error, the bound. Names: o,
    dq, dk, dv (visual rows), the same with ".text" (joint: text rows) and "cross." (cross-
    attention)."""

    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    kernel: str = ""

    @property
    def passed(self) -> bool:
        return all(err <= bound for err, _, bound in self.errors.values())


def _draw(seq_id: int, length: int, cfg: CheckConfig, device: torch.device, stream: int):
    """q, k, v, dO of one sequence, [length, N, H] float32 on `device`, seeded by its id (any
    process can redraw any sequence); `stream` separates self/joint from cross draws."""
    gen = torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + seq_id) * 4 + stream)
    shape = (length, cfg.num_heads, cfg.head_dim)
    return [torch.randn(shape, generator=gen, device=device) for _ in range(4)]


def _reference(q, k, v, do, key_order: Tensor | None = None) -> list[Tensor]:
    """o, dq, dk, dv of single-process attention of one sequence (q [Lq, N, H] against k, v
    [Lk, N, H]; torch SDPA + autograd), optionally with the keys/values taken in `key_order`
    (gradients put back). No keys: zeros."""
    if k.shape[0] == 0:
        return [torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    q, k, v = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k, v))
    k_in, v_in = (k, v) if key_order is None else (k[:, key_order], v[:, key_order])
    o = F.scaled_dot_product_attention(q[None], k_in[None], v_in[None])[0]
    o.backward(do.transpose(0, 1))
    return [t.transpose(0, 1) for t in (o.detach(), q.grad, k.grad, v.grad)]


class _Errors:
    """Largest |distributed - reference|, |permuted reference - reference| and |reference| per
    tensor name, reduced over ranks (MAX) at the end."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        self.values = torch.zeros(3 * len(names), dtype=torch.float64, device=device)

    def add(self, name: str, got: Tensor, want: Tensor, permuted: Tensor) -> None:
        if want.numel() == 0:
            return
        i = self.names.index(name)
        n = len(self.names)
        want = want.double()
        for j, value in enumerate(
            (
                (got.double() - want).abs().max(),
                (permuted.double() - want).abs().max(),
                want.abs().max(),
            )
        ):
            self.values[j * n + i] = torch.maximum(self.values[j * n + i], value)

    def result(self, dtype: torch.dtype) -> dict[str, tuple[float, float, float]]:
        dist.all_reduce(self.values, op=dist.ReduceOp.MAX)
        n = len(self.names)
        roundoff = unit_roundoff(dtype)
        out = {}
        for i, name in enumerate(self.names):
            scale = max(self.values[2 * n + i].item(), 1e-300)
            err, ref_err = self.values[i].item() / scale, self.values[n + i].item() / scale
            out[name] = (err, ref_err, BOUND_FACTOR * ref_err + ROUNDOFF_FACTOR * roundoff)
        return out


def _scatter_modalities(visual: Tensor, text: Tensor, step: Step) -> Tensor:
    """Held visual rows and held text rows -> all held tokens (differentiable)."""
    out = visual.new_zeros((step.num_held_tokens, *visual.shape[1:]))
    return out.index_copy(0, step.visual_index, visual).index_copy(0, step.text_index, text)


def _check_self(
    batch: _core.Batch, step: Step, cfg: CheckConfig, dtype, device, errors: _Errors
) -> None:
    """Self- or joint attention. q (and o) travel per modality, k and v through the route of all
    tokens, so both kinds of route are checked."""
    rank = dist.get_rank()
    mine = [s for s in batch.sequences if s.source_rank == rank]
    text_of = {s.id: s.text_tokens if cfg.joint_attention else 0 for s in mine}
    drawn = {s.id: _draw(s.id, text_of[s.id] + s.num_tokens, cfg, device, 0) for s in mine}

    def cat(parts: list[Tensor]) -> Tensor:
        empty = torch.zeros((0, cfg.num_heads, cfg.head_dim), device=device)
        return (torch.cat(parts) if parts else empty).to(dtype)

    def source(i: int, part: str) -> Tensor:
        pieces = []
        for s in mine:
            whole, t = drawn[s.id][i], text_of[s.id]
            pieces.append({"all": whole, "text": whole[:t], "visual": whole[t:]}[part])
        return cat(pieces)

    q_vis, q_txt = source(0, "visual").requires_grad_(), source(0, "text").requires_grad_()
    k_all, v_all = source(1, "all").requires_grad_(), source(2, "all").requires_grad_()
    q = route(q_vis, step, "visual")
    if cfg.joint_attention:
        q = _scatter_modalities(q, route(q_txt, step, "text"), step)
    k, v = route(k_all, step), route(v_all, step)
    o = distributed_attention(q, k, v, step, backend=cfg.backend)
    o_vis = reverse_route(o.index_select(0, step.visual_index), step, "visual")
    outputs, grads = [o_vis], [source(3, "visual")]
    if cfg.joint_attention:
        outputs.append(reverse_route(o.index_select(0, step.text_index), step, "text"))
        grads.append(source(3, "text"))
    torch.autograd.backward(outputs, grads)
    o_txt = outputs[1].detach() if cfg.joint_attention else None

    offsets = {"all": 0, "visual": 0, "text": 0}
    for s in mine:
        t, length = text_of[s.id], text_of[s.id] + s.num_tokens
        inputs = [x.to(dtype) for x in drawn[s.id]]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s.id)
        ref = _reference(*inputs)
        permuted = _reference(*inputs, key_order=torch.randperm(length, generator=gen).to(device))
        a, vo, to = offsets["all"], offsets["visual"], offsets["text"]
        got = {
            "o": (
                o_vis.detach()[vo : vo + s.num_tokens],
                None if o_txt is None else o_txt[to : to + t],
            ),
            "dq": (q_vis.grad[vo : vo + s.num_tokens], q_txt.grad[to : to + t] if t else None),
            "dk": (k_all.grad[a + t : a + length], k_all.grad[a : a + t]),
            "dv": (v_all.grad[a + t : a + length], v_all.grad[a : a + t]),
        }
        for i, name in enumerate(TENSORS):
            visual_got, text_got = got[name]
            errors.add(name, visual_got, ref[i][t:], permuted[i][t:])
            if t:
                errors.add(name + ".text", text_got, ref[i][:t], permuted[i][:t])
        offsets["all"] += length
        offsets["visual"] += s.num_tokens
        offsets["text"] += t


def _check_cross(
    batch: _core.Batch, step: Step, cfg: CheckConfig, dtype, device, errors: _Errors
) -> None:
    """Cross-attention: each sequence's visual queries against its own text, the text delivered
    by route_text (its gradients summed back over every rank that used it)."""
    rank = dist.get_rank()
    mine = [s for s in batch.sequences if s.source_rank == rank]
    queries = {s.id: _draw(s.id, s.num_tokens, cfg, device, 1) for s in mine}
    texts = {s.id: _draw(s.id, s.text_tokens, cfg, device, 2) for s in mine}

    def cat(parts: list[Tensor]) -> Tensor:
        empty = torch.zeros((0, cfg.num_heads, cfg.head_dim), device=device)
        return (torch.cat(parts) if parts else empty).to(dtype)

    q_src = cat([queries[s.id][0] for s in mine]).requires_grad_()
    k_src = cat([texts[s.id][1] for s in mine]).requires_grad_()
    v_src = cat([texts[s.id][2] for s in mine]).requires_grad_()
    o = cross_attention(
        route(q_src, step, "visual"),
        route_text(k_src, step),
        route_text(v_src, step),
        step,
        backend=cfg.backend,
    )
    o_src = reverse_route(o, step, "visual")
    o_src.backward(cat([queries[s.id][3] for s in mine]))
    q_at = x_at = 0
    for s in mine:
        inputs = [
            x.to(dtype)
            for x in (queries[s.id][0], texts[s.id][1], texts[s.id][2], queries[s.id][3])
        ]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s.id)
        ref = _reference(*inputs)
        order = torch.randperm(s.text_tokens, generator=gen).to(device)
        permuted = _reference(*inputs, key_order=order) if s.text_tokens else ref
        q_rows, x_rows = slice(q_at, q_at + s.num_tokens), slice(x_at, x_at + s.text_tokens)
        got = [o_src.detach()[q_rows], q_src.grad[q_rows], k_src.grad[x_rows], v_src.grad[x_rows]]
        for i, name in enumerate(TENSORS):
            errors.add("cross." + name, got[i], ref[i], permuted[i])
        q_at += s.num_tokens
        x_at += s.text_tokens


def check_rank(batch: _core.Batch, plan: _core.Plan, cfg: CheckConfig) -> CheckResult:
    """Runs on every rank of the initialised default group; returns the same result everywhere."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    step = prepare_step(batch, plan, cfg.num_heads, device, joint_attention=cfg.joint_attention)
    names = list(TENSORS)
    if cfg.joint_attention:
        names += [n + ".text" for n in TENSORS]
    elif cfg.cross_attention:
        names += ["cross." + n for n in TENSORS]
    errors = _Errors(names, device)
    _check_self(batch, step, cfg, dtype, device, errors)
    if cfg.cross_attention and not cfg.joint_attention:
        _check_cross(batch, step, cfg, dtype, device, errors)
    result = CheckResult(errors=errors.result(dtype))
    result.kernel = kernel_for(device, dtype, cfg.head_dim, cfg.backend or step.engine.backend).name
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


def _worker(rank, world_size, port, batch_json, checks, queue) -> None:
    from zellige.plan_io import plan_from_json
    from zellige.workload import batch_from_json

    torch.set_num_threads(1)
    init_process_group(rank, world_size, port, checks[0][1].device)
    try:
        batch = batch_from_json(batch_json)
        results = []
        for plan_json, cfg in checks:  # one process group for every plan
            if cfg.device == "cuda":
                cfg.device = f"cuda:{torch.cuda.current_device()}"
            result = check_rank(batch, plan_from_json(plan_json), cfg)
            results.append((result.errors, result.kernel))
        if rank == 0:
            queue.put(("ok", results))
    except ValueError as exc:  # a plan/batch mismatch: the same message on every rank
        if rank == 0:
            queue.put(("error", str(exc)))
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank_process()  # together, and without interpreter finalization (runtime/teardown.py)


def spawn_check(
    batch: _core.Batch, checks: list[tuple[_core.Plan, CheckConfig]], num_processes: int
) -> list[CheckResult]:
    """check_rank of each (plan, config) on `num_processes` fresh processes (gloo on CPU, NCCL
    on CUDA), all in one process group (same device for all). Raises the ranks' ValueError when
    a plan does not fit."""
    from zellige.plan_io import plan_to_json
    from zellige.workload import batch_to_json

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    jsons = [(plan_to_json(plan), cfg) for plan, cfg in checks]
    mp.spawn(
        _worker,
        args=(num_processes, free_port(), batch_to_json(batch), jsons, queue),
        nprocs=num_processes,
        join=True,
    )
    status, payload = queue.get()
    if status == "error":
        raise ValueError(payload)
    return [CheckResult(errors=errors, kernel=kernel) for errors, kernel in payload]
