"""Subcommands of the `zellige` CLI, one module each."""
