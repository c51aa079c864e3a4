"""The profiler on a CPU: the metrics on synthetic numbers, and a --quick profile's schema."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from zellige.profiler import fit  # noqa: E402
from zellige.profiler.validate import RankResult, local_copy_s, summarise  # noqa: E402


def test_local_copies_are_the_ulysses_messages_of_the_rank():
    # The stand-in copies q, k, v out and o back in the forward, q, k, v out again in the
    # recompute (selective checkpointing keeps o), do out and dq, dk, dv back in the backward:
    # 11 messages of tokens * width * (u - 1) / u elements per layer, each read and written
    # once. Local sequences copy nothing.
    from zellige import _core
    from zellige.costs import make_cost_model
    from zellige.profiler.models import model_spec

    spec = model_spec("wan-14b", 2)
    cost = make_cost_model(spec, gpus=4)
    tokens, degree, bytes_per_s = 8192, 4, 1e12
    batch = _core.Batch(
        sequences=[
            _core.Sequence(id=0, num_tokens=tokens, text_tokens=512, source_rank=1),
            _core.Sequence(id=1, num_tokens=300, text_tokens=512),
        ]
    )
    plan = _core.Plan(
        num_ranks=4,
        placements=[
            _core.Placement(
                sequence_id=0,
                strategy=_core.Strategy.ulysses,
                ranks=[0, 1, 2, 3],
                ulysses_degree=degree,
            ),
            _core.Placement(sequence_id=1, strategy=_core.Strategy.local, ranks=[2]),
        ],
    )
    chunk = tokens // degree
    message_bytes = chunk * spec.width * (degree - 1) / degree * 2  # bf16
    expected_s = spec.num_layers * 11 * message_bytes * 2 / bytes_per_s
    for rank in range(4):
        assert local_copy_s(cost, batch, plan, rank, bytes_per_s) == pytest.approx(expected_s)
    local_only = _core.Plan(num_ranks=4, placements=plan.placements[1:])
    assert local_copy_s(cost, batch, local_only, 2, bytes_per_s) == 0.0


def test_mape_on_known_numbers():
    assert fit.mape_percent([110.0, 90.0], [100.0, 100.0]) == pytest.approx(10.0)
    assert fit.mape_percent([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.0
    # relative to the measured value, not the prediction
    assert fit.mape_percent([2.0], [1.0]) == pytest.approx(100.0)


@pytest.mark.parametrize(
    "predicted, measured",
    [([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0])],
    ids=["empty", "lengths-differ", "zero-measured"],
)
def test_mape_rejects_bad_input(predicted, measured):
    with pytest.raises(ValueError):
        fit.mape_percent(predicted, measured)


@pytest.mark.parametrize("gamma", [0.0, 0.4, 1.7])
def test_gamma_fit_recovers_a_planted_model(gamma):
    width = 3072
    seconds_per_unit = 2.5e-15
    lengths = [256, 1024, 4096, 16384, 65536]
    latencies = [seconds_per_unit * fit.knapformer_work(n, width, gamma) for n in lengths]
    fitted_gamma, fitted_scale = fit.fit_knapformer_gamma(lengths, latencies, width)
    assert fitted_gamma == pytest.approx(gamma, abs=1e-9)
    assert fitted_scale == pytest.approx(seconds_per_unit, rel=1e-9)


def test_gamma_fit_weights_every_length_alike():
    # 10% noise on the shortest point must not be ignored because its latency is tiny
    width, lengths = 1536, [256, 4096, 65536]
    exact = [fit.knapformer_work(n, width, 0.5) for n in lengths]
    noisy = [exact[0] * 1.1, *exact[1:]]
    gamma, _ = fit.fit_knapformer_gamma(lengths, noisy, width)
    assert gamma != pytest.approx(0.5, abs=1e-6)


def test_best_scale_minimises_relative_error():
    work = [1.0, 2.0, 4.0]
    measured = [2.0, 4.0, 8.0]
    assert fit.fit_scale(work, measured) == pytest.approx(2.0)


def _rank(predicted_s, measured_s, predicted_peak, measured_peak, work, state=0.0, tokens=1):
    return RankResult(
        plan="p",
        rank=0,
        tokens=tokens,
        num_sequences=1,
        predicted_s=predicted_s,
        measured_s=measured_s,
        predicted_peak_bytes=predicted_peak,
        measured_peak_bytes=measured_peak,
        modelled_state_bytes=state,
        knapformer_work=work,
    )


def test_summary_on_synthetic_ranks():
    ranks = [
        _rank(1.03, 1.0, 103.0, 100.0, work=1.0, state=50.0),
        _rank(1.94, 2.0, 196.0, 200.0, work=1.0, state=50.0),
    ]
    report = summarise(ranks, gamma=0.4)
    assert report.time_mape_percent == pytest.approx((3.0 + 3.0) / 2)
    assert report.memory_mape_percent == pytest.approx((3.0 + 2.0) / 2)
    # the shard buffer is removed from both sides for the step part: 53/50 and 146/150
    assert report.step_memory_mape_percent == pytest.approx((6.0 + 100 * 4 / 150) / 2)
    # equal work for unequal times: the best scale still leaves a large error
    assert report.knapformer_time_mape_percent > 20.0
    assert report.num_plans == 1


def test_summary_splits_the_errors_by_rank_size():
    ranks = [
        _rank(1.10, 1.0, 100.0, 100.0, work=1.0, tokens=50_000),
        _rank(1.00, 1.0, 102.0, 100.0, work=1.0, tokens=20_000),
        _rank(0.80, 1.0, 100.0, 100.0, work=1.0, tokens=1_000),
    ]
    by_size = summarise(ranks, gamma=0.4).by_size
    assert list(by_size) == [">= 20k tokens", "< 2k tokens"]  # empty classes left out
    assert by_size[">= 20k tokens"]["ranks"] == 2
    assert by_size[">= 20k tokens"]["time_mape_percent"] == pytest.approx(5.0)
    assert by_size[">= 20k tokens"]["memory_mape_percent"] == pytest.approx(1.0)
    assert by_size["< 2k tokens"]["time_mape_percent"] == pytest.approx(20.0)
    cpu = summarise([_rank(1.0, 1.0, 5.0, 0.0, work=1.0)], gamma=0.4).by_size
    assert cpu["< 2k tokens"]["memory_mape_percent"] is None


def test_summary_without_memory_on_cpu():
    report = summarise([_rank(1.0, 1.0, 5.0, 0.0, work=1.0)], gamma=0.4)
    assert report.memory_mape_percent is None


def test_profile_refuses_a_cpu_without_quick():
    from zellige.profiler.measure import ProfileOptions, profile_device

    with pytest.raises(ValueError, match="GPU"):
        profile_device(ProfileOptions(model="tiny", device="cpu"), progress=lambda line: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_profile_command_refuses_a_cpu(tmp_path):
    from zellige.cli import main

    try:
        code = main(["profile", "--out", str(tmp_path / "p.json")])
    except ValueError:  # cli.main turns it into exit status 2 once user errors are caught there
        code = 2
    assert code == 2
    assert not (tmp_path / "p.json").exists()


def test_profile_command_refuses_zero_repeats(tmp_path, capsys):
    from zellige.cli import main

    assert main(["profile", "--quick", "--repeats", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert "--repeats: must be a positive integer <= 1000, got 0" in capsys.readouterr().err


def test_quick_profile_writes_a_valid_measured_profile(tmp_path):
    pytest.importorskip("zellige.runtime.coalesced", reason="needs the engine's coalesced call")
    from zellige.cli import main
    from zellige.profile import load_profile

    out = tmp_path / "profile.json"
    details = tmp_path / "details.json"
    assert main(["profile", "--quick", "--out", str(out), "--details", str(details)]) == 0
    data = json.loads(out.read_text())
    for key in (
        "attention_forward_s_per_head",
        "attention_backward_s_per_head",
        "matmul_forward_flops_per_s",
        "matmul_backward_flops_per_s",
    ):
        assert data[key]["source"] == "measured"
        assert len(data[key]["x"]) >= 3
        assert all(math.isfinite(v) and v > 0 for v in data[key]["y"])
    assert data["device_name"]
    assert "torch" in data["created"]
    assert data["attention_head_dim"] == 16  # the tiny model's head dim
    assert data["attention_ragged"] is False  # a CPU's engine runs dense calls
    # Call tables: per length, calls of 1 head up to the full pack; the host's issue time.
    assert len(data["attention_call_lengths"]) == len(data["attention_call_forward_s"]) >= 2
    for table in data["attention_call_forward_s"] + data["attention_call_backward_s"]:
        assert table["x"][0] == 1 and len(table["x"]) >= 3
    # The host launch time is measured (a row of the profile only where memory is, on a GPU).
    launch = json.loads(details.read_text())["launch"]
    # each part is clamped at 0 and a loaded CPU can push either there, never both
    assert launch["launch_s_per_layer"] >= 0 and launch["launch_s_per_attention_call"] >= 0
    assert launch["launch_s_per_layer"] + launch["launch_s_per_attention_call"] > 0
    assert data["launch_s_per_layer"] == [] and data["memory_models"] == []
    # Ulysses and ring layouts: the engine's row work per byte a shard sends, never negative
    layouts = json.loads(details.read_text())["layouts"]
    for strategy in ("ulysses", "ring"):
        value = data[f"{strategy}_layout_s_per_byte"]
        assert math.isfinite(value) and value >= 0
        assert layouts[f"{strategy} L=256,r=2"]["sent_bytes"] > 0
    profile = load_profile(out)  # the core reads it back
    assert profile.matmul_flops_per_s > 0
    assert json.loads(details.read_text())["model"] == "tiny"


def test_quick_validate_runs_ranks_through_the_engine(tmp_path):
    pytest.importorskip("zellige.runtime.attention", reason="needs the engine's attention")
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main

    out = tmp_path / "validate.json"
    code = main(
        ["validate-profile", "--quick", "--plans", "2", "--repeats", "1", "--json", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_plans"] == 2
    assert len(report["ranks"]) >= 2
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in report["ranks"])
    assert any("exchanges excluded" in note for note in report["notes"])
    assert (
        "attention priced as the engine runs it here: dense calls (attention_ragged)"
        in (report["notes"])
    )
    # --plan-range 2-2 runs only the second of the same two plans
    part = tmp_path / "part.json"
    args = ["validate-profile", "--quick", "--plans", "2", "--plan-range", "2-2", "--repeats", "1"]
    assert main([*args, "--json", str(part)]) == 0
    second = {r["plan"] for r in json.loads(part.read_text())["ranks"]}
    assert len(second) == 1 and second < {r["plan"] for r in report["ranks"]}
    assert main([*args[:-4], "--plan-range", "2-3", "--repeats", "1"]) != 0


def test_harness_peak_model_leaves_the_gradients_out():
    """The harness keeps its sharded gradients between steps and takes them out of the measured
    peak with its weights, so validate-profile predicts the peak without weight gradients: no
    gradient bytes, the state without them, and a tiny rank's peak (training's: the backward's
    end, with every gradient) lower by about the gradients."""
    from zellige import _core
    from zellige.costs import make_cost_model
    from zellige.profiler.models import model_spec
    from zellige.profiler.validate import harness_peak_model

    spec = model_spec("mmdit-11b", 3)
    profile = _core.analytic_profile("t", 700e12, 550e12, 4.2e12)
    training = make_cost_model(spec, gpus=8, profile=profile)
    harness = harness_peak_model(spec, 8, profile, _core.CostOptions())
    assert harness.gradient_bytes() == 0
    assert harness.fixed_bytes() == pytest.approx(
        training.fixed_bytes() - training.gradient_bytes()
    )
    assert harness.options.state_bytes_per_param == 12.0
    batch = _core.Batch()
    batch.sequences = [_core.Sequence(id=0, num_tokens=64, text_tokens=16, source_rank=0)]
    plan = _core.Plan()
    plan.num_ranks = 8
    plan.placements = [_core.make_placement(0, _core.Strategy.local, [0])]
    # a rank of a few tokens: training's peak is the backward's end, every gradient there
    trained = training.evaluate(batch, plan).ranks[0].peak_bytes
    assert trained == pytest.approx(training.fixed_bytes())
    # the harness's: a layer's backward without gradients (its few tokens' bytes at most)
    measured_like = harness.evaluate(batch, plan).ranks[0].peak_bytes
    assert trained - training.gradient_bytes() <= measured_like
    assert measured_like < trained - 0.9 * training.gradient_bytes()


def test_validate_summarises_a_results_file_without_running(tmp_path, capsys):
    import dataclasses

    from zellige.cli import main

    rows = [
        RankResult(
            plan=f"wan-stage2/8/dp-cost/{i}",
            rank=0,
            tokens=32760,
            num_sequences=1,
            predicted_s=1.0,
            measured_s=1.0 + 0.1 * i,
            predicted_peak_bytes=20e9,
            measured_peak_bytes=20e9 * (1.0 + 0.02 * i),
            modelled_state_bytes=1e9,
            knapformer_work=1.0,
        )
        for i in (1, 2)
    ]
    jsonl = tmp_path / "ranks.jsonl"
    jsonl.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))
    out = tmp_path / "report.json"
    assert main(["validate-profile", "--summarise", str(jsonl), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_plans"] == 2 and len(report["ranks"]) == 2
    expected = (1 - 1 / 1.1 + 1 - 1 / 1.2) / 2 * 100
    assert report["time_mape_percent"] == pytest.approx(expected)
    printed = capsys.readouterr().out
    assert "summarised from ranks.jsonl" in printed
    # the files do not say which model their ranks ran: no claim of the CLI's default model
    assert "model not recorded in the results files" in printed
    assert "wan-14b" not in printed and "layers)" not in printed
    # the parts of a --plan-range split are read together; the same rank twice is refused
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(json.dumps(dataclasses.asdict(rows[0])) + "\n")
    second.write_text(json.dumps(dataclasses.asdict(rows[1])) + "\n")
    both = ["validate-profile", "--summarise", str(first), str(second)]
    assert main([*both, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["time_mape_percent"] == pytest.approx(expected)
    assert main(["validate-profile", "--summarise", str(first), str(jsonl)]) != 0
    assert "rank 0 again" in capsys.readouterr().err
    jsonl.write_text("")
    assert main(["validate-profile", "--summarise", str(jsonl)]) != 0
    assert "holds no rank results" in capsys.readouterr().err
    jsonl.write_text('{"plan": "x"}\n')
    assert main(["validate-profile", "--summarise", str(jsonl)]) != 0
    assert "line 1 is not a rank result" in capsys.readouterr().err


def test_fsdp_blocks_need_a_group_of_one_that_goes_away():
    import torch.distributed as dist

    from zellige.profiler import rank_work
    from zellige.profiler.memory import local_pack_plan
    from zellige.profiler.models import dit_config

    config = dit_config("tiny")
    device = torch.device("cpu")
    with pytest.raises(RuntimeError, match="group of one"):
        rank_work.make_fsdp_blocks(config, 1, device, torch.float32)
    with rank_work.process_group_of_one(device):
        blocks = rank_work.make_fsdp_blocks(config, 1, device, torch.float32)
        weights = sum(p.numel() * 4 for p in blocks.parameters())
        assert rank_work.persistent_bytes(blocks) == weights  # no gradients before a step
        batch, plan = local_pack_plan(32, config.text_tokens)
        inputs = rank_work.plan_rank_inputs(
            batch=batch,
            plan=plan,
            rank=0,
            config=config,
            device=device,
            dtype=torch.float32,
            output_grad=False,
        )
        rank_work.train_step(blocks, inputs, checkpointing=True)
        assert inputs.grad_TD is None
        assert rank_work.persistent_bytes(blocks) == 2 * weights  # the sharded gradients stay
    assert not dist.is_initialized()


@pytest.mark.parametrize("backward", [33_000.0, -17_000.0], ids=["buffers", "freed-early"])
def test_memory_rows_recover_a_known_memory_model(backward):
    """Probes made from a known model (per-token rows, step-fixed bytes, text bytes) give those
    rows back: what the profile stores is what the cost model charges. A backward that frees
    more than it allocates (below 0) is stored as 0 (the profile's rows are >= 0; the cost
    model's peak then errs above)."""
    from zellige.profiler.memory import MemoryProbe, memory_rows

    layers, sequences, text_tokens = 2, 2, 512
    inputs, activation, checkpoint = 11_000.0, 450_000.0, 10_240.0
    text, fixed = 51_000.0, 1.1e9

    def probe(tokens: int, text_per_sequence: int) -> MemoryProbe:
        kept_ckpt = layers * checkpoint * tokens
        # the last layer's recompute rebuilds its activations around its own checkpoint
        step_peak = (
            (layers - 1) * checkpoint * tokens
            + activation * tokens
            + backward * tokens
            + text * sequences * text_per_sequence
            + fixed
        )
        return MemoryProbe(
            inputs=int(inputs * tokens),
            kept=int(layers * activation * tokens + 40_000.0 * sequences * text_per_sequence),
            transient=int(backward * tokens),
            kept_checkpointing=int(kept_ckpt),
            transient_checkpointing=int(step_peak - kept_ckpt - inputs * tokens),
        )

    probes = {8192: probe(8192, text_tokens), 32768: probe(32768, text_tokens)}
    rows = memory_rows(
        probes,
        probe(8192, text_tokens + 8192),
        num_layers=layers,
        num_sequences=sequences,
        text_tokens=text_tokens,
        extra_text_tokens=8192,
    )
    assert rows["activation_bytes_per_token_layer"] == pytest.approx(activation)
    assert rows["checkpoint_bytes_per_token_layer"] == pytest.approx(checkpoint)
    assert rows["backward_bytes_per_token_layer"] == pytest.approx(max(0.0, backward), abs=0.01)
    assert rows["text_bytes_per_token_layer"] == pytest.approx(text)
    assert rows["text_kept_bytes_per_token_layer"] == pytest.approx(40_000.0 / layers)
    assert rows["step_fixed_bytes"] == pytest.approx(fixed, rel=1e-6)


@pytest.mark.parametrize("attended_text", [0, 1024], ids=["cross", "joint"])
def test_reduce_rows_recover_the_small_packs_line(attended_text):
    """reduce_rows: the line through two small packs' step peaks (the gradient reduction's
    moment), per held token (a joint model's text counted with the visual tokens) and at 0
    tokens; the profile accepts them and the cost model charges them (a small rank's peak)."""
    from zellige.profile import load_profile, profile_from_dict, profile_to_dict
    from zellige.profiler.memory import MemoryProbe, merge_memory, reduce_rows

    fixed, per_token = 2.4e9, 93_000.0

    def probe(tokens: int) -> MemoryProbe:
        peak = int(fixed + per_token * (tokens + attended_text))
        return MemoryProbe(
            inputs=0, kept=0, transient=0, kept_checkpointing=0, transient_checkpointing=peak
        )

    rows = reduce_rows({1024: probe(1024), 4096: probe(4096)}, attended_text_tokens=attended_text)
    assert rows["reduce_bytes_per_token"] == pytest.approx(per_token, rel=1e-6)
    assert rows["reduce_fixed_bytes"] == pytest.approx(fixed, rel=1e-6)
    merged = merge_memory(profile_to_dict(load_profile()), "mmdit-11b", rows)
    profile = profile_from_dict(merged)
    row = profile.memory_models.index("mmdit-11b")
    assert profile.reduce_fixed_bytes[row] == pytest.approx(fixed, rel=1e-6)
    assert profile.reduce_bytes_per_token[row] == pytest.approx(per_token, rel=1e-6)
    wan = profile.memory_models.index("wan-14b")
    assert profile.reduce_fixed_bytes[wan] == 0  # other models: not modelled, as before


def test_backward_peak_table_is_the_packs_peaks_beyond_their_kept_activations():
    """backward_peak_table: at each pack's held tokens (text among them for a joint model), its
    step peak minus the other layers' checkpoints and one layer's activations as the rows charge
    them; where the rows come from, that is their line (step_fixed + x * backward); the profile
    stores it per model and the cost model reads it."""
    from zellige.profile import load_profile, profile_from_dict, profile_to_dict
    from zellige.profiler.memory import MemoryProbe, backward_peak_table, merge_memory

    layers, text = 3, 1024
    rows = {
        "activation_bytes_per_token_layer": 150_000.0,
        "checkpoint_bytes_per_token_layer": 12_000.0,
        "backward_bytes_per_token_layer": 60_000.0,
        "step_fixed_bytes": 1.0e9,
    }
    bend = {8192: 2.0e8, 16384: 0.0, 32768: -1.5e8, 65536: 0.0, 98304: 3.0e8}

    def probe(tokens: int) -> MemoryProbe:
        held = tokens + text
        peak = 1.0e9 + (2 * 12_000.0 + 150_000.0 + 60_000.0) * held + bend[tokens]
        return MemoryProbe(0, 0, 0, 0, int(peak))

    table = backward_peak_table(
        {t: probe(t) for t in bend},
        rows,
        num_layers=layers,
        attended_text_tokens=text,
        text_bytes=0.0,
    )
    assert table["x"] == [float(t + text) for t in sorted(bend)]
    for x, y, t in zip(table["x"], table["y"], sorted(bend), strict=True):
        assert y == pytest.approx(1.0e9 + 60_000.0 * x + bend[t], abs=1.0)
    merged = merge_memory(
        profile_to_dict(load_profile()), "mmdit-11b", rows, {"backward_peak_bytes": table}
    )
    profile = profile_from_dict(merged)
    row = profile.memory_models.index("mmdit-11b")
    assert list(profile.backward_peak_bytes[row].y) == pytest.approx(table["y"])
    assert profile.backward_peak_bytes[profile.memory_models.index("wan-14b")].x == []


def test_memory_rows_merge_into_a_profile():
    from zellige.profile import load_profile, profile_from_dict, profile_to_dict
    from zellige.profiler.memory import merge_memory

    base = profile_to_dict(load_profile())
    memory = {
        "activation_bytes_per_token_layer": 1000.0,
        "checkpoint_bytes_per_token_layer": 20.0,
        "backward_bytes_per_token_layer": 300.0,
        "text_bytes_per_token_layer": 40.0,
    }
    merged = merge_memory(base, "hunyuan-13b", memory)
    row = merged["memory_models"].index("hunyuan-13b")
    assert merged["activation_bytes_per_token_layer"][row] == 1000.0
    # a row the new model was not measured for: 0 (no launch floor); wan-14b keeps its own
    assert merged["launch_s_per_layer"][row] == 0.0
    assert merged["launch_s_per_layer"][merged["memory_models"].index("wan-14b")] > 0
    again = merge_memory(merged, "hunyuan-13b", {**memory, "text_bytes_per_token_layer": 7.0})
    assert again["memory_models"].count("hunyuan-13b") == 1
    assert again["text_bytes_per_token_layer"][row] == 7.0
    profile_from_dict(again)  # the core accepts the merged rows
    # a profile without memory rows gets one row in every column
    bare = {**base, "memory_models": [], **{key: [] for key in memory}}
    assert merge_memory(bare, "tiny", memory)["backward_bytes_per_token_layer"] == [300.0]


def test_memory_probes_run_through_fsdp_blocks():
    """profile_memory's probes (packs of two sequences, and one sequence whole or as a Ulysses or
    ring shard, on FSDP blocks) run on a CPU, where the allocator reports nothing, and leave no
    process group behind."""
    import torch.distributed as dist

    from zellige.profiler.measure import ProfileOptions
    from zellige.profiler.memory import local_pack_plan, profile_memory

    batch, _ = local_pack_plan(96, 16)
    assert [s.num_tokens for s in batch.sequences] == [48, 48]
    lines: list[str] = []
    options = ProfileOptions(model="tiny", quick=True, device="cpu")
    memory = profile_memory(options, torch.device("cpu"), torch.float32, lines.append)
    assert set(memory["probes"]) == {"64", "128"}
    assert memory["step_fixed_bytes"] == 0.0  # nothing measured on a CPU
    assert set(memory["shard_probes"]) == {
        "local_shard",
        "ulysses_shard_2",
        "ring_shard_2",
        "ulysses_shard_4",
        "ring_beside_local",
        "ulysses_beside_local",
    }
    assert memory["ulysses_wide_degree"] == 4  # the tiny model's 4 heads: one a rank
    assert memory["ulysses_bytes_per_token"] == memory["ring_bytes_per_token"] == 0.0
    assert memory["attention_phase_bytes_per_token"] == 0.0
    # the gradient reduction's small packs, and the check packs between the two lines
    assert set(memory["reduce_probes"]) == {"16", "32"} and set(memory["check_probes"]) == {"96"}
    assert set(memory["lines"]) == {"16", "32", "64", "96", "128"}
    lengths = memory["calls_probe"]["lengths"]  # one call each: distinct and positive
    assert len(set(lengths)) == len(lengths) == 8 and min(lengths) > 0
    assert memory["reduce_fixed_bytes"] == memory["reduce_bytes_per_token"] == 0.0
    assert any("step fixed" in line for line in lines)
    assert any("gradient reduction" in line for line in lines)
    assert not dist.is_initialized()


def test_fsdp_blocks_compute_the_plain_blocks_step():
    """The FSDP harness (blocks sharded as in training, over a group of one) runs the same
    step: equal output, input gradients and weight gradients (fp32 on a CPU)."""
    import torch.distributed as dist

    from zellige.profiler import rank_work
    from zellige.profiler.memory import local_pack_plan
    from zellige.profiler.models import dit_config

    config = dit_config("tiny")
    batch, plan = local_pack_plan(64, config.text_tokens)
    device, dtype = torch.device("cpu"), torch.float32
    results = []
    with rank_work.process_group_of_one(device):
        for make in (rank_work.make_blocks, rank_work.make_fsdp_blocks):
            torch.manual_seed(0)
            blocks = make(config, 2, device, dtype)
            inputs = rank_work.plan_rank_inputs(
                batch=batch,
                plan=plan,
                rank=0,
                config=config,
                device=device,
                dtype=dtype,
                generator=torch.Generator().manual_seed(1),
            )
            out = rank_work.forward_blocks(blocks, inputs, checkpointing=True)
            (out * inputs.grad_TD).sum().backward()
            weight = next(iter(blocks.parameters())).grad
            weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            # copies: the next step adds into the same gradient tensors
            grads = (out.detach(), inputs.x_TD.grad, inputs.text_XD.grad, weight)
            results.append(tuple(t.clone() for t in grads))
            # a whole step, as validate-profile runs it, keeps the FSDP weight gradients
            rank_work.train_step(blocks, inputs, checkpointing=True)
            kept = next(iter(blocks.parameters())).grad is not None
            assert kept == isinstance(blocks, rank_work.FSDPBlocks)
    assert not dist.is_initialized()
    for plain, sharded in zip(*results, strict=True):
        torch.testing.assert_close(sharded, plain)


def test_per_token_timing_runs_the_backward_of_every_projection():
    from zellige.profiler import rank_work
    from zellige.profiler.models import dit_config

    config = dit_config("tiny")
    device = torch.device("cpu")
    blocks = rank_work.make_blocks(config, 1, device, torch.float32)
    inputs = rank_work.per_token_inputs(
        config=config, num_tokens=32, device=device, dtype=torch.float32
    )
    rank_work.forward_blocks(blocks, inputs, checkpointing=False).backward(inputs.grad_TD)
    attention = blocks[0].self_attention
    for projection in (attention.q, attention.k, attention.v, attention.o):
        assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0


def test_mmdit_rank_work_runs_joint_blocks_on_a_sharded_rank():
    """The harness's MMDiT path: double then single blocks, a rank's held text and visual
    tokens of a ring shard (text first in the joint list), a training step through them."""
    from zellige import _core
    from zellige.model.mmdit import DoubleStreamBlock, SingleStreamBlock
    from zellige.profiler import rank_work
    from zellige.profiler.models import dit_config

    config = dit_config("mmdit-tiny")
    blocks = rank_work.make_blocks(config, 3, torch.device("cpu"), torch.float32)
    assert [type(b) for b in blocks] == [DoubleStreamBlock, DoubleStreamBlock, SingleStreamBlock]
    batch = _core.Batch(
        sequences=[
            _core.sequence_from_tokens(0, "video", 30, 12, 0),
            _core.sequence_from_tokens(1, "video", 5, 3, 1),
        ]
    )
    plan = _core.Plan()
    plan.num_ranks = 2
    plan.placements = [
        _core.make_placement(0, _core.Strategy.ring, [0, 1]),
        _core.make_placement(1, _core.Strategy.local, [0]),
    ]
    inputs = rank_work.plan_rank_inputs(
        batch=batch,
        plan=plan,
        rank=0,
        config=config,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    # rank 0 holds the first half of sequence 0's joint list (its 12 text + 9 visual) and
    # sequence 1 whole (3 text + 5 visual)
    assert inputs.num_tokens == 21 + 8 and inputs.num_text == 12 + 3
    assert inputs.vec_SD.shape[0] == 2
    rank_work.train_step(blocks, inputs, checkpointing=True)
    assert all(p.grad is None for p in blocks.parameters())  # dropped after the step


def test_mmdit_model_spec_cut_keeps_double_and_single_blocks():
    from zellige.profiler.models import dit_config, model_spec

    spec = model_spec("mmdit-11b", 2)
    d, f = 3072, 4 * 3072
    assert (spec.num_layers, spec.num_double_layers) == (2, 1)
    assert dit_config("mmdit-11b", 2).num_double_layers == 1
    assert spec.param_count == 2 * (10 * d * d + 2 * d * f) + 7 * d * d + 2 * d * f
    assert model_spec("mmdit-11b").param_count == _core_preset("mmdit-11b").param_count


def _core_preset(name):
    from zellige import _core

    return _core.model_preset(name)


def test_joint_memory_rows_count_text_as_attended_tokens():
    from zellige.profiler.memory import MemoryProbe, memory_rows

    layers, sequences, text_tokens = 2, 2, 512
    per_token = {"kept": 3000.0, "kept_checkpointing": 200.0}

    def probe(tokens: int) -> MemoryProbe:
        attended = tokens + sequences * text_tokens
        return MemoryProbe(
            inputs=int(40 * attended),
            kept=int(per_token["kept"] * layers * attended),
            transient=int(900 * attended),
            kept_checkpointing=int(per_token["kept_checkpointing"] * layers * attended),
            transient_checkpointing=int(5000 * attended) + 7_000_000,
        )

    rows = memory_rows(
        {8192: probe(8192), 32768: probe(32768)},
        None,
        num_layers=layers,
        num_sequences=sequences,
        text_tokens=text_tokens,
        extra_text_tokens=0,
    )
    assert rows["activation_bytes_per_token_layer"] == pytest.approx(3000.0)
    assert rows["text_bytes_per_token_layer"] == 0 and rows["text_kept_bytes_per_token_layer"] == 0
    assert rows["step_fixed_bytes"] == pytest.approx(7_000_000, rel=1e-6)


def test_quick_profile_and_validate_run_the_mmdit(tmp_path, capsys):
    """--model mmdit-11b --quick: both commands run MMDiT blocks (the tiny preset of its kind)."""
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main

    out, details = tmp_path / "profile.json", tmp_path / "details.json"
    args = ["profile", "--quick", "--model", "mmdit-11b", "--out", str(out)]
    assert main([*args, "--details", str(details)]) == 0
    assert "mmdit-11b runs as mmdit-tiny" in capsys.readouterr().err
    assert json.loads(details.read_text())["model"] == "mmdit-tiny"
    assert json.loads(out.read_text())["attention_head_dim"] == 16
    report_path = tmp_path / "validate.json"
    args = ["validate-profile", "--quick", "--model", "mmdit-11b", "--plans", "1"]
    assert main([*args, "--repeats", "1", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert len(report["ranks"]) >= 1
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in report["ranks"])
    assert any("layers of mmdit-tiny" in note for note in report["notes"])


def test_a_joint_spec_file_profiles_on_the_mmdit_blocks(tmp_path, capsys):
    """A joint-attention spec file (here mmdit-tiny's sizes under the user's name) runs the MMDiT
    reference blocks at its own sizes, cut as the preset is; profile --quick measures it."""
    from zellige.cli import main
    from zellige.model.mmdit import DoubleStreamBlock, SingleStreamBlock
    from zellige.model_spec import load_model_spec, save_model_spec
    from zellige.profiler import rank_work
    from zellige.profiler.models import dit_config, model_spec

    preset = _core_preset("mmdit-tiny")
    preset.name = "my-mmdit"
    path = tmp_path / "my_mmdit.toml"
    save_model_spec(preset, path)
    spec = load_model_spec(path)
    config = dit_config(spec)
    assert (config.joint_attention, config.num_layers, config.num_double_layers) == (True, 3, 2)
    blocks = rank_work.make_blocks(config, 3, "cpu", torch.float32)
    assert [type(b) for b in blocks] == [DoubleStreamBlock, DoubleStreamBlock, SingleStreamBlock]
    cut, cut_preset = model_spec(spec, 2), model_spec("mmdit-tiny", 2)
    assert (cut.num_layers, cut.num_double_layers, cut.param_count) == (
        cut_preset.num_layers,
        cut_preset.num_double_layers,
        cut_preset.param_count,
    )
    assert spec.num_layers == 3  # the cut is a copy

    out, details = tmp_path / "profile.json", tmp_path / "details.json"
    args = ["profile", "--quick", "--repeats", "1", "--model-spec", str(path), "--out", str(out)]
    assert main([*args, "--details", str(details)]) == 0
    assert "runs as" not in capsys.readouterr().err  # a spec file keeps its own sizes
    assert json.loads(details.read_text())["model"] == "my-mmdit"
    assert "--model-spec (my-mmdit)" in json.loads(out.read_text())["created"]


def test_quick_attention_call_table_is_what_the_merge_policy_reads(tmp_path, capsys):
    """`zellige profile --attention-calls` writes the table runtime/merging.py prices padded
    merges with (a --quick CPU run: tiny shapes; without --quick a CPU is refused)."""
    from zellige.cli import main
    from zellige.runtime.merging import CallCosts

    out = tmp_path / "calls.json"
    if not torch.cuda.is_available():
        assert main(["profile", "--attention-calls", "--out", str(out)]) == 2
        assert "--attention-calls needs a GPU" in capsys.readouterr().err
        assert not out.exists()
    assert (
        main(["profile", "--attention-calls", "--quick", "--repeats", "1", "--out", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    assert len(data["lengths"]) == len(data["masked_backward_s"]) >= 2
    costs = CallCosts.from_call_table(data, str(out))
    forward_s, backward_s = costs.call_s(32, 32, 3, masked=True)
    assert forward_s > 0 and backward_s > 0


@pytest.mark.parametrize("memory", ["roomy", "tight"])
def test_validate_runs_a_rank_with_the_full_recompute_its_cost_chose(memory):
    """Issue 16: where a rank does not fit with every layer's attention outputs kept, the cost
    model recomputes its first layers in full (attention included) and prices that; the harness
    must run the rank so. A full recompute runs the attention forward again, so forward over
    backward attention kernel calls is 1 + full layers / layers, over any number of steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zellige import _core
    from zellige.costs import make_cost_model
    from zellige.profiler import rank_work
    from zellige.profiler.models import dit_config, model_spec
    from zellige.profiler.validate import ValidationOptions, harness_peak_model, measure_rank

    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    class CountAttention(TorchDispatchMode):
        forward_calls = backward_calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.forward_calls += func is forward_op
            self.backward_calls += func is backward_op
            return func(*args, **(kwargs or {}))

    num_layers = 2
    spec = model_spec("tiny", num_layers=num_layers)
    batch = _core.Batch()
    batch.sequences = [
        _core.sequence_from_tokens(i, "video", 300 + 40 * i, spec.text_tokens, 0) for i in range(2)
    ]
    plan = _core.Plan()
    plan.planner, plan.num_ranks = "test", 1
    plan.placements = [_core.make_placement(i, _core.Strategy.local, [0]) for i in range(2)]
    cost_model = make_cost_model(spec, gpus=1)
    if memory == "tight":  # one byte short of the rank's peak with every layer checkpointed
        cluster = cost_model.cluster
        peak_bytes = cost_model.evaluate(batch, plan).ranks[0].peak_bytes
        cluster.gpu_memory_bytes = int((peak_bytes - 1) / (1 - cost_model.options.memory_headroom))
        cost_model = _core.CostModel(spec, cost_model.profile, cluster, cost_model.options)
    cost = cost_model.evaluate(batch, plan)
    peak_model = harness_peak_model(spec, 1, cost_model.profile, cost_model.options)
    expected_full = cost.ranks[0].full_recompute_layers
    assert (expected_full > 0) == (memory == "tight")
    device = torch.device("cpu")
    config = dit_config("tiny", num_layers=num_layers)
    options = ValidationOptions(
        model="tiny", num_layers=num_layers, repeats=1, device="cpu", quick=True
    )
    blocks = rank_work.make_blocks(config, num_layers, device, torch.float32)
    with rank_work.process_group_of_one(device):
        fsdp_blocks = rank_work.make_fsdp_blocks(config, num_layers, device, torch.float32)
        with CountAttention() as count:
            result = measure_rank(
                name="test", batch=batch, plan=plan, rank=0, cost_model=cost_model, cost=cost,
                peak_model=peak_model, peak_cost=peak_model.evaluate(batch, plan),
                blocks=blocks, fsdp_blocks=fsdp_blocks, config=config, options=options,
                device=device, dtype=torch.float32, gamma=0.0,
            )  # fmt: skip
        del fsdp_blocks
    assert result.full_recompute_layers == expected_full
    assert result.predicted_s > 0 and result.measured_s > 0
    assert count.backward_calls > 0
    assert count.forward_calls == count.backward_calls * (1 + expected_full / num_layers)


def test_attention_phase_rows_recover_the_phase_model():
    """attention_phase_rows: from probes of one rank made by the cost model's picture (a convex
    step peak in held tokens, shard rows per shard token, the attention buffers held for one
    phase at a time), the shard rows, the Ulysses share row and the phase row come back; the
    profile stores the phase row per model and the cost model takes it off a rank of two phases
    only."""
    from zellige import _core
    from zellige.profile import load_profile, profile_from_dict, profile_to_dict
    from zellige.profiler.memory import attention_phase_rows, linear_peaks, merge_memory

    n = 16384
    ring, ulysses, exchanged, phase = 84_000.0, 58_000.0, 30_000.0, 25_000.0

    def base(held: float) -> float:  # convex, as measured: cancels at equal held tokens
        return 1.0e9 + 230_000.0 * held + 0.4 * held**2

    def peak(local: float = 0, shard: float = 0, row: float = 0.0) -> dict:
        held = local + shard
        outside = held - max(local, shard)
        value = base(held) + row * shard - phase * outside
        return {"held_tokens": int(held), "calls": [max(local, shard)], "step_peak": value}

    wide = ulysses + exchanged * (7 / 8 - 0.5)
    probes = {
        "local_shard": peak(local=n),
        "ring_shard_2": peak(shard=n, row=ring),
        "ulysses_shard_2": peak(shard=n, row=ulysses),
        "ulysses_shard_8": peak(shard=n, row=wide),
        "ring_beside_local": peak(local=n, shard=n, row=ring),
        "ring_shard_2_double": peak(shard=2 * n, row=ring),
        "ulysses_beside_local": peak(local=n, shard=n, row=ulysses),
        "ulysses_shard_2_double": peak(shard=2 * n, row=ulysses),
    }
    # the one-phase peaks as the cost model reads its table: linear between packs
    packs = linear_peaks({x: base(x) for x in (8192, 2 * n, 65536)})
    assert packs(2 * n) == base(2 * n) and packs(3 * n) > base(3 * n)  # the chord of a convex
    rows = attention_phase_rows(probes, packs)
    assert rows["ring_bytes_per_token"] == pytest.approx(ring)
    assert rows["ulysses_bytes_per_token"] == pytest.approx(ulysses)
    assert rows["ulysses_exchanged_bytes_per_token"] == pytest.approx(exchanged)
    assert rows["attention_phase_bytes_per_token"] == pytest.approx(phase)
    assert rows["ring_bytes_per_token_at_2n"] == pytest.approx(ring)  # linear here
    assert "attention_phase_bytes_per_token" not in attention_phase_rows(probes)  # no packs
    with pytest.raises(ValueError, match="two token counts"):
        linear_peaks({1.0: 2.0})

    merged = merge_memory(profile_to_dict(load_profile()), "mmdit-11b", rows)
    profile = profile_from_dict(merged)
    row = profile.memory_models.index("mmdit-11b")
    assert profile.attention_phase_bytes_per_token[row] == pytest.approx(phase)
    assert profile.attention_phase_bytes_per_token[profile.memory_models.index("wan-14b")] == 0
    batch = _core.Batch()
    batch.sequences = [
        _core.sequence_from_tokens(0, "video", 20000, 512, 0),
        _core.sequence_from_tokens(1, "video", 30000, 512, 0),
    ]
    plan = _core.Plan()
    plan.num_ranks = 2
    plan.placements = [
        _core.make_placement(0, _core.Strategy.local, [0]),
        _core.make_placement(1, _core.Strategy.ring, [0, 1]),
    ]
    without = profile_from_dict(dict(merged, attention_phase_bytes_per_token=[]))
    spec = _core.model_preset("mmdit-11b")
    peaks = [
        _core.CostModel(spec, p, _core.make_cluster(2, 2)).evaluate(batch, plan).ranks
        for p in (without, profile)
    ]
    local, ring_shard = 20000 + 512, (30000 + 512) // 2  # attended tokens; the smaller phase
    assert peaks[0][0].peak_bytes - peaks[1][0].peak_bytes == pytest.approx(
        phase * min(local, ring_shard)
    )
    assert peaks[0][1].peak_bytes == peaks[1][1].peak_bytes  # one phase: as before


def test_ranks_are_timed_over_a_fixed_wall_time():
    """validate-profile times a rank over at least --min-timed-s of steps, never fewer than
    --repeats (2 for steps over a second), at most MAX_TIMED_STEPS; the median is kept."""
    from zellige.profiler.validate import MAX_TIMED_STEPS, timed_steps

    assert timed_steps(0.040, 3, 2.0) == 50  # a launch-floor rank: 2 s of 40 ms steps
    assert timed_steps(0.5, 3, 2.0) == 4
    assert timed_steps(0.9, 5, 2.0) == 5  # --repeats when it lasts longer
    assert timed_steps(1.8, 3, 2.0) == 2  # steps of seconds: two
    assert timed_steps(3.0, 3, 2.0) == 2 and timed_steps(3.0, 1, 2.0) == 1
    assert timed_steps(1e-4, 3, 2.0) == MAX_TIMED_STEPS
    assert timed_steps(0.040, 3, 0.0) == 3  # no wall time asked: --repeats


def test_relative_spread_is_the_interquartile_range_over_the_median():
    from zellige.profiler.validate import relative_spread

    assert relative_spread([0.1]) == 0.0
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0
    assert relative_spread([0.9, 1.0, 1.0, 1.1, 1.2]) == pytest.approx(0.1 / 1.0)


def test_time_only_profile_replaces_the_time_rows_and_keeps_the_memory_rows(
    tmp_path, capsys, monkeypatch
):
    """`zellige profile --time-only` over a base: the attention rows, the stream count the engine
    runs here (1 on a CPU) and the model's launch and per-token rows are measured; memory rows,
    other models' rows and the exchange rows stay the base's."""
    from zellige.cli import main
    from zellige.profile import load_profile, profile_to_dict

    monkeypatch.delenv("ZELLIGE_ATTENTION_STREAMS", raising=False)
    base = profile_to_dict(load_profile(None))
    base_path, out = tmp_path / "base.json", tmp_path / "rows.json"
    base["attention_streams"], base["attention_stream_overlap"] = 3, 0.5  # replaced
    base_path.write_text(json.dumps(base))
    args = ["profile", "--time-only", "--quick", "--base", str(base_path)]
    assert main([*args, "--out", str(out)]) == 0
    assert "attention streams: 1" in capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert rows["attention_streams"] == 1 and rows["attention_stream_overlap"] == 0.0
    assert rows["attention_head_dim"] == 16  # the tiny model's attention rows
    assert rows["attention_forward_s_per_head"]["x"] == [64.0, 128.0, 256.0]
    # --quick measures the tiny preset of the model's kind: its row is added, the others kept
    models = base["memory_models"]
    assert rows["memory_models"] == [*models, "tiny"]
    for key in ("activation_bytes_per_token_layer", "launch_s_per_layer", "step_fixed_bytes"):
        assert rows[key][: len(models)] == base[key]  # memory (and other models') rows kept
    assert rows["activation_bytes_per_token_layer"][-1] == 0.0  # not measured: analytic
    # measured: one of the two is above 0 (a loaded CPU's noise may put either at its floor, 0)
    assert rows["launch_s_per_layer"][-1] + rows["launch_s_per_attention_call"][-1] > 0
    assert rows["model_matmul_forward_flops_per_s"][-1]["x"] == [64.0, 128.0, 256.0]
    assert rows["exchange_intra_node_s"] == base["exchange_intra_node_s"]
    assert "--time-only --quick" in rows["created"]
    assert main(["profile", "--time-only", "--memory-only", "--quick", "--out", str(out)]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_validate_measures_the_time_rows_in_its_own_process(tmp_path, capsys):
    """validate-profile --measure-rows FILE --time-rows: the model's launch and per-token rows and
    the per-head attention tables measured and validated in one process; memory rows, call
    tables and streams stay --profile's."""
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main
    from zellige.profile import load_profile, profile_to_dict

    rows, results = tmp_path / "rows.json", tmp_path / "ranks.jsonl"
    args = ["validate-profile", "--quick", "--model", "mmdit-11b", "--plans", "1", "--repeats", "1"]
    assert main([*args, "--time-rows"]) == 2
    assert "--time-rows needs --measure-rows" in capsys.readouterr().err
    extra = ["--measure-rows", str(rows), "--time-rows", "--results-jsonl", str(results)]
    assert main([*args, *extra]) == 0
    err = capsys.readouterr().err
    assert "host issue time" in err and "attention streams" not in err
    measured, base = json.loads(rows.read_text()), profile_to_dict(load_profile(None))
    assert measured["attention_forward_s_per_head"]["x"] == [64.0, 128.0, 256.0]  # measured
    for key in ("attention_call_forward_s", "attention_streams", "attention_stream_overlap"):
        assert measured[key] == base[key]  # the call tables and streams stay
    assert measured["memory_models"][: len(base["memory_models"])] == base["memory_models"]
    assert measured["step_fixed_bytes"][: len(base["memory_models"])] == base["step_fixed_bytes"]
    assert "--time-only --quick" in measured["created"]
    ranks = [json.loads(line) for line in results.read_text().splitlines()]
    assert ranks and all(r["timed_steps"] == 1 and r["measured_s"] > 0 for r in ranks)


def test_validate_measures_only_the_launch_rows_in_its_own_process(tmp_path, capsys):
    """validate-profile --measure-rows FILE --launch-rows: the model's host launch rows measured
    in the validating process; every other row (per-token rates, attention tables, memory) stays
    --profile's, and the ranks are predicted with the new launch rows."""
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main
    from zellige.profile import load_profile, profile_to_dict

    rows, results = tmp_path / "rows.json", tmp_path / "ranks.jsonl"
    args = ["validate-profile", "--quick", "--model", "mmdit-11b", "--plans", "1", "--repeats", "1"]
    assert main([*args, "--launch-rows"]) == 2
    assert "--launch-rows needs --measure-rows" in capsys.readouterr().err
    both = ["--measure-rows", str(rows), "--launch-rows", "--time-rows"]
    assert main([*args, *both]) == 2
    assert "exclude each other" in capsys.readouterr().err
    extra = ["--measure-rows", str(rows), "--launch-rows", "--results-jsonl", str(results)]
    assert main([*args, *extra]) == 0
    err = capsys.readouterr().err
    assert "host issue time" in err and "per-token layers" not in err
    measured, base = json.loads(rows.read_text()), profile_to_dict(load_profile(None))
    row = measured["memory_models"].index("mmdit-tiny")  # what --quick runs mmdit-11b as
    assert measured["launch_s_per_layer"][row] + measured["launch_s_per_attention_call"][row] > 0
    for key in ("attention_forward_s_per_head", "attention_call_forward_s", "attention_streams"):
        assert measured[key] == base[key]
    kept = len(base["memory_models"])
    assert measured["memory_models"][:kept] == base["memory_models"]
    assert measured["step_fixed_bytes"][:kept] == base["step_fixed_bytes"]
    for table in ("model_matmul_forward_flops_per_s", "model_matmul_backward_flops_per_s"):
        assert measured[table][:kept] == base[table]  # no per-token rates measured
    assert "time rows (launch)" in measured["created"]
    ranks = [json.loads(line) for line in results.read_text().splitlines()]
    assert ranks and all(r["measured_s"] > 0 for r in ranks)


def _quick_validate_ranks(tmp_path, *extra: str) -> list[dict]:
    pytest.importorskip("zellige.runtime.attention", reason="needs the engine's attention")
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main

    jsonl = tmp_path / "ranks.jsonl"
    args = ["validate-profile", "--quick", "--plans", "1", "--ranks-per-plan", "1"]
    assert main([*args, "--repeats", "3", "--results-jsonl", str(jsonl), *extra]) == 0
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def test_validate_records_the_hosts_issue_time_and_facts(tmp_path, capsys):
    """Each rank records the host's issue time of its steps (on a CPU the host is the device:
    about the step's time, never more) and the facts of the process that can slow the issue."""
    import os

    (rank,) = _quick_validate_ranks(tmp_path)
    assert 0 < rank["host_issue_s"] <= rank["measured_s"] + 1e-4
    assert len(rank["timed_gc_collections"]) == 3
    assert all(n >= 0 for n in rank["timed_gc_collections"])
    host = rank["host"]
    assert host["pid"] == os.getpid() and host["torch_threads"] == torch.get_num_threads()
    assert host["python_threads"] >= 1 and len(host["gc_collections"]) == 3
    if os.path.exists("/proc/self/task"):
        assert host["os_threads"] >= host["python_threads"]
    printed = capsys.readouterr()
    assert f"host: pid {os.getpid()}, torch_threads" in printed.err  # the log's header
    assert "host issue" in printed.err  # the per-rank line


def test_validate_times_ranks_with_the_collector_frozen_as_training_does(tmp_path):
    """The ranks run with Python's collector as training's loop keeps it (QuietCollector): the
    objects that exist when the ranks start (torch.compile's among them) frozen, so a full
    collection does not traverse them inside a timed step; unfrozen again afterwards."""
    import gc

    before = gc.get_freeze_count()
    (rank,) = _quick_validate_ranks(tmp_path)
    assert rank["host"]["gc_frozen_objects"] > max(before, 10_000)
    assert gc.get_freeze_count() == 0  # close(): the run's objects collectable again


def test_host_issue_time_ends_before_the_final_synchronize(tmp_path, monkeypatch):
    """A slow synchronize (a GPU still busy after the host queued everything) lengthens the
    measured step but not the host's issue time: that is taken before the synchronize."""
    import time

    from zellige.profiler import timing

    wait_s = 0.03
    synchronize = timing.synchronize

    def slow_synchronize(device):
        time.sleep(wait_s)
        synchronize(device)

    monkeypatch.setattr(timing, "synchronize", slow_synchronize)
    (rank,) = _quick_validate_ranks(tmp_path)
    assert rank["measured_s"] >= wait_s
    assert 0 < rank["host_issue_s"] <= rank["measured_s"] - 0.9 * wait_s


def test_summarise_reads_results_written_before_the_host_issue_time(capsys):
    """Run 9's results (no host_issue_s, host facts or GC counts) still summarise; their
    launch-floor ranks are listed with the issue time not recorded."""
    from pathlib import Path

    from zellige.cli import main

    old = Path(__file__).resolve().parents[2] / "tests/fixtures/mmdit11b_h200_validate_ranks.jsonl"
    assert "host_issue_s" not in old.read_text()
    assert main(["validate-profile", "--summarise", str(old)]) == 0
    printed = capsys.readouterr().out
    assert "launch-floor ranks (2)" in printed
    floor = [line for line in printed.splitlines() if "dp-tokens/0" in line]
    assert len(floor) == 2 and all(line.endswith("not recorded") for line in floor)
    assert "host as the ranks began" not in printed  # no facts recorded: none claimed


def test_summarise_shows_the_issue_time_of_launch_floor_ranks(tmp_path, capsys):
    import dataclasses

    from zellige.cli import main

    def rank(index, busy_s, issue_s):
        return RankResult(
            plan=f"p/{index}",
            rank=0,
            tokens=1700,
            num_sequences=3,
            predicted_s=0.030,
            measured_s=0.038,
            predicted_peak_bytes=1e9,
            measured_peak_bytes=1e9,
            modelled_state_bytes=0.0,
            knapformer_work=1.0,
            predicted_busy_s=busy_s,
            host_issue_s=issue_s,
        )

    rows = [rank(0, 0.020, 0.0371), rank(1, 0.030, 0.0052), rank(2, 0.0, None)]
    jsonl = tmp_path / "ranks.jsonl"
    jsonl.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))
    assert main(["validate-profile", "--summarise", str(jsonl)]) == 0
    printed = capsys.readouterr().out
    # only rank 0 is a launch floor (busy < predicted; 0: not recorded, not a floor)
    assert "launch-floor ranks (1)" in printed
    (line,) = [line for line in printed.splitlines() if "1700 tokens" in line]
    assert line.split(":")[-1].split() == ["30.00", "/", "38.00", "/", "37.10"]


def test_repredict_lists_launch_floor_ranks_with_their_issue_time(tmp_path, monkeypatch, capsys):
    """bench/profile_repredict.py on run 9's two launch-floor ranks, one given an issue time."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    old = root / "tests/fixtures/mmdit11b_h200_validate_ranks.jsonl"
    floor = [json.loads(line) for line in old.read_text().splitlines() if "dp-tokens/0" in line]
    assert len(floor) == 2
    floor[0]["host_issue_s"] = 0.0377
    jsonl = tmp_path / "ranks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in floor))
    spec = importlib.util.spec_from_file_location("repredict", root / "bench/profile_repredict.py")
    repredict = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repredict)
    profile = root / "tests/fixtures/mmdit11b_h200_rows.json"
    argv = [
        "x",
        str(jsonl),
        "--model",
        "mmdit-11b",
        "--layers",
        "3",
        "--plan-profile",
        str(profile),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    repredict.main()
    lines = capsys.readouterr().out.split("launch-floor ranks")[1].splitlines()
    rows = [line.split() for line in lines if "dp-tokens/0" in line]
    assert [row[-2:] for row in rows] == [["39.52", "37.70"], ["37.47", "-"]]


def test_interleaved_step_times_alternates_rounds_and_keeps_every_run():
    """profile_launch's two tiny ranks are timed in alternating rounds, so a drift of the host's
    speed falls on both: each fn runs per_round times in a row, then the next, round after
    round, and every run's seconds come back under its own fn."""
    from zellige.profiler.launch import interleaved_step_times

    order: list[str] = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    times = interleaved_step_times(fns, torch.device("cpu"), rounds=3, per_round=2)
    assert order == ["a", "a", "b", "b"] * 3
    assert [len(t) for t in times] == [6, 6]
    assert all(s >= 0 for t in times for s in t)
