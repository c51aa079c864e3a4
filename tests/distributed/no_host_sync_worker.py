"""torchrun worker for test_no_host_sync.py: one training step per plan under a guard that records
every read of a tensor's values on the host; rank 0 saves every rank's records as JSON.

usage: torchrun --nproc-per-node N no_host_sync_worker.py OUT.json BATCH PLANNER [PLANNER ...]
(BATCH and PLANNER as in train_grad_worker.py; PLANNER "canary" runs the step with reads made
on purpose, to show that the guard sees them; "mmdit:PLANNER" runs the MMDiT's joint step,
mmdit_step.py, under PLANNER instead of the Wan-style model's)

The guarded window is what the training loop runs after the loader hands a step over (the
second step: the first does one-time work, like the attention kernel's check on first use):
assemble_step (load_step, the routes, the step's tables), the forward, the loss and the
backward. On a GPU a read of a device tensor's values makes the host wait for the GPU's queue
(a host sync); on CPU there is no queue to wait for, so the guard watches the operations that
would read: Tensor.item / bool / int / float (aten._local_scalar_dense), .tolist(), .numpy(),
np.asarray(tensor), torch.tensor / as_tensor of a list holding tensors, nonzero and the ops
made of it (torch.where(mask), boolean-mask indexing and assignment, masked_select, unique),
and repeat_interleave without output_size. It does not see what a CPU run cannot show: a
blocking host-to-device copy (bench/train_throughput.py --sync-check counts those on a GPU).

Excluded from the window, on purpose: load_step's agreement among ranks (_agree_on_status),
which reads the ranks' gathered status on the host by design; on CUDA it gathers host tensors
over a gloo group (runtime.layout._status_group), so it reads no device tensor.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist
from mmdit_grad_worker import make_model as make_mmdit
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from train_grad_worker import BATCHES, RING_PLAN, make_model

from zellige.data import StepDataset
from zellige.runtime import end_rank_process, layout
from zellige.train.config import mmdit_tiny_cpu, tiny_cpu
from zellige.train.loop import setup_distributed, step_loss
from zellige.train.mmdit_step import assemble_joint_step, joint_step_loss
from zellige.train.parallelize import parallelize
from zellige.train.step import assemble_step
from zellige.train.timing import StepTimer

aten = torch.ops.aten
READ_OPS = {
    aten._local_scalar_dense.default,  # item(), bool(), int(), float(), is_nonzero
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


_GUARD_FRAMES = {"_where", "record", "__torch_dispatch__", "read", "make"}


def _where() -> str:
    """The innermost frame of zellige (or of this worker, not the guard's own) that read."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        mine = name.endswith("no_host_sync_worker.py")
        if ("/zellige/" in name or mine) and not (mine and frame.name in _GUARD_FRAMES):
            return f"{name.split('/')[-1]}:{frame.lineno} ({frame.name})"
    return "torch internals"


class ReadGuard(TorchDispatchMode):
    """Records reads of tensor values by the host while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.active = True

    def record(self, what: str) -> None:
        if self.active:
            self.reads.append(f"{what} at {_where()}")

    @contextlib.contextmanager
    def paused(self):
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READ_OPS:
            self.record(str(func))
        elif func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None:
            if func is not aten.repeat_interleave.self_int:
                self.record(f"{func} without output_size")
        elif func.overloadpacket in INDEX_OPS and len(args) > 1:
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]
            ):
                self.record(f"{func} with a boolean mask")
        return func(*args, **kwargs)


@contextlib.contextmanager
def guarded():
    """ReadGuard over the dispatcher, plus the reads that bypass it (patched while inside)."""
    guard = ReadGuard()
    saved = {
        "tolist": torch.Tensor.tolist,
        "numpy": torch.Tensor.numpy,
        "__array__": torch.Tensor.__array__,
    }
    factories = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}
    agree = layout._agree_on_status

    def method(name):
        def read(self, *args, **kwargs):
            guard.record(f"Tensor.{name}()")
            with guard.paused():  # once per read: __array__ calls numpy()
                return saved[name](self, *args, **kwargs)

        return read

    def factory(name):
        def make(data, *args, **kwargs):
            if isinstance(data, list | tuple) and any(isinstance(x, torch.Tensor) for x in data):
                guard.record(f"torch.{name}(a list of tensors)")
            return factories[name](data, *args, **kwargs)

        return make

    def agree_paused(*args, **kwargs):
        with guard.paused():
            return agree(*args, **kwargs)

    for name in saved:
        setattr(torch.Tensor, name, method(name))
    for name in factories:
        setattr(torch, name, factory(name))
    layout._agree_on_status = agree_paused
    try:
        with guard:
            yield guard
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)
        layout._agree_on_status = agree


def canary() -> None:
    """Reads the guard must see (one each), as a step's careless code would make them."""
    x = torch.arange(6.0)
    counts = torch.tensor([1, 2, 3])
    x[0].item()
    bool(x[1] > 0)
    x[x > 2].sum()
    x.tolist()
    torch.repeat_interleave(torch.arange(3), counts)
    torch.tensor([x[0], x[1]])
    np.asarray(x)


def main() -> None:
    out_path, batch_name, planners = sys.argv[1], sys.argv[2], sys.argv[3:]
    configs = {
        joint: (mmdit_tiny_cpu() if joint else tiny_cpu()).with_fields(
            dtype="float64",
            activation_checkpointing=True,
        )
        for joint in (False, True)
    }
    device = setup_distributed(configs[False])
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    records = {}
    for name in planners:
        joint = name.startswith("mmdit:")
        planner = name.removeprefix("mmdit:")
        config = configs[joint]
        assemble, loss_of = (
            (assemble_joint_step, joint_step_loss) if joint else (assemble_step, step_loss)
        )
        timer = StepTimer(device)
        model = make_mmdit(config) if joint else make_model(config)
        mesh = init_device_mesh("cpu", (num_ranks,))
        parallelize(model, mesh, dtype="float64", activation_checkpointing=True, timer=timer)
        dataset = StepDataset(
            model=config.model.dit,
            recipe=config.data.recipe,
            planner="dp-cost" if planner == "canary" else planner,
            rank=rank,
            num_ranks=num_ranks,
            gpus_per_node=num_ranks,
            seed=config.seed,
            sequences=BATCHES[batch_name],
            plan=RING_PLAN if planner == "hand-ring" else None,
        )
        # step 0 warms up: the attention kernel's one-time check against the math kernel reads
        # its error back (kernels.py), as the first training step does; step 1 is watched
        for step in range(2):
            data = dataset[step]
            with guarded() if step else contextlib.nullcontext() as guard:
                step_input = assemble(data, config.model.dit.num_heads, device)
                loss = loss_of(model, step_input, data.total_tokens, timer)
                (loss * num_ranks).backward()
                if step and planner == "canary":
                    canary()
            model.zero_grad(set_to_none=True)
        everyone = [None] * num_ranks
        dist.all_gather_object(everyone, guard.reads)
        records[name] = everyone
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump(records, out, indent=1)
    end_rank_process()  # together, and without interpreter finalization (runtime/teardown.py)


if __name__ == "__main__":
    main()
