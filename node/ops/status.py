"""`swarm-node status TARGET`: a node at a glance.

TARGET is a node's metrics URL (``http://host:9100`` or ``host:9100``; ``/metrics`` is appended)
or its libp2p multiaddr (``/ip4/.../tcp/.../p2p/PEER``), in which case the node is asked over
``/swarm-node/health/1``. Prints stage, state, peers per stage, tokens/s, loss and the last error.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="metrics URL (http://host:9100) or the node's multiaddr")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the node (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def _metrics_url(target: str) -> str:
    url = target if "://" in target else f"http://{target}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    return url


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from the Prometheus text format (``local_swarm.parse_metrics``
    keys each sample by its printed name and labels instead)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _one(samples: dict, name: str, default: float | None = None) -> float | None:
    vals = samples.get(name)
    return vals[0][1] if vals else default


def status_from_metrics(text: str) -> dict[str, Any]:
    s = metric_samples(text)
    info = (s.get("swarm_node_info") or [({}, 0)])[0][0]
    state = next((lab.get("state") for lab, v in s.get("swarm_node_state", []) if v == 1), "unknown")
    peers = {lab.get("stage", "?"): int(v) for lab, v in s.get("swarm_node_peers", [])}
    verdicts: dict[str, int] = {}
    for lab, v in s.get("swarm_node_verifier_verdicts_total", []):
        key = lab.get("reason") or lab.get("verdict") or "?"
        verdicts[key] = verdicts.get(key, 0) + int(v)
    stage = _one(s, "swarm_node_stage")
    out: dict[str, Any] = {
        "run": info.get("run"),
        "peer_id": info.get("peer_id"),
        "stage": int(stage) if stage is not None else None,
        "state": state,
        "version": int(_one(s, "swarm_node_version", 0) or 0),
        "steps": int(_one(s, "swarm_node_steps_total", 0) or 0),
        "tokens_per_s": _one(s, "swarm_node_tokens_per_second"),
        "capacity_tokens_per_s": _one(s, "swarm_node_capacity_tokens_per_second"),
        "loss": _one(s, "swarm_node_loss"),
        "loss_ema": _one(s, "swarm_node_loss_ema"),
        "inflight": _one(s, "swarm_node_inflight_microbatches"),
        "banned_peers": int(_one(s, "swarm_node_banned_peers", 0) or 0),
        "peers_per_stage": dict(sorted(peers.items())),
        "verifier_verdicts": verdicts,
        "last_error": info.get("last_error") or None,
    }
    out["connections"] = {lab.get("kind", "?"): int(v) for lab, v in s.get("swarm_node_connections", [])}
    links: dict[str, dict[str, int]] = {}
    for lab, v in s.get("swarm_node_connected_peers", []):
        if lab.get("peer_stage") not in (None, "none") and v:
            links.setdefault(lab["peer_stage"], {})[lab.get("kind", "?")] = int(v)
    out["peers_by_path"] = dict(sorted(links.items()))
    punches = s.get("swarm_node_holepunch_total")
    out["holepunch"] = None if not punches else {
        "attempts": int(sum(v for _, v in punches)),
        "successes": int(sum(v for lab, v in punches if lab.get("outcome") == "success")),
    }
    errs = s.get("swarm_node_last_error_info")
    if errs:
        out["last_error"] = errs[0][0].get("message") or out["last_error"]
    return out


def fetch_metrics(target: str, timeout: float) -> str:
    url = _metrics_url(target)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"cannot read {url}: {reason}; is the node running with --metrics-port?") from e


async def status_from_multiaddr(maddr: str, timeout: float) -> dict[str, Any]:
    from node.net import Transport
    from protocol import HEALTH, make_health_request, parse_health

    # a node behind NAT is reached through the relay named in its address (.../p2p-circuit/p2p/ID)
    transport = await Transport.start(host_maddrs=("/ip4/127.0.0.1/tcp/0",) if "/127." in maddr
                                      else ("/ip4/0.0.0.0/tcp/0",), use_relay="/p2p-circuit" in maddr)
    try:
        peer = await transport.connect(maddr, timeout=timeout)
        frame = await transport.request(peer, HEALTH, make_health_request(), timeout=timeout)
        return parse_health(frame)
    finally:
        await transport.close()


def format_status(st: dict[str, Any]) -> str:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    peers = ", ".join(f"stage {k}: {v}" for k, v in st.get("peers_per_stage", {}).items()) or "-"
    verdicts = ", ".join(f"{k}={v}" for k, v in st.get("verifier_verdicts", {}).items()) or "-"
    lines = [
        f"run          {st.get('run') or '-'}",
        f"peer         {st.get('peer_id') or '-'}",
        f"stage        {st.get('stage') if st.get('stage') is not None else '-'}",
        f"state        {st.get('state')}",
        f"version      {st.get('version')} (steps {st.get('steps')})",
        f"tokens/s     {f(st.get('tokens_per_s'), '{:.1f}')} (capacity {f(st.get('capacity_tokens_per_s'), '{:.1f}')} per busy second)",
        f"loss         {f(st.get('loss'))} (ema {f(st.get('loss_ema'))})",
        f"in flight    {f(st.get('inflight'), '{:.0f}')}",
        f"peers        {peers}",
        f"banned       {st.get('banned_peers', 0)}",
        f"connections  {_connections(st)}",
        f"hole punches {_holepunch(st)}",
        f"verifier     {verdicts}",
        f"last error   {st.get('last_error') or '-'}",
    ]
    return "\n".join(lines)


def _connections(st: dict[str, Any]) -> str:
    conns = st.get("connections") or {}
    text = f"{conns.get('direct', 0)} direct, {conns.get('relayed', 0)} relayed"
    links = st.get("peers_by_path") or {}
    if links:
        text += "; stage peers " + ", ".join(
            f"{stage}: " + " + ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
            for stage, kinds in links.items())
    return text


def _holepunch(st: dict[str, Any]) -> str:
    hp = st.get("holepunch")
    if hp is None:
        return "- (not reported: the daemon runs no AutoNAT, e.g. --local)"
    return f"{hp['successes']} of {hp['attempts']} succeeded"


def main(args: argparse.Namespace) -> int:
    from node.base import CliError

    if args.target.startswith("/"):
        import asyncio

        try:
            st = asyncio.run(asyncio.wait_for(status_from_multiaddr(args.target, args.timeout), args.timeout + 15))
        except Exception as e:  # noqa: BLE001 - one line for the operator
            raise CliError(f"cannot reach {args.target}: {e}") from e
        print(json.dumps(st, indent=2, default=str) if args.json else
              "\n".join(f"{k:12s} {v}" for k, v in st.items()))
        return 0
    try:
        text = fetch_metrics(args.target, args.timeout)
    except ConnectionError as e:
        raise CliError(str(e)) from e
    st = status_from_metrics(text)
    if st["state"] == "unknown" and st["stage"] is None:
        raise CliError(f"{_metrics_url(args.target)} does not look like a swarm-node metrics endpoint")
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0
