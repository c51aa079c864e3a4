"""The launcher's input checks (python -m zellige.train, in this process: seconds per case):
every value of a run file, the command line, a model table or a checkpoint is checked where it
enters, against the limits of docs/formats.md, and refused in one line with exit status 2 before
training, leaving what is on disk as it was."""

from __future__ import annotations

import os

import pytest

from zellige.train.__main__ import main


@pytest.fixture(autouse=True)
def _restored_environment():
    """An in-process run sets RANK, WORLD_SIZE and MASTER_* (setup_distributed): later tests'
    subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _one_error(capsys, argv: list[str], status: int = 2) -> str:
    """Runs the CLI in this process; asserts one error line and the exit status; returns it."""
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse's errors exit
        got = exit_.code
    captured = capsys.readouterr()
    assert got == status, captured.err[-3000:]
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zellige.train: error: "), captured.err[-3000:]
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def _model_file(tmp_path, lines: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(f'config = "tiny-cpu"\n[model]\npreset = "tiny-cpu"\n{lines}\n')
    return str(path)


MODEL_TABLE_CASES = [
    ("num_heads = 0", "model.num_heads must be an integer in [1,"),
    ("ffn_width = -5", "model.ffn_width must be an integer in [1,"),
    ("freq_dim = 31", "model.freq_dim must be even"),
    ("freq_dim = 0", "model.freq_dim must be an integer in [2,"),
    ("width = 4294967296", "model.width must be an integer in [1,"),
    ("num_layers = 1000000000", "model.num_layers must be an integer in [1,"),
    ("num_layers = 1e9", "model.num_layers must be an integer, got 1000000000.0"),
    ("eps = nan", "model.eps must be a number in"),
    ("eps = 0.0", "model.eps must be a number in"),
    ("rope_theta = 0.0", "model.rope_theta must be a number in"),
    ("rope_theta = inf", "model.rope_theta must be a number in"),
    ("latent_channels = 0", "model.latent_channels must be an integer in [1,"),
    ("patch_hw = 0", "model.patch_hw must be an integer in [1,"),
    ("patch_hw = -2", "model.patch_hw must be an integer in [1,"),
    ("patch_t = 0", "model.patch_t must be an integer in [1,"),
    ("text_dim = 0", "model.text_dim must be an integer in [1,"),
    ("text_tokens = -1", "model.text_tokens must be an integer in [0,"),
    ("num_double_layers = -1", "model.num_double_layers must be an integer in [0,"),
    ("width = 62", "width 62 is not a multiple of num_heads 4"),
    ("width = 65536\nffn_width = 262144\nnum_layers = 1024", "parameters need about"),
]


@pytest.mark.parametrize("lines, words", MODEL_TABLE_CASES, ids=[c[0] for c in MODEL_TABLE_CASES])
def test_model_table_values_outside_the_limits(capsys, tmp_path, lines, words) -> None:
    line = _one_error(capsys, ["--config-file", _model_file(tmp_path, lines), "--steps", "1"])
    assert words in line


def test_config_file_from_dev_zero_is_refused_by_the_size_cap(capsys) -> None:
    line = _one_error(capsys, ["--config", "tiny-cpu", "--config-file", "/dev/zero"])
    assert line == "zellige.train: error: /dev/zero: larger than the 1 MiB limit on TOML files"


def test_config_file_nested_five_thousand_deep(capsys, tmp_path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("steps = " + "[" * 5000 + "]" * 5000 + "\n")
    line = _one_error(capsys, ["--config", "tiny-cpu", "--config-file", str(path)])
    assert "nested too deeply" in line
    path.write_text("steps = " + "[" * 100 + "]" * 100 + "\n")  # parsed, past MAX_NESTING
    line = _one_error(capsys, ["--config", "tiny-cpu", "--config-file", str(path)])
    assert "nested deeper than 64 levels" in line


FLAG_CASES = [
    (["--data-ranks", "20000"], "data_ranks must be at most 16,384"),
    (["--data-ranks", "16384"], "data_ranks 16,384: each step's batch is drawn for that many"),
    (["--timeout-s", "1e300"], "timeout_s must be in [1, 604800] seconds"),
    (["--timeout-s", "1e-9"], "timeout_s must be in [1, 604800] seconds"),
    (["--timeout-s", "inf"], "timeout_s must be > 0 seconds"),
    (["--learning-rate", "1e38"], "learning_rate must be at most 1e+30"),
    (["--steps", str(10**23)], "steps must be at most 1,073,741,824"),
    (["--steps", str(2**63 - 1)], "steps must be at most 1,073,741,824"),
    (["--warmup-steps", str(2**63)], "warmup_steps must be at most"),
    (["--checkpoint-every", str(2**40)], "checkpoint_every must be at most"),
    (["--loader-workers", "100000"], "loader_workers must be at most 64"),
    (["--gpus-per-node", "100000"], "gpus_per_node must be at most 16,384"),
    (["--grad-clip-norm", "1e300"], "grad_clip_norm must be at most"),
    (["--weight-decay", "1e300"], "weight_decay must be at most"),
    (["--peak-flops-per-s", "1e300"], "peak_flops_per_s must be at most"),
]


@pytest.mark.parametrize("argv, words", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_training_flags_outside_the_limits(capsys, tmp_path, argv, words) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("kept\n")
    line = _one_error(capsys, ["--config", "tiny-cpu", *argv, "--metrics", str(metrics)])
    assert words in line
    assert metrics.read_text() == "kept\n"


def test_a_first_adamw_step_past_float32_is_refused(capsys, tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'config = "tiny-cpu"\n[optimizer]\nlearning_rate = 1e30\nbetas = [0.99999999, 0.999]\n'
    )
    line = _one_error(capsys, ["--config-file", str(path), "--warmup-steps", "0"])
    assert "learning_rate must be such that learning_rate / (1 - betas[0]) is at most" in line


def test_terminal_escapes_in_a_recipe_are_escaped(capsys) -> None:
    line = _one_error(capsys, ["--config", "tiny-cpu", "--recipe", "\x1b[31mred\x07"])
    assert "\\x1b[31mred\\x07" in line and all(ch.isprintable() for ch in line)


def test_a_long_recipe_string_is_cut_in_the_message(capsys, tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'config = "tiny-cpu"\n[data]\nrecipe = "{"r" * 500_000}"\n')
    line = _one_error(capsys, ["--config-file", str(path)])
    assert len(line) <= 450 and "characters cut" in line


def test_a_recipe_string_past_the_toml_cap_is_refused(capsys, tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'config = "tiny-cpu"\n[data]\nrecipe = "{"r" * (2 << 20)}"\n')
    assert "larger than the 1 MiB limit" in _one_error(capsys, ["--config-file", str(path)])


def test_terminal_escapes_in_latest_are_escaped(capsys, tmp_path) -> None:
    (tmp_path / "latest").write_text("\x1b]0;title\x07step-1\n")
    line = _one_error(capsys, ["--config", "tiny-cpu", "--resume", str(tmp_path)])
    assert "not a step-K" in line and all(ch.isprintable() for ch in line)
