"""The training loop that torchrun runs: rectified flow on the reference DiT under any planner."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from zellige.data import StepDataset, make_loader
from zellige.model import VideoDiT
from zellige.train.checkpoint import load_checkpoint, save_checkpoint
from zellige.train.config import TrainConfig
from zellige.train.parallelize import parallelize, set_checkpointed_blocks
from zellige.train.step import StepInput, assemble_step
from zellige.train.timing import StepTimer


def setup_distributed(config: TrainConfig) -> torch.device:
    """Joins the process group torchrun describes (or a one-process group without torchrun)."""
    if config.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(backend=config.backend, device_id=device_id)
    return device


def build_model(config: TrainConfig, device: torch.device, timer: StepTimer) -> VideoDiT:
    """The sharded model. On CUDA it is built on the meta device and initialised after sharding
    (no rank ever holds the whole model); on CPU built whole, identical on every rank."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        with torch.device("meta"):
            model = VideoDiT(config.model)
    else:
        model = VideoDiT(config.model)
    parallelize(
        model,
        mesh,
        dtype=config.dtype,
        activation_checkpointing=config.activation_checkpointing,
        timer=timer,
        compile_elementwise=device.type == "cuda"
        if config.compile_elementwise is None
        else config.compile_elementwise,
    )
    if device.type == "cuda":
        model.to_empty(device=device)
        model.reset_parameters()
    return model


def train(
    config: TrainConfig,
    *,
    metrics_path: str | Path | None = None,
    out_dir: str | Path | None = None,
    resume_dir: str | Path | None = None,
    sequences: list[dict] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Runs config.steps steps (counting the resumed ones); returns each step's metrics (the same
    on every rank). `sequences` fixes every step's batch (tests)."""
    device = setup_distributed(config)
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    timer = StepTimer(device)
    model = build_model(config, device, timer)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.learning_rate,
        betas=config.betas,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",  # one kernel over all parameters, no per-tensor launches
    )
    warmup = max(config.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    first_step = load_checkpoint(resume_dir, model, optimizer, scheduler) if resume_dir else 0

    dataset = StepDataset(
        model=config.model,
        recipe=config.recipe,
        planner=config.planner,
        rank=rank,
        num_ranks=num_ranks,
        gpus_per_node=config.gpus_per_node,
        seed=config.seed,
        profile=config.profile,
        activation_checkpointing=config.activation_checkpointing,
        adaptive_checkpointing=config.activation_checkpointing and config.adaptive_checkpointing,
        sequences=sequences,
    )
    num_steps = max(config.steps - first_step, 0)
    loader = make_loader(
        dataset, first_step, num_steps, config.loader_workers, cuda=device.type == "cuda"
    )
    metrics_file = None
    if metrics_path and rank == 0:
        metrics_file = open(metrics_path, "a" if resume_dir else "w")  # noqa: SIM115
    bar = tqdm(
        total=config.steps,
        initial=first_step,
        disable=not progress or rank != 0,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    history = []
    data_iter = iter(loader)
    for step in range(first_step, first_step + num_steps):
        wait_start = time.perf_counter()
        data = next(data_iter)
        wait_s = time.perf_counter() - wait_start
        _synchronize(device)
        allocated_start_gib = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            allocated_start_gib = torch.cuda.memory_allocated(device) / 2**30
        step_start = time.perf_counter()
        timer.reset()
        checkpointed = _checkpointed_blocks(config, data.plan, rank)
        set_checkpointed_blocks(model, checkpointed)
        sync_check = config.sync_debug and device.type == "cuda"
        if sync_check:
            torch.cuda.set_sync_debug_mode("warn")  # every host sync until the optimizer step
        step_input = assemble_step(data, config.model.num_heads, device)
        local_loss = step_loss(model, step_input, data.total_tokens, timer)
        # FSDP averages gradients over ranks: scaling by the rank count makes that their sum
        (local_loss * num_ranks).backward()
        # the step's peak split by phase, against the cost model's (which has no optimizer step)
        peak_backward_gib = _peak_gib(device, reset=True)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if sync_check:
            torch.cuda.set_sync_debug_mode("default")
        regions = timer.seconds()
        _synchronize(device)
        step_s = time.perf_counter() - step_start

        busy_s = regions.get("block", 0.0) + regions.get("block.backward", 0.0)
        local = torch.tensor(
            [
                local_loss.item(),
                busy_s,
                regions.get("attention", 0.0) + regions.get("attention.backward", 0.0),
                regions.get("cross_attention", 0.0) + regions.get("cross_attention.backward", 0.0),
                step_s,
                wait_s,
            ],
            dtype=torch.float64,
        )
        gathered = _all_gather(local, device)  # [ranks, fields]
        loss = float(gathered[:, 0].sum())
        rank_busy = gathered[:, 1]
        slowest_step_s = float(gathered[:, 4].max())
        predicted = data.plan["predicted"]["rank_time_s"]
        record = {
            "step": step + 1,
            "loss": loss,
            "tokens_per_s": data.total_tokens / slowest_step_s,
            "plan_ms": float(data.plan["plan_ms"]),
            "mfu": _mfu(data.train_flops, slowest_step_s, num_ranks, config.peak_flops_per_s),
            "step_s": slowest_step_s,
            "tokens": data.total_tokens,
            "train_flops": data.train_flops,
            "sequences": data.num_sequences,
            "planned_imbalance": max(predicted) / (sum(predicted) / len(predicted)),
            "measured_imbalance": float(rank_busy.max() / rank_busy.mean().clamp_min(1e-12)),
            "predicted_makespan_s": float(data.plan["predicted"]["makespan_s"]),
            "busy_s_max": float(rank_busy.max()),
            "attention_s_max": float(gathered[:, 2].max()),
            "cross_attention_s_max": float(gathered[:, 3].max()),
            "data_wait_s_max": float(gathered[:, 5].max()),
            "grad_norm": float(_full(grad_norm)),
            "peak_gib": None
            if peak_backward_gib is None
            else max(peak_backward_gib, _peak_gib(device)),
            "peak_backward_gib": peak_backward_gib,  # forward and backward
            "peak_optimizer_gib": _peak_gib(device),  # clipping and the optimizer step
            "predicted_peak_gib": data.plan["predicted"]["rank_peak_bytes"][rank] / 2**30,
            "checkpointed_blocks": checkpointed,
            "allocated_start_gib": allocated_start_gib,  # held when the step began
            "lr": scheduler.get_last_lr()[0],
            "planner": config.planner,
        }
        history.append(record)
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if rank == 0 and progress:
            bar.update(1)
            bar.write(_step_line(record, config.steps))
        done = step + 1
        if out_dir and config.checkpoint_every and done % config.checkpoint_every == 0:
            save_checkpoint(out_dir, done, model, optimizer, scheduler)
    bar.close()
    if metrics_file:
        metrics_file.close()
    saved_last = config.checkpoint_every and config.steps % config.checkpoint_every == 0
    if out_dir and num_steps and not saved_last:
        save_checkpoint(out_dir, config.steps, model, optimizer, scheduler)
    return history


def step_loss(
    model: VideoDiT, step_input: StepInput, total_tokens: int, timer: StepTimer
) -> torch.Tensor:
    """This rank's share of the batch's rectified-flow loss: the sum over its tokens of the mean
    squared velocity error, divided by the GLOBAL token count. Summed over ranks it is the
    batch's mean loss whatever the placement, and summed gradients are its gradient."""
    velocity_TC = model(
        step_input.tokens,
        timer.wrap("attention", step_input.self_attention, fresh_output=False),
        timer.wrap("cross_attention", step_input.cross_attention, fresh_output=False),
    )
    loss_dtype = torch.promote_types(velocity_TC.dtype, torch.float32)
    error_TC = velocity_TC.to(loss_dtype) - step_input.velocity_TC.to(loss_dtype)
    return error_TC.square().mean(dim=1).sum() / total_tokens


def _checkpointed_blocks(config: TrainConfig, plan: dict, rank: int) -> int:
    """How many of the first blocks this rank checkpoints this step: the plan's choice under
    adaptive checkpointing, else all of them or none."""
    num_blocks = config.model.num_layers
    if not config.activation_checkpointing:
        return 0
    chosen = plan["predicted"].get("rank_checkpointed_layers") or []
    if config.adaptive_checkpointing and len(chosen) > rank:
        return int(chosen[rank])
    return num_blocks


def _peak_gib(device: torch.device, reset: bool = False) -> float | None:
    """GiB the allocator has held at most since its last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def _step_line(record: dict, total_steps: int) -> str:
    mfu = "-" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (
        f"step {record['step']}/{total_steps} loss {record['loss']:.4f} "
        f"tok/s {record['tokens_per_s']:.4g} MFU {mfu} "
        f"imbalance planned {record['planned_imbalance']:.3f} "
        f"measured {record['measured_imbalance']:.3f} plan {record['plan_ms']:.2f} ms"
    )


def _mfu(flops: float, step_s: float, num_ranks: int, peak_flops_per_s: float | None):
    if peak_flops_per_s is None:
        return None
    return flops / (step_s * num_ranks * peak_flops_per_s)


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _all_gather(local, device):
    buffers = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(buffers, local.to(device))
    return torch.stack(buffers).cpu()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
