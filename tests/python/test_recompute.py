"""Selective activation checkpointing (zellige.runtime.recompute): checkpointed blocks give the
gradients of blocks without checkpointing, and their recompute does not run attention again.
(Distributed plans, Ulysses and ring included: tests/distributed/test_train.py checkpoints every
block against a single-process reference without checkpointing.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from zellige.data.synthetic import grid_positions
from zellige.model import JointTokens, MMDiT, PackedTokens, VideoDiT, fused, model_preset
from zellige.model.mmdit import TEXT, VISUAL
from zellige.runtime import recompute
from zellige.runtime.recompute import checkpointed

aten = torch.ops.aten
# the CPU engine's kernel (runtime/kernels.py CpuFlashKernel): one forward op per dense call
ATTENTION_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _Runner(nn.Module):
    """A block run as `how` says: "none" (no checkpointing), "selective" (checkpointed()), or
    "full" (plain torch checkpoint: the whole block again, attention included)."""

    def __init__(self, block: nn.Module, how: str) -> None:
        super().__init__()
        self.block, self.how = block, how

    def forward(self, *args):
        if self.how == "selective":
            return checkpointed(self.block, *args)
        if self.how == "full":
            return checkpoint(self.block, *args, use_reentrant=False)
        return self.block(*args)


def _wrapped(model: nn.Module, how: str) -> nn.Module:
    for index, block in enumerate(model.blocks):
        model.blocks[index] = _Runner(block, how)
    return model


def _wan(how: str) -> tuple[nn.Module, PackedTokens]:
    config = model_preset("tiny-cpu")
    torch.manual_seed(0)
    model = VideoDiT(config).double()
    torch.nn.init.normal_(model.head.linear.weight, std=0.1)  # else every other gradient is 0
    grids, texts = [(1, 4, 4), (3, 4, 4), (1, 1, 7), (2, 3, 5)], [8, 0, 3, 5]
    lengths = [t * h * w for t, h, w in grids]
    generator = torch.Generator().manual_seed(1)
    tokens = PackedTokens(
        latents_TC=torch.randn(sum(lengths), config.token_channels, generator=generator).double(),
        positions_T3=torch.cat([grid_positions(*grid) for grid in grids]),
        timesteps_S=torch.rand(len(grids), generator=generator).double(),
        text_XE=torch.randn(sum(texts), config.text_dim, generator=generator).double(),
        tokens_per_sequence=lengths,
        text_tokens_per_sequence=texts,
    )
    return _wrapped(model, how), tokens


def _mmdit(how: str) -> tuple[nn.Module, JointTokens]:
    config = model_preset("mmdit-tiny-cpu")
    torch.manual_seed(0)
    model = MMDiT(config).double()
    torch.nn.init.normal_(model.head.linear.weight, std=0.1)
    generator = torch.Generator().manual_seed(1)
    modality, sequence, positions = [], [], []
    for index, (grid, text_tokens) in enumerate([((2, 3, 4), 8), ((1, 1, 1), 3), ((3, 2, 2), 0)]):
        modality += [TEXT] * text_tokens
        positions += [torch.tensor([k, 0, 0]) for k in range(text_tokens)]
        visual = grid_positions(*grid)
        modality += [VISUAL] * visual.shape[0]
        positions += list(visual)
        sequence += [index] * (text_tokens + visual.shape[0])
    num_visual = modality.count(VISUAL)
    tokens = JointTokens(
        latents_VC=torch.randn(num_visual, config.token_channels, generator=generator).double(),
        text_XE=torch.randn(modality.count(TEXT), config.text_dim, generator=generator).double(),
        modality_T=torch.tensor(modality, dtype=torch.int64),
        sequence_index_T=torch.tensor(sequence, dtype=torch.int64),
        positions_T3=torch.stack(positions).long(),
        timesteps_S=torch.rand(3, generator=generator, dtype=torch.float64),
    )
    return _wrapped(model, how), tokens


class _CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.forward_calls = self.backward_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forward_calls += func is ATTENTION_FORWARD
        self.backward_calls += func is ATTENTION_BACKWARD
        return func(*args, **(kwargs or {}))


def _step(make, how: str) -> tuple[torch.Tensor, list[torch.Tensor], _CountAttention]:
    model, tokens = make(how)
    with _CountAttention() as count:
        loss = model(tokens).square().sum()
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], count


@pytest.mark.parametrize("make", [_wan, _mmdit], ids=["wan", "mmdit"])
def test_selective_checkpointing_gives_the_gradients_without_checkpointing(make) -> None:
    loss, grads, _ = _step(make, "none")
    loss_s, grads_s, _ = _step(make, "selective")
    assert all(g.abs().max() > 0 for g in grads)
    torch.testing.assert_close(loss_s, loss, rtol=0, atol=0)
    for grad_s, grad in zip(grads_s, grads, strict=True):
        # the recompute repeats the same float64 arithmetic: bit for bit
        torch.testing.assert_close(grad_s, grad, rtol=0, atol=0)


@pytest.mark.parametrize("make", [_wan, _mmdit], ids=["wan", "mmdit"])
def test_the_recompute_runs_no_attention_kernel(make) -> None:
    """Forward + backward of checkpointed blocks calls the attention kernels' forward as often as
    without checkpointing; plain checkpointing calls it twice as often (so the count sees a
    recompute when there is one)."""
    _step(make, "none")  # the kernels' one-time check against math calls them too: done first
    counts = {how: _step(make, how)[2] for how in ("none", "selective", "full")}
    plain = counts["none"]
    assert plain.forward_calls > 0 and plain.backward_calls == plain.forward_calls
    assert counts["selective"].forward_calls == plain.forward_calls
    assert counts["selective"].backward_calls == plain.backward_calls
    assert counts["full"].forward_calls == 2 * plain.forward_calls


def test_selective_checkpointing_with_compiled_regions() -> None:
    """The compiled per-token regions (aot_eager: the same graphs as on a GPU) inside
    checkpointed blocks give the eager gradients without checkpointing and re-run no attention."""
    loss, grads, plain = _step(_wan, "none")
    torch._dynamo.reset()
    fused.use_compiled(True, backend="aot_eager")
    try:
        loss_c, grads_c, count = _step(_wan, "selective")
    finally:
        fused.use_compiled(False)
    torch.testing.assert_close(loss_c, loss, rtol=1e-12, atol=0)
    for grad_c, grad in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(grad_c, grad, rtol=1e-10, atol=1e-12)
    assert count.forward_calls == plain.forward_calls


def test_an_attention_output_changed_in_place_is_an_error() -> None:
    """The kept outputs are the forward's tensors: an in-place change after the forward must not
    silently reach the backward."""
    from zellige.model import local_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(6, 2, 4, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    attend = local_attention([6], [6], "cpu")
    outputs = []

    def block(q, k, v):
        o = attend(q, k, v)
        outputs.append(o)
        return o * 2

    out = checkpointed(block, q, k, v)
    with torch.no_grad():
        outputs[0].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


@pytest.mark.parametrize("make", [_wan, _mmdit], ids=["wan", "mmdit"])
def test_kept_outputs_only_in_checkpointed_blocks_and_released_by_the_backward(
    make, monkeypatch
) -> None:
    """Blocks without checkpointing keep nothing in recompute's store (their attention outputs
    are held by autograd alone, once); checkpointed blocks keep one entry per attention call,
    and the backward takes every entry back (none outlives the step)."""
    kept: list = []
    original = recompute._Kept.__init__

    def counting(self, tensors) -> None:
        original(self, tensors)
        kept.append(self)

    monkeypatch.setattr(recompute._Kept, "__init__", counting)
    stores = []
    contexts = recompute._contexts

    def recording():
        forward, replay = contexts()
        stores.append(replay.mode[1])
        return forward, replay

    monkeypatch.setattr(recompute, "_contexts", recording)
    _, _, count = _step(make, "none")
    assert count.forward_calls > 0 and kept == []
    assert getattr(recompute._state, "mode", None) is None

    model, tokens = make("selective")
    model(tokens).square().sum().backward()
    assert len(kept) > 0 and len(stores) == len(model.blocks)
    assert all(len(store) == 0 for store in stores)
    assert getattr(recompute._state, "mode", None) is None
