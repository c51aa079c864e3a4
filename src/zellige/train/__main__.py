"""torchrun --nproc-per-node N -m zellige.train --config NAME [--config-file RUN.toml] [--steps K]
[...any config field as --field-name VALUE] [--metrics FILE.jsonl] [--tensorboard DIR]
[--wandb PROJECT] [--out DIR] [--resume DIR]

Bad input is one line `zellige.train: error: ...` (from rank 0 only) and exit status 2, before
any training; a run that fails while training (a non-finite loss, a stuck rank) says so in one
line and exits with 1.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

import torch.distributed as dist

from zellige.cli import printable  # one line: escapes shown, at most 400 characters
from zellige.runtime import end_rank_process
from zellige.train.config import (
    CONFIGS,
    FIELD_HELP,
    SECTION_OF,
    SECTIONS,
    field_types,
    load_config_file,
    resolve_config,
)
from zellige.train.loop import say, train
from zellige.train.watchdog import TrainingFailed

PROG = "zellige.train"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line from rank 0, not a usage block from every rank."""

    def error(self, message: str):
        say(f"{PROG}: error: {printable(message)}")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=f"torchrun ... -m {PROG}",
        description="Train the reference video DiT. Values come from the named config, then "
        "--config-file, then the flags below.",
    )
    parser.add_argument("--config", help=f"named config: {', '.join(CONFIGS)}")
    parser.add_argument(
        "--config-file",
        metavar="RUN.toml",
        help="TOML file: config = NAME, steps/seed/freeze_gc, and a table per section "
        "([model] [data] [parallelism] [optimizer] [checkpoint] [metrics]) of the fields below",
    )
    parser.add_argument("--model", metavar="PRESET", help="model preset (e.g. tiny-cpu)")
    types = field_types()
    # one group per TOML table, so --help shows where each flag's key goes in a file
    groups = {"": parser.add_argument_group("run (top of the TOML file)")}
    groups |= {name: parser.add_argument_group(f"[{name}]") for name in SECTIONS}
    for key, help_text in FIELD_HELP.items():
        kind = types[key].removesuffix(" | None")
        flag = "--" + key.replace("_", "-")
        group = groups[SECTION_OF[key]]
        if kind == "bool":
            action = argparse.BooleanOptionalAction
            group.add_argument(flag, dest=key, action=action, help=help_text)
        elif kind in ("int", "float", "str"):
            group.add_argument(flag, dest=key, type=_number(kind), help=help_text)
    parser.add_argument("--metrics", metavar="FILE", help="write one JSON object per step")
    parser.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars here")
    parser.add_argument("--wandb", metavar="PROJECT", help="log to Weights & Biases (if installed)")
    parser.add_argument("--out", metavar="DIR", help="checkpoint directory")
    parser.add_argument("--resume", metavar="DIR", help="resume from this checkpoint directory")
    return parser


def _number(kind: str):
    def parse(text: str):
        try:
            return {"int": int, "float": float, "str": str}[kind](text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {kind}") from None

    return parse


def die_with_launcher() -> None:
    """Under torchrun on Linux, the kernel kills this rank when its launcher dies: killing
    torchrun (or its process group; torchrun starts ranks in sessions of their own) must not
    leave ranks training and writing checkpoints."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() == 1:  # the launcher died before the line above
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    args = _parser().parse_args(argv)
    overrides = {
        key: getattr(args, key) for key in FIELD_HELP if getattr(args, key, None) is not None
    }
    try:
        file_values = load_config_file(args.config_file) if args.config_file else {}
        if args.model is not None:  # the preset; the file's [model] fields still apply
            table = file_values.get("model")
            table = dict(table) if isinstance(table, dict) else {}
            file_values["model"] = table | {"preset": args.model}
        config = resolve_config(args.config, file_values, overrides, args.config_file or "")
    except ValueError as error:
        say(f"{PROG}: error: {printable(str(error))}")
        return 2
    try:
        train(
            config,
            metrics_path=args.metrics,
            out_dir=args.out,
            resume_dir=args.resume,
            tensorboard_dir=args.tensorboard,
            wandb_project=args.wandb,
        )
    except ValueError as error:
        say(f"{PROG}: error: {printable(str(error))}")
        return 2
    except TrainingFailed as failure:
        if failure.report:
            print(f"{PROG}: error: {printable(str(failure))}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # a barrier on success, then exit without Python's finalization, where the FSDP2-held gloo
    # group aborts a rank now and then after training succeeded (runtime/teardown.py)
    end_rank_process(main())
