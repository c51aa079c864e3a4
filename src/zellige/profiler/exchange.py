"""All-to-all time by bytes each rank sends and by group size, on the GPUs of this node.

One process per visible GPU (NCCL); groups of 2, 4, 8... consecutive GPUs time
`all_to_all_single` with even splits. Only the profile's intra-node tables come from here:
across nodes the cluster's links are used. Untested on real hardware so far: only one-GPU
machines were available when it was written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zellige.profiler.timing import median_time_s

SEND_BYTES = tuple(1 << e for e in range(16, 29, 2))  # 64 KiB .. 256 MiB per rank


def group_sizes(num_gpus: int) -> list[int]:
    sizes, size = [], 2
    while size <= num_gpus:
        sizes.append(size)
        size *= 2
    return sizes


def _worker(rank: int, world: int, port: int, result_path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared hosts
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", rank)
    results: dict[int, list[float]] = {}
    for size in group_sizes(world):
        # every rank joins every new_group call, in the same order
        groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        group = groups[rank // size] if rank < (world // size) * size else None
        seconds = []
        for num_bytes in SEND_BYTES:
            elements = num_bytes // 2 // size * size
            send = torch.randn(elements, device=device, dtype=torch.bfloat16)
            recv = torch.empty_like(send)
            if group is None:
                seconds.append(0.0)
                continue
            seconds.append(
                median_time_s(
                    lambda send=send, recv=recv, group=group: dist.all_to_all_single(
                        recv, send, group=group
                    ),
                    device,
                    warmup=3,
                    repeats=10,
                )
            )
        # the slowest rank of the group sets the collective's time
        times = torch.tensor(seconds, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        results[size] = times.tolist()
    if rank == 0:
        torch.save(results, result_path)
    dist.barrier()
    dist.destroy_process_group()


def profile_exchanges(progress: Callable[[str], None]) -> tuple[list[int], list[dict]]:
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "exchange.pt")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_worker, args=(world, port, path), nprocs=world, join=True)
        results = torch.load(path)
    sizes, tables = [], []
    for size, seconds in sorted(results.items()):
        sizes.append(size)
        tables.append({"source": "measured", "x": [float(b) for b in SEND_BYTES], "y": seconds})
        progress(
            f"all_to_all over {size} GPUs: {SEND_BYTES[-1] / seconds[-1] / 1e9:.0f} GB/s per rank "
            f"at {SEND_BYTES[-1] >> 20} MiB, {seconds[0] * 1e6:.0f} us at {SEND_BYTES[0] >> 10} KiB"
        )
    return sizes, tables
