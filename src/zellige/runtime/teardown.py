"""How a rank process of a multi-process job ends: leave the process group together, then exit
without the interpreter's finalization.

Why: a process group lives on after destroy_process_group while anything still refers to it.
FSDP2 does (DTensor's sharding caches keep the device mesh, and the mesh keeps the group), and
so can a step's P2P operations until the garbage collector runs. A gloo group's C++ threads
(pt_gloo_runloop, gloo_tcp_loop) then still run while Python finalizes, and about one rank exit
in 30 to 50 aborts there with "terminate called without an active exception" (SIGABRT), after
the work has succeeded (seen in CI and reproduced with FSDP2 alone, without Zellige, on a loaded
2-core machine). Exiting with os._exit after the group is destroyed skips that finalization.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_rank_process(exit_code: int = 0) -> NoReturn:
    """Ends this rank's process with `exit_code`. On success (0) the ranks meet in a barrier,
    so that none tears its connections down while another still talks to it; the process group
    is destroyed, stdout and stderr are flushed and the process exits without Python's
    finalization (atexit handlers do not run: close files and writers before). A failing rank
    (exit_code != 0) destroys the group and exits as Python does (sys.exit): exiting at once
    would let torchrun stop the other ranks before rank 0 has printed the error they share.

    Call it last, from a rank's entry point (a torchrun script's `__main__`, a spawned worker),
    never from library code or an interactive session."""
    if exit_code != 0:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(exit_code)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
