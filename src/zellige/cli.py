"""The `zellige` command line. Each subcommand lives in zellige.commands.<module>, which exposes
`add_arguments(parser)` and `run(args) -> int`; this file only wires them up and turns user errors
into one-line messages."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from zellige._json import printable as escaped

# subcommand -> (module under zellige.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan", "place one step's batch on the GPUs with one planner and write the plan"),
    "compare": ("compare", "run several planners on the same batch and compare their predictions"),
    "show": ("show", "draw the per-rank picture of a plan (text, or a Gantt chart as PNG)"),
    "profile": ("profile", "measure this GPU for the cost model and write a profile JSON"),
    "check": (
        "check",
        "run a plan's distributed attention on N processes against single-process attention",
    ),
    "validate-profile": (
        "validate_profile",
        "MAPE of predicted rank time and peak memory against ranks run on this GPU",
    ),
    "encode": (
        "encode",
        "encode images and clips with your VAE and text encoder into a latent dataset",
    ),
    "train": (
        "train",
        "check a training run, then start its ranks (torchrun underneath): zellige.train",
    ),
}


MESSAGE_CHARACTERS = 400  # an error message longer than this is cut (it may echo a huge value)


def printable(text: str, limit: int = MESSAGE_CHARACTERS) -> str:
    """One line of `text` safe for a terminal: whitespace runs become one space, other control
    characters (terminal escapes) and lone surrogates are shown escaped (_json.printable), and
    the middle of an overlong text is cut."""
    text = escaped(" ".join(text.split()))
    if len(text) > limit:
        cut = len(text) - limit + 60
        text = f"{text[: limit - 60]} ...[{cut:,} characters cut]... {text[-40:]}"
    return text


class _Parser(argparse.ArgumentParser):
    """Usage mistakes (a missing flag, `--gpus abc`) also get one line; --help has the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {printable(message)} (see {self.prog} --help)\n")


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    else:
        text = str(error) or type(error).__name__
    return printable(text)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="zellige",
        description="Per-sequence parallel placement for mixed image/video DiT training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"zellige.commands.{module_name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    try:
        args, passed = parser.parse_known_args(argv)
        module = importlib.import_module(f"zellige.commands.{COMMANDS[args.command][0]}")
        # a command with PASS_THROUGH hands the arguments it does not know to another program
        if passed and not getattr(module, "PASS_THROUGH", False):
            parser.error(f"unrecognized arguments: {' '.join(passed)}")
        args.passed = passed
    except SystemExit as exit_request:  # --help, or a usage error argparse has already printed
        return 0 if exit_request.code is None else int(exit_request.code)
    try:
        return module.run(args)
    except BrokenPipeError:
        # The reader left (`zellige show plan.json | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # User errors (bad files, names, lengths, memory) become one line; ValueError covers
    # json.JSONDecodeError and zellige.PlanMemoryError. Anything else is a bug: keep its traceback.
    except (ValueError, OSError) as error:
        print(f"zellige: error: {_one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
