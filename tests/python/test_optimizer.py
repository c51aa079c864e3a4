"""CopyingAdamW (zellige.train.optimizer): torch.optim.AdamW's update, the copies it writes, its
state, and its compiled form (no recompilation across steps)."""

from __future__ import annotations

import pytest
import torch

from zellige.train.optimizer import CopyingAdamW

OPTIONS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (7, 5), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=generator, dtype=dtype)) for s in shapes]


def _grads(params, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]


def _train(optimizer, params, steps: int, scale: float | None, copies_dtype=None):
    """Steps with fixed gradients (divided by `scale` through grad_scale where given); returns
    each step's copies (CopyingAdamW) or None."""
    written = []
    for step in range(steps):
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g.clone()
        if scale is not None:
            optimizer.grad_scale = torch.tensor(scale, dtype=torch.float32)
        copies = None
        if isinstance(optimizer, CopyingAdamW):
            copies = {id(p): torch.empty_like(p, dtype=copies_dtype or p.dtype) for p in params}
            optimizer.copies_out = copies
        optimizer.step()
        optimizer.grad_scale = None
        written.append(None if copies is None else [copies[id(p)].clone() for p in params])
        for p in params:
            p.grad = None
    return written


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("scale", [None, 3.0], ids=["unscaled", "grad-scale"])
def test_update_matches_torch_adamw(dtype: torch.dtype, scale: float | None) -> None:
    """Five steps against torch.optim.AdamW (its grad_scale through the fused CPU kernel; without
    one, its single-tensor form): the same parameters and moments up to the rounding of a
    different evaluation order; the copies are the new parameters in the copy dtype."""
    ours, theirs = _params(dtype), _params(dtype)
    optimizer = CopyingAdamW(ours, chunks=[ours[:2], ours[2:]], **OPTIONS)
    reference = torch.optim.AdamW(theirs, fused=scale is not None, **OPTIONS)
    written = _train(optimizer, ours, 5, scale, copies_dtype=torch.bfloat16)
    _train(reference, theirs, 5, scale)
    tolerance = 1e-14 if dtype == torch.float64 else 2e-6
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=tolerance, atol=tolerance)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                optimizer.state[p][key], reference.state[q][key], rtol=tolerance, atol=1e-30
            )
        assert float(optimizer.state[p]["step"]) == 5.0
    for copy, p in zip(written[-1], ours, strict=True):
        assert copy.dtype == torch.bfloat16
        assert torch.equal(copy, p.detach().to(torch.bfloat16))
    # the same five steps with a 1% larger learning rate are far outside that tolerance
    other = _params(dtype)
    _train(CopyingAdamW(other, **(OPTIONS | {"lr": 1.01e-2})), other, 5, scale)
    assert not torch.allclose(other[0], theirs[0], rtol=100 * tolerance, atol=0)


def test_state_loads_into_torch_adamw_and_back() -> None:
    """A checkpoint of either optimizer continues in the other: torch's state layout."""
    ours, theirs = _params(torch.float64), _params(torch.float64)
    optimizer = CopyingAdamW(ours, **OPTIONS)
    reference = torch.optim.AdamW(theirs, **OPTIONS)
    _train(optimizer, ours, 2, None)
    _train(reference, theirs, 2, None)
    swapped = torch.optim.AdamW(ours, **OPTIONS)
    swapped.load_state_dict(optimizer.state_dict())
    back = CopyingAdamW(theirs, **OPTIONS)
    back.load_state_dict(reference.state_dict())
    for step in range(2, 4):  # continue crossed over: the two runs stay together
        for params, opt in ((ours, swapped), (theirs, back)):
            for p, g in zip(params, _grads(params, step), strict=True):
                p.grad = g
            if isinstance(opt, CopyingAdamW):
                opt.copies_out = {id(p): torch.empty_like(p) for p in params}
            opt.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-14)


def test_compiled_update_equals_eager_and_compiles_once() -> None:
    """Compiled (aot_eager: the graphs a GPU gets, without code generation): eager's result,
    and one graph per chunk shape for every step, whatever the learning rate and step count
    (they reach the graph as device tensors, not as constants)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    eager, compiled = _params(torch.float32), _params(torch.float32)
    # two chunks of the same shapes (two blocks) and one of others (the root)
    chunks = lambda ps: [ps[:1], ps[1:2], ps[2:]]  # noqa: E731
    reference = CopyingAdamW(eager, chunks=chunks(eager), **OPTIONS)
    optimizer = CopyingAdamW(compiled, chunks=chunks(compiled), compiled=counter, **OPTIONS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
    scheduler_eager = torch.optim.lr_scheduler.LambdaLR(reference, lambda s: (s + 1) / 4)
    for step in range(4):
        _train(optimizer, compiled, 1, 2.0)
        _train(reference, eager, 1, 2.0)
        scheduler.step()
        scheduler_eager.step()
        if step == 0:
            graphs = counter.frame_count
    for p, q in zip(compiled, eager, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert graphs == 2  # chunk shapes [(7, 5)] (twice: one graph) and [(3, 4, 2)]
    assert counter.frame_count == graphs


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        CopyingAdamW(_params(torch.float32), amsgrad=True)


def test_compiled_update_keeps_compiling_past_eight_chunk_shapes() -> None:
    """One process may train several models (a benchmark): the chunk update compiles a graph for
    each of ten chunk shapes instead of falling back to eager after torch.compile's default
    limit of eight."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    params = [torch.nn.Parameter(torch.randn(n + 1)) for n in range(10)]
    optimizer = CopyingAdamW(params, chunks=[[p] for p in params], compiled=counter, **OPTIONS)
    _train(optimizer, params, 1, None)
    assert counter.frame_count == 10


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_tuned_update_asks_inductor_to_time_launch_configurations(backend, monkeypatch) -> None:
    """tuned=True: the chunk update compiles with inductor's pointwise autotuning and coordinate
    descent (launch configurations timed on the device, the same arithmetic); other backends
    and tuned=False compile as before."""
    seen = []

    def compile_spy(fn, **kwargs):
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", compile_spy)
    for tuned in (True, False):
        CopyingAdamW(_params(torch.float32), compiled=backend, tuned=tuned, **OPTIONS)
    tuned_options, plain_options = (kwargs["options"] for kwargs in seen)
    assert plain_options is None
    if backend == "inductor":
        assert tuned_options == {"max_autotune_pointwise": True, "coordinate_descent_tuning": True}
    else:
        assert tuned_options is None
    assert all(kwargs["backend"] == backend and kwargs["dynamic"] is False for kwargs in seen)
