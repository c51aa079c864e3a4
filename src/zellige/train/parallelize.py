"""Parallelism, activation checkpointing, precision and timing are applied here, in one place;
the model itself knows none of them.

FSDP2 (fully_shard) over all ranks, one unit per block plus the root; on a world of one, by
default no FSDP at all (LoneRankWeights: the same arithmetic without FSDP2's copies). FSDP
averages gradients over ranks; the loop scales each rank's loss by the rank count so the result
is their sum (each rank's loss is already normalised by the global token count). A divide factor
of 1 would say the same, but gloo lacks the PREMUL_SUM reduction it needs.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zellige.model import VideoDiT, fused
from zellige.runtime.precision import bf16_policy
from zellige.runtime.recompute import recomputed
from zellige.train.timing import StepTimer

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


class BlockRunner(nn.Module):
    """Runs one block under the step timer; when checkpointing, its backward recomputes the
    block's per-token layers (selective checkpointing: the attention outputs are kept,
    zellige.runtime.recompute), or with `full_recompute` the whole block, attention included
    (where the plan's memory has no room for the kept outputs). Both may change between steps
    (set_checkpointed_blocks)."""

    def __init__(
        self,
        block: nn.Module,
        timer: StepTimer,
        activation_checkpointing: bool,
        fresh_output: bool = True,
    ) -> None:
        super().__init__()
        self.block = block
        self.activation_checkpointing = activation_checkpointing
        self.full_recompute = False
        # fresh_output: the output is a copy, for FSDP's hooks on module outputs; without FSDP
        # a view of the block's own output does (no copy of [T, D] after every block)
        self._timed = timer.wrap("block", self._run, fresh_output=fresh_output)

    def _run(self, *args):
        if self.activation_checkpointing:
            return recomputed(self.block, *args, full=self.full_recompute)
        return self.block(*args)

    def forward(self, *args):
        return self._timed(*args)


def set_checkpointed_blocks(model: VideoDiT, count: int, full: int = 0) -> None:
    """Checkpoint the first `count` blocks of a parallelized model, the first `full` of them
    with a full recompute, and keep the others' activations (the cost model lays memory out the
    same way: the backward frees the full activations of the last blocks first, while the
    gradients grow)."""
    if not 0 <= count <= len(model.blocks):
        raise ValueError(f"checkpointed blocks must be in [0, {len(model.blocks)}], got {count}")
    if not 0 <= full <= count:
        raise ValueError(f"fully recomputed blocks must be in [0, {count}], got {full}")
    for index, runner in enumerate(model.blocks):
        runner.activation_checkpointing = index < count
        runner.full_recompute = index < full


class LoneRankWeights:
    """Mixed precision on a world of one without FSDP: the modules' parameters stay the master
    weights (what the optimizer updates and checkpoints save); each forward computes with copies
    in the compute dtype made in one multi-tensor cast at its start, and each copy's gradient
    becomes its master's gradient as soon as the backward has accumulated it (the copy is then
    freed). The same arithmetic as FSDP2's policy on one rank (bf16 weights, bf16 gradients cast
    to fp32), without its per-unit copies into and out of the collectives' buffers, and without
    the backward's second cast; the copies live from the forward to their backward, as FSDP2's
    do with reshard_after_forward=False.

    An optimizer that writes the copies with its update (train.optimizer.CopyingAdamW) offers
    them for the next forward (offer_copies), which then casts nothing. keep_gradients: the
    backward's gradients stay in the compute dtype for such an optimizer (take_gradients), with
    their norm, and the masters get none."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, keep_gradients: bool = False) -> None:
        self._dtype = dtype
        self.keeps_gradients = keep_gradients
        self._gradients = {}  # keep_gradients: id(master) -> its gradient in the compute dtype
        self._norms = []  # keep_gradients: each kept gradient's 2-norm (device scalars)
        group_of = {
            id(m): 1 + index for index, runner in enumerate(model.blocks) for m in runner.modules()
        }
        # (module, name) of every parameter, looked up at each forward: the model may be
        # materialised (to_empty) or loaded after this
        self._slots = [
            (module, name)
            for module in model.modules()
            for name, p in module._parameters.items()
            if p is not None
        ]
        groups = [group_of.get(id(module), 0) for module, _ in self._slots]
        self._groups = [  # slot indices of the root's parameters, then of each block's
            [slot for slot, g in enumerate(groups) if g == group]
            for group in range(1 + len(model.blocks))
        ]
        self._masters = None  # during a step: the master weights, in slot order
        # the forward's parameters an optimizer offered (offer_copies): (weights, masters' ids
        # and versions then)
        self._offered = None
        self._restore_queued = False
        model.register_forward_pre_hook(self._before_forward)

    def chunks(self, blocks_per_chunk: int = 1) -> list[list[nn.Parameter]]:
        """The masters in the optimizer's chunks: the root's, then those of each run of
        `blocks_per_chunk` consecutive blocks (the last run may be shorter)."""
        blocks = self._groups[1:]
        runs = [self._groups[:1]] + [
            blocks[i : i + blocks_per_chunk] for i in range(0, len(blocks), blocks_per_chunk)
        ]
        return [[self._slot_param(slot) for group in run for slot in group] for run in runs]

    def new_copies(self) -> dict[int, torch.Tensor]:
        """Empty copies in the compute dtype, by id of their master, for an optimizer that
        writes them with its update (train.optimizer.CopyingAdamW; then offer_copies)."""
        masters = [self._slot_param(slot) for slot in range(len(self._slots))]
        return {id(m): torch.empty_like(m, dtype=self._dtype) for m in masters}

    def offer_copies(self, copies: dict[int, torch.Tensor]) -> None:
        """The next forward computes with `copies` instead of casting the masters, unless a
        master changed after this (its version counter moved: a checkpoint loaded, say) or was
        replaced. They are held from now to that forward, where the cast would make them anyway:
        between the optimizer's step and the next forward, never in the backward; the cost model
        prices them in the optimizer step (CostOptions.optimizer_copy_bytes_per_param). Their
        parameters and gradient hooks are made now, while the device runs the optimizer, not at
        the forward's start, where the device would wait for the host."""
        masters = [self._slot_param(slot) for slot in range(len(self._slots))]
        weights = self._weights(masters, [copies[id(m)] for m in masters])
        self._offered = (weights, [(id(m), m._version) for m in masters])

    def _take_offered(self, masters: list[nn.Parameter]) -> list[nn.Parameter] | None:
        offered, self._offered = self._offered, None
        if offered is None:
            return None
        weights, versions = offered
        if [(id(m), m._version) for m in masters] != versions:  # a master changed or moved
            return None
        return weights

    def _weights(self, masters: list[nn.Parameter], computes: list[torch.Tensor]) -> list:
        """The forward's parameters: the compute copies as leaves whose gradient, once
        accumulated, becomes their master's (_arrived)."""
        weights = []
        for (module, name), master, compute in zip(self._slots, masters, computes, strict=True):
            weight = nn.Parameter(compute, requires_grad=master.requires_grad)
            if weight.requires_grad:
                weight.register_post_accumulate_grad_hook(self._arrived(module, name, master))
            weights.append(weight)
        return weights

    def take_gradients(self) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """keep_gradients: this step's gradients in the compute dtype by id of their master,
        and their global 2-norm (None where none came); forgets both."""
        gradients, norms = self._gradients, self._norms
        self._gradients, self._norms = {}, []
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
        return gradients, norm

    def _slot_param(self, slot: int) -> nn.Parameter:
        module, name = self._slots[slot]
        return module._parameters[name]

    def _before_forward(self, _module, _args) -> None:
        if self._masters is not None:
            raise RuntimeError("LoneRankWeights: a forward began before the last backward ended")
        masters = [module._parameters[name] for module, name in self._slots]
        weights = self._take_offered(masters)
        if weights is None:
            computes = [torch.empty_like(m, dtype=self._dtype) for m in masters]
            with torch.no_grad():
                torch._foreach_copy_(computes, masters)  # the step's one cast of every weight
            weights = self._weights(masters, computes)
        self._masters = masters
        for (module, name), weight in zip(self._slots, weights, strict=True):
            module._parameters[name] = weight

    def _arrived(self, module: nn.Module, name: str, master: nn.Parameter):
        # The hook lives on the copy, and a copy may outlive the step where something keeps it
        # (one a compiled function saw, say): weak references, so that it never keeps the
        # LoneRankWeights, its modules or the masters alive.
        self_ref, module_ref, master_ref = (
            weakref.ref(self),
            weakref.ref(module),
            weakref.ref(master),
        )

        def hook(weight: torch.Tensor) -> None:
            self, module, master = self_ref(), module_ref(), master_ref()
            if not self._restore_queued:
                # at the backward's end, the masters go back where no gradient came
                torch.autograd.Variable._execution_engine.queue_callback(self._restore)
                self._restore_queued = True
            if self.keeps_gradients:
                # kept as the backward made it, for an optimizer that reads the compute dtype
                # (CopyingAdamW): no cast to the master's dtype (6 bytes a parameter moved)
                # and no fp32 gradient (2 bytes a parameter held instead of 4); its norm, which
                # the clipping needs, is taken now from the 2-byte values
                if id(master) in self._gradients:
                    raise RuntimeError("LoneRankWeights: two backwards in one step")
                grad = weight.grad
                self._gradients[id(master)] = grad
                wide = torch.promote_types(grad.dtype, torch.float32)
                self._norms.append(torch.linalg.vector_norm(grad, dtype=wide))
            else:
                grad = weight.grad.to(master.dtype)
                master.grad = grad if master.grad is None else master.grad + grad
            weight.grad = None
            module._parameters[name] = master  # the copy is freed with the autograd graph

        return hook

    def _restore(self) -> None:
        for (module, name), master in zip(self._slots, self._masters, strict=True):
            module._parameters[name] = master
        self._masters = None
        self._restore_queued = False

    def close(self) -> None:
        """Drops what a finished run still holds: an offer no forward will take (a copy of
        every weight), kept gradients."""
        self._offered = None
        self._gradients, self._norms = {}, []


def parallelize(
    model: VideoDiT,
    mesh: DeviceMesh,
    *,
    dtype: str,
    activation_checkpointing: bool,
    timer: StepTimer,
    compile_elementwise: bool = False,
    compile_outside: bool | None = None,
    reshard_after_forward: bool | None = None,
    fsdp_on_one_rank: bool = False,
    copying_optimizer: bool = False,
    compute_dtype_gradients: bool = False,
) -> VideoDiT:
    """Shards `model` in place over `mesh` and returns it. bfloat16 means bf16 compute with fp32
    master weights and fp32 gradient reduction; float32 / float64 compute in that dtype.
    compile_elementwise fuses the blocks' per-token layers with torch.compile (zellige.model.fused),
    compile_outside (None: the same) the RoPE tables, output head and loss.
    Each block unit prefetches the next one's all-gather in the forward (FSDP2's backward
    prefetches one unit by default). reshard_after_forward (None: on more than one rank) frees
    each unit's gathered weights after its forward; a lone rank keeps them for the backward,
    which then neither casts nor copies them again (FSDP2's gather on one rank is those two
    passes over every weight: pure overhead, paid once per step instead of twice). On one rank
    FSDP2 is left out unless fsdp_on_one_rank: LoneRankWeights gives bf16 compute on fp32
    masters with one cast per step and no copies; copying_optimizer (there only): copies in the
    compute dtype whatever it is, which the optimizer writes (LoneRankWeights.offer_copies);
    with compute_dtype_gradients it also reads the gradients in the compute dtype
    (LoneRankWeights.take_gradients). The LoneRankWeights is model.lone_weights (None where
    there is none)."""
    if reshard_after_forward is None:
        reshard_after_forward = mesh.size() > 1
    lone = mesh.size() == 1 and not fsdp_on_one_rank
    fused.use_compiled(compile_elementwise, outside=compile_outside)
    if dtype == "bfloat16":
        policy = bf16_policy()
    else:
        model.to(DTYPES[dtype])
        policy = MixedPrecisionPolicy()
    for index, block in enumerate(model.blocks):
        runner = BlockRunner(block, timer, activation_checkpointing, fresh_output=not lone)
        model.blocks[index] = runner
        if lone:
            continue
        fully_shard(
            runner, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward
        )
    model.lone_weights = None
    if lone:
        if dtype == "bfloat16" or copying_optimizer:
            model.lone_weights = LoneRankWeights(
                model,
                DTYPES[dtype],
                keep_gradients=copying_optimizer and compute_dtype_gradients,
            )
        return model
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    runners = list(model.blocks)
    for runner, following in zip(runners, runners[1:], strict=False):
        runner.set_modules_to_forward_prefetch([following])
    return model
