"""The errors every room may raise and catch: an operator's mistake (``CliError``) and a
checkpoint that cannot be written or restored (``CheckpointError``)."""


class CliError(Exception):
    """An operator mistake: printed as one line `swarm-node: error: ...`, exit status 2."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or restored; the message says why and what to do."""
