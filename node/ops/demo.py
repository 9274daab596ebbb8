"""`swarm-node demo`: a bootstrap peer and a whole local swarm, as separate processes, training.

The swarm is a ``LocalSwarm`` (node/ops/local_swarm.py). The demo shows one progress line: the
tail's optimizer step and loss, tokens/s, and wire bytes per token (every node's fwd+bwd bytes
out, divided by the tokens the head trained). It stops cleanly on Ctrl-C or after ``--steps``:
SIGTERM to every node, each drains and leaves.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from node.base import CliError
from node.ops.local_swarm import LocalSwarm, NodeProc, metric_sum


def add_arguments(p) -> None:
    p.add_argument("--manifest", default="default", help="run manifest (default: the shipped default run)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of each middle stage (default 1)")
    p.add_argument("--steps", type=int, default=0,
                   help="stop after the tail reaches this many steps (default: the manifest's train.steps)")
    p.add_argument("--workdir", default="", help="keep logs and checkpoints here (default: a temp dir, removed)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per node (default 1)")


def main(args) -> int:
    from node.ops.startup import load_manifest_arg

    m = load_manifest_arg(args.manifest)
    if args.replicas < 1:
        raise CliError(f"--replicas must be >= 1, got {args.replicas}")
    steps = args.steps or m.train.steps
    swarm = LocalSwarm(args.manifest, workdir=args.workdir or None, torch_threads=args.torch_threads)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        print(f"swarm-node demo: run {m.run.id}, {m.n_stages} stages, layout {list(map(list, m.stages.layout))}, "
              f"k={m.k}; logs in {swarm.workdir}", flush=True)
        swarm.start_bootstrap()
        print(f"bootstrap peer: {swarm.initial_peers[0]}", flush=True)
        nodes = []
        for s in range(m.n_stages):
            reps = args.replicas if 0 < s < m.n_stages - 1 else 1
            for r in range(reps):
                nodes.append(swarm.start_node(s, name=f"stage{s}" + (f"-{r}" if reps > 1 else "")))
        swarm.wait_ready(timeout=300)
        for n in nodes:
            print(f"  {n.name:<10} metrics {n.url}/metrics  status {n.url}/status", flush=True)
        code = _progress(swarm, nodes, steps)
    except KeyboardInterrupt:
        print("\nswarm-node demo: interrupted", flush=True)
    finally:
        print("swarm-node demo: stopping the swarm (SIGTERM: drain, checkpoint, leave)", flush=True)
        codes = swarm.close()
        signal.signal(signal.SIGTERM, previous)
    bad = {k: v for k, v in codes.items() if v != 0}
    print(f"swarm-node demo: done; exit codes {json.dumps(codes)}", flush=True)
    return 1 if bad or code else 0


def _progress(swarm: LocalSwarm, nodes: list[NodeProc], steps: int) -> int:
    """One progress line until the tail reaches ``steps`` (Ctrl-C stops it earlier)."""
    head, tail = nodes[0], nodes[-1]
    t0, shown = time.monotonic(), None
    live = sys.stdout.isatty()
    while True:
        mt = swarm.metrics(tail)
        step = int(metric_sum(mt, "swarm_node_steps_total"))
        loss = f"{mt['swarm_node_loss_ema']:6.3f}" if step and "swarm_node_loss_ema" in mt else "     -"
        tps = mt.get("swarm_node_tokens_per_second", 0.0)
        tokens = swarm.value(head, "swarm_node_tokens_total")
        wire = sum(metric_sum(swarm.metrics(n), "swarm_node_wire_bytes_total", direction="out", protocol=p)
                   for n in nodes for p in ("fwd", "bwd"))
        bpt = wire / tokens if tokens else 0.0
        line = (f"step {min(step, steps):5d}/{steps}  loss {loss}  {tps:8.0f} tok/s  "
                f"{bpt:6.1f} wire B/token  {time.monotonic() - t0:6.0f} s")
        if live:
            print("\r" + line, end="", flush=True)
        elif step != shown and (shown is None or step - shown >= 10 or step >= steps):
            print(line, flush=True)
            shown = step
        if step >= steps:
            if live:
                print()
            return 0
        if any(n.proc.poll() is not None for n in nodes):
            dead = [n.name for n in nodes if n.proc.poll() is not None]
            print(f"\nswarm-node demo: {', '.join(dead)} exited; see {swarm.workdir}/*.err", file=sys.stderr)
            return 1
        time.sleep(0.5)
