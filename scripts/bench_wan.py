"""Benchmark: the 3-stage swarm across the network lab (tests/helpers/netlab.py, root only), once per
link profile and boundary codec. Prints ONE JSON object.

Profiles (every stage node gets the same access link; the bootstrap peer's link is unshaped):

    loopback       no shaping (veth pairs through the lab's router)
    consumer       10 Mbit/s up, 50 down, RTT 60 ms between two nodes, 0.5 % loss each way
    datacenter-80  80 Mbit/s both ways, RTT 10 ms

Codecs: ``subspace`` (the manifest's, k coordinates per token on the wire) and ``dense`` (the same
manifest with ``subspace.enabled = false``: d_model coordinates per token, the plain pipeline).

Each cell trains for ``--seconds`` of wall time after the swarm is online (checkpoints every
``--checkpoint-every`` steps, all kept), then reports tokens/s (tail, first to last step), wire
bytes per token (fwd + bwd written by all nodes / tokens the head sent), the bottleneck link's
bound (per node: bytes written per token against its upload rate, read against its download
rate; the tightest gives the most tokens/s the links allow), the head's microbatch round trip
p50/p99, each stage's utilisation (compute-busy seconds / wall seconds) and the validation loss of
the stages' weights chained, at equal tokens (the largest step every cell reached, rounded down
to a checkpoint) and at equal wall time (the weights at the end). ``ratios`` divide each cell's
tokens/s by the loopback cell's with the same codec.

    sudo .venv/bin/python scripts/bench_wan.py [--seconds 60] [--profiles consumer,...] [--codecs dense]

Default: the shipped default manifest with the basic verifier (``--sentinel`` for SENTINEL),
60 s per cell, six cells: 481 s in all on an idle 2-core machine (40 minutes with the cores
shared at load average 30-50). ``--batch-size`` / ``--max-inflight`` override the manifest's
local fields (``--manifest test --batch-size 64 --max-inflight 4``: a latency-bound swarm).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from node.base import read_json_log  # noqa: E402

PROFILES = {
    "loopback": dict(up_mbit=None, down_mbit=None, delay_ms=0.0, loss=0.0),
    "consumer": dict(up_mbit=10, down_mbit=50, delay_ms=15.0, loss=0.005),
    "datacenter-80": dict(up_mbit=80, down_mbit=80, delay_ms=2.5, loss=0.0),
}


class Archiver(threading.Thread):
    """Hard-links every checkpoint a node writes into ``dest`` before the node prunes it."""

    def __init__(self, dirs: list[Path], dest: list[Path]):
        super().__init__(daemon=True)
        self.pairs = list(zip(dirs, dest))
        self.stop = threading.Event()
        for d in dest:
            d.mkdir(parents=True, exist_ok=True)

    def sweep(self) -> None:
        for src, dst in self.pairs:
            if not src.exists():
                continue
            for f in src.glob("*.safetensors"):
                target = dst / f.name
                if not target.exists():
                    try:
                        os.link(f, target)
                    except (FileNotFoundError, FileExistsError):
                        pass

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.sweep()


def checkpoints(d: Path) -> dict[int, Path]:
    from node.base import list_checkpoints

    return dict(list_checkpoints(d))


_VAL: dict = {}


def val_loss(manifest, paths: list[Path], n_batches: int) -> float:
    import torch

    from node.base import read_checkpoint, restore_module
    from stages import build_stage, lm_loss, load_corpus, val_batches

    stages = []
    for i, p in enumerate(paths):
        s = build_stage(manifest, i, device="cpu")
        _, tensors, _ = read_checkpoint(p)
        restore_module(s, tensors)
        s.eval()
        stages.append(s)
    key = (manifest.data, manifest.model.seq_len, n_batches)
    if key not in _VAL:  # the corpus is read once for all cells
        corpus = load_corpus(manifest.data)
        _VAL[key] = val_batches(corpus.val, manifest.data.batch_size, manifest.model.seq_len, n_batches)
    batches = _VAL[key]
    total = 0.0
    with torch.no_grad():
        for ids in batches:
            x = None
            for s in stages:
                x = s(x, ids)
            total += lm_loss(x, ids).item()
    return total / max(1, len(batches))


def run_cell(lab, manifest, profile: str, codec: str, seconds: float, ckpt_every: int, workdir: Path,
             torch_threads: int) -> dict:
    from node.ops import metric_sum
    from tests.helpers.labswarm import LabSwarm
    from tests.helpers.netlab import Link

    link = Link(**PROFILES[profile])
    cell = workdir / f"{profile}-{codec}"
    sw = LabSwarm(lab, manifest, workdir=cell / "swarm", torch_threads=torch_threads)
    n = manifest.n_stages
    logs = [cell / f"steps{i}.jsonl" for i in range(n)]
    ck = [cell / f"ckpt{i}" for i in range(n)]
    arch = [cell / f"archive{i}" for i in range(n)]
    archiver = Archiver(ck, arch)
    archiver.start()
    where = [lab.add_node(f"{profile[:4]}{codec[:2]}{i}", link) for i in range(n)]
    try:
        sw.start_bootstrap(lab.add_node(f"{profile[:4]}{codec[:2]}b"))
        nodes = [sw.start_node(i, where[i], name=f"stage{i}",
                               extra=["--json-log", str(logs[i]), "--no-averaging", "--checkpoint-dir", str(ck[i]),
                                      "--checkpoint-every", str(ckpt_every), "--drain-timeout", "5"])
                 for i in range(n)]
        sw.wait_ready(timeout=300)
        t_online = time.monotonic()
        busy0 = [metric_sum(sw.metrics(x), "swarm_node_compute_busy_seconds_total") for x in nodes]
        while time.monotonic() - t_online < seconds:
            time.sleep(2.0)
            if any(x.proc.poll() is not None for x in nodes):
                raise RuntimeError(f"a node exited: {[(x.name, x.proc.poll()) for x in nodes]} (logs in {cell})")
        wall = time.monotonic() - t_online
        ms = [sw.metrics(x) for x in nodes]
        status = json.loads(sw.get(nodes[0], "/status")[1] or "{}")
        busy = [metric_sum(m, "swarm_node_compute_busy_seconds_total") - b for m, b in zip(ms, busy0)]
        out_b = [sum(metric_sum(m, "swarm_node_wire_bytes_total", protocol=p, direction="out") for p in ("fwd", "bwd"))
                 for m in ms]
        in_b = [sum(metric_sum(m, "swarm_node_wire_bytes_total", protocol=p, direction="in") for p in ("fwd", "bwd"))
                for m in ms]
        head_tokens = metric_sum(ms[0], "swarm_node_tokens_total")
    finally:
        codes = sw.close(timeout=60)
        archiver.sweep()
        archiver.stop.set()
    tail = read_json_log(logs[-1])
    if len(tail) < 2:
        raise RuntimeError(f"{profile}/{codec}: the tail logged {len(tail)} steps (exit codes {codes}; logs in {cell})")
    first, last = tail[0], tail[-1]
    span = last["time"] - first["time"]
    tps = (last["tokens"] - first["tokens"]) / span if span > 0 else None
    bpt_out = [b / head_tokens for b in out_b] if head_tokens else []
    bpt_in = [b / head_tokens for b in in_b] if head_tokens else []
    bounds = []
    if link.up_mbit:
        bounds += [link.up_mbit * 1e6 / 8 / b for b in bpt_out if b > 0]
    if link.down_mbit:
        bounds += [link.down_mbit * 1e6 / 8 / b for b in bpt_in if b > 0]
    losses = [r["loss"] for r in tail if r.get("loss") is not None]
    k = min(10, len(losses))
    return {
        "profile": profile, "codec": codec, "link": PROFILES[profile],
        "tokens_per_s": tps, "tail_steps": last["step"], "train_wall_s": round(wall, 1),
        "wire_bytes_per_token": (sum(out_b) / head_tokens) if head_tokens else None,
        "node_out_bytes_per_token": [round(b, 1) for b in bpt_out],
        "node_in_bytes_per_token": [round(b, 1) for b in bpt_in],
        "link_bound_tokens_per_s": min(bounds) if bounds else None,
        "mb_rtt_p50_ms": status.get("mb_rtt_p50_ms"), "mb_rtt_p99_ms": status.get("mb_rtt_p99_ms"),
        "stage_utilisation": [round(b / wall, 3) for b in busy],
        "train_loss_last10": sum(losses[-k:]) / k if k else None,
        "exit_codes": codes,
        "_archive": [str(a) for a in arch],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--manifest", default="default")
    p.add_argument("--seconds", type=float, default=60.0, help="training wall time per cell (default 60)")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--codecs", default="subspace,dense")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--sentinel", action="store_true", help="verify with SENTINEL (default: the basic checks)")
    p.add_argument("--batch-size", type=int, default=0, help="data.batch_size (default: the manifest's)")
    p.add_argument("--max-inflight", type=int, default=0, help="train.max_inflight (default: the manifest's)")
    p.add_argument("--workdir", default="")
    args = p.parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)

    from stages import load_manifest
    from tests.helpers.netlab import Lab, lab_unavailable

    reason = lab_unavailable()
    if reason:
        print(json.dumps({"error": reason}))
        return 2
    base = load_manifest(args.manifest)
    if not args.sentinel:
        base = base.replace(sentinel={"enabled": False})
    if args.batch_size:  # local fields (not hashed): the same run with more tokens per microbatch
        base = base.replace(data={"batch_size": args.batch_size})
    if args.max_inflight:
        base = base.replace(train={"max_inflight": args.max_inflight})
    manifests = {"subspace": base, "dense": base.replace(subspace={"enabled": False})}
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-wan-"))
    workdir.mkdir(parents=True, exist_ok=True)
    profiles = [x for x in args.profiles.split(",") if x]
    codecs = [x for x in args.codecs.split(",") if x]
    load_before = os.getloadavg()[0]
    cells = []
    t0 = time.monotonic()
    with Lab() as lab:
        netem = lab.netem
        for codec in codecs:
            for profile in profiles:
                print(f"# {profile} / {codec} ...", file=sys.stderr, flush=True)
                cells.append(run_cell(lab, manifests[codec], profile, codec, args.seconds, args.checkpoint_every,
                                      workdir, args.torch_threads))
    # validation: at equal tokens (the largest checkpoint step every cell's stages all have) and at the end
    # (a stage that never stepped, e.g. a head whose first gradient had not come back, wrote no
    # checkpoint: its cell gets no validation loss)
    common = None
    for c in cells:
        steps = set.intersection(*[set(checkpoints(Path(a))) for a in c["_archive"]])
        common = steps if common is None else common & steps
    eq_step = max(s for s in common if s > 0) if common and any(s > 0 for s in common) else None
    for c in cells:
        m = manifests[c["codec"]]
        arch = [checkpoints(Path(a)) for a in c.pop("_archive")]
        complete = all(arch)
        c["val_loss_at_equal_wall_time"] = val_loss(m, [a[max(a)] for a in arch], args.val_batches) if complete else None
        c["val_loss_at_equal_wall_time_steps"] = [max(a) if a else 0 for a in arch]
        c["val_loss_at_equal_tokens"] = val_loss(m, [a[eq_step] for a in arch], args.val_batches) if eq_step else None
    by = {(c["profile"], c["codec"]): c for c in cells}
    ratios = {}
    for (profile, codec), c in by.items():
        ref = by.get(("loopback", codec))
        if ref and ref["tokens_per_s"] and c["tokens_per_s"]:
            ratios[f"{profile}/{codec}"] = round(c["tokens_per_s"] / ref["tokens_per_s"], 3)
    checks = {}
    cs, cd = by.get(("consumer", "subspace")), by.get(("consumer", "dense"))
    if "consumer/subspace" in ratios:
        checks["consumer_subspace_vs_loopback_tokens_per_s"] = {"ratio": ratios["consumer/subspace"], "target": 0.9,
                                                               "met": ratios["consumer/subspace"] >= 0.9}
    if cd:
        checks["consumer_dense_link_bound"] = {
            "tokens_per_s": cd["tokens_per_s"], "link_bound_tokens_per_s": cd["link_bound_tokens_per_s"],
            "ratio": round(cd["tokens_per_s"] / cd["link_bound_tokens_per_s"], 3)
            if cd["tokens_per_s"] and cd["link_bound_tokens_per_s"] else None}
    if cs and cd and cs["val_loss_at_equal_wall_time"] and cd["val_loss_at_equal_wall_time"]:
        checks["consumer_val_loss_equal_wall_time"] = {
            "subspace": cs["val_loss_at_equal_wall_time"], "dense": cd["val_loss_at_equal_wall_time"],
            "subspace_better": cs["val_loss_at_equal_wall_time"] < cd["val_loss_at_equal_wall_time"]}
    out = {
        "cells": cells, "ratios_to_loopback_tokens_per_s": ratios, "checks": checks,
        "equal_tokens_step": eq_step,
        "settings": {
            "manifest": args.manifest, "run": base.run.id, "n_stages": base.n_stages, "d_model": base.model.d_model,
            "k": base.k, "batch_size": base.data.batch_size, "seq_len": base.model.seq_len,
            "max_inflight": base.train.max_inflight, "sentinel": base.sentinel.enabled, "averaging": False,
            "seconds_per_cell": args.seconds, "checkpoint_every": args.checkpoint_every,
            "val_batches": args.val_batches, "torch_threads_per_node": args.torch_threads,
            "profiles": {k: PROFILES[k] for k in profiles}, "latency": "netem" if netem else "nfqueue delay line",
            "rtt_between_nodes_ms": {k: 4 * PROFILES[k]["delay_ms"] for k in profiles},
            "cpu_count": os.cpu_count(), "load_average_before": round(load_before, 2),
            "total_wall_s": round(time.monotonic() - t0, 1), "workdir": str(workdir),
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
