"""`swarm-node run`: the daemon that holds one pipeline stage, joins the swarm and trains.

Start-up is a straight line, and every step that can fail because of the operator fails with
one line naming what is wrong and how to fix it (``CliError``), before anything is left running
(``node.daemon.checks``):

1. settings: flags > ``SWARM_NODE_*`` env > ``--config`` TOML > defaults (``node.ops.config``);
2. pre-flight: manifest, identity key permissions, listen and metrics ports free, device;
3. identity not already online (a throwaway daemon dials the key's peer id);
4. DHT + p2pd, bootstrapped from ``--initial-peers`` with retries (``node.net.dht``);
5. the swarm's manifest: same hash, or refuse naming the differing fields; publish if first;
6. stage: forced, from our checkpoint, or ``auto`` (least announced capacity);
7. memory: the stage must fit in the device's free memory (numbers in the error);
8. build the stage, restore the newest valid checkpoint, or download the weights from an online
   replica (``joining`` -> ``online``), serve fwd/bwd/state/health, announce, train
   (``node.daemon.node``: the lifecycle; ``node.daemon.slot``: what it holds for its stage;
   ``node.daemon.announcer``: what it tells the swarm every ``--announce-every`` seconds).

SIGTERM/SIGINT: stop injecting, drain in-flight microbatches (bounded by ``--drain-timeout``),
write a checkpoint, announce ``offline``, stop p2pd, exit 0.

Importing this package loads nothing heavy (``swarm-node --help`` imports it): the modules that
need torch and hivemind load when ``run_node`` runs or one of their names is first used.
"""

from __future__ import annotations

import logging
import time

from node import lazy_face
from node.ops import announce_line, run_and_exit, uvloop_runner
from node.ops import config as node_config

log = logging.getLogger("swarm_node.daemon")

# name -> the module that defines it, loaded on first use
_EXPORTS = {
    "Announcer": "node.daemon.announcer",
    "Holding": "node.daemon.announcer",
    "Node": "node.daemon.node",
    "StageSlot": "node.daemon.slot",
    "StartUp": "node.daemon.checks",
    "make_attacks": "node.daemon.verifier",
    "make_verifier": "node.daemon.verifier",
    "replicate_p2p": "node.daemon.checks",
    "start_up": "node.daemon.checks",
}
__all__ = sorted([*_EXPORTS, "add_arguments", "main", "run_node"])

__getattr__ = lazy_face(__name__, _EXPORTS, globals())


def add_arguments(parser) -> None:
    node_config.add_arguments(parser)


def main(args) -> int:
    return run_and_exit(lambda: run_node(node_config.resolve_config(args)))


def run_node(cfg: node_config.NodeConfig) -> int:
    """Check, start, serve until told to leave, leave: the exit status (``CliError`` when a
    start-up check fails)."""
    from node.daemon.checks import start_up
    from node.daemon.node import Node

    t_start = time.monotonic()
    with start_up(cfg) as started:
        node = Node(cfg, started)
        node.setup()
        m = started.manifest
        announce_line(f"peer {started.peer_id} holds stage {started.index}/{m.n_stages} of run {m.run.id}; "
                      f"listening on {' '.join(started.maddrs)}")
        log.info("start-up took %.1f s", time.monotonic() - t_start)
        with uvloop_runner() as runner:
            return runner.run(node.serve())
