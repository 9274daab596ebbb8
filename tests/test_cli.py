"""The command line lists every subcommand."""

from __future__ import annotations

import subprocess
import sys

from node.cli import SUBCOMMANDS


def test_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "node.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for name in SUBCOMMANDS:
        assert name in out.stdout
    for name in ("run", "demo", "bootstrap", "train-local", "keygen", "status", "probe", "doctor"):
        assert name in SUBCOMMANDS
