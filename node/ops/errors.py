"""Errors shared by the subcommands (kept apart from node/ops/cli.py, which may run as __main__)."""


class CliError(Exception):
    """An operator mistake: printed as one line `swarm-node: error: ...`, exit status 2."""
