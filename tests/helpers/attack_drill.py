"""Attack drill: a real loopback swarm in which one middle replica poisons what it sends.

Shared by tests/test_sentinel_swarm.py (asserts) and scripts/bench_sentinel.py ``--part real``
(reports). Every node is a real ``swarm-node run`` process (``node.ops.local_swarm.LocalSwarm``: own p2pd,
own metrics port, own process group). The run:

1. bootstrap, head (stage 0), ``honest`` replicas of stage 1, tail (stage 2), SENTINEL on;
2. once they are online and past SENTINEL's warm-up (tail step ``warmup`` + 10: the warm-up is
   honest by assumption), the malicious replica of stage 1 starts with ``--attack NAME
   --allow-attacks``: a newcomer, judged from its first tensor against the references the
   honest traffic built (a replica that turns malicious later is the same case after a ban: the
   verifier forgets a banned sender);
3. metrics are polled until a neighbour bans it (the tail for its activations, cause
   ``verifier``; the head for its refused output, cause ``verifier-downstream``; the head for
   its gradients, cause ``verifier``), then for ``observe_s`` more seconds;
4. the swarm is stopped (SIGTERM: drain, leave) and the logs say who banned whom.

Figures: time and tail steps from the attacker's first served microbatch to its first ban, the
share of the stage's microbatches it served after that ban (0 while it lasts), honest peers
banned, the tail's steps and loss.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

from node.ops import LocalSwarm, metric_sum, write_manifest
from node.ops.local_swarm import NodeProc, p2pd_pids_of

BAN_CAUSES = ("verifier", "verifier-downstream")
# the distances that compare a tensor with the token table (what a swap of positions cannot hide from)
TOKEN_CHECKS = ("tok", "pos", "tokc", "shift")
_LOSS = re.compile(r"step (\d+) loss ([0-9.]+|nan|inf)")


def drill_manifest(manifest: str = "test", **sentinel) -> object:
    """``manifest`` (name or path) with SENTINEL on and ``sentinel`` fields overridden."""
    from stages import load_manifest

    return load_manifest(manifest).replace(sentinel={"enabled": True, **sentinel})


def peer_id_of(node: NodeProc) -> str | None:
    m = re.search(r"peer (\S+) holds stage", node.output())
    return m.group(1) if m else None


def banned_in_logs(node: NodeProc, peer: str) -> int:
    """How many times ``node`` logged a ban of ``peer`` (routing bans of every cause)."""
    return len(re.findall(rf"\bbanned {re.escape(peer)} for ", node.logs()))


def rejections_over(nodes: list[NodeProc], peer: str) -> list[set[str]]:
    """For each of ``peer``'s tensors that the ``nodes`` rejected on a fence: the distances over
    their fences (the logs' ``over:`` lists). The metrics count a rejection under its worst
    distance only, which hides what else caught it."""
    out = []
    pattern = re.compile(rf"verifier rejected \w+ from {re.escape(peer[-8:])}: \S+ \(score [^;)]*; over: ([^)]*)\)")
    for node in nodes:
        out += [{item.split(" ", 1)[0] for item in listed.split(", ")} for listed in pattern.findall(node.logs())]
    return out


def _reasons(metrics: dict[str, float]) -> dict[str, int]:
    """Rejections by reason (every sender's) from a node's /metrics."""
    out: dict[str, int] = {}
    for key, v in metrics.items():
        if key.startswith("swarm_node_verifier_verdicts_total{") and 'verdict="reject"' in key and v:
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(v)
    return out


def _served(sw: LocalSwarm, node: NodeProc) -> float:
    return sw.value(node, "swarm_node_served_total", protocol="fwd", result="ack")


def run_attack_drill(workdir: str | Path, *, attack: str = "scaling", honest: int = 1, manifest: str = "test",
                     sentinel: dict | None = None, observe_s: float = 15.0, ban_timeout_s: float = 60.0,
                     ready_timeout_s: float = 120.0, torch_threads: int = 1, progress=None) -> dict:
    """Run the drill in ``workdir`` (logs stay there); returns the figures (see the module doc).
    Raises TimeoutError if the swarm does not come up; a missing ban is a result (``banned``
    False), not an exception. Every process is stopped before returning."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    m = drill_manifest(manifest, **(sentinel or {}))
    path = write_manifest(m, workdir / "drill.toml")
    say = progress or (lambda msg: None)
    sw = LocalSwarm(str(path), workdir=workdir / "swarm", torch_threads=torch_threads)
    out: dict = {"attack": attack, "replicas": honest + 1, "manifest": manifest,
                 "sentinel": {k: getattr(m.sentinel, k) for k in ("warmup", "kappa", "flags_to_ban", "window")}}
    t0 = time.monotonic()
    steps_at_join = None
    try:
        sw.start_bootstrap()
        head = sw.start_node(0, name="head")
        good = [sw.start_node(1, name=f"mid-honest{i}") for i in range(honest)]
        tail = sw.start_node(2, name="tail")
        sw.wait_ready(timeout=ready_timeout_s)
        say(f"honest swarm online after {time.monotonic() - t0:.0f} s")
        # SENTINEL's warm-up is honest by assumption (docs/REFERENCES.md §3): the attacker joins once the
        # tail has judged `warmup` tensors past it (one per step), so the references it meets
        # were built by honest replicas only
        want = m.sentinel.warmup + 10
        deadline = time.monotonic() + ready_timeout_s
        while sw.value(tail, "swarm_node_steps_total") < want:
            if time.monotonic() > deadline or any(n.proc.poll() is not None for n in sw.nodes):
                raise TimeoutError(f"attack drill: the honest swarm did not reach {want} steps")
            time.sleep(0.25)
        say(f"SENTINEL warmed up (tail step >= {want}) after {time.monotonic() - t0:.0f} s")
        bad = sw.start_node(1, name="mid-malicious", extra=["--attack", attack, "--allow-attacks"])
        sw.wait_ready([bad], timeout=ready_timeout_s)
        out["startup_s"] = round(time.monotonic() - t0, 1)
        steps_at_join = sw.value(tail, "swarm_node_steps_total")
        say(f"malicious replica online at tail step {steps_at_join:.0f}")

        # ---- until a neighbour bans it (its logs name the peer), and the head (which routes) does
        bad_id = peer_id_of(bad) or "?"
        t_first = steps_first = None
        t_ban = steps_ban = t_head = None
        deadline = time.monotonic() + ban_timeout_s
        while time.monotonic() < deadline and t_head is None:
            now = time.monotonic()
            if t_first is None and _served(sw, bad) > 0:
                t_first, steps_first = now, sw.value(tail, "swarm_node_steps_total")
            head_banned = banned_in_logs(head, bad_id) > 0
            if t_ban is None and (head_banned or banned_in_logs(tail, bad_id) > 0):
                t_ban, steps_ban = now, sw.value(tail, "swarm_node_steps_total")
            if head_banned:
                t_head = now
            if any(n.proc.poll() is not None for n in sw.nodes):
                break
            time.sleep(0.25)
        out["banned"] = t_ban is not None
        out["head_ban_after_first_ban_s"] = round(t_head - t_ban, 2) if t_head is not None else None
        if t_ban is not None and t_first is None:  # banned between two polls of its first work
            t_first, steps_first = t_ban, steps_ban
        out["time_to_ban_s"] = round(t_ban - t_first, 2) if t_ban is not None else None
        out["steps_to_ban"] = int(steps_ban - steps_first) if t_ban is not None else None
        say(f"ban after {out['time_to_ban_s']} s ({out['steps_to_ban']} tail steps)")

        # ---- after the ban: who serves the stage, does training go on
        time.sleep(1.0)  # what was already on its way lands
        before = {n.name: _served(sw, n) for n in [bad, *good]}
        steps_before = sw.value(tail, "swarm_node_steps_total")
        time.sleep(observe_s)
        after = {n.name: _served(sw, n) for n in [bad, *good]}
        mt = sw.metrics(tail)
        served_bad = after[bad.name] - before[bad.name]
        served_good = sum(after[n.name] - before[n.name] for n in good)
        out["malicious_served_after_ban"] = int(served_bad)
        out["honest_served_after_ban"] = int(served_good)
        out["malicious_share_after_ban"] = (round(served_bad / (served_bad + served_good), 4)
                                            if served_bad + served_good else None)
        out["tail_steps_after_ban"] = int(metric_sum(mt, "swarm_node_steps_total") - steps_before)
        out["observe_s"] = observe_s
        out["steps"] = int(metric_sum(mt, "swarm_node_steps_total"))
        out["loss_end"] = mt.get("swarm_node_loss_ema")
        out["banned_peers"] = {n.name: sw.value(n, "swarm_node_banned_peers") for n in (head, tail)}
        out["bans_by_cause"] = {n.name: {c: sw.value(n, "swarm_node_bans_total", cause=c) for c in BAN_CAUSES}
                                for n in (head, tail)}
        out["rejected_by_tail"] = sw.value(tail, "swarm_node_verifier_verdicts_total", verdict="reject")
        out["rejected_by_head"] = sw.value(head, "swarm_node_verifier_verdicts_total", verdict="reject")
        out["reject_reasons"] = {n.name: _reasons(sw.metrics(n)) for n in (head, tail)}
    finally:
        out["exit_codes"] = sw.close()
        out["seconds"] = round(time.monotonic() - t0, 1)
    out["p2pd_left"] = len(p2pd_pids_of([n.pid for n in sw.nodes] + ([sw.bootstrap.pid] if sw.bootstrap else [])))

    # ---- from the logs: who banned whom
    ids = {n.name: peer_id_of(n) for n in sw.nodes}
    out["peers"] = ids
    bad_id = ids.get("mid-malicious")
    neighbours = [n for n in sw.nodes if n.name in ("head", "tail")]
    out["malicious_banned_by"] = sorted(n.name for n in neighbours if bad_id and banned_in_logs(n, bad_id))
    over = rejections_over(neighbours, bad_id) if bad_id else []
    out["malicious_flags_over"] = {name: sum(name in o for o in over) for name in sorted(set().union(*over))}
    out["malicious_token_flags"] = sum(bool(o & set(TOKEN_CHECKS)) for o in over)
    honest_ids = [pid for name, pid in ids.items() if name != "mid-malicious" and pid]
    out["honest_banned"] = sum(banned_in_logs(n, pid) for n in sw.nodes for pid in honest_ids)
    losses = [(int(a), float(b)) for a, b in _LOSS.findall(next(n for n in sw.nodes if n.name == "tail").logs())]
    out["loss_start"] = losses[0][1] if losses else None
    out["loss_finite"] = bool(losses) and all(math.isfinite(v) for _, v in losses) and (
        out.get("loss_end") is not None and math.isfinite(out["loss_end"]))
    out["steps_at_join"] = None if steps_at_join is None else int(steps_at_join)
    return out
