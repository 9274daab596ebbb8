"""The training paths on the CPU and on a GPU, side by side in one run (one JSON object).

For each device in ``--devices`` (default: ``cpu``, plus ``cuda`` when one is visible):

1. ``reference``: the reference trainer (``node.ops.train_local.train``, every stage chained in one
   process) for ``--steps`` optimizer steps: tokens/s (training steps only), first and last loss,
   validation loss. bf16 autocast on CUDA, float32 on the CPU.
2. ``pipeline``: the node's own runtime. One ``node.runtime.StageRuntime`` per stage, each with
   the verifier a node builds (SENTINEL when the manifest enables it) and its compute and verify
   threads, exchanging real frames through ``tests.helpers.memnet`` (no p2pd, no sockets) for
   ``--pipeline-seconds`` (and at least ``--pipeline-min-steps`` tail steps): tail steps, tokens/s, loss, tensors judged and rejected by the
   verifiers. Every tensor crossing a stage boundary takes the same path as in a swarm: subspace
   coordinates encoded into a frame, decoded, verified, decompressed on the receiving device.

Ratios (``speedup``: the GPU's tokens/s over the CPU's; ``val_loss_diff``: bf16 on the GPU minus
float32 on the CPU, same seed and data) are computed from the same run, since machines are noisy.
The model can be scaled (``--d-model``, ``--n-layers``, ``--batch-size``, ``--seq-len``) to see
where a GPU stops being latency-bound; the settings used are in the JSON.

Run on a machine with a GPU::

    python scripts/bench_device.py --steps 300 --pipeline-seconds 30
    python scripts/bench_device.py --devices cuda --d-model 1024 --n-layers 12 --steps 200

``--quick`` is the test suite's smoke run (tiny model, a few steps, CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="", help="comma-separated, e.g. cpu,cuda (default: cpu and cuda if visible)")
    p.add_argument("--manifest", default="default", help="manifest file or shipped name")
    p.add_argument("--d-model", type=int, default=0, help="model width (0: manifest's)")
    p.add_argument("--n-layers", type=int, default=0, help="layers (0: manifest's), split evenly over the stages")
    p.add_argument("--n-heads", type=int, default=0, help="attention heads (0: manifest's)")
    p.add_argument("--batch-size", type=int, default=0, help="sequences per microbatch (0: manifest's)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: manifest's)")
    p.add_argument("--steps", type=int, default=200, help="reference trainer: optimizer steps per device")
    p.add_argument("--pipeline-seconds", type=float, default=30.0, help="runtime pipeline: seconds per device")
    p.add_argument("--pipeline-min-steps", type=int, default=0,
                   help="runtime pipeline: time at least this many tail steps (the window grows past --pipeline-seconds)")
    p.add_argument("--parts", default="reference,pipeline", help="which parts to run")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: the test manifest, a few steps, CPU")
    return p.parse_args(argv)


def make_manifest(args):
    from stages import even_layout, load_manifest

    m = load_manifest("test" if args.quick else args.manifest)
    model = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers),
                               ("n_heads", args.n_heads), ("seq_len", args.seq_len)) if v}
    changes: dict = {"model": model} if model else {}
    if args.n_layers:  # the same number of stages, the layers split evenly (one replace: validated together)
        S, n = m.n_stages, args.n_layers
        if S > n:
            raise SystemExit(f"--n-layers {n} is fewer than the manifest's {S} stages")
        changes["stages"] = {"layout": even_layout(n, S)}
    if changes:
        m = m.replace(**changes)
    if args.batch_size:
        m = m.replace(data={"batch_size": args.batch_size})
    return m


def describe(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}", "autocast": "bf16"}
    return {"name": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "autocast": None}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ reference


def reference_run(m, device: torch.device, steps: int, corpus) -> dict:
    from node.ops import train

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    r = train(m, steps=steps, device=device, corpus=corpus, quiet=True, log_every=1)
    out = {
        "steps": steps,
        "tokens_per_s": round(r["tokens_per_s"], 1),
        "loss_start": round(r["loss_start"], 4),
        "loss_end": round(r["loss_end"], 4),
        "val_loss": round(r["val_loss"], 4) if r.get("val_loss") is not None else None,
        "wall_s": round(r["wall_s"], 1),
    }
    if device.type == "cuda":
        out["peak_memory_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


# ------------------------------------------------------------------------------- pipeline


async def _pipeline(m, device: torch.device, seconds: float, corpus, min_steps: int = 0) -> dict:
    from node.daemon import make_verifier
    from node.net import Router
    from node.ops import NodeMetrics, metric_sum, parse_metrics
    from node.runtime import RuntimeOptions, StageRuntime
    from stages import Batches, build_optimizer, build_stage
    from tests.helpers.memnet import MemTransport, Net

    torch.manual_seed(m.run.seed)
    net = Net()
    rts = []
    for i in range(m.n_stages):
        peer = f"stage{i}"
        stage = build_stage(m, i, device=device)
        batches = (Batches(corpus.train, m.data.batch_size, m.model.seq_len, seed=m.run.seed)
                   if i == 0 else None)
        rts.append(StageRuntime(
            m, i, stage, build_optimizer(m, stage), transport=MemTransport(net, peer),
            router=Router(peer, rng=random.Random(i)), metrics=NodeMetrics(), verifier=make_verifier(m, i),
            peer_id=peer, device=device, options=RuntimeOptions(use_amp=device.type == "cuda"),
            batches=batches, rng=random.Random(m.run.seed + i),
        ))
    # what a DHT record carries, without node.net.membership (it imports hivemind, which a GPU box may lack)
    records = [SimpleNamespace(peer_id=rt.peer_id, stage=rt.index, state="online", throughput=0.0, capacity=None,
                               queue=0, version=0, maddrs=[]) for rt in rts]
    for rt in rts:
        rt.router.update(records)
        await rt.start()
        rt.set_state("online")
    head, tail = rts[0], rts[-1]
    maintain = [asyncio.ensure_future(rt.maintain(period=0.25)) for rt in rts]
    drive = asyncio.ensure_future(head.drive())
    try:
        # the first steps pay for CUDA/cuBLAS initialisation and SENTINEL's warm-up: timed from step 5
        t_wait = time.monotonic() + 120
        while tail.version < 5 and time.monotonic() < t_wait and not drive.done():
            await asyncio.sleep(0.01)
        sync(device)
        v0, t0 = tail.version, time.perf_counter()
        await asyncio.sleep(seconds)
        # and at least ``min_steps`` tail steps (a loaded machine steps slower; the rate is over
        # the whole window either way), for up to 120 s more
        t_wait = time.monotonic() + 120
        while tail.version - v0 < min_steps and time.monotonic() < t_wait and not drive.done():
            await asyncio.sleep(0.01)
        sync(device)
        v1, t1 = tail.version, time.perf_counter()
    finally:
        drive.cancel()
        for t in maintain:
            t.cancel()
        for rt in rts:
            await rt.stop()
    if drive.done() and not drive.cancelled() and drive.exception() is not None:
        raise drive.exception()
    tokens = (v1 - v0) * m.data.batch_size * m.model.seq_len
    losses = [loss for _, loss in tail.trainer.loss_history]
    judged = rejected = bans = 0.0
    for rt in rts:
        mt = parse_metrics(rt.metrics.render().decode())
        acc = metric_sum(mt, "swarm_node_verifier_verdicts_total", verdict="accept")
        rej = metric_sum(mt, "swarm_node_verifier_verdicts_total", verdict="reject")
        judged, rejected = judged + acc + rej, rejected + rej
        bans += metric_sum(mt, "swarm_node_bans_total")
    return {
        "seconds": round(t1 - t0, 1),
        "tail_steps": v1 - v0,
        "tokens_per_s": round(tokens / (t1 - t0), 1) if t1 > t0 else None,
        "loss_first10": round(statistics.fmean(losses[:10]), 4) if len(losses) >= 10 else None,
        "loss_last10": round(statistics.fmean(losses[-10:]), 4) if len(losses) >= 10 else None,
        "losses_finite": all(math.isfinite(x) for x in losses),
        "verifier_judged": int(judged),
        "verifier_rejected": int(rejected),
        "bans": int(bans),
        "versions": [rt.version for rt in rts],
    }


def pipeline_run(m, device: torch.device, seconds: float, corpus, min_steps: int = 0) -> dict:
    return asyncio.run(_pipeline(m, device, seconds, corpus, min_steps))


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    from stages import load_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.pipeline_seconds = min(args.steps, 6), min(args.pipeline_seconds, 2.0)
        args.pipeline_min_steps = max(args.pipeline_min_steps, 20)
    names = [d for d in args.devices.split(",") if d] or (
        ["cpu", "cuda"] if torch.cuda.is_available() and not args.quick else ["cpu"])
    devices = [torch.device(d) for d in names]
    for d in devices:
        if d.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit(f"--devices {d}: CUDA is not available here")
        if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
            raise SystemExit(f"--devices {d}: only {torch.cuda.device_count()} CUDA device(s) visible")
    parts = [x for x in args.parts.split(",") if x]
    bad = set(parts) - {"reference", "pipeline"}
    if bad:
        raise SystemExit(f"--parts: unknown {sorted(bad)}; use reference, pipeline")
    m = make_manifest(args)
    corpus = load_corpus(m.data)
    out: dict = {"settings": {
        "manifest": "test" if args.quick else args.manifest, "d_model": m.model.d_model,
        "n_layers": m.model.n_layers, "n_heads": m.model.n_heads, "stages": m.n_stages,
        "batch_size": m.data.batch_size, "seq_len": m.model.seq_len, "k": m.k,
        "sentinel": bool(m.sentinel.enabled), "steps": args.steps, "pipeline_seconds": args.pipeline_seconds,
        "pipeline_min_steps": args.pipeline_min_steps,
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "data": corpus.description,
    }, "devices": {}}
    for d in devices:
        res: dict = {"device": describe(d)}
        if "reference" in parts:
            print(f"[bench_device] reference trainer on {d}", file=sys.stderr, flush=True)
            res["reference"] = reference_run(m, d, args.steps, corpus)
        if "pipeline" in parts:
            print(f"[bench_device] runtime pipeline on {d}", file=sys.stderr, flush=True)
            res["pipeline"] = pipeline_run(m, d, args.pipeline_seconds, corpus, args.pipeline_min_steps)
        out["devices"][str(d)] = res
    if len(devices) == 2:
        (a, ra), (b, rb) = out["devices"].items()
        ratios = {}
        for part in parts:
            ta, tb = ra[part]["tokens_per_s"], rb[part]["tokens_per_s"]
            ratios[f"{part}_speedup"] = round(tb / ta, 2) if ta and tb else None
        if "reference" in parts and ra["reference"]["val_loss"] is not None and rb["reference"]["val_loss"] is not None:
            ratios["reference_val_loss_diff"] = round(rb["reference"]["val_loss"] - ra["reference"]["val_loss"], 4)
        out["ratios"] = {"of": f"{b} over {a}", **ratios}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
