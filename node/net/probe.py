"""``swarm-node probe MULTIADDR``: check a node from the outside with a second libp2p stack.

The probe runs py-libp2p (``node.net.probe_libp2p``) in a child process (py-libp2p and hivemind can
never share one), dials the node over Noise + yamux, calls ``/swarm-node/health/1``, then sends
one ``fwd`` frame for a run id the node does not serve, which a healthy node refuses with
``reject``/``wrong-run``. It reports reachability, round-trip latencies, the node's protocol
version and that reject reason. Exit status 0 when all of that worked, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from node.base import CliError

ROOT = Path(__file__).resolve().parent.parent


def run_probe(maddr: str, run: str | None = None, timeout: float = 10.0) -> dict:
    """Run the py-libp2p probe in a subprocess and return its JSON result."""
    cmd = [sys.executable, "-m", "node.net.probe_libp2p", maddr, "--timeout", str(timeout)]
    if run:
        cmd += ["--run", run]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        # the child needs a few seconds to import py-libp2p on top of the network timeout
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return {"maddr": maddr, "reachable": False, "error": "the py-libp2p probe process hung; killed"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"maddr": maddr, "reachable": False, "error": f"probe process failed: {tail[0]}"}
    return json.loads(lines[-1])


def ok(result: dict) -> bool:
    """The node is reachable, answers health, and refuses a wrong-run fwd politely."""
    return (
        bool(result.get("reachable"))
        and (result.get("health") or {}).get("type") == "health"
        and (result.get("fwd") or {}).get("type") == "reject"
        and "error" not in result
    )


def format_result(r: dict) -> str:
    lines = [f"node        {r.get('maddr')}"]
    if r.get("reachable"):
        lines.append(
            f"reachable   yes, in {r.get('connect_ms')} ms ({r.get('implementation')}, "
            f"{r.get('security')} + {r.get('muxer')})"
        )
    else:
        lines.append("reachable   no")
    h = r.get("health")
    if h:
        lines.append(f"health      {h.get('type')} in {h.get('rtt_ms')} ms, protocol version {h.get('version')}")
        status = h.get("status")
        if isinstance(status, dict) and status:
            shown = ", ".join(f"{k}={status[k]}" for k in list(status)[:8])
            lines.append(f"status      {shown}")
    f = r.get("fwd")
    if f:
        if f.get("type") == "reject":
            lines.append(f"wrong run   rejected with '{f.get('reason')}' in {f.get('rtt_ms')} ms: {f.get('detail')}")
        else:
            lines.append(f"wrong run   NOT rejected: the node answered {f.get('type')!r} to run {f.get('run')!r}")
    if r.get("retried"):
        lines.append(f"retried     {'; '.join(r['retried'])} (once, on a new stream)")
    if r.get("error"):
        lines.append(f"error       {r['error']}")
    lines.append("result      " + ("ok" if ok(r) else "FAILED"))
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("maddr", metavar="MULTIADDR", help="the node's full address: /ip4/.../tcp/PORT/p2p/PEER_ID")
    parser.add_argument("--run", default=None, help="run id to put in the test fwd frame (default: a wrong one)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for the network steps (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def main(args) -> int:
    if "/p2p/" not in args.maddr:
        raise CliError(f"{args.maddr} has no peer id; pass the full multiaddr the node prints, ending in /p2p/<id>")
    if args.timeout <= 0:
        raise CliError("--timeout must be positive")
    result = run_probe(args.maddr, args.run, args.timeout)
    result["ok"] = ok(result)
    print(json.dumps(result) if args.json else format_result(result))
    return 0 if result["ok"] else 1
