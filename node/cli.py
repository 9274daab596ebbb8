"""`swarm-node` command line: one subcommand per operator task.

The top of ``node``'s rooms (``base`` < ``net`` < ``runtime`` < ``ops`` < ``daemon`` < ``cli``):
each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``. Modules keep heavy imports (torch, hivemind) inside ``main`` so that
``swarm-node --help`` is fast, and ``probe`` (py-libp2p) never shares a process with hivemind.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from node.base import CliError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("node.daemon", "run a node that holds one pipeline stage of a run"),
    "demo": ("node.ops.demo", "start a bootstrap peer and a whole local swarm that trains the default run"),
    "bootstrap": ("node.ops.bootstrap", "run a DHT-only entry peer and print its multiaddrs"),
    "train-local": ("node.ops.train_local", "train the chained stages in one process (the reference baseline)"),
    "keygen": ("node.net.identity", "write a persistent libp2p identity key (mode 0600)"),
    "manifest": ("node.ops.manifest_cmd", "organisers: create a run key, sign a manifest, verify one"),
    "status": ("node.ops.status", "show a node's stage, state, peers, throughput, capacity and loss"),
    "probe": ("node.net.probe", "dial a node with py-libp2p (a second libp2p implementation) and test it"),
    "doctor": ("node.ops.doctor", "check this machine: torch/CUDA, memory, ports, p2pd, clock, identity"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-node",
        description="Lend a GPU to a public swarm that trains one transformer by pipeline parallelism.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="log line format")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from node.base import setup_logging

    setup_logging(args.log_level, args.log_format)
    try:
        return int(args._main(args) or 0)
    except CliError as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swarm-node: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
