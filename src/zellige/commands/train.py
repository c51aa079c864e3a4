"""`zellige train --nproc N [launcher flags] TRAIN ARGUMENTS`: checks the run as the trainer does
(zellige.train's arguments, config, world size, planner, data, checkpoint), then starts N ranks
of `python -m zellige.train` on this node with torch's elastic launcher (torchrun's engine;
multi-node flags are torchrun's). A failure is one line per error, not torchrun's report."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from zellige.commands._args import int_in

PASS_THROUGH = True  # the arguments this parser does not know go to zellige.train
_TRAINER_STATUSES = (1, 2)  # zellige.train's own failures: it has printed their line
_MAX_NPROC = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # a trainer flag must never pass for a prefix of these
    parser.usage = "%(prog)s [--nproc N] [multi-node flags below] ARGUMENTS (zellige.train's)"
    parser.add_argument(
        "--nproc",
        type=int_in(1, _MAX_NPROC),
        default=1,
        metavar="N",
        help="processes (ranks) on this node (1)",
    )
    parser.add_argument(
        "--nnodes", type=int_in(1, 1 << 16), default=1, metavar="N", help="nodes (torchrun's)"
    )
    parser.add_argument(
        "--node-rank", type=int_in(0, 1 << 16), default=0, metavar="R", help="this node's rank"
    )
    parser.add_argument("--master-addr", metavar="HOST", help="rank 0's node (torchrun's)")
    parser.add_argument(
        "--master-port", type=int_in(1, 65535), metavar="PORT", help="its port (torchrun's)"
    )
    parser.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend (torchrun's)")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="(torchrun's)")
    parser.add_argument("--rdzv-id", metavar="ID", help="the job's rendezvous id (torchrun's)")


def _torchrun_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--nproc-per-node", str(args.nproc), "--nnodes", str(args.nnodes)]
    argv += ["--node-rank", str(args.node_rank)]
    for flag in ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    return [*argv, "-m", "zellige.train"]


def check_run(train_argv: list[str], num_ranks: int, nproc: int) -> bool:
    """The trainer's own checks of the run, here before any process starts: ValueError with
    one line for bad input. False when the checkpoint is already at --steps (said here)."""
    from zellige.train.__main__ import parse_run
    from zellige.train.loop import preflight

    args, config = parse_run(train_argv)
    if config.parallelism.device == "cuda":
        import torch

        if torch.cuda.is_available() and nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {nproc}: this node has {torch.cuda.device_count()} GPUs (one rank each)"
            )
    start = preflight(
        config,
        num_ranks=num_ranks,
        metrics_path=args.metrics,
        out_dir=args.out,
        resume_dir=args.resume,
        tensorboard_dir=args.tensorboard,
        wandb_project=args.wandb,
    )
    if start.checkpoint is not None and start.first_step == config.steps:
        print(
            f"checkpoint {start.checkpoint.path} is already at step {start.first_step} = "
            f"--steps: nothing to do (pass --steps above {start.first_step} to train on)",
            file=sys.stderr,
        )
        return False
    return True


def run(args: argparse.Namespace) -> int:
    train_argv = list(getattr(args, "passed", []))
    if args.nnodes > 1 and args.master_addr is None and args.rdzv_endpoint is None:
        raise ValueError(
            f"--nnodes {args.nnodes}: pass --master-addr (and --master-port) of node rank 0, or "
            "--rdzv-endpoint, so the nodes can meet"
        )
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be below --nnodes {args.nnodes}")
    if not check_run(train_argv, args.nproc * args.nnodes, args.nproc):
        return 0
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # one thread per rank, as torchrun sets it, without its banner; the user's value wins
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in ("elastic", "run", "launcher"):  # torchrun's own reports
        logging.getLogger(f"torch.distributed.{name}").setLevel(logging.CRITICAL)
    launch_args = torchrun.parse_args([*_torchrun_argv(args), *train_argv])
    try:
        torchrun.run(launch_args)
    except ChildFailedError as failed:
        return _report(failed.failures)
    return 0


def _report(failures: dict[int, Any]) -> int:
    """One line per rank that failed in a way zellige.train did not report itself (a signal, a
    crash); ranks the launcher stopped with SIGTERM after a peer failed say nothing. The exit
    status is the first such failure's (128 + N for signal N, as a shell's)."""
    stopped = -signal.SIGTERM
    failed = {r: f for r, f in failures.items() if f.exitcode != stopped} or failures
    status = None
    for rank, failure in sorted(failed.items()):
        code = failure.exitcode
        if code < 0:
            name = _signal_name(-code)
            print(f"zellige train: rank {rank} was killed by {name}", file=sys.stderr)
            code = 128 - code
        elif code not in _TRAINER_STATUSES:
            print(f"zellige train: rank {rank} exited with status {code}", file=sys.stderr)
        status = code if status is None else status
    return status


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
