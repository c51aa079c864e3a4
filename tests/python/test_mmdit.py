"""The MMDiT on one process: held-token sharding against the whole-sequence model, and the
planning core's ModelSpec against what the module holds and executes."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import zellige
from zellige.data.synthetic import grid_positions
from zellige.model import JointTokens, MMDiT, ModelNumerics, VideoDiT, build_model, model_preset
from zellige.model.config import model_entry
from zellige.model.mmdit import TEXT, VISUAL, StreamOrder, whole_sequence_attention

CONFIG = model_preset("mmdit-tiny-cpu")
# (grid, text tokens): a 1-token video, a textless one, text longer than the video
SEQUENCES = [((2, 3, 4), 8), ((1, 1, 1), 3), ((3, 2, 2), 0), ((1, 2, 3), 9)]


def _model(config=CONFIG, seed: int = 0, numerics: ModelNumerics | None = None) -> MMDiT:
    torch.manual_seed(seed)
    model = MMDiT(config, numerics or ModelNumerics()).double()
    # the zero-initialised output layer would hide everything upstream from these tests
    torch.nn.init.normal_(model.head.linear.weight, std=0.1)
    return model


def _joint_rows(seed: int = 0):
    """Per sequence: its joint token list (text first), as rows of a table with the sequence,
    modality, position and features of each token."""
    generator = torch.Generator().manual_seed(seed)
    rows = []  # (sequence, modality, position [3], feature)
    for index, (grid, text_tokens) in enumerate(SEQUENCES):
        for k in range(text_tokens):
            feature = torch.randn(CONFIG.text_dim, generator=generator, dtype=torch.float64)
            rows.append((index, TEXT, torch.tensor([k, 0, 0]), feature))
        for position in grid_positions(*grid):
            feature = torch.randn(CONFIG.token_channels, generator=generator, dtype=torch.float64)
            rows.append((index, VISUAL, position, feature))
    timesteps = torch.rand(len(SEQUENCES), generator=generator, dtype=torch.float64)
    return rows, timesteps


def _tokens(rows, timesteps, sequences: list[int]) -> JointTokens:
    """A held buffer of `rows` (any order); local sequence s is global sequences[s]."""
    local = {global_index: s for s, global_index in enumerate(sequences)}
    modality = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    visual = [r[3] for r in rows if r[1] == VISUAL]
    text = [r[3] for r in rows if r[1] == TEXT]
    return JointTokens(
        latents_VC=torch.stack(visual) if visual else torch.zeros(0, CONFIG.token_channels),
        text_XE=torch.stack(text) if text else torch.zeros(0, CONFIG.text_dim).double(),
        modality_T=modality,
        sequence_index_T=torch.tensor([local[r[0]] for r in rows], dtype=torch.int64),
        positions_T3=torch.stack([r[2] for r in rows]).long(),
        timesteps_S=timesteps[sequences],
    )


class ThreadedRanks:
    """R ranks as threads that meet in every attention call: each posts its q, k, v and the
    global sequence of each row; each then attends its rows to every rank's rows of the same
    sequence (autograd spans the threads, as a distributed runtime's exchanges would)."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks)
        self.posts: dict[tuple[int, int], tuple] = {}
        self.num_ranks = num_ranks

    def attention(self, rank: int, global_sequence_T: torch.Tensor):
        calls = [0]

        def attend(q, k, v):
            call = calls[0]
            calls[0] += 1
            self.posts[call, rank] = (q, k, v, global_sequence_T)
            self.barrier.wait()
            parts = [self.posts[call, r] for r in range(self.num_ranks)]
            q_all, k_all, v_all, sequence_all = (torch.cat(p) for p in zip(*parts, strict=True))
            start = sum(p[0].shape[0] for p in parts[:rank])
            o_all = whole_sequence_attention(sequence_all)(q_all, k_all, v_all)
            return o_all[start : start + q.shape[0]]

        return attend


def test_sharded_held_tokens_equal_the_whole_sequence_model() -> None:
    rows, timesteps = _joint_rows()
    model = _model()
    target = torch.randn(sum(r[1] == VISUAL for r in rows), CONFIG.token_channels).double()
    target_of = {}
    visual_rows = [i for i, r in enumerate(rows) if r[1] == VISUAL]
    for j, i in enumerate(visual_rows):
        target_of[i] = target[j]

    whole = model(_tokens(rows, timesteps, list(range(len(SEQUENCES)))))
    loss = (whole - target).square().sum()
    loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert all(g.abs().max() > 0 for g in want.values())
    model.zero_grad()

    # 3 ranks: sequence 0's joint list (8 text + 24 visual) cut in 3 with the first cut inside
    # its text; sequence 3 cut in 2 at a text/visual boundary; the others whole; every rank's
    # buffer in a shuffled order (the model must not care where a token sits)
    starts = {}
    offset = 0
    for index, (grid, text_tokens) in enumerate(SEQUENCES):
        starts[index] = offset
        offset += text_tokens + grid[0] * grid[1] * grid[2]
    s0, s3 = starts[0], starts[3]
    held = [
        list(range(s0, s0 + 5)) + list(range(starts[1], starts[2])) + list(range(s3, s3 + 9)),
        list(range(s0 + 5, s0 + 20)) + list(range(starts[2], s3)),
        list(range(s0 + 20, starts[1])) + list(range(s3 + 9, len(rows))),
    ]
    assert sorted(sum(held, [])) == list(range(len(rows)))
    generator = torch.Generator().manual_seed(1)
    held = [[h[i] for i in torch.randperm(len(h), generator=generator)] for h in held]

    ranks = ThreadedRanks(len(held))
    outputs: list = [None] * len(held)
    errors = []

    def run(rank: int) -> None:
        try:
            rank_rows = [rows[i] for i in held[rank]]
            sequences = sorted({r[0] for r in rank_rows})
            tokens = _tokens(rank_rows, timesteps, sequences)
            global_sequence = torch.tensor([r[0] for r in rank_rows])
            outputs[rank] = model(tokens, ranks.attention(rank, global_sequence))
        except BaseException as error:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(error)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(held))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    loss_sharded = 0
    for rank, output in enumerate(outputs):
        rank_visual = [i for i in held[rank] if rows[i][1] == VISUAL]
        rank_target = torch.stack([target_of[i] for i in rank_visual])
        loss_sharded = loss_sharded + (output - rank_target).square().sum()
        want_output = whole[[visual_rows.index(i) for i in rank_visual]]
        torch.testing.assert_close(output, want_output, rtol=1e-12, atol=1e-13)
    loss_sharded.backward()
    torch.testing.assert_close(loss_sharded, loss, rtol=1e-12, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-13, msg=name)


def test_the_stream_order_from_host_tables_equals_the_derived_one() -> None:
    """StreamOrder.from_host (what mmdit_step.py builds from the step program, no read back)
    gives the same order, text count and per-stream tables as StreamOrder.of, and the model
    gives the same velocity with either."""
    rows, timesteps = _joint_rows(seed=3)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(4)).tolist()
    tokens = _tokens([rows[i] for i in order], timesteps, [0, 1, 2, 3])
    modality = tokens.modality_T.numpy()
    host = StreamOrder.from_host(
        (modality == TEXT).nonzero()[0],
        (modality == VISUAL).nonzero()[0],
        tokens.sequence_index_T.numpy(),
        torch.device("cpu"),
    )
    derived = StreamOrder.of(tokens.modality_T, tokens.sequence_index_T)
    assert host.num_text == derived.num_text == sum(r[1] == TEXT for r in rows)
    for name in ("order", "sequence_index_X", "sequence_index_V"):
        assert torch.equal(getattr(host, name), getattr(derived, name)), name
    model = _model()
    expected = model(tokens)
    tokens.streams = host
    assert torch.equal(model(tokens), expected)


def test_only_double_blocks_still_give_every_weight_a_gradient() -> None:
    config = model_preset("mmdit-tiny-cpu", num_layers=2, num_double_layers=2)
    model = _model(config)
    rows, timesteps = _joint_rows()
    model(_tokens(rows, timesteps, list(range(len(SEQUENCES))))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_block_parameters_match_model_spec() -> None:
    """The planning core's preset counts the blocks' weight matrices (cpp/src/model_spec.cc);
    the module's blocks hold exactly those plus biases and norm weights; the spec the planner
    gets from the module (zellige.data.model_spec) counts all of the module's parameters."""
    for name in ("mmdit-11b", "hunyuan-13b", "mmdit-tiny-cpu"):
        config = model_preset(name)
        with torch.device("meta"):
            model = MMDiT(config)
        matrices = sum(
            m.weight.numel() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)
        )
        spec = zellige.data.model_spec(config)
        assert spec.joint_attention and spec.num_double_layers == config.num_double_layers
        everything = sum(p.numel() for p in model.parameters())
        assert spec.param_count == everything
        # the planning core's preset of these sizes (the registry's entry names it)
        preset = model_entry(name).spec
        assert (preset.width, preset.num_layers, preset.num_double_layers) == (
            config.width,
            config.num_layers,
            config.num_double_layers,
        )
        assert (preset.num_heads, preset.ffn_width, preset.text_tokens) == (
            config.num_heads,
            config.ffn_width,
            config.text_tokens,
        )
        assert preset.param_count == matrices
        # FLUX.1 reports 12B parameters (our text / time embeddings are smaller than its)
        assert name == "mmdit-tiny-cpu" or 11.5e9 < everything < 13.5e9, (name, everything)


@pytest.mark.parametrize("num_double_layers", [2, 1])
def test_forward_flops_match_model_spec(num_double_layers: int) -> None:
    """What the blocks execute for one sequence equals ModelSpec's layer FLOPs (linear + joint
    attention over text + visual), plus the AdaLN work it leaves out: the per-sequence
    modulation linears and their expansion to tokens (a one-hot matmul, conditioning.per_token).
    Attention is one SDPA call (the sequence alone) on the math backend: bmm calls the counter
    sees."""
    # counted without per_token's zero padding rows (their multiplications are not the model's)
    config = model_preset("mmdit-tiny-cpu", num_double_layers=num_double_layers)
    model = _model(config, numerics=ModelNumerics(row_multiple=1))
    rows, timesteps = _joint_rows()
    rows = [r for r in rows if r[0] == 0]  # one sequence: 8 text + 24 visual tokens
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(_tokens(rows, timesteps, [0]), _dense_attention)
    counts = counter.get_flop_counts()
    block_flops = sum(
        sum(ops.values())
        for module, ops in counts.items()
        if module.count(".") == 2 and ".blocks." in module
    )
    spec = zellige.data.model_spec(config)
    layer = zellige._core.layer_forward_flops(spec, 24, 8)
    d = config.width
    # linears: 6 vectors per stream (double) or 3 (single) for the one sequence; expansion: 6
    # (double, each token in its own stream) or 3 (single) per token
    linears = 2 * d * d * (2 * 6 * num_double_layers + 3 * config.num_single_layers)
    expansion = 2 * (24 + 8) * d * (6 * num_double_layers + 3 * config.num_single_layers)
    adaln = linears + expansion
    expected = config.num_layers * (layer.linear + layer.self_attention) + adaln
    assert block_flops == expected
    assert zellige.train_flops(spec, 24, 8) == 3 * config.num_layers * (
        layer.linear + layer.self_attention
    )


def _dense_attention(q_TNH, k_TNH, v_TNH):
    q, k, v = (t.transpose(0, 1) for t in (q_TNH, k_TNH, v_TNH))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(0, 1)


def test_build_model_picks_the_architecture() -> None:
    assert isinstance(build_model(CONFIG), MMDiT)
    assert isinstance(build_model(model_preset("tiny-cpu")), VideoDiT)
    with pytest.raises(ValueError, match="joint-attention"):
        VideoDiT(CONFIG)
    with pytest.raises(ValueError, match="joint-attention config"):
        MMDiT(model_preset("tiny-cpu"))
    with pytest.raises(ValueError, match="num_double_layers"):
        model_preset("mmdit-tiny-cpu", num_double_layers=4)


def test_reduced_depth_keeps_the_double_block_share() -> None:
    assert model_preset("mmdit-11b", num_layers=6).num_double_layers == 2
    assert model_preset("hunyuan-13b", num_layers=3).num_double_layers == 1
    assert model_preset("mmdit-11b", num_layers=1).num_double_layers == 1
    assert model_preset("wan-14b", num_layers=4).num_double_layers == 0


def test_compiled_regions_equal_eager_and_compile_once() -> None:
    """The double- and single-stream blocks' fused regions under torch.compile (aot_eager: the
    same graphs and partitioner as on a GPU, without code generation) give eager's loss and
    gradients, and compile on the first step only: later steps of other token, text and
    sequence counts (one sequence; first blocks recomputed or not) reuse its graphs. A counting
    backend counts every graph torch.compile makes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from zellige.model import fused

    class Recomputed(torch.nn.Module):  # activation checkpointing, as training's BlockRunner
        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args):
            return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)

    rows, timesteps = _joint_rows(seed=5)

    def step(sequences: list[int]) -> JointTokens:
        return _tokens([r for r in rows if r[0] in sequences], timesteps, sequences)

    def loss_and_grads(tokens: JointTokens, recomputed: int) -> tuple[torch.Tensor, list]:
        model = _model()
        for index in range(recomputed):
            model.blocks[index] = Recomputed(model.blocks[index])
        loss = model(tokens).square().sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    # every step holds at least 2 text and 2 visual tokens (dynamic shapes specialise 0 and 1)
    steps = [
        (step([0, 1, 2, 3]), 0),
        (step([0, 3]), 2),
        (step([0]), 0),  # one sequence
        (step([1, 3]), 3),
        (step([0, 1]), 1),
        (step([3]), 2),
    ]
    eager = [loss_and_grads(*s) for s in steps]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fused.use_compiled(True, backend=counter)
    try:
        compiled = [loss_and_grads(*steps[0])]
        graphs_first_step = counter.frame_count
        compiled += [loss_and_grads(*s) for s in steps[1:]]
    finally:
        fused.use_compiled(False)
    for (loss, grads), (loss_c, grads_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(loss_c, loss, rtol=1e-12, atol=0)
        for grad, grad_c in zip(grads, grads_c, strict=True):
            torch.testing.assert_close(grad_c, grad, rtol=1e-10, atol=1e-12)
    # joint_stream_in, joint_text_stream_in, joint_stream_out_ffn, single_stream_in,
    # single_stream_out, the head's modulated_layer_norm
    assert graphs_first_step == 7  # the six regions and the RoPE tables
    assert counter.frame_count == graphs_first_step  # no compilation after the first step


def test_split_modulation_leaves_loss_and_gradients() -> None:
    """ModelNumerics.split_pieces (one one-hot GEMM per modulation piece): the MMDiT's loss
    exactly (the GEMMs select exactly) and, in float64, its gradients."""
    rows, timesteps = _joint_rows(seed=3)
    tokens = _tokens(rows, timesteps, [0, 1, 2, 3])

    def loss_and_grads(split: bool):
        model = _model(numerics=ModelNumerics(split_pieces=split))
        loss = model(tokens).square().sum()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = loss_and_grads(False)
    loss_split, grads_split = loss_and_grads(True)
    torch.testing.assert_close(loss_split, loss, rtol=0, atol=0)
    for grad, grad_split in zip(grads, grads_split, strict=True):
        torch.testing.assert_close(grad_split, grad, rtol=1e-12, atol=1e-14)
