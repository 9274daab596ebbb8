"""Benchmark: a local 3-stage swarm (separate processes, real libp2p streams on loopback) against
`train-local` (the same stages chained in one process) on the same machine, data and number of
optimizer steps. Prints ONE JSON object:

    swarm_tokens_per_s, local_tokens_per_s, ratio (swarm / local), wire_bytes_per_token (fwd + bwd
    bytes every node wrote on our stream protocols, per token trained), mb_rtt_p50_ms /
    mb_rtt_p99_ms (head: a microbatch's forward sent -> its gradient applied), loss_start /
    loss_end (tail, mean of the first / last 10 steps), local_loss_start / local_loss_end, settings,
    and `limits`: what bounds the ratio on this machine.

Throughput is measured between the tail's first and last optimizer step (start-up excluded on
both sides; validation excluded for train-local). Default: the shipped default manifest for 60
steps (a few minutes on a loaded 2-core box); ``--quick``: stages/runs/test.toml for 60 steps. The
baseline runs with whichever torch thread count is faster here (probed first; see settings).

    .venv/bin/python scripts/bench_swarm.py [--quick] [--steps N] [--manifest M] [--no-sentinel]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.base import read_json_log  # noqa: E402


def pick_local_threads(manifest, probe_steps: int = 3) -> tuple[int, dict]:
    """The baseline gets its best setting on this machine: time a few steps with one torch thread
    and with one per core (on a busy machine, intra-op threads that spin-wait for each other can be
    many times slower than one)."""
    import torch

    from node.ops import train

    cores = os.cpu_count() or 1
    timings = {}
    for n in sorted({1, cores}):
        torch.set_num_threads(n)
        timings[n] = train(manifest, steps=probe_steps, device="cpu", quiet=True)["tokens_per_s"]
    best = max(timings, key=lambda n: timings[n] or 0.0)
    torch.set_num_threads(best)
    return best, {str(k): round(v or 0.0, 1) for k, v in timings.items()}


def run_local(manifest, steps: int) -> dict:
    from node.ops import train

    res = train(manifest, steps=steps, device="cpu", quiet=True)
    return {"tokens_per_s": res["tokens_per_s"], "loss_start": res["loss_start"], "loss_end": res["loss_end"],
            "boundary_bytes_per_token": res["boundary_bytes_per_token"]}


def run_swarm(manifest_arg: str, manifest, steps: int, torch_threads: int, workdir: Path, timeout: float,
              stall_timeout: float = 180.0) -> dict:
    from node.ops import LocalSwarm, metric_sum

    logs = [workdir / f"steps{i}.jsonl" for i in range(manifest.n_stages)]
    sw = LocalSwarm(manifest_arg, workdir=workdir / "swarm", torch_threads=torch_threads)
    snapshot: dict = {}
    try:
        sw.start_bootstrap()
        nodes = [sw.start_node(i, name=f"stage{i}", extra=["--steps", str(steps), "--json-log", str(logs[i]),
                                                            "--no-averaging"])
                 for i in range(manifest.n_stages)]
        sw.wait_ready(timeout=300)
        head, tail = nodes[0], nodes[-1]
        deadline = time.monotonic() + timeout
        last_step, last_change = -1, time.monotonic()
        tail_left = None
        while time.monotonic() < deadline and any(n.proc.poll() is None for n in nodes):
            # every node leaves at --steps of its own; a stage that refused a gradient (a false
            # flag) is a step behind the tail and never gets its last one once the tail has left:
            # the run is over when the tail is, the rest are stopped (SIGTERM) a little later
            if tail.proc.poll() is not None:
                tail_left = tail_left or time.monotonic()
                if time.monotonic() - tail_left > 15.0:
                    break
            step = metric_sum(sw.metrics(tail), "swarm_node_steps_total") if tail.proc.poll() is None else last_step
            if step != last_step:
                last_step, last_change = step, time.monotonic()
            elif time.monotonic() - last_change > stall_timeout:
                bans = sum(metric_sum(sw.metrics(n), "swarm_node_bans_total") for n in nodes)
                raise RuntimeError(f"the swarm stalled at step {int(last_step)} for {stall_timeout:.0f} s "
                                   f"({int(bans)} bans; logs in {workdir / 'swarm'})")
            if head.proc.poll() is None:
                status, text = sw.get(head, "/status")
                ms = [sw.metrics(n) for n in nodes]
                if status == 200 and all(ms):
                    st = json.loads(text)
                    wire = {p: sum(metric_sum(m, "swarm_node_wire_bytes_total", protocol=p, direction="out")
                                   for m in ms) for p in ("fwd", "bwd")}
                    snapshot = {"status": st, "wire": wire, "head_tokens": metric_sum(ms[0], "swarm_node_tokens_total")}
            time.sleep(1.0)
        codes = {n.name: n.proc.poll() for n in nodes}
    finally:
        sw.close()
    tail_steps = read_json_log(logs[-1])
    if len(tail_steps) < 2:
        raise RuntimeError(f"the swarm did not train (tail logged {len(tail_steps)} steps; exit codes {codes})")
    first, last = tail_steps[0], tail_steps[-1]
    tokens = last["tokens"] - first["tokens"]
    span = last["time"] - first["time"]
    losses = [r["loss"] for r in tail_steps if r.get("loss") is not None]
    n = min(10, len(losses))
    st = snapshot.get("status", {})
    head_tokens = snapshot.get("head_tokens") or 0
    wire = snapshot.get("wire", {"fwd": 0, "bwd": 0})
    return {
        "tokens_per_s": tokens / span if span > 0 else None,
        "steps": last["step"],
        "loss_start": sum(losses[:n]) / n, "loss_end": sum(losses[-n:]) / n,
        "wire_bytes_per_token": (wire["fwd"] + wire["bwd"]) / head_tokens if head_tokens else None,
        "wire_bytes_per_token_fwd": wire["fwd"] / head_tokens if head_tokens else None,
        "wire_bytes_per_token_bwd": wire["bwd"] / head_tokens if head_tokens else None,
        "mb_rtt_p50_ms": st.get("mb_rtt_p50_ms"), "mb_rtt_p99_ms": st.get("mb_rtt_p99_ms"),
        "exit_codes": codes,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", default=None, help="run manifest (default: default; test with --quick)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps on each side (default 60)")
    p.add_argument("--quick", action="store_true", help="smoke run on stages/runs/test.toml")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per swarm node (default 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds the swarm may train")
    p.add_argument("--workdir", default="", help="keep the swarm's logs here")
    p.add_argument("--no-sentinel", action="store_true",
                   help="verify with the basic checks instead of SENTINEL (a variant of the manifest)")
    args = p.parse_args()

    def on_term(signum, frame):  # `timeout` and CI send SIGTERM: stop the swarm on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


    from stages import load_manifest

    manifest_arg = args.manifest or ("test" if args.quick else "default")
    steps = args.steps or 60
    m = load_manifest(manifest_arg)
    load_before = os.getloadavg()[0]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-swarm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.no_sentinel:
        from node.ops import write_manifest

        m = m.replace(sentinel={"enabled": False})
        manifest_arg = str(write_manifest(m, workdir / "manifest-basic-verifier.toml"))

    local_threads, probe = pick_local_threads(m)
    local = run_local(m, steps)
    swarm = run_swarm(manifest_arg, m, steps, args.torch_threads, workdir, args.timeout)
    ratio = swarm["tokens_per_s"] / local["tokens_per_s"] if swarm["tokens_per_s"] and local["tokens_per_s"] else None
    cores = os.cpu_count() or 1
    limits = (
        f"{m.n_stages} stage processes (+{m.n_stages + 1} p2pd daemons, a bootstrap peer, and the other "
        f"tenants of this machine: load average {load_before:.1f}) share {cores} CPU core(s); a pipeline can "
        f"only overlap as many stages as there are cores, while train-local runs one process with "
        f"{local_threads} torch thread(s) (its faster setting here). Each microbatch also crosses {2 * (m.n_stages - 1)} libp2p "
        f"stream exchanges (p50 round trip {swarm['mb_rtt_p50_ms']} ms end to end at the head)."
    )
    out = {
        "swarm_tokens_per_s": swarm["tokens_per_s"],
        "local_tokens_per_s": local["tokens_per_s"],
        "ratio": ratio,
        "wire_bytes_per_token": swarm["wire_bytes_per_token"],
        "wire_bytes_per_token_fwd": swarm["wire_bytes_per_token_fwd"],
        "wire_bytes_per_token_bwd": swarm["wire_bytes_per_token_bwd"],
        "mb_rtt_p50_ms": swarm["mb_rtt_p50_ms"],
        "mb_rtt_p99_ms": swarm["mb_rtt_p99_ms"],
        "loss_start": swarm["loss_start"],
        "loss_end": swarm["loss_end"],
        "local_loss_start": local["loss_start"],
        "local_loss_end": local["loss_end"],
        "swarm_steps": swarm["steps"],
        "target_ratio": 0.8,
        "limits": limits,
        "settings": {
            "manifest": manifest_arg, "run": m.run.id, "steps": steps, "n_stages": m.n_stages,
            "layout": [list(r) for r in m.stages.layout], "d_model": m.model.d_model, "k": m.k,
            "batch_size": m.data.batch_size, "seq_len": m.model.seq_len, "tokens_per_step": m.data.batch_size *
            m.model.seq_len * m.train.grad_accum, "asyncmesh_mode": m.asyncmesh.mode,
            "max_inflight": m.train.max_inflight, "sentinel": m.sentinel.enabled, "averaging": False,
            "swarm_torch_threads_per_node": args.torch_threads, "local_torch_threads": local_threads,
            "local_threads_probe_tokens_per_s": probe,
            "cpu_count": cores, "load_average_before": round(load_before, 2), "device": "cpu",
            "local_boundary_bytes_per_token": local["boundary_bytes_per_token"],
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
