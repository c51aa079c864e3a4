"""Synthetic data and the loader: determinism by seed, shapes, and the text route."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import zellige
from zellige.data import StepDataset, SyntheticLatents
from zellige.model import model_preset
from zellige.runtime import compile_step

CONFIG = model_preset("tiny-cpu")


def test_samples_are_deterministic_by_seed_step_and_id() -> None:
    latents = SyntheticLatents(token_channels=16, text_dim=32, seed=3)
    again = SyntheticLatents(token_channels=16, text_dim=32, seed=3)
    a = latents.sample(step=5, sequence_id=2, grid_thw=(2, 3, 4), text_tokens=7)
    b = again.sample(step=5, sequence_id=2, grid_thw=(2, 3, 4), text_tokens=7)
    c = latents.sample(step=5, sequence_id=3, grid_thw=(2, 3, 4), text_tokens=7)
    assert torch.equal(a.noisy_LC, b.noisy_LC) and torch.equal(a.text_XE, b.text_XE)
    assert a.timestep == b.timestep and 0 < a.timestep < 1
    assert not torch.equal(a.noisy_LC, c.noisy_LC)
    assert a.noisy_LC.shape == (24, 16) and a.text_XE.shape == (7, 32)
    assert a.positions_L3.tolist()[5] == [0, 1, 1]
    # x_t = (1 - t) x0 + t eps and v = eps - x0 for the x0 = x_t - t v they imply
    clean = a.noisy_LC - a.timestep * a.velocity_LC
    noise = clean + a.velocity_LC
    torch.testing.assert_close((1 - a.timestep) * clean + a.timestep * noise, a.noisy_LC)


@pytest.mark.parametrize("planner", ["dp-cost", "static-cp:2", "knapformer:g2n2"])
def test_program_text_route_delivers_each_sequence_text_to_its_chunks(planner: str) -> None:
    num_ranks = 4
    batch = zellige.generate(zellige.data.load_training_recipe("tiny"), num_ranks, seed=1)
    cost_model = zellige.make_cost_model(zellige.data.model_spec(CONFIG), num_ranks, num_ranks)
    plan = zellige.make_plan(planner, batch, cost_model)
    sequences = batch.sequences
    # every sequence's text rows carry its id, so delivery can be checked row by row
    source_rows = {
        r: np.concatenate(
            [[s.id] * s.text_tokens for s in sequences if s.source_rank == r] or [np.zeros(0)]
        )
        for r in range(num_ranks)
    }
    programs = [compile_step(batch, plan, CONFIG.num_heads, r) for r in range(num_ranks)]
    routes = [p.cross_text_route for p in programs]
    for rank, program in enumerate(programs):
        received = np.concatenate(
            [
                source_rows[src][routes[src].send_index][
                    sum(routes[src].send_splits[:rank]) : sum(routes[src].send_splits[: rank + 1])
                ]
                for src in range(num_ranks)
            ]
        )
        assert len(received) == sum(routes[rank].recv_splits)
        text_XE = received[routes[rank].recv_index]  # what route_text hands the model
        offsets = program.chunk_cross_text_offset
        for c, index in enumerate(program.chunk_sequence_index):
            count = program.chunk_cross_text_tokens[c]
            assert count == (sequences[index].text_tokens if program.chunk_num_tokens[c] else 0)
            assert (text_XE[offsets[c] : offsets[c] + count] == sequences[index].id).all()


@pytest.mark.parametrize("text_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_step_tensors_are_the_samples_concatenated(text_dtype: torch.dtype) -> None:
    """The dataset's tensors are each of its sequences' sample() in batch order, bit for bit
    (the text rows in text_dtype are the float32 rows rounded to it, as a bf16 model's own
    cast of them gives); the class text rows it keeps do not leak between sequences."""
    dataset = StepDataset(
        model=CONFIG, recipe="tiny", planner="dp-cost", rank=0, num_ranks=1, gpus_per_node=1,
        seed=4, text_dtype=text_dtype,
    )  # fmt: skip
    latents = SyntheticLatents(
        token_channels=CONFIG.token_channels, text_dim=CONFIG.text_dim, seed=4
    )
    counts = []
    for step in (1, 2, 3, 4, 5, 2):
        data = dataset[step]
        mine = [s for s in dataset.batch(step).sequences if s.source_rank == 0]
        counts.append(len(mine))
        samples = [
            latents.sample(
                step=step, sequence_id=s.id, grid_thw=(s.grid_t, s.grid_h, s.grid_w),
                text_tokens=s.text_tokens,
            )
            for s in mine
        ]  # fmt: skip
        want = {
            "source_noisy_TC": torch.cat([a.noisy_LC for a in samples]),
            "source_velocity_TC": torch.cat([a.velocity_LC for a in samples]),
            "source_timestep_T": torch.cat(
                [
                    torch.full((s.num_tokens,), a.timestep)
                    for s, a in zip(mine, samples, strict=True)
                ]
            ),
            "source_text_XE": torch.cat([a.text_XE for a in samples]).to(text_dtype),
            "source_text_timestep_X": torch.cat(
                [
                    torch.full((s.text_tokens,), a.timestep)
                    for s, a in zip(mine, samples, strict=True)
                ]
            ),
        }
        for name, tensor in want.items():
            got = getattr(data, name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert data.source_text_tokens == [s.text_tokens for s in mine]
    assert max(counts) >= 3


def test_step_dataset_materialises_only_this_ranks_sequences() -> None:
    dataset = StepDataset(
        model=CONFIG,
        recipe="tiny",
        planner="dp-cost",
        rank=1,
        num_ranks=2,
        gpus_per_node=2,
        seed=0,
    )
    data = dataset[3]
    batch = dataset.batch(3)
    mine = [s for s in batch.sequences if s.source_rank == 1]
    tokens = sum(s.num_tokens for s in mine)
    assert data.source_noisy_TC.shape == (tokens, CONFIG.token_channels)
    assert data.source_velocity_TC.shape == (tokens, CONFIG.token_channels)
    assert data.source_text_XE.shape == (sum(s.text_tokens for s in mine), CONFIG.text_dim)
    assert data.source_text_timestep_X.shape == (sum(s.text_tokens for s in mine),)
    assert data.total_tokens == sum(s.num_tokens for s in batch.sequences)
    assert data.num_sequences == len(batch.sequences)
    assert data.record.planner == "dp-cost" and data.record.plan_ms >= 0
    assert torch.equal(dataset[3].source_noisy_TC, data.source_noisy_TC)
    # The worker's compiled program: this rank's, and it crosses processes by pickle as is.
    assert data.error is None and data.program.rank == 1
    assert data.program.visual_route.num_source == tokens
    again = pickle.loads(pickle.dumps(data))
    assert again.program == data.program
    assert again.program.to_bytes() == data.program.to_bytes()
    assert again.record == data.record  # the plan's typed record crosses with it


SPAWNED_LOADER = """
import torch
from zellige.data import StepDataset
from zellige.model import model_preset

if __name__ == "__main__":
    dataset = StepDataset(model=model_preset("tiny-cpu"), recipe="wan-stage2", planner="dp-cost",
                          rank=0, num_ranks=1, gpus_per_node=1, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=range(2),
                                         num_workers=1, multiprocessing_context="spawn")
    print(sum(1 for _ in loader))
"""


def test_spawned_loader_worker_exits_without_nanobind_leak_reports(tmp_path) -> None:
    """A spawned worker (as with CUDA) keeps its dataset until interpreter teardown; the core
    objects it planned with must be gone by then, or nanobind prints leak reports."""
    import os
    import subprocess
    import sys

    script = tmp_path / "spawned_loader.py"
    script.write_text(SPAWNED_LOADER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"
    # nanobind's reports ("nanobind: leaked N instances!", types, functions); Python's
    # multiprocessing may warn of a leaked semaphore of its own now and then, unrelated
    assert "nanobind: leaked" not in result.stderr, result.stderr
