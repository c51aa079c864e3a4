"""Pieces of the training stack that need no process group: configs and the step timer."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from zellige.train.config import CONFIGS, get_config
from zellige.train.timing import StepTimer


def test_every_named_config_builds_and_names_itself() -> None:
    for name in CONFIGS:
        config = get_config(name)
        assert config.name == name
        assert get_config(name.replace("-", "_")).name == name  # function names work too
    width = get_config("wan14b-width-h200").model.dit.width
    assert width == get_config("wan14b-h200x8").model.dit.width
    with pytest.raises(ValueError, match="allowed: tiny-cpu"):
        get_config("wan-99b")


def test_named_configs_keep_their_values_in_sections() -> None:
    """Every named config holds, field by field, the values the fixture lists by command-line
    name (tests/fixtures/train_configs.json): sections moved the fields, not their values."""
    import json
    from pathlib import Path

    from zellige.train.config import SECTION_OF, flat_fields

    fixture = Path(__file__).parents[1] / "fixtures" / "train_configs.json"
    expected = json.loads(fixture.read_text())
    assert sorted(expected) == sorted(CONFIGS)
    for name in CONFIGS:
        config = get_config(name)
        values = flat_fields(config)
        values |= {"name": config.name, "model": dataclasses.asdict(values["model"])}
        values["betas"] = list(values["betas"])
        assert values == expected[name], name
    assert sorted(SECTION_OF) == sorted(set(expected["tiny-cpu"]) - {"name", "model"})


def test_resolved_makes_every_none_choice_for_the_device_and_world() -> None:
    """resolved(num_ranks) leaves no None choice; each default is the documented one, a value
    the user set is kept, and a resolved config resolves to itself."""
    gpu = get_config("wan14b-width-h200")  # CUDA, bf16, every choice left at None
    assert gpu.model.compile_elementwise is None and gpu.optimizer.copying_optimizer is None
    one, two = gpu.resolved(1), gpu.resolved(2)
    assert one.model.compile_elementwise is True and one.model.compile_outside is True
    assert one.parallelism.reshard_after_forward is False and two.parallelism.reshard_after_forward
    assert one.optimizer.fused_optimizer and one.optimizer.copying_optimizer
    assert one.optimizer.compute_dtype_gradients
    assert one.resolved(2) == one and two.resolved(2) == two
    cpu = get_config("tiny-cpu").resolved(1)
    assert not cpu.model.compile_elementwise and not cpu.model.compile_outside
    assert not cpu.optimizer.fused_optimizer and not cpu.optimizer.copying_optimizer
    assert not cpu.optimizer.compute_dtype_gradients  # only the copying optimizer reads them
    chosen = gpu.with_fields(compile_elementwise=False, compile_outside=True, dtype="float32")
    chosen = chosen.resolved(1)
    assert not chosen.model.compile_elementwise and chosen.model.compile_outside
    assert not chosen.optimizer.copying_optimizer  # float32: no copies to write
    for config in (one, two, cpu, chosen):
        for section in ("model", "parallelism", "optimizer"):
            values = getattr(config, section)
            for field in dataclasses.fields(values):
                if field.type == "bool | None":
                    assert getattr(values, field.name) in (True, False), field.name


def test_toml_tables_set_each_section() -> None:
    """A run file's tables replace their sections' fields, and the command line follows;
    [model] without a preset changes the named config's model."""
    from zellige.train.config import resolve_config

    values = {
        "config": "tiny-cpu",
        "steps": 7,
        "model": {"num_layers": 3, "dtype": "float64"},
        "data": {"loader_workers": 0},
        "parallelism": {"planner": "dp-cost"},
        "optimizer": {"learning_rate": 1e-3, "betas": [0.5, 0.9]},
        "checkpoint": {"checkpoint_every": 2},
        "metrics": {"metrics_one_step_late": False},
    }
    config = resolve_config(None, values, {"learning_rate": 2e-3}, "run.toml")
    assert config.steps == 7 and config.model.dtype == "float64"
    assert config.model.dit == dataclasses.replace(get_config("tiny-cpu").model.dit, num_layers=3)
    assert config.data.loader_workers == 0 and config.parallelism.planner == "dp-cost"
    assert config.optimizer.learning_rate == 2e-3 and config.optimizer.betas == (0.5, 0.9)
    assert config.checkpoint.checkpoint_every == 2 and not config.metrics.metrics_one_step_late
    with pytest.raises(ValueError, match="unknown field 'lr'"):
        config.with_fields(lr=1.0)
    with pytest.raises(ValueError, match="optimizer.learning_rate must be a number"):
        resolve_config("tiny-cpu", {"optimizer": {"learning_rate": "x"}}, {}, "run.toml")


def test_example_run_files_resolve() -> None:
    """Each TOML run file under examples/ loads and resolves to a valid config."""
    from pathlib import Path

    from zellige.train.config import load_config_file, resolve_config

    paths = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert paths
    for path in paths:
        config = resolve_config(None, load_config_file(path), {}, str(path))
        assert config.name in CONFIGS


def test_step_timer_counts_forward_and_backward_of_a_region() -> None:
    timer = StepTimer(torch.device("cpu"))

    def slow_square(x: torch.Tensor, factor: float) -> torch.Tensor:
        time.sleep(0.02)
        return SlowBackward.apply(x * factor)

    x = torch.ones(3, requires_grad=True)
    y = timer.wrap("region", slow_square)(x, 2.0)
    assert not y._is_view()  # FSDP hooks region outputs: they must not be views
    y.sum().backward()
    seconds = timer.seconds()
    assert seconds["region"] >= 0.02 and seconds["region.backward"] >= 0.03
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    timer.reset()
    assert timer.seconds() == {}


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad


def test_step_timer_leaves_tensors_without_gradients_alone() -> None:
    """Marks go on tensors that need gradients only: a table passed beside them (RoPE) must not
    start requiring grad, or every product with it would save operands for its gradient."""
    timer = StepTimer(torch.device("cpu"))
    seen = {}

    def region(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        seen["table requires grad"] = table.requires_grad
        return x * table

    x, table = torch.ones(3, requires_grad=True), torch.full((3,), 2.0)
    y = timer.wrap("region", region, fresh_output=False)(x, table)
    assert seen["table requires grad"] is False
    assert y._is_view()  # fresh_output=False: no copy of the output
    y.sum().backward()
    torch.testing.assert_close(x.grad, table)
    assert set(timer.seconds()) == {"region", "region.backward"}


def test_checkpointed_blocks_follow_the_plan() -> None:
    """Adaptive: the plan's count for this rank; otherwise every block, or none (the cost model
    decides: its prediction, checked here against those rules). The plan's full recompute count
    applies to either (never more than the checkpointed blocks)."""
    import dataclasses

    import zellige
    from zellige.data import model_spec
    from zellige.pipeline import StepRecord, make_step_plan
    from zellige.train.loop import _checkpointed_blocks

    record = StepRecord(
        planner="hand",
        num_ranks=2,
        plan_ms=0.0,
        makespan_s=1.0,
        rank_time_s=(1.0, 1.0),
        rank_peak_bytes=(0.0, 0.0),
        rank_checkpointed_layers=(7, 30),
        rank_full_recompute_layers=(0, 4),
    )
    assert _checkpointed_blocks(record, 0) == (7, 0)
    assert _checkpointed_blocks(record, 1) == (30, 4)
    fewer = dataclasses.replace(record, rank_full_recompute_layers=(9, 4))
    assert _checkpointed_blocks(fewer, 0) == (7, 7)  # never more than the checkpointed blocks

    config = get_config("wan1p3b-h200")
    spec = model_spec(config.model.dit)
    layers = config.model.dit.num_layers
    sequences = [
        {"id": i, "num_tokens": 8190 if i < 2 else 1024, "text_tokens": 512, "source_rank": i % 2}
        for i in range(6)
    ]
    batch = zellige.batch_from_dict({"sequences": sequences}, num_ranks=2)

    def record_of(checkpointing: bool, adaptive: bool) -> StepRecord:
        cost_model = zellige.make_cost_model(
            spec, 2, 2, activation_checkpointing=checkpointing, adaptive_checkpointing=adaptive
        )
        return StepRecord.from_plan(make_step_plan("dp-cost", batch, cost_model, seed=0))

    for rank in range(2):
        count, full = _checkpointed_blocks(record_of(True, False), rank)
        assert count == layers and 0 <= full <= count  # fixed: every block
        assert _checkpointed_blocks(record_of(False, False), rank) == (0, 0)  # off: none
        assert _checkpointed_blocks(record_of(False, True), rank) == (0, 0)
        count, full = _checkpointed_blocks(record_of(True, True), rank)
        assert 0 <= full <= count <= layers


def test_block_runners_recompute_as_the_plan_says() -> None:
    """set_checkpointed_blocks(count, full): the first `full` blocks recompute in full (plain
    checkpoint), the rest of the first `count` selectively, the others not at all; every mode
    gives the same gradients."""
    from types import SimpleNamespace

    from torch import nn

    from zellige.train.parallelize import BlockRunner, set_checkpointed_blocks

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4).double() for _ in range(4)]
    model = SimpleNamespace(
        blocks=[BlockRunner(layer, StepTimer(torch.device("cpu")), True) for layer in layers]
    )
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def grads(count: int, full: int) -> list[torch.Tensor]:
        set_checkpointed_blocks(model, count, full)
        y = x
        for runner in model.blocks:
            y = runner(y).tanh()
        return list(torch.autograd.grad(y.square().sum(), [x, *model_parameters()]))

    def model_parameters():
        return [p for layer in layers for p in layer.parameters()]

    reference = grads(0, 0)
    assert [(r.activation_checkpointing, r.full_recompute) for r in model.blocks] == [
        (False, False)
    ] * 4
    got = grads(3, 1)
    assert [(r.activation_checkpointing, r.full_recompute) for r in model.blocks] == [
        (True, True),
        (True, False),
        (True, False),
        (False, False),
    ]
    for g, want in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fully recomputed blocks"):
        set_checkpointed_blocks(model, 2, 3)


@pytest.mark.parametrize("exit_code", [0, 3])
def test_end_rank_process_keeps_output_and_exit_code(exit_code) -> None:
    """runtime.end_rank_process with a gloo group of one: what the rank printed reaches a pipe
    (os._exit drops unflushed buffers), and the exit code is the one given."""
    import os
    import subprocess
    import sys

    script = (
        "import torch.distributed as dist\n"
        "from zellige.runtime import end_rank_process\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "import atexit\n"
        "atexit.register(lambda: print('finalized'))\n"
        "print('done', end='')\n"
        f"end_rank_process({exit_code})\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == exit_code, done.stderr[-2000:]
    # success: printed and flushed, and no finalization (atexit) ran; a failure exits as Python
    # does, so that the other ranks are not stopped before rank 0 has said why
    assert done.stdout == ("done" if exit_code == 0 else "donefinalized\n")


def test_lone_rank_forward_takes_offered_copies_unless_a_master_changed() -> None:
    """LoneRankWeights: copies an optimizer offered (offer_copies) are the next forward's
    weights, no cast; a master changed after the offer (a checkpoint loaded) voids them: the
    forward casts the masters as without an offer; an offer is used once."""
    from zellige.model import build_model
    from zellige.train.parallelize import LoneRankWeights

    model = build_model(get_config("tiny-cpu").model.dit)
    lone = LoneRankWeights(model, torch.bfloat16)
    master = model.patch_embedding.weight

    def forward_weight() -> torch.Tensor:
        lone._before_forward(model, ())
        weight = model.patch_embedding.weight
        lone._restore()
        return weight

    copies = lone.new_copies()
    for chunk in lone.chunks():
        for p in chunk:
            copies[id(p)].fill_(3.0)  # not what a cast of the masters gives
    lone.offer_copies(copies)
    used = forward_weight()
    assert used.data_ptr() == copies[id(master)].data_ptr()
    assert bool((used == 3.0).all())
    assert torch.equal(forward_weight(), master.detach().to(torch.bfloat16))  # used once
    lone.offer_copies(copies)
    with torch.no_grad():
        master.mul_(2.0)  # after the offer
    assert torch.equal(forward_weight(), master.detach().to(torch.bfloat16))
    every = [id(p) for p in model.parameters()]
    for per_chunk in (1, 2, 8):
        chunks = lone.chunks(per_chunk)
        assert sorted(id(p) for chunk in chunks for p in chunk) == sorted(every)
        assert len(chunks) == 1 + -(-len(model.blocks) // per_chunk)
        assert [id(p) for p in chunks[1]] == [
            id(p) for block in list(model.blocks)[:per_chunk] for p in block.parameters()
        ]


def test_lone_rank_kept_gradients_are_the_backwards_with_their_norm() -> None:
    """keep_gradients: the masters get no gradient; take_gradients gives each master's
    gradient in the compute dtype, the values whose cast the default path accumulates, and
    their global norm (get_total_norm's over the cast gradients, to float32 rounding)."""
    from zellige.model import build_model
    from zellige.train.parallelize import LoneRankWeights

    def backward(keep: bool):
        torch.manual_seed(0)
        model = build_model(get_config("tiny-cpu").model.dit)
        lone = LoneRankWeights(model, torch.bfloat16, keep_gradients=keep)
        generator = torch.Generator().manual_seed(1)
        lone._before_forward(model, ())
        channels = model.config.token_channels
        x = torch.randn(6, channels, generator=generator, dtype=torch.bfloat16)
        loss = model.patch_embedding(x).float().square().sum()
        # every other weight takes part too, with a zero gradient
        loss = loss + 0 * sum(p.float().sum() for p in model.blocks.parameters())
        loss.backward()  # LoneRankWeights restores the masters at its end
        return model, lone

    reference, _ = backward(keep=False)
    model, lone = backward(keep=True)
    gradients, norm = lone.take_gradients()
    assert all(p.grad is None for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert id(p) not in gradients, name
            continue
        assert gradients[id(p)].dtype == torch.bfloat16
        assert torch.equal(gradients[id(p)].float(), q.grad), name
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(grads), rtol=1e-6, atol=0)
    assert norm > 0
    assert lone.take_gradients() == ({}, None)  # taken once


def test_kept_bf16_gradients_are_priced_at_two_bytes() -> None:
    """The cost model prices what training holds: 2-byte gradients where the copying optimizer
    reads the backward's bf16 ones (one rank), 4 otherwise; the other 12 bytes of state stay."""

    import zellige
    from zellige.train.optimizer_builder import gradient_bytes_per_param

    config = get_config("wan14b-width-h200")  # on CUDA: the copying optimizer by default
    assert gradient_bytes_per_param(config, 1) == 2.0
    assert gradient_bytes_per_param(config, 2) == 4.0  # FSDP2 reduces fp32 gradients
    for changes in ({"copying_optimizer": False}, {"compute_dtype_gradients": False}):
        assert gradient_bytes_per_param(config.with_fields(**changes), 1) == 4.0
    assert gradient_bytes_per_param(get_config("tiny-cpu"), 1) == 4.0  # CPU: torch's AdamW
    float32 = config.with_fields(dtype="float32")  # no copies to write: torch's AdamW
    assert not float32.resolved(1).optimizer.copying_optimizer
    assert gradient_bytes_per_param(float32, 1) == 4.0
    fp32, bf16 = (
        zellige.make_cost_model("wan-14b", 1, profile=None, gradient_bytes_per_param=g)
        for g in (4.0, 2.0)
    )
    params = fp32.gradient_bytes() / 4
    assert bf16.gradient_bytes() == pytest.approx(2 * params)
    assert fp32.fixed_bytes() - bf16.fixed_bytes() == pytest.approx(2 * params)


def test_copying_optimizer_step_is_priced_with_its_copies() -> None:
    """One rank's copying AdamW writes the next forward's bf16 copy of every weight while the
    gradients are held: the cost model prices that optimizer step (2 bytes a parameter beside
    the state), which is the peak of a step of few tokens; nowhere else does it write copies."""

    import zellige
    from zellige.train.optimizer_builder import optimizer_copy_bytes_per_param

    config = get_config("wan14b-width-h200")  # on CUDA: the copying optimizer by default
    assert optimizer_copy_bytes_per_param(config, 1) == 2.0
    assert optimizer_copy_bytes_per_param(config, 2) == 0.0  # FSDP2: no copies to write
    for changes in ({"copying_optimizer": False}, {"fsdp_on_one_rank": True}):
        assert optimizer_copy_bytes_per_param(config.with_fields(**changes), 1) == 0.0
    assert optimizer_copy_bytes_per_param(get_config("tiny-cpu"), 1) == 0.0
    plain, copying = (
        zellige.make_cost_model(
            "wan-1.3b", 1, profile=None, gradient_bytes_per_param=2.0,
            optimizer_copy_bytes_per_param=c, weights_kept_to_backward=True,
        )
        for c in (0.0, 2.0)
    )  # fmt: skip
    params = plain.gradient_bytes() / 2
    no_tokens = (0.0, 0.0, 0.0, 0)
    assert copying.rank_peak_bytes(*no_tokens) - plain.rank_peak_bytes(*no_tokens) > params
    assert copying.rank_peak_bytes(*no_tokens) > 16 * params  # state (14) + copies (2)
    with pytest.raises(ValueError, match="optimizer_copy_bytes_per_param"):
        zellige.make_cost_model("wan-1.3b", 1, profile=None, optimizer_copy_bytes_per_param=-1)


FREED_COPIES_SCRIPT = """
import dataclasses, json, tempfile, weakref
from zellige.runtime import end_rank_process
from zellige.train import loop
from zellige.train.config import get_config
from zellige.train.parallelize import LoneRankWeights

forward_copies, alive = [], []
before, new_copies = LoneRankWeights._before_forward, LoneRankWeights.new_copies

def spy_before(self, module, args):
    before(self, module, args)
    forward_copies[:] = [weakref.ref(m._parameters[name]) for m, name in self._slots]

def spy_new(self):
    alive.append(sum(ref() is not None for ref in forward_copies))
    return new_copies(self)

LoneRankWeights._before_forward, LoneRankWeights.new_copies = spy_before, spy_new
config = get_config("tiny-cpu").with_fields(steps=2, dtype="bfloat16", copying_optimizer=True)
with tempfile.TemporaryDirectory() as out:
    loop.train(config, out_dir=out, progress=False)
print()  # a line of its own whatever training printed last
print(json.dumps({"copies": len(forward_copies), "alive": alive}))
end_rank_process(0)
"""


def test_forward_copies_are_freed_before_the_optimizer_writes_the_next() -> None:
    """Training on one rank with the copying optimizer: when the optimizer makes the next
    forward's copies, the forward's own are gone (the step's graph, whose nodes hold them, is
    released after the backward), so the optimizer step holds one set of copies, as priced.
    In a process of its own: training joins a process group, which outlives it."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", FREED_COPIES_SCRIPT],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["copies"] > 0 and seen["alive"] == [0, 0], seen


def test_a_kept_copy_does_not_keep_the_model_alive() -> None:
    """A compute copy that outlives its step (something kept it: a compiled function's cache,
    say) holds neither the masters nor the model through its gradient hook; close() drops an
    offer no forward took."""
    import gc
    import weakref

    from zellige.model import build_model
    from zellige.train.parallelize import LoneRankWeights

    def step():
        model = build_model(get_config("tiny-cpu").model.dit)
        lone = LoneRankWeights(model, torch.bfloat16, keep_gradients=True)
        model.lone_weights = lone  # as parallelize() sets it: a cycle, collectable
        lone._before_forward(model, ())
        kept = model.patch_embedding.weight  # the step's copy
        x = torch.randn(3, model.config.token_channels, dtype=torch.bfloat16)
        model.patch_embedding(x).float().sum().backward()
        lone.offer_copies(lone.new_copies())
        lone.close()
        assert lone._offered is None
        return kept, weakref.ref(model), weakref.ref(model.patch_embedding.weight)

    kept, model, master = step()
    gc.collect()
    assert kept.dtype == torch.bfloat16
    assert model() is None and master() is None
