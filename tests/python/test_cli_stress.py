"""Issue 17, through the command line as a user runs it: the bad inputs of the stress test (sizes
beyond the documented limits, int64 overflow, huge or prime token counts, absurd profiles,
outputs over inputs or through symlinks, unwritable outputs, values that used to give
tracebacks, inputs accepted silently) each get one line `zellige...: error: ...` on stderr and
exit status 2 within seconds; and the newcomer fixes of `show` and the help texts."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
from test_cli import assert_user_error, images, write_batch

from zellige import _core
from zellige._files import MAX_INPUT_BYTES
from zellige.cli import COMMANDS, main
from zellige.profile import BUILTIN_PROFILE

WORKLOAD = ["--workload", "opensora2-stage2", "--gpus", "8"]
SECONDS = 20  # every refusal below comes well within this; the old behaviour ran for minutes


def zellige(
    *args, timeout: float = SECONDS, address_space_bytes: int | None = None
) -> subprocess.CompletedProcess:
    """`python -m zellige.cli ARGS`, failing the test if it runs longer than `timeout`; with
    `address_space_bytes`, an allocation beyond it fails (MemoryError) instead of swapping."""

    def limit_memory() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))

    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "zellige.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_memory if address_space_bytes is not None else None,
    )
    result.seconds = time.monotonic() - started
    return result


def refused(*args, needles: tuple[str, ...] = ()) -> str:
    """Runs the command and asserts the one-line refusal (exit 2, no traceback)."""
    return assert_user_error(zellige(*args), *needles)


def plan_file(tmp_path, *extra) -> tuple[str, dict]:
    out = tmp_path / "plan.json"
    result = zellige("plan", *WORKLOAD, "--planner", "zellige", "--out", out, *extra)
    assert result.returncode == 0, result.stderr
    return str(out), json.loads(out.read_text())


def builtin_profile() -> dict:
    from importlib import resources

    path = resources.files("zellige") / "profiles" / f"{BUILTIN_PROFILE}.json"
    return json.loads(path.read_text())


# ---- stress 2: documented upper bounds on rank counts, refused up front ----


def test_a_plan_file_with_a_trillion_ranks_is_refused_up_front(tmp_path):
    path, data = plan_file(tmp_path)
    data["num_ranks"] = 10**12
    (tmp_path / "big.json").write_text(json.dumps(data))
    refused("show", tmp_path / "big.json", needles=("num_ranks", str(_core.MAX_GPUS)))


@pytest.mark.parametrize("gpus", [1_000_000, _core.MAX_GPUS + 8])
def test_gpus_beyond_the_limit_are_refused_up_front(gpus):
    message = refused("plan", "--workload", "wan-stage1", "--gpus", gpus, "--planner", "zellige")
    assert str(_core.MAX_GPUS) in message


# ---- pricing a ring or hybrid placement takes time and memory linear in its ranks ----


@pytest.mark.parametrize("strategy", ["ring", "hybrid(8,2048)"])
def test_a_placement_over_the_most_ranks_is_shown_in_seconds_and_little_memory(tmp_path, strategy):
    # A 100 KB plan: one 2^20-token sequence over 16,384 ranks, whose r ring steps on each of r
    # ranks would take gigabytes as r x r listed calls.
    ranks = _core.MAX_GPUS
    batch = {"sequences": [{"id": 0, "num_tokens": 1 << 20, "text_tokens": 512}]}
    plan = {
        "planner": "hand-made",
        "num_ranks": ranks,
        "placements": [{"id": 0, "strategy": strategy, "ranks": list(range(ranks))}],
        "context": {"model": "wan-14b", "gpus_per_node": 8, "links": "nvlink", "batch": batch},
    }
    path = tmp_path / "wide.json"
    path.write_text(json.dumps(plan))
    result = zellige("show", path, address_space_bytes=2 << 30)
    assert result.returncode == 0, result.stderr
    assert result.seconds < SECONDS
    assert f"\n{ranks - 1} " in result.stdout  # a row for every rank


def test_a_sequence_no_placement_holds_is_refused_with_an_estimate_in_seconds(tmp_path):
    # Sizing it weighs every shape over up to 16,384 ranks: each in O(1), not O(its ranks).
    path = write_batch(tmp_path / "b.json", [{"id": 0, "num_tokens": 2**32, "text_tokens": 512}])
    result = zellige(
        "plan", "--batch", path, "--model", "wan-14b", "--gpus", _core.MAX_GPUS,
        "--planner", "zellige", address_space_bytes=2 << 30,
    )  # fmt: skip
    message = assert_user_error(result, "sequence 0", "does not fit in memory", "GiB per rank")
    assert result.seconds < SECONDS, message


# ---- model spec sizes are bounded: no size hangs a plan or wraps int64 ----


@pytest.mark.parametrize(
    "sizes, needle",
    [
        ({"num_layers": 2**20}, "num_layers must be at most"),
        ({"num_layers": 2**40}, "num_layers must be at most"),  # 4.9e18 parameters
        ({"width": 4, "head_dim": 2**62 + 1}, "head_dim must be at most"),  # x 4 heads wraps to 4
        ({"ffn_width": 2**40}, "ffn_width must be at most"),
        ({"num_heads": 2**13, "width": 2**13}, "num_heads must be at most"),
    ],
    ids=["layers-2^20", "layers-2^40", "head-dim-wraps", "ffn-2^40", "heads-2^13"],
)
def test_model_spec_sizes_beyond_their_bounds_are_refused_at_once(tmp_path, sizes, needle):
    spec = {"name": "big", "width": 64, "num_heads": 4, "num_layers": 2, "ffn_width": 128}
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**spec, "text_tokens": 8, **sizes}))
    message = refused("plan", *WORKLOAD, "--planner", "zellige", "--model-spec", path)
    assert needle in message and "big.json" in message


@pytest.mark.parametrize("joint", [False, True], ids=["cross", "joint"])
def test_a_model_spec_at_every_bound_plans_or_is_refused_in_seconds(tmp_path, joint):
    from zellige.model_spec import load_model_spec, save_model_spec

    layers = _core.MAX_MODEL_LAYERS
    spec = _core.make_model_spec(
        "largest", _core.MAX_MODEL_WIDTH, _core.MAX_MODEL_HEADS, layers,
        _core.MAX_MODEL_FFN_WIDTH, 1 << 20, joint, layers // 2 if joint else 0,
    )  # fmt: skip
    assert 0 < spec.param_count <= _core.MAX_MODEL_PARAMS
    path = tmp_path / "largest.toml"
    save_model_spec(spec, path)
    assert load_model_spec(path) == spec
    result = zellige("plan", *WORKLOAD, "--planner", "zellige", "--model-spec", path)
    if result.returncode != 0:  # its training state fits no GPU: one line, no traceback
        assert_user_error(result, "does not fit")


# ---- stress 3: int64 overflow of frames x height x width; a plan's grid must multiply ----


def test_pixel_sizes_whose_token_count_overflows_are_refused(tmp_path):
    side = 1 << 40  # (2^40 / 16)^2 tokens wrapped around int64 to a small count before
    path = write_batch(tmp_path / "b.json", [{"id": 0, "height": side, "width": side}])
    refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        needles=("sequence 0", "at most"),
    )  # fmt: skip


def test_show_refuses_a_plan_whose_batch_grid_does_not_multiply_to_its_tokens(tmp_path):
    batch = write_batch(tmp_path / "b.json", images(8))
    out = tmp_path / "plan.json"
    result = zellige(
        "plan", "--batch", batch, "--model", "tiny", "--gpus", 8, "--planner", "dp-tokens",
        "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    data["context"]["batch"]["sequences"][0]["grid"] = [(1 << 62) + 1, 4, 64]  # wraps to 256
    out.write_text(json.dumps(data))
    refused("show", out, needles=("sequence 0", "grid"))


# ---- stress 4: num_tokens near 2^63 used to hang; a prime near 1e18 took 3.5 s ----


@pytest.mark.parametrize("num_tokens", [2**63 - 25, 10**18 + 3, _core.MAX_SEQUENCE_TOKENS + 1])
def test_token_counts_beyond_the_limit_are_refused_at_once(tmp_path, num_tokens):
    path = write_batch(tmp_path / "b.json", [{"id": 1, "num_tokens": num_tokens, "text_tokens": 0}])
    message = refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        needles=("sequence 1", "num_tokens"),
    )  # fmt: skip
    assert str(_core.MAX_SEQUENCE_TOKENS) in message


def test_large_prime_token_counts_within_the_limit_grid_quickly(tmp_path):
    # 4294967291 is the largest prime below 2^32: its grid search takes every step there is.
    sequences = [{"id": i, "num_tokens": 4294967291, "text_tokens": 0} for i in range(200)]
    path = write_batch(tmp_path / "b.json", sequences)
    from zellige.workload import load_batch

    started = time.monotonic()
    batch = load_batch(path, model="tiny")
    assert time.monotonic() - started < 2.0
    assert (batch.sequences[0].grid_h, batch.sequences[0].grid_w) == (1, 4294967291)


# ---- stress 5: profiles bounded to physical ranges; predictions finite; JSON valid ----


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_bytes_per_s", 1e-300),
        ("matmul_flops_per_s", 1e300),
        ("launch_s_per_layer", "1e308 per model"),
        ("attention_forward_s_per_head", {"source": "measured", "x": [1, 2], "y": [1e-300, 1e300]}),
    ],
)
def test_profiles_outside_physical_ranges_are_refused(tmp_path, field, value):
    data = builtin_profile()
    if value == "1e308 per model":
        value = [1e308] * len(data["memory_models"])
    data[field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    refused("compare", *WORKLOAD, "--profile", path, needles=(field, "physical range"))


def steep_profile(tmp_path) -> str:
    """Within every range, but the attention table's end segment extrapolates to inf."""
    data = builtin_profile()
    data["attention_forward_s_per_head"] = {
        "source": "measured",
        "x": [1, 1.0001],
        "y": [1e-9, 1e6],
    }
    path = tmp_path / "steep.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "command",
    [
        ["compare"],
        ["compare", "--json"],
        ["plan", "--planner", "zellige"],
        ["plan", "--planner", "dp-tokens"],
    ],
)
def test_a_profile_that_predicts_inf_is_refused_never_printed(tmp_path, command):
    message = refused(*command, *WORKLOAD, "--profile", steep_profile(tmp_path))
    assert "PlanMemoryError" not in message
    assert "non-finite" in message or "finite predicted time" in message


def test_compare_json_never_holds_infinity_or_nan_and_refusals_have_reasons(tmp_path):
    result = zellige("compare", *WORKLOAD, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout, parse_constant=lambda name: pytest.fail(name))
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), (row["planner"], key)
        assert row.get("error", "x"), row  # a refusal always says why


# ---- stress 7: atomic writes, never over an input, symlinks replaced ----


def test_out_equal_to_the_batch_is_refused_and_the_batch_survives(tmp_path):
    path = write_batch(tmp_path / "b.json", images(8))
    before = (tmp_path / "b.json").read_text()
    refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        "--out", path, needles=("--out", "--batch", "input"),
    )  # fmt: skip
    assert (tmp_path / "b.json").read_text() == before


def test_show_png_equal_to_the_plan_is_refused(tmp_path):
    path, _ = plan_file(tmp_path)
    before = open(path).read()
    refused("show", path, "--png", path, needles=("--png", "input"))
    assert open(path).read() == before


def test_a_symlinked_output_is_replaced_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    result = zellige("plan", *WORKLOAD, "--planner", "dp-tokens", "--out", link)
    assert result.returncode == 0, result.stderr
    assert target.read_text() == "keep me"
    assert not link.is_symlink()
    assert json.loads(link.read_text())["planner"] == "dp-tokens"


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch, capsys):
    out = tmp_path / "plan.json"
    out.write_text("previous plan")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    rc = main(["plan", *WORKLOAD, "--planner", "dp-tokens", "--out", str(out)])
    assert rc == 2
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_text() == "previous plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_outputs_keep_the_usual_file_mode(tmp_path):
    out = tmp_path / "plan.json"
    assert zellige("plan", *WORKLOAD, "--planner", "dp-tokens", "--out", out).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


# ---- stress 8: outputs checked before the work ----


def test_profile_out_in_a_missing_directory_fails_before_measuring():
    result = zellige("profile", "--quick", "--out", "/missing-dir-17/p.json")
    assert_user_error(result, "/missing-dir-17", "does not exist")
    assert "[profile]" not in result.stderr  # nothing was measured
    assert result.seconds < 10


@pytest.mark.parametrize("flag", ["--json", "--results-jsonl"])
def test_validate_profile_outputs_are_checked_before_running(flag):
    result = zellige("validate-profile", "--quick", flag, "/missing-dir-17/r.json")
    assert_user_error(result, "does not exist")
    assert "[validate]" not in result.stderr


def test_an_output_that_is_a_directory_is_refused(tmp_path):
    refused("plan", *WORKLOAD, "--planner", "dp-tokens", "--out", tmp_path, needles=("directory",))


# ---- stress 11: one-line errors where there were tracebacks ----


@pytest.mark.parametrize(
    "sequence, needles",
    [
        ({"id": 2**63, "num_tokens": 4, "text_tokens": 0}, ("'id'",)),
        ({"id": 1, "num_tokens": 2**63, "text_tokens": 0}, ("'num_tokens'",)),
        ({"id": 1, "num_tokens": 4, "text_tokens": 2**64}, ("'text_tokens'",)),
        ({"id": 1, "num_tokens": 4, "text_tokens": 0, "source_rank": -(2**63) - 1}, ("rank",)),
        ({"id": 1, "num_tokens": 4, "text_tokens": 0, "grid": [1, 2**63, 2]}, ("grid",)),
    ],
)
def test_integers_beyond_int64_in_a_batch(tmp_path, sequence, needles):
    path = write_batch(tmp_path / "b.json", [sequence])
    refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        needles=needles,
    )  # fmt: skip


@pytest.mark.parametrize("rank", [2**63, -1, 2**70])
def test_plan_ranks_beyond_int64(tmp_path, rank):
    path, data = plan_file(tmp_path)
    data["placements"][0]["ranks"][0] = rank
    (tmp_path / "bad.json").write_text(json.dumps(data))
    refused("show", tmp_path / "bad.json", needles=("rank",))


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--gpus", str(2**63)], ("--gpus",)),
        (["--gpus", "8", "--seed", "-1"], ("--seed",)),
        (["--gpus", "8", "--seed", str(2**64)], ("--seed",)),
        (["--gpus", "8", "--gpus-per-node", str(2**63)], ("--gpus-per-node",)),
    ],
)
def test_command_line_integers_out_of_range(flags, needles):
    refused("plan", "--workload", "wan-stage1", *flags, "--planner", "zellige", needles=needles)


def test_json_nested_ten_thousand_deep(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 10_000 + "]" * 10_000)
    refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        needles=("nested too deeply",),
    )  # fmt: skip
    refused("show", path, needles=("nested too deeply",))


@pytest.mark.parametrize("text", ['{"sequences": NaN}', '{"num_ranks": Infinity}'])
def test_json_nan_and_infinity_are_not_numbers(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_text(text)
    refused("show", path, needles=("not a JSON number",))


@pytest.mark.parametrize("flag, value", [("--head-dim", 0), ("--heads", 0), ("--max-tokens", -5)])
def test_check_refuses_non_positive_sizes(flag, value):
    result = zellige(
        "check", "--nproc", 2, "--workload", "wan-stage1", "--planner", "zellige", flag, value
    )
    assert_user_error(result, flag)
    assert result.seconds < 10  # refused before any process starts


def test_batch_from_dev_zero_is_refused_by_the_input_size_cap():
    result = zellige(
        "plan", "--batch", "/dev/zero", "--model", "tiny", "--gpus", 8, "--planner", "zellige"
    )
    assert_user_error(result, "/dev/zero", f"{MAX_INPUT_BYTES >> 20} MiB")


# ---- stress 12: what used to be accepted silently ----


@pytest.mark.parametrize(
    "sizes",
    [
        {"height": 100, "width": 256},  # 100 is not a multiple of 16 (VAE 8 x patch 2)
        {"height": 256, "width": 250},
        {"frames": 80, "height": 256, "width": 256},  # frames - 1 not a multiple of 4
    ],
)
def test_pixel_sizes_that_are_not_whole_multiples_are_refused(tmp_path, sizes):
    path = write_batch(tmp_path / "b.json", [{"id": 3, "text_tokens": 0, **sizes}])
    refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige",
        needles=("sequence 3", "multiple"),
    )  # fmt: skip


def test_a_plan_for_another_batch_reusing_the_ids_does_not_pass_check(tmp_path):
    sequences = [{"id": i, "num_tokens": 256, "text_tokens": 8} for i in range(8)]
    batch = write_batch(tmp_path / "b.json", sequences)
    out = tmp_path / "plan.json"
    result = zellige(
        "plan", "--batch", batch, "--model", "tiny", "--gpus", 2, "--planner", "zellige",
        "--out", out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for seq in sequences:  # the same ids, other lengths
        seq["num_tokens"] = 1024
    other = write_batch(tmp_path / "other.json", sequences)
    result = zellige(
        "check", "--nproc", 2, "--batch", other, "--model", "tiny", "--plan", out, "--max-tokens",
        4096,
    )  # fmt: skip
    assert_user_error(result, "this plan is not for this batch")
    assert "PASS" not in result.stdout
    refused("show", out, "--batch", other, needles=("this plan is not for this batch",))


def test_a_huge_value_is_cut_and_terminal_escapes_are_escaped(tmp_path):
    huge = "x" * (20 << 20)  # 20 MB in one field name
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"sequences": [{"id": 1, "num_tokens": 4, huge: 1}]}))
    message = refused(
        "plan", "--batch", path, "--model", "tiny", "--gpus", 8, "--planner", "zellige"
    )
    assert len(message) < 1000
    result = zellige("plan", "--workload", "\x1b[31mred\x07", "--gpus", 8, "--planner", "zellige")
    message = assert_user_error(result, "unknown workload")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "\\x1b[31mred\\x07" in message


# ---- newcomer 7: `show` ----


def test_show_text_view_shows_exchange_where_the_timeline_has_it(tmp_path):
    path, data = plan_file(tmp_path)
    assert any(p["strategy"] != "local" for p in data["placements"])  # something is exchanged
    # Its sharded sequences as Ulysses (zellige may run them as rings), so that some ranks exchange
    for placement in data["placements"]:
        if placement["strategy"] != "local":
            placement["strategy"] = "ulysses"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    result = zellige("show", path)
    assert result.returncode == 0, result.stderr
    sharded = {rank for p in data["placements"] if p["strategy"] != "local" for rank in p["ranks"]}
    # Ulysses all-to-alls always cost time; a ring placement's transfers hide behind its steps'
    # attention, and what is left (latency, about 2 ms a step here) may be under the bar's
    # smallest mark
    exchanging = {
        rank
        for p in data["placements"]
        if p["strategy"].startswith(("ulysses", "hybrid"))
        for rank in p["ranks"]
    }
    assert exchanging
    for line in result.stdout.splitlines()[1:]:
        rank = int(line.split()[0])
        bar = line.split("|")[1]
        assert "~" not in bar or rank in sharded, line
        assert "~" in bar or rank not in exchanging, line


def test_show_png_has_ids_makespan_bound_and_workload_and_only_drawn_phases(tmp_path, monkeypatch):
    from matplotlib import pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path, _ = plan_file(tmp_path)
    png = tmp_path / "plan.png"
    assert main(["show", path, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = figures[0].axes
    title = ax.get_title()
    assert "opensora2-stage2" in title and "makespan" in title and "lower bound" in title
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert not any("waiting for the host" in label for label in labels)  # no launch time here
    assert any("all layers, drawn as one block" in label for label in labels)
    assert {"makespan", "lower bound"} <= set(labels)
    assert any(text.get_text().split("u")[0].isdigit() for text in ax.texts)  # sequence ids
    assert len(ax.lines) == 2  # the makespan and lower-bound lines


# ---- newcomer 8: help texts ----


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    import importlib

    parser = argparse.ArgumentParser(prog="zellige")
    sub = parser.add_subparsers()
    parsers = {}
    for name, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(f"zellige.commands.{module_name}")
        parsers[name] = sub.add_parser(name)
        module.add_arguments(parsers[name])
    return parsers


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_a_description(command):
    parser = _subparsers()[command]
    for action in parser._actions:
        assert action.help and action.help.strip(), (command, action.option_strings)


@pytest.mark.parametrize("command", ["plan", "compare", "show", "check"])
def test_help_lists_the_workloads(command):
    result = zellige(command, "--help")
    assert result.returncode == 0
    text = "".join(result.stdout.split())  # argparse may wrap a name at its hyphens
    for name in ("opensora2-stage2", "wan-stage3", "knapformer-mixed-images"):
        assert name in text


# ---- the Python API refuses the same limits with a ValueError (no nanobind TypeError) ----


@pytest.mark.parametrize("gpus, seed", [(2**63, 0), (1_000_000, 0), (8, -1), (8, 2**64)])
def test_the_api_refuses_gpus_and_seeds_beyond_the_limits(gpus, seed):
    import zellige

    with pytest.raises(ValueError, match="gpus|seed"):
        zellige.plan("wan-stage1", gpus, seed=seed)
