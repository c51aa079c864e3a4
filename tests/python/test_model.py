"""The reference DiT on one process: packing, RoPE and segment attention against oracles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from zellige.data.synthetic import grid_positions
from zellige.model import ModelNumerics, PackedTokens, VideoDiT, local_attention, model_preset
from zellige.model.rope import rope_axis_dims

CONFIG = model_preset("tiny-cpu")
GRIDS = [(1, 4, 4), (1, 4, 4), (3, 4, 4), (1, 1, 7), (2, 3, 5)]
TEXT_TOKENS = [8, 8, 0, 3, 5]


def _model(seed: int = 0, numerics: ModelNumerics | None = None) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(CONFIG, numerics or ModelNumerics()).double()
    # the zero-initialised output layer would hide everything upstream from these tests
    torch.nn.init.normal_(model.head.linear.weight, std=0.1)
    return model


def _packed(grids, text_tokens, seed: int = 0) -> PackedTokens:
    generator = torch.Generator().manual_seed(seed)
    lengths = [t * h * w for t, h, w in grids]
    return PackedTokens(
        latents_TC=torch.randn(sum(lengths), CONFIG.token_channels, generator=generator).double(),
        positions_T3=torch.cat([grid_positions(*grid) for grid in grids]),
        timesteps_S=torch.rand(len(grids), generator=generator).double(),
        text_XE=torch.randn(sum(text_tokens), CONFIG.text_dim, generator=generator).double(),
        tokens_per_sequence=lengths,
        text_tokens_per_sequence=list(text_tokens),
    )


def _select(packed: PackedTokens, index: int) -> PackedTokens:
    lengths, texts = list(packed.tokens_per_sequence), list(packed.text_tokens_per_sequence)
    start, text_start = sum(lengths[:index]), sum(texts[:index])
    tokens = slice(start, start + lengths[index])
    return PackedTokens(
        latents_TC=packed.latents_TC[tokens],
        positions_T3=packed.positions_T3[tokens],
        timesteps_S=packed.timesteps_S[index : index + 1],
        text_XE=packed.text_XE[text_start : text_start + texts[index]],
        tokens_per_sequence=[lengths[index]],
        text_tokens_per_sequence=[texts[index]],
    )


def test_packing_equals_each_sequence_alone() -> None:
    model, packed = _model(), _packed(GRIDS, TEXT_TOKENS)
    together = model(packed)
    alone = torch.cat([model(_select(packed, i)) for i in range(len(GRIDS))])
    assert together.shape == (packed.latents_TC.shape[0], CONFIG.token_channels)
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-12)


def test_rope_follows_each_tokens_own_position() -> None:
    # Shuffling a sequence's tokens (positions travel with them) must shuffle the output the same
    # way: attention is order-free and RoPE reads only (t, h, w).
    model, packed = _model(), _select(_packed(GRIDS, TEXT_TOKENS), 4)
    permutation = torch.randperm(
        packed.latents_TC.shape[0], generator=torch.Generator().manual_seed(1)
    )
    shuffled = _select(packed, 0)
    shuffled.latents_TC = packed.latents_TC[permutation]
    shuffled.positions_T3 = packed.positions_T3[permutation]
    torch.testing.assert_close(model(shuffled), model(packed)[permutation], rtol=0, atol=1e-12)
    # RoPE is relative: a shift of every position changes nothing, a stretch of one axis does
    shifted, stretched = _select(packed, 0), _select(packed, 0)
    shifted.positions_T3 = packed.positions_T3 + torch.tensor([3, 1, 2])
    stretched.positions_T3 = packed.positions_T3 * torch.tensor([1, 2, 1])
    torch.testing.assert_close(model(shifted), model(packed), rtol=0, atol=1e-12)
    assert not torch.allclose(model(stretched), model(packed))


def test_rope_axis_split_covers_head_dim() -> None:
    for head_dim in (16, 64, 128):
        dims = rope_axis_dims(head_dim)
        assert sum(dims) == head_dim and all(d % 2 == 0 and d > 0 for d in dims)


@pytest.mark.parametrize(
    "q_lengths,kv_lengths",
    [([5], [5]), ([3, 3, 4, 3], [3, 3, 4, 3]), ([4, 2, 4, 1], [6, 0, 6, 2]), ([0, 2], [1, 3])],
    ids=["one-segment", "equal-lengths-grouped", "cross-with-empty-text", "empty-query"],
)
def test_segment_attention_matches_per_segment_loop(q_lengths, kv_lengths) -> None:
    generator = torch.Generator().manual_seed(0)
    num_heads, head_dim = 3, 8
    q = torch.randn(sum(q_lengths), num_heads, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(sum(kv_lengths), num_heads, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(sum(kv_lengths), num_heads, head_dim, generator=generator, dtype=torch.float64)
    expected, q_start, kv_start = [], 0, 0
    for q_len, kv_len in zip(q_lengths, kv_lengths, strict=True):
        qs, ks, vs = (
            t.transpose(0, 1)
            for t in (
                q[q_start : q_start + q_len],
                k[kv_start : kv_start + kv_len],
                v[kv_start : kv_start + kv_len],
            )
        )
        if kv_len == 0:
            expected.append(torch.zeros(q_len, num_heads, head_dim, dtype=torch.float64))
        else:
            expected.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    out = local_attention(q_lengths, kv_lengths, "cpu")(q, k, v)
    torch.testing.assert_close(out, torch.cat(expected), rtol=0, atol=1e-14)


def test_presets_match_public_parameter_counts() -> None:
    # Wan 2.1 reports 1.3B and 14B parameters; our blocks reproduce its layer shapes
    expected = {"wan-1.3b": 1.42e9, "wan-14b": 14.29e9}
    for name, params in expected.items():
        with torch.device("meta"):
            model = VideoDiT(model_preset(name))
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - params) / params < 0.01, (name, count)


def _per_token_case(num_sequences: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows [S, 6, 4], index: each token's sequence, 1-4 tokens a sequence, grad [T, 6, 4]),
    float64."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_sequences, 6, 4, generator=generator, dtype=torch.float64)
    counts = torch.randint(1, 5, (num_sequences,), generator=generator)
    index = torch.repeat_interleave(torch.arange(num_sequences), counts)
    grad = torch.randn(index.numel(), 6, 4, generator=generator, dtype=torch.float64)
    return rows, index, grad


@pytest.mark.parametrize("multiple", [8, 1], ids=["padded", "unpadded"])
@pytest.mark.parametrize("num_sequences", [0, 1, 5, 8, 9], ids=["0", "1", "5", "8", "9"])
def test_per_token_rows_equal_indexing_forward_and_backward(
    num_sequences: int, multiple: int
) -> None:
    from zellige.model.conditioning import per_token

    numerics = ModelNumerics(row_multiple=multiple)
    rows, index, grad = _per_token_case(num_sequences, seed=0)
    ours, reference = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out = per_token(ours, index, numerics)
    out.backward(grad)
    reference[index].backward(grad)
    torch.testing.assert_close(out, rows[index], rtol=0, atol=0)
    torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("multiple", [8, 1], ids=["padded", "unpadded"])
@pytest.mark.parametrize("num_sequences", [0, 1, 5, 9], ids=["0", "1", "5", "9"])
def test_split_pieces_and_gathered_rows_equal_indexing(num_sequences: int, multiple: int) -> None:
    """per_token_pieces with one GEMM a piece, and gathered_pieces (indexing forward, one-hot
    GEMM backward): indexing's values exactly, its row gradients in float64; a piece whose
    gradient does not come (the gate of a block's last region unused, say) counts as zero."""
    from zellige.model.conditioning import gathered_pieces, per_token_pieces

    numerics = ModelNumerics(row_multiple=multiple, split_pieces=True)
    rows, index, grad = _per_token_case(num_sequences, seed=1)
    grad[:, 2] = 0  # the piece below that gets no gradient
    reference = rows.clone().requires_grad_()
    reference[index].backward(grad)

    split = rows.clone().requires_grad_()
    pieces = per_token_pieces(split, index, numerics)
    assert len(pieces) == 6
    for k, piece in enumerate(pieces):
        torch.testing.assert_close(piece, rows[index][:, k], rtol=0, atol=0)
    used = [k for k in range(6) if k != 2]
    torch.autograd.backward([pieces[k] for k in used], [grad[:, k] for k in used])
    torch.testing.assert_close(split.grad, reference.grad, rtol=1e-15, atol=1e-15)

    gathered = rows.clone().requires_grad_()
    pieces = gathered_pieces(gathered, index, multiple)
    for k, piece in enumerate(pieces):
        torch.testing.assert_close(piece, rows[index][:, k], rtol=0, atol=0)
    torch.autograd.backward([pieces[k] for k in used], [grad[:, k] for k in used])
    torch.testing.assert_close(gathered.grad, reference.grad, rtol=1e-15, atol=1e-15)


def test_split_pieces_make_no_stack_in_the_backward() -> None:
    """The reason for the split: unbinding per_token's [T, K, D] stacks the K gradients back into
    one [T, K, D] tensor in the backward; one GEMM a piece stacks only the [S, K, D] rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zellige.model.conditioning import per_token_pieces

    class Stacks(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("stack", "cat")):
                self.shapes.append(tuple(out.shape))
            return out

    rows = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 0, 1, 2, 2, 2, 2])
    for split, largest in ((False, 7 * 6 * 4), (True, 8 * 6 * 4)):
        pieces = per_token_pieces(rows, index, ModelNumerics(split_pieces=split))
        with Stacks() as stacks:
            sum(piece.sum() for piece in pieces).backward()
        rows.grad = None
        sizes = [torch.Size(shape).numel() for shape in stacks.shapes]
        if split:  # only rows: the 8 padded sequences' [8, 6, 4]
            assert all(size <= largest for size in sizes) and 7 * 6 * 4 not in sizes
        else:
            assert largest in sizes


def test_per_token_one_hot_rows_are_16_byte_aligned() -> None:
    """The one-hot GEMM's operands have a sequence count padded to a multiple of 8 (bf16 rows of
    16 bytes: cuBLAS's aligned kernels), whatever the sequence count."""
    from torch.overrides import TorchFunctionMode

    from zellige.model.conditioning import per_token

    class Shapes(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("matmul", "__matmul__"):
                self.seen.append((tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    for num_sequences in (1, 21):
        rows = torch.randn(num_sequences, 6, 16, dtype=torch.bfloat16)
        index = torch.arange(num_sequences).repeat_interleave(3)
        with Shapes() as shapes:
            per_token(rows, index)
        ((one_hot, table),) = shapes.seen
        assert one_hot == (3 * num_sequences, 8 * -(-num_sequences // 8))
        assert table == (one_hot[1], 6 * 16)


class Recomputed(torch.nn.Module):
    """A block recomputed in the backward (activation checkpointing, as training's BlockRunner)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


@pytest.mark.parametrize("outside", [True, False], ids=["outside-compiled", "outside-eager"])
@pytest.mark.parametrize(
    "split, gathered",
    [(False, True), (False, False), (True, True)],
    ids=["default", "one-hot-head", "split"],
)
def test_compiled_regions_equal_eager_and_compile_once(
    outside: bool, split: bool, gathered: bool
) -> None:
    """The blocks' fused regions under torch.compile (aot_eager: the same graphs and
    partitioner as on a GPU, without code generation) give eager's loss and gradients, and
    compile on the first step only: later steps of other token, text and sequence counts (one
    sequence, whose attention output is one kernel call's; a token count equal to the width;
    the first block recomputed or not) reuse its graphs. A counting backend counts every
    graph torch.compile makes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from zellige.model import fused

    numerics = ModelNumerics(split_pieces=split, gathered_head=gathered)

    def loss_and_grads(packed: PackedTokens, recompute: bool) -> tuple[Tensor, list[Tensor]]:
        model = _model(numerics=numerics)
        if recompute:
            model.blocks[0] = Recomputed(model.blocks[0])
        loss = model(packed).square().sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    assert CONFIG.width == 64
    steps = [
        (_packed(GRIDS, TEXT_TOKENS, seed=1), False),
        (_packed(GRIDS[1:], TEXT_TOKENS[1:], seed=2), True),
        (_packed([(2, 3, 5)], [5], seed=3), False),  # one sequence
        (_packed([(1, 4, 4), (3, 4, 4)], [32, 32], seed=4), True),  # 64 tokens, 64 text
        (_packed([(2, 2, 3), (1, 3, 3)], [4, 6], seed=5), False),
        (_packed([(1, 1, 7)], [3], seed=6), True),
    ]
    eager = [loss_and_grads(*step) for step in steps]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fused.use_compiled(True, backend=counter, outside=outside)
    try:
        compiled = [loss_and_grads(*steps[0])]
        graphs_first_step = counter.frame_count
        compiled += [loss_and_grads(*step) for step in steps[1:]]
    finally:
        fused.use_compiled(False)
    for (loss, grads), (loss_c, grads_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(loss_c, loss, rtol=1e-12, atol=0)
        for grad, grad_c in zip(grads, grads_c, strict=True):
            torch.testing.assert_close(grad_c, grad, rtol=1e-10, atol=1e-12)
    # the four regions of a block, and outside the blocks the RoPE tables and the output head
    assert graphs_first_step == 4 + 2 * outside
    assert counter.frame_count == graphs_first_step  # no compilation after the first step


def test_split_modulation_and_gathered_head_leave_loss_and_gradients() -> None:
    """ModelNumerics' split_pieces and gathered_head change where the per-token rows are made,
    not what they are: the same loss (the one-hot GEMMs and the gather select exactly) and, in
    float64, the same gradients as the default model, recomputed block or not."""

    def loss_and_grads(split: bool, gathered: bool) -> tuple[Tensor, list[Tensor]]:
        model = _model(numerics=ModelNumerics(split_pieces=split, gathered_head=gathered))
        model.blocks[1] = Recomputed(model.blocks[1])
        loss = model(_packed(GRIDS, TEXT_TOKENS, seed=7)).square().sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = loss_and_grads(False, False)
    for split, gathered in ((True, False), (False, True), (True, True)):
        loss_v, grads_v = loss_and_grads(split, gathered)
        torch.testing.assert_close(loss_v, loss, rtol=0, atol=0)
        for grad, grad_v in zip(grads, grads_v, strict=True):
            torch.testing.assert_close(grad_v, grad, rtol=1e-12, atol=1e-14)


def test_compiled_loss_equals_eager_and_compiles_once() -> None:
    """The loss region (squared_error_sum) over token counts 1..: eager's value and gradient,
    one graph for every count above 1 (a count of 1 is specialised once, like every region)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from zellige.model import fused

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fused.use_compiled(True, backend=counter)
    try:
        for tokens in (5, 9, 2, 33):
            predicted = torch.randn(tokens, 4, dtype=torch.float64, requires_grad=True)
            target = torch.randn(tokens, 4, dtype=torch.float64)
            loss = fused.kernels["squared_error_sum"](predicted, target)
            (grad,) = torch.autograd.grad(loss, predicted)
            expected = (predicted - target).square().mean(dim=1).sum()
            torch.testing.assert_close(loss, expected, rtol=1e-14, atol=0)
            torch.testing.assert_close(grad, (predicted - target).detach() / 2, rtol=1e-14, atol=0)
    finally:
        fused.use_compiled(False)
    assert counter.frame_count == 1


def test_compiled_region_ignores_the_calling_threads_thread_count() -> None:
    """On a GPU the backward (with the recompute of checkpointed blocks) runs on another host
    thread, whose thread count torch.compile would otherwise guard on: no second graph."""
    import threading

    from torch._dynamo.testing import CompileCounterWithBackend

    from zellige.model import fused

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fused.use_compiled(True, backend=counter)
    threads = torch.get_num_threads()
    x, y, gate = (torch.randn(5, 8, dtype=torch.float64) for _ in range(3))
    try:
        fused.kernels["gated_residual"](x, y, gate)
        compiled = counter.frame_count

        def other_thread() -> None:
            torch.set_num_threads(threads + 1)
            fused.kernels["gated_residual"](x[:4], y[:4], gate[:4])

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    finally:
        fused.use_compiled(False)
        torch.set_num_threads(threads)
    assert compiled == 1
    assert counter.frame_count == compiled


def test_compiled_region_keeps_widths_static_across_models() -> None:
    """Only the token dim is dynamic: a region called for a second and a third model width
    compiles a graph for each (static widths, as fast as the first), instead of one graph
    generic in the width from the second call on (torch.compile's automatic dynamic)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from zellige.model import fused

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fused.use_compiled(True, backend=counter)
    try:
        for tokens, width in [(5, 8), (7, 8), (6, 12), (9, 12), (4, 16)]:
            x, y, gate = (torch.randn(tokens, width, dtype=torch.float64) for _ in range(3))
            fused.kernels["gated_residual"](x, y, gate)
    finally:
        fused.use_compiled(False)
    assert counter.frame_count == 3  # one graph per width, none per token count
