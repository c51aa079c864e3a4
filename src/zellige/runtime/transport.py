"""Transport: how the engine's exchanges move rows between ranks (the route and Ulysses
all_to_all, the ring's P2P messages).

The Step carries one (load_step(transport=...)); the default is torch.distributed. A tool that
runs one rank's work alone (the profiler) passes its own, e.g. local copies of the same sizes,
instead of patching the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class Transport:
    """torch.distributed: every collective is called by every rank of the group with sizes from
    the plan compiler, so ranks with nothing to send still take part (zero splits)."""

    def all_to_all_rows(
        self,
        send: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup | None,
        async_op: bool = False,
    ) -> tuple[Tensor, dist.Work | None]:
        """Uneven all_to_all_single on dim 0: the receive buffer (and the handle if async)."""
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        work = dist.all_to_all_single(
            recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=async_op
        )
        return recv, work

    def p2p(
        self,
        sends: Sequence[tuple[int, Tensor]],
        recvs: Sequence[tuple[int, Tensor]],
        global_ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> list:
        """One dist.batch_isend_irecv for all messages of a ring step (peers are group ranks;
        global_ranks maps them to global ranks)."""
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), global_ranks[p], group, tag)
            for p, t in sends
            if t.numel() > 0
        ]
        ops += [
            dist.P2POp(dist.irecv, t, global_ranks[p], group, tag)
            for p, t in recvs
            if t.numel() > 0
        ]
        return dist.batch_isend_irecv(ops) if ops else []


DISTRIBUTED = Transport()


def wait_all(works: list) -> None:
    for work in works:
        work.wait()
