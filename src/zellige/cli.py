"""The `zellige` command line. Each subcommand lives in zellige.commands.<module>, which exposes
`add_arguments(parser)` and `run(args) -> int`; this file only wires them up and turns user errors
into one-line messages."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under zellige.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "profile": ("profile", "measure this GPU for the cost model and write a profile JSON"),
    "validate-profile": (
        "validate_profile",
        "MAPE of predicted rank time and peak memory against ranks run on this GPU",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zellige", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"zellige.commands.{module_name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(f"zellige.commands.{COMMANDS[args.command][0]}")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
