"""Benchmark: AsyncMesh (docs/REFERENCES.md §2) — stale pipeline gradients with and without look-ahead,
sparse replica averaging with and without the staleness correction, pipeline utilisation.

Loss runs are in one process on the bundled corpus (stages.data) with the real stages
(stages.model.build_stage) and the real AsyncMesh code (stages.asyncmesh). Prints ONE JSON object.

Pipeline axis (S stages, one replica each, equal tokens and equal optimizer steps, averaged over
``--seeds`` data orders):
- ``gpipe``: synchronous; every stage's gradient is computed on the weights it is applied to
  (a flush of F microbatches of B/F sequences is one step on B sequences, so gpipe here is
  one step per batch with delay 0);
- ``async_none`` / ``async_lookahead``: 1F1B without flushes: microbatch j's gradient reaches
  stage s at tick j + τ_s, τ_s = (S−1−s)·u optimizer steps later (u = ⌊(max_inflight−1)/(S−1)⌋,
  at least 1: the head has max_inflight microbatches in flight; the floor matches the delays the
  real swarm measures, (3.2–4.1, 1.8–2.0, 0) at max_inflight 6 in three runs, where the
  ceiling would say (6, 3, 0)); ``none`` recomputes on a stash of the
  forward's weights, ``lookahead`` forwards and recomputes on Ŵ = W − τ̂·η·m̂.
- ``lookahead_gap_rel`` = val(async_lookahead)/val(gpipe) − 1 (seed means).
- ``--deep-stages N`` (off by default) adds a second regime next to the default layout's: the same
  model cut into N stages, 1F1B delays 2·(N−1−s) (``--deep-max-inflight``), peak lr ``--deep-lr``,
  reported as ``val_loss_deep``, ``lookahead_beats_none_deep`` and ``deep_settings``.

Utilisation (busy / wall per stage): ``utilisation`` is measured on a real local swarm
(node.ops.local_swarm.LocalSwarm: bootstrap + one ``swarm-node run`` per stage on loopback) of the
manifest's own model in lookahead and gpipe mode (``--runtime-more-inflight``: also lookahead
with ``--more-inflight`` microbatches in flight), busy = growth of ``swarm_node_compute_busy_seconds_total`` over
``--runtime-seconds``; ``utilisation.simulated`` is a discrete-event simulation of both
schedules driven by the per-stage forward and backward(+recompute) times measured in the async
loss runs, zero-latency links (the only utilisation with ``--runtime-seconds 0``).

Data axis (R replicas of the whole model, equal tokens):
- ``full_every_step``: all parameters averaged after every step;
- ``sparse``: a rotating p-fraction slice every H steps (PartitionSchedule), the average arriving
  ``avg_latency`` steps after its snapshot and applied as a delta (λ = 1);
- ``sparse_corrected``: ``avg_correction`` as node/net/averaging.py does it: first moments averaged
  on the same slice, their delta scaled by β^s (StalenessCorrection), and the parameters' delta
  spread over ``--avg-blend`` local steps (stages.BlendedDelta; 0: the manifest's
  ``asyncmesh.avg_blend_steps``); ``sparse_at_once`` (``--variants``) is the same with the delta
  applied at once;
- ``sparse_avg_gap_rel`` = val(sparse_corrected)/val(full) − 1; ``avg_bytes_ratio`` = all-reduce
  payload bytes of full / sparse_corrected. These val losses are per replica (mean over the
  replicas' own val losses). ``averaging_consensus_*`` / ``sparse_avg_consensus_gap_rel`` are the
  same figures for the consensus model (element-wise mean of the replicas' parameters at the end,
  what a swarm would publish); ``--avg-every-extra`` reruns the sparse variants at other H values
  (``averaging_other_H``, gaps against the same full run). ``--ablation`` adds sparse_moments (λ_m = 1) and
  sparse_lambda (parameters' λ = 1 + s/(P·H)); ``--variants`` runs any set, among them
  ``independent`` (no averaging at all: what the averaging adds is measured against it),
  ``sparse_second`` and ``sparse_outer`` (experiments, docs/ASYNCMESH.md), on ``--avg-seeds`` seeds.

Loss runs use a smaller model than stages/runs/default.toml (d_model 64, seq_len 64, k 8; ``settings``
says so) to fit ~10 minutes on a shared 2-core CPU; ``--quick`` is a smoke run (seconds).
"""

from __future__ import annotations

import argparse
import copy
import functools
import heapq
import json
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from stages import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    AveragingLayout,
    Batches,
    BlendedDelta,
    LookaheadForward,
    ManifestError,
    PartitionSchedule,
    StalenessCorrection,
    apply_average_delta,
    build_model,
    build_optimizer,
    butterfly,
    build_stage,
    count_parameters,
    even_layout,
    first_moments,
    lm_loss,
    load_corpus,
    load_manifest,
    lr_at,
    set_lr,
    snapshot,
    val_batches,
)


def progress(msg: str) -> None:
    print(f"[bench_asyncmesh {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", default="default", help="manifest file or shipped name")
    p.add_argument("--d-model", type=int, default=64, help="model width (0: manifest's)")
    p.add_argument("--n-layers", type=int, default=6, help="layers (0: manifest's); split evenly over stages")
    p.add_argument("--k", type=int, default=8, help="subspace.k, coordinates per token (0: the manifest's)")
    p.add_argument("--stages", type=int, default=3, help="pipeline stages S")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch / step")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (= microbatches) per run")
    p.add_argument("--optim", default="nadam", help="pipeline optimizer (docs/REFERENCES.md §2: NAdam β1 0.99)")
    p.add_argument("--beta1", type=float, default=0.99)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-inflight", type=int, default=0,
                   help="head's microbatches in flight, loss runs and real swarm alike (0: the manifest's "
                   "train.max_inflight, 6 in stages/runs/default.toml: for S = 3 the loss runs' delays are (4, 2, 0), "
                   "what the real swarm measures at 6, whose busy fraction is above 0.9, docs/ASYNCMESH.md)")
    p.add_argument("--lookahead-target", choices=("momentum", "update"), default=None,
                   help="what look-ahead extrapolates (default: the manifest's asyncmesh.lookahead_target)")
    p.add_argument("--other-targets", default="",
                   help="comma list of further look-ahead targets run side by side as async_lookahead_<target>")
    p.add_argument("--lookahead-horizon", choices=("stage", "pipeline"), default=None,
                   help="how far each stage looks ahead: its own delay, or the head's (default: the manifest's "
                   "asyncmesh.lookahead_horizon)")
    p.add_argument("--other-horizon", "--pipeline-horizon", dest="other_horizon", action="store_true",
                   help="also run look-ahead with the other horizon (async_lookahead_stage_horizon or "
                   "async_lookahead_pipeline_horizon), and the synchronous run with every stage extrapolating "
                   "by the head's delay (gpipe_extrapolated)")
    p.add_argument("--manifest-optim", action="store_true",
                   help="also run the pipeline modes with the manifest's own optimizer (keys *_manifest_optim)")
    p.add_argument("--flush-every", type=int, default=0, help="GPipe microbatches per flush (0: manifest's)")
    p.add_argument("--replicas", type=int, default=2, help="replicas R for the averaging runs")
    p.add_argument("--avg-fraction", type=float, default=0.05, help="p")
    p.add_argument("--avg-every", type=int, default=10, help="H")
    p.add_argument("--avg-latency", type=int, default=5, help="local steps between snapshot and application")
    p.add_argument("--avg-blend", type=int, default=0,
                   help="local steps a round's parameter delta is spread over (0: the manifest's asyncmesh.avg_blend_steps)")
    p.add_argument("--disjoint-shards", action="store_true",
                   help="replicas train on disjoint contiguous shards (default: independent samples of the whole corpus)")
    p.add_argument("--avg-optim", default="adamw", help="optimizer of the averaging runs")
    p.add_argument("--val-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=3, help="pipeline runs per mode (seeds seed, seed+1, ...), averaged")
    p.add_argument("--runtime-seconds", type=float, default=20.0,
                   help="measure utilisation on a real local swarm of the manifest's own model for this many "
                   "seconds per mode (0: skip)")
    p.add_argument("--more-inflight", type=int, default=8,
                   help="also report async utilisation with this many microbatches in flight (0: skip)")
    p.add_argument("--runtime-more-inflight", action="store_true",
                   help="measure --more-inflight on the real swarm too (another swarm run), not only simulated")
    p.add_argument("--deep-stages", type=int, default=0,
                   help="also run the pipeline modes with the model cut into this many stages (0: skip), "
                   "reported as val_loss_deep / lookahead_beats_none_deep next to the default layout's")
    p.add_argument("--deep-max-inflight", type=int, default=0,
                   help="deep regime: head's microbatches in flight (0: 2·(S−1)+1, 1F1B delays 2·(S−1−s))")
    p.add_argument("--deep-lr", type=float, default=0.0, help="deep regime: peak lr (0: --lr)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu",
                   help="device of the averaging runs (cpu, cuda, cuda:N; bf16 autocast on CUDA); "
                        "the pipeline runs stay on the CPU")
    p.add_argument("--only", choices=("pipeline", "averaging"), default=None)
    p.add_argument("--ablation", action="store_true",
                   help="also run sparse_moments (moments averaged, λ_m = 1) and sparse_lambda (λ = 1 + s/(P·H))")
    p.add_argument("--variants", default="",
                   help="comma-separated averaging variants to run (experiments): full, sparse, sparse_corrected, "
                   "sparse_moments, sparse_lambda, independent (no averaging: reference), sparse_second (+ second moments, λ_v = β2^s), sparse_outer "
                   "(+ outer Nesterov on the averaged slice)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="sparse_outer: outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="sparse_outer: outer Nesterov momentum")
    p.add_argument("--avg-seeds", type=int, default=1,
                   help="averaging runs per variant (seeds seed, seed+1, ...), averaged")
    p.add_argument("--avg-every-extra", default="",
                   help="comma-separated further H values: the sparse variants run again at each (full and "
                   "independent do not depend on H), reported under averaging_other_H against the same full run")
    p.add_argument("--robust", action="store_true",
                   help="also run sparse_robust: sparse_corrected with each round judged as the swarm judges it "
                   "(stages.robust_avg: robust rule at each reducer, receivers check the returned ranges)")
    p.add_argument("--avg-attack", choices=("none", "scale25"), default="none",
                   help="the last replica contributes its slices x25 to every round (every sparse variant); "
                   "val losses are then the honest replicas'")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps")
    args = p.parse_args(argv)
    if args.quick:
        args.manifest, args.d_model, args.n_layers, args.seq_len, args.k = "test", 0, 0, 16, 0
        args.batch_size, args.steps, args.val_batches, args.avg_every = 2, 8, 2, 2
        args.avg_latency, args.avg_fraction, args.seeds, args.runtime_seconds = 1, 0.25, 1, 0.0
    return args


def make_manifest(args):
    m = load_manifest(args.manifest)
    model = {}
    if args.d_model:
        model["d_model"] = args.d_model
    if args.n_layers:
        model["n_layers"] = args.n_layers
    model["seq_len"] = args.seq_len
    # model and k in one replace: a width and a k that fit together are valid in either order
    subspace = {"k": args.k} if args.k and m.subspace.enabled else {}
    try:
        m = m.replace(model=model, subspace=subspace)
    except ManifestError as e:
        raise SystemExit(f"--d-model {args.d_model} --k {args.k}: {e}") from None
    n, S = m.model.n_layers, args.stages
    if S > n:
        raise SystemExit(f"--stages {S} exceeds the model's {n} layers")
    return m.replace(
        stages={"layout": even_layout(n, S)},
        optim={"name": args.optim, "lr": args.lr, "betas": [args.beta1, args.beta2]},
        schedule={"total_steps": args.steps, "warmup_steps": max(1, args.steps // 20)},
        data={"batch_size": args.batch_size},
        asyncmesh={k: v for k, v in (("lookahead_target", args.lookahead_target),
                                     ("lookahead_horizon", args.lookahead_horizon)) if v},
    )


@torch.no_grad()
def val_loss_chain(stages, batches) -> float:
    losses = []
    for ids in batches:
        x = None
        for st in stages:
            x = st(x, ids)
        losses.append(float(lm_loss(x, ids)))
    return statistics.fmean(losses)


# ------------------------------------------------------------------------------------ pipeline


def pipeline_modes(m, delays: list[int], corpus, val, args) -> dict:
    """gpipe (delay 0), async_none and async_lookahead (``delays``) on ``args.seeds`` seeds:
    per mode the list of per-seed run results."""
    other = [t for t in args.other_targets.split(",") if t and t != m.asyncmesh.lookahead_target]
    other_h = "stage" if m.asyncmesh.lookahead_horizon == "pipeline" else "pipeline"
    per_seed = {mode: [] for mode in ("gpipe", "async_none", "async_lookahead",
                                      *(f"async_lookahead_{t}" for t in other),
                                      *((f"async_lookahead_{other_h}_horizon", "gpipe_extrapolated")
                                        if args.other_horizon else ()))}
    for seed in [args.seed + i for i in range(args.seeds)]:
        args_s = argparse.Namespace(**{**vars(args), "seed": seed})
        per_seed["gpipe"].append(run_pipeline(m, "gpipe", [0] * m.n_stages, corpus, val, args_s))
        per_seed["async_none"].append(run_pipeline(m, "none", delays, corpus, val, args_s))
        per_seed["async_lookahead"].append(run_pipeline(m, "lookahead", delays, corpus, val, args_s))
        for t in other:
            mt = m.replace(asyncmesh={"lookahead_target": t})
            per_seed[f"async_lookahead_{t}"].append(run_pipeline(mt, "lookahead", delays, corpus, val, args_s))
        if args.other_horizon:
            # the other horizon ("pipeline": every stage looks ahead by the head's delay, to when
            # the microbatch's last gradient lands; "stage": by its own), and the head's
            # extrapolation on the synchronous run: is a gain staleness correction, or the
            # extrapolation itself (Nesterov-like) also without delays?
            mh = m.replace(asyncmesh={"lookahead_horizon": other_h})
            per_seed[f"async_lookahead_{other_h}_horizon"].append(
                run_pipeline(mh, "lookahead", delays, corpus, val, args_s))
            per_seed["gpipe_extrapolated"].append(
                run_pipeline(m, "lookahead", [0] * m.n_stages, corpus, val, args_s, horizon=float(max(delays))))
    return per_seed


def one_f_one_b_delays(S: int, inflight: int) -> list[int]:
    """τ_s = (S−1−s)·⌊(inflight−1)/(S−1)⌋ (at least one step per hop): the module docstring."""
    u = max(1, (inflight - 1) // max(1, S - 1))
    return [(S - 1 - s) * u for s in range(S)]


def pipeline_summary(per_seed: dict, tag: str = "") -> dict:
    """Seed means and look-ahead / plain-async comparisons of ``pipeline_modes``' runs, keys
    ``val_loss{tag}``, ``lookahead_gap_rel{tag}``, …"""
    vl = {k: statistics.fmean(r["val_loss"] for r in v) for k, v in per_seed.items()}
    return {
        f"val_loss{tag}": {k: round(v, 4) for k, v in vl.items()},
        f"val_loss{tag}_per_seed": {k: [round(r["val_loss"], 4) for r in v] for k, v in per_seed.items()},
        f"lookahead_gap_rel{tag}": rel_gap(vl["async_lookahead"], vl["gpipe"]),
        f"none_gap_rel{tag}": rel_gap(vl["async_none"], vl["gpipe"]),
        f"lookahead_beats_none{tag}": vl["async_lookahead"] < vl["async_none"],
        f"lookahead_beats_none{tag}_seeds": sum(
            a["val_loss"] < b["val_loss"] for a, b in zip(per_seed["async_lookahead"], per_seed["async_none"])),
    }


def prediction_errors(per_seed: dict, S: int) -> dict:
    """Per look-ahead variant and stage, the seed mean of Σ|Ŵ_j − W_apply| / Σ|W_j − W_apply|
    (None for a stage without delay)."""
    return {
        k: [round(statistics.fmean(r["prediction_error_rel"][s] for r in v), 4)
            if v[0]["prediction_error_rel"][s] is not None else None for s in range(S)]
        for k, v in per_seed.items() if k.startswith("async_lookahead")
    }


def rel_gap(a: float, b: float) -> float:
    return round(a / b - 1, 4)


def run_pipeline(m, mode: str, delays: list[int], corpus, val, args, horizon: float | None = None) -> dict:
    """Train S stages for ``args.steps`` microbatches with per-stage gradient delays ``delays``;
    ``horizon`` is every stage's least look-ahead extrapolation (None: each stage's own τ̂)."""
    S = m.n_stages
    if horizon is None and mode == "lookahead" and m.asyncmesh.lookahead_horizon == "pipeline":
        horizon = float(max(delays))  # what the runtime's fwd frames carry: the head's delay
    torch.manual_seed(args.seed)
    stages = [build_stage(m, s) for s in range(S)]
    opts = [build_optimizer(m, st) for st in stages]
    las = [LookaheadForward(st, o, mode=mode, delay_ema=m.asyncmesh.delay_ema, target=m.asyncmesh.lookahead_target,
                            horizon=horizon) for st, o in zip(stages, opts)]
    batches = Batches(corpus.train, args.batch_size, m.model.seq_len, args.seed)
    ctx = [dict() for _ in range(S)]  # microbatch -> (weights, x, ids)
    grads = [dict() for _ in range(S)]  # gradient w.r.t. stage s's output, per microbatch
    fwd_t = [[] for _ in range(S)]
    bwd_t = [[] for _ in range(S)]
    train_losses = []
    # look-ahead's prediction: |Ŵ_j − W_apply| against plain async's |W_j − W_apply| (the weights
    # when microbatch j's gradient is applied), summed per stage
    live_at = [dict() for _ in range(S)]  # version -> W (flat), lookahead mode only
    pred_err = [[0.0, 0.0] for _ in range(S)]

    def flat(tensors):
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    def step(s):
        torch.nn.utils.clip_grad_norm_(stages[s].parameters(), m.optim.grad_clip)
        opts[s].step()
        opts[s].zero_grad(set_to_none=True)
        las[s].stepped()
        set_lr(opts[s], lr_at(m.schedule, m.optim.lr, las[s].version))

    for s in range(S):
        set_lr(opts[s], lr_at(m.schedule, m.optim.lr, 0))
    t = 0
    while t < args.steps or any(ctx):
        if t < args.steps:  # forward of microbatch t through every stage
            ids = batches.batch(t)
            x = None
            for s in range(S):
                w = las[s].weights()
                ctx[s][t] = (w, x, ids)
                if mode == "lookahead" and delays[s] and w.version not in live_at[s]:
                    live_at[s][w.version] = flat(stages[s].parameters())
                if s < S - 1:
                    t0 = time.perf_counter()
                    x = las[s].forward(w, x, ids)
                    fwd_t[s].append(time.perf_counter() - t0)
        for s in range(S - 1, -1, -1):  # gradients that arrive at tick t
            j = t - delays[s]
            if j not in ctx[s]:
                continue
            w, x, ids = ctx[s].pop(j)
            if w.version in live_at[s] and las[s].version > w.version:
                now = flat(stages[s].parameters())
                hat = flat(w.tensors[n] for n, _ in stages[s].named_parameters())
                pred_err[s][0] += float((hat - now).norm())
                pred_err[s][1] += float((live_at[s][w.version] - now).norm())
                oldest = min((c[0].version for c in ctx[s].values()), default=las[s].version)
                for v in [v for v in live_at[s] if v < oldest]:
                    del live_at[s][v]
            t0 = time.perf_counter()
            if s == S - 1:
                out = las[s].backward(w, (x, ids), loss_fn=lambda logits, ids=ids: lm_loss(logits, ids))
                train_losses.append(float(out.loss))
            else:
                out = las[s].backward(w, (x, ids), grad_output=grads[s].pop(j))
            bwd_t[s].append(time.perf_counter() - t0)
            if s > 0:
                grads[s - 1][j] = out.input_grads[0]
            step(s)
        if t % 50 == 0 and train_losses:
            progress(f"pipeline {mode}: tick {t} loss {train_losses[-1]:.3f}")
        t += 1
    return {
        "val_loss": val_loss_chain(stages, val),
        "train_loss_last20": statistics.fmean(train_losses[-20:]),
        "tau_hat": [round(la.delays.tau_hat, 3) for la in las],
        "prediction_error_rel": [round(a / b, 4) if b else None for a, b in pred_err],
        "fwd_s": [statistics.median(x) if x else 0.0 for x in fwd_t],
        "bwd_s": [statistics.median(x) for x in bwd_t],
    }


# ------------------------------------------------------------------------------- utilisation


def simulate_schedule(fwd: list[float], bwd: list[float], n_micro: int, mode: str, inflight: int, flush: int) -> dict:
    """Discrete-event simulation of S single-server stages; returns busy/wall per stage.

    Each stage runs one task at a time, backward first when both are ready (1F1B). async: the
    head injects a microbatch whenever fewer than ``inflight`` are in flight; gpipe: ``flush``
    microbatches, then waits until all their backwards are done (then the optimizer step).
    The tail's backward includes its forward (recompute), so the tail has no separate forward.
    """
    S = len(bwd)
    fwd = list(fwd)
    fwd[S - 1] = 0.0
    free_at = [0.0] * S
    busy = [0.0] * S
    ready: list[list] = [[] for _ in range(S)]  # heap of (priority, time_ready, microbatch, kind)
    events: list = []
    injected = done = group_done = 0
    inflight_now = 0
    now = 0.0
    seq = 0

    def push_ready(s, when, j, kind):
        heapq.heappush(ready[s], (0 if kind == "B" else 1, when, j, kind))

    def try_inject(at):
        nonlocal injected, inflight_now
        while injected < n_micro:
            if mode == "gpipe":
                if injected - group_done * flush >= flush:
                    return
            elif inflight_now >= inflight:
                return
            push_ready(0, at, injected, "F")
            injected += 1
            inflight_now += 1

    try_inject(0.0)
    while done < n_micro:
        started = False
        for s in range(S):
            if free_at[s] <= now and ready[s] and ready[s][0][1] <= now:
                _, _, j, kind = heapq.heappop(ready[s])
                dur = fwd[s] if kind == "F" else bwd[s]
                free_at[s] = now + dur
                busy[s] += dur
                seq += 1
                heapq.heappush(events, (now + dur, seq, s, j, kind))
                started = True
        if started:
            continue
        when, _, s, j, kind = heapq.heappop(events)
        now = max(now, when)
        if kind == "F":
            if s + 1 < S:
                push_ready(s + 1, now, j, "F" if s + 1 < S - 1 else "B")
        else:
            if s > 0:
                push_ready(s - 1, now, j, "B")
            else:
                done += 1
                inflight_now -= 1
                if mode == "gpipe" and done % flush == 0:
                    group_done += 1
                try_inject(now)
        # a stage whose next task is ready later waits for the next event
    wall = now
    return {"per_stage": [round(b / wall, 4) for b in busy], "wall_s": round(wall, 4)}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def manifest_toml(m) -> str:
    """The manifest as TOML (every section and field; values are scalars, strings and lists)."""
    lines = []
    for section, fields in m.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
        lines.append("")
    return "\n".join(lines)


def _busy_seconds(metrics: dict) -> float:
    """The compute worker's busy seconds (``swarm_node_compute_busy_seconds_total``; older nodes:
    the sum of the per-microbatch compute-time histogram)."""
    from node.ops import metric_sum

    key = "swarm_node_compute_busy_seconds_total"
    if any(k.split("{")[0] == key for k in metrics):
        return metric_sum(metrics, key)
    return metric_sum(metrics, "swarm_node_compute_seconds_sum")


def runtime_utilisation(m, mode: str, seconds: float, warmup_steps: int = 5, max_inflight: int = 0) -> dict:
    """busy/wall per stage of a real local swarm (bootstrap + one ``swarm-node run`` per stage on
    loopback): busy = growth of the compute worker's busy seconds (forward / backward / step) over
    a window of ``seconds`` after ``warmup_steps`` tail steps. Also the mean measured delay τ per
    stage over the window (``swarm_node_staleness_steps``), to check it against the loss runs'."""
    import tempfile

    from node.ops import LocalSwarm, metric_sum

    train = {"steps": 1_000_000, **({"max_inflight": max_inflight} if max_inflight else {})}
    mm = m.replace(asyncmesh={"mode": mode}, train=train, schedule={"total_steps": 1_000_000},
                   sentinel={"enabled": False})
    with tempfile.TemporaryDirectory(prefix="bench_asyncmesh_") as tmp:
        path = Path(tmp) / f"{mode}.toml"
        path.write_text(manifest_toml(mm))
        with LocalSwarm(str(path), workdir=Path(tmp) / "swarm", torch_threads=1) as sw:
            sw.start_bootstrap()
            nodes = [sw.start_node(i, name=f"stage{i}", extra=["--no-averaging"]) for i in range(mm.n_stages)]
            sw.wait_ready(timeout=300)
            deadline = time.monotonic() + 300
            while sw.value(nodes[-1], "swarm_node_steps_total") < warmup_steps:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"runtime utilisation ({mode}): the swarm did not train")
                time.sleep(0.5)

            def sample():
                mets = [sw.metrics(n) for n in nodes]
                tau = [(metric_sum(x, "swarm_node_staleness_steps_sum"), metric_sum(x, "swarm_node_staleness_steps_count"))
                       for x in mets]
                return (time.monotonic(), [_busy_seconds(x) for x in mets],
                        metric_sum(mets[-1], "swarm_node_steps_total"), tau)

            t0, busy0, steps0, tau0 = sample()
            time.sleep(seconds)
            t1, busy1, steps1, tau1 = sample()
    per_stage = [round((b1 - b0) / (t1 - t0), 4) for b0, b1 in zip(busy0, busy1)]
    tau = [round((s1 - s0) / max(1.0, c1 - c0), 2) for (s0, c0), (s1, c1) in zip(tau0, tau1)]
    return {"per_stage": per_stage, "mean": round(statistics.fmean(per_stage), 4),
            "tail_steps_per_s": round((steps1 - steps0) / (t1 - t0), 3), "window_s": round(t1 - t0, 1),
            "tau_measured": tau, "max_inflight": mm.train.max_inflight}


# ------------------------------------------------------------------------------- averaging

CORRECTED = "sparse_corrected"  # what asyncmesh.avg_correction = true does in node/net/averaging.py
ROBUST = "sparse_robust"  # sparse_corrected, each round judged by stages.robust_avg (butterfly)
CORRECTED_VARIANTS = ("sparse_corrected", "sparse_at_once", "sparse_second", "sparse_outer", ROBUST)


def blend_of(m, args) -> int:
    """Local steps a round's parameter delta is spread over in ``sparse_corrected``."""
    return args.avg_blend or m.asyncmesh.avg_blend_steps


def averaging_runs(m, variants, corpus, val, args) -> dict:
    """Every variant on ``args.avg_seeds`` seeds; per variant the seed means and per-seed figures."""
    avg_runs = {}
    avg_seeds = [args.seed + i for i in range(max(1, args.avg_seeds))]
    for v in variants:
        runs = [run_averaging(m, v, corpus, val, argparse.Namespace(**{**vars(args), "seed": sd}))
                for sd in avg_seeds]
        avg_runs[v] = {"val_loss": statistics.fmean(r["val_loss"] for r in runs),
                       "val_loss_per_seed": [round(r["val_loss"], 4) for r in runs],
                       "val_loss_per_replica": [r["val_loss_per_replica"] for r in runs],
                       "consensus_val_loss": statistics.fmean(r["consensus_val_loss"] for r in runs),
                       "consensus_val_loss_per_seed": [round(r["consensus_val_loss"], 4) for r in runs],
                       "bytes_per_replica": runs[0]["bytes_per_replica"],
                       "mean_moment_lambda": runs[0]["mean_moment_lambda"],
                       "judged": [r["judged"] for r in runs]}
    return avg_runs


def averaging_gaps(runs: dict, full: dict, key: str = "val_loss") -> tuple[dict, dict]:
    """(seed-mean gap, per-seed gaps) of every run but ``full`` against ``full`` on ``key``."""
    others = {k: v for k, v in runs.items() if k != "full"}
    return ({k: rel_gap(v[key], full[key]) for k, v in others.items()},
            {k: [rel_gap(a, b) for a, b in zip(v[f"{key}_per_seed"], full[f"{key}_per_seed"])]
             for k, v in others.items()})


def run_averaging(m, variant: str, corpus, val, args) -> dict:
    """R replicas of the whole model; ``variant`` in full | sparse | sparse_corrected | …"""
    R = args.replicas
    torch.manual_seed(args.seed)
    am = m.replace(optim={"name": args.avg_optim, "betas": [0.9, 0.95]}, stages={"layout": [[0, m.model.n_layers]]})
    dev = torch.device(args.device)
    amp = functools.partial(torch.autocast, device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    models = [build_model(am).to(dev) for _ in range(R)]
    val = [v.to(dev) for v in val]
    for mod in models[1:]:
        mod.load_state_dict(models[0].state_dict())
    opts = [build_optimizer(am, mod) for mod in models]
    if args.disjoint_shards:  # contiguous, disjoint regions of the corpus (different source files)
        data = [Batches(corpus.train, args.batch_size, am.model.seq_len, args.seed, shard=r, num_shards=R)
                for r in range(R)]
    else:  # each replica samples the whole corpus with its own seed (a stage replica fed by many heads)
        data = [Batches(corpus.train, args.batch_size, am.model.seq_len, args.seed * 1000 + r) for r in range(R)]
    params = [[p for p in mod.parameters() if p.requires_grad] for mod in models]
    n_elem = sum(p.numel() for p in params[0])
    sched = PartitionSchedule([p.shape for p in params[0]], args.avg_fraction, am.run.seed)
    mom_on = variant in ("sparse_moments", *CORRECTED_VARIANTS)
    corr = StalenessCorrection(variant in CORRECTED_VARIANTS)
    blend_steps = blend_of(m, args) if variant in (CORRECTED, ROBUST) else 1
    attacker = R - 1 if args.avg_attack == "scale25" else None
    honest = [r for r in range(R) if r != attacker]
    layout = AveragingLayout(1 + mom_on, sched.max_size)
    judged = {"rounds": 0, "dropped": 0, "refused": 0}  # sparse_robust: members dropped, ranges refused
    blends = [BlendedDelta(blend_steps) for _ in range(R)]
    sq_on = variant == "sparse_second"
    outer = None
    if variant == "sparse_outer":
        # DiLoCo-style outer optimizer per element, on the slice a round averages: the replicas'
        # mean progress since the slice's last average is an outer (pseudo-)gradient, stepped with
        # Nesterov momentum. The state is computed from averaged values only, so it is identical
        # on every replica (same init).
        outer = ([p.detach().clone() for p in params[0]], [torch.zeros_like(p) for p in params[0]])
    pending = []  # (apply_at_step, indices, param snaps, param avg, moment snaps, moment avg, ..., start, round)
    bytes_total = 0
    group = 2 * (R - 1) / R  # butterfly all-reduce payload factor per peer
    rnd = 0
    lams = []
    for step in range(args.steps):
        for r in range(R):
            ids = data[r].batch(step).to(dev, non_blocking=True)
            with amp():
                loss = lm_loss(models[r](ids), ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params[r], am.optim.grad_clip)
            set_lr(opts[r], lr_at(am.schedule, am.optim.lr, step))
            opts[r].step()
            opts[r].zero_grad(set_to_none=True)
        done = step + 1
        for r in range(R):
            blends[r].step(params[r])
        if variant == "full":
            with torch.no_grad():
                for ps in zip(*params):
                    mean = torch.stack(ps).mean(0)
                    for p in ps:
                        p.copy_(mean)
            bytes_total += group * 4 * n_elem
            continue
        if variant == "independent":  # reference: no averaging at all
            continue
        if done % args.avg_every == 0:
            idx = sched.indices(rnd)
            for r in range(R):
                blends[r].before_snapshot(params[r], sched.partition(rnd))
            snaps = [snapshot(params[r], idx) for r in range(R)]
            sent = [s_ * 25 if r == attacker else s_ for r, s_ in enumerate(snaps)]  # what each contributes
            avg = torch.stack(sent).mean(0)
            msnaps = mavg = vsnaps = vavg = None
            if mom_on:
                msnaps = [snapshot(first_moments(opts[r], params[r])[0], idx) for r in range(R)]
                msent = [s_ * 25 if r == attacker else s_ for r, s_ in enumerate(msnaps)]
                mavg = torch.stack(msent).mean(0)
            avgs, mavgs = [avg] * R, [mavg] * R
            if variant == ROBUST:  # the round as the swarm runs it: judged at each reducer and receiver
                n = snaps[0].numel()
                contribs = torch.stack([layout.pack([sent[r], msent[r]]) for r in range(R)])
                outcome = butterfly(contribs, layout=layout)
                parts = [layout.unpack(res) for res in outcome.results]
                avgs, mavgs = [p_[0][:n] for p_ in parts], [p_[1][:n] for p_ in parts]
                judged["rounds"] += 1
                judged["dropped"] += len(outcome.dropped_members)
                judged["refused"] += sum(len(v) for v in outcome.refused.values())
            if sq_on:
                vsnaps = [snapshot(second_moments(opts[r], params[r]), idx) for r in range(R)]
                vavg = torch.stack(vsnaps).mean(0)
            if outer is not None:
                avg = outer_step(outer, idx, avg, args.outer_lr, args.outer_momentum)
                avgs = [avg] * R
            pending.append((done + args.avg_latency, idx, snaps, avgs, msnaps, mavgs, vsnaps, vavg, done, rnd))
            bytes_total += group * 4 * sched.max_size * (1 + mom_on + sq_on)
            rnd += 1
        while pending and pending[0][0] <= done:
            _, idx, snaps, avgs, msnaps, mavgs, vsnaps, vavg, start, number = pending.pop(0)
            s = done - start
            for r in range(R):
                avg, mavg = avgs[r], mavgs[r]
                if variant == "sparse_lambda":
                    apply_average_delta(params[r], idx, snaps[r], avg, 1.0 + s / (sched.n_partitions * args.avg_every))
                else:
                    blends[r].add(params[r], idx, snaps[r], avg, partition=sched.partition(number))
                if mavg is not None:
                    moments, decays = first_moments(opts[r], params[r])
                    lam_m = corr.moment_lambdas(s, decays) if corr.enabled else [1.0] * len(decays)
                    lams.append(statistics.fmean(lam_m))
                    apply_average_delta(moments, idx, msnaps[r], mavg, lam_m)
                if vavg is not None:
                    b2 = float(opts[r].param_groups[0]["betas"][1])
                    apply_average_delta(second_moments(opts[r], params[r]), idx, vsnaps[r], vavg, b2 ** s)
        if step % 50 == 0:
            progress(f"averaging {variant}: step {step} loss {loss.item():.3f}")
    with amp():  # with an attacker: the honest replicas' losses and their consensus
        losses = [val_loss_chain([_Whole(models[r])], val) for r in honest]
        consensus = val_loss_chain([_Whole(consensus_model([models[r] for r in honest]))], val)
    return {
        "val_loss": statistics.fmean(losses),
        "val_loss_per_replica": [round(x, 4) for x in losses],
        "consensus_val_loss": consensus,
        "bytes_per_replica": int(bytes_total),
        "mean_moment_lambda": round(statistics.fmean(lams), 4) if lams else None,
        "judged": judged,
    }


@torch.no_grad()
def consensus_model(models: list[torch.nn.Module]) -> torch.nn.Module:
    """A new model whose floating-point parameters and buffers are the element-wise mean of the
    replicas' (what a swarm would publish or checkpoint); other entries (integer buffers) are
    taken from the first replica. The replicas are not modified."""
    states = [mod.state_dict() for mod in models]
    mean = {k: torch.stack([st[k] for st in states]).mean(0) if v.is_floating_point() else v.clone()
            for k, v in states[0].items()}
    out = copy.deepcopy(models[0])
    out.load_state_dict(mean)
    return out


def second_moments(optimizer, params) -> list:
    """Adam's ``exp_avg_sq`` per parameter (None before the first step)."""
    return [(optimizer.state.get(p) or {}).get("exp_avg_sq") for p in params]


@torch.no_grad()
def outer_step(outer, idx, avg: torch.Tensor, lr: float, momentum: float) -> torch.Tensor:
    """Nesterov outer step on one slice: Δ = g_prev − avg, u ← μ·u + Δ, g = g_prev − lr·(Δ + μ·u).
    Updates the outer state (g_prev, u) on the slice; returns g, the value the replicas move to."""
    g_prev, u = outer
    gp, uu = snapshot(g_prev, idx), snapshot(u, idx)
    delta = gp - avg
    uu_new = momentum * uu + delta
    g = gp - lr * (delta + momentum * uu_new)
    apply_average_delta(u, idx, uu, uu_new)  # u[S] ← uu_new
    apply_average_delta(g_prev, idx, gp, g)  # g_prev[S] ← g
    return g


class _Whole(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, ids):
        return self.model(ids)


# ------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like an exception, so every `with LocalSwarm(...)` stops its nodes
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # one intra-op thread: on a shared box more threads oversubscribe the cores and run slower
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    m = make_manifest(args)
    corpus = load_corpus(m.data)
    val = val_batches(corpus.val, args.batch_size, m.model.seq_len, args.val_batches)
    S = m.n_stages
    inflight = args.max_inflight or m.train.max_inflight
    flush = args.flush_every or m.asyncmesh.gpipe_flush_every
    delays = one_f_one_b_delays(S, inflight)
    out: dict = {"benchmark": "asyncmesh"}
    if args.only != "averaging":
        per_seed = pipeline_modes(m, delays, corpus, val, args)
        out.update(pipeline_summary(per_seed))
        out["train_loss_last20"] = {
            k: round(statistics.fmean(r["train_loss_last20"] for r in v), 4) for k, v in per_seed.items()
        }
        out["tau_hat"] = per_seed["async_lookahead"][0]["tau_hat"]
        out["lookahead_prediction_error_rel"] = prediction_errors(per_seed, S)
        timed = per_seed["async_none"] + per_seed["async_lookahead"]
        fwd = [statistics.median(r["fwd_s"][s] for r in timed) for s in range(S)]
        bwd = [statistics.median(r["bwd_s"][s] for r in timed) for s in range(S)]
        n_micro = 50 * flush * S
        ua = simulate_schedule(fwd, bwd, n_micro, "async", inflight, flush)
        ug = simulate_schedule(fwd, bwd, n_micro, "gpipe", inflight, flush)
        simulated = {
            "async": round(statistics.fmean(ua["per_stage"]), 4),
            "gpipe": round(statistics.fmean(ug["per_stage"]), 4),
            "async_per_stage": ua["per_stage"],
            "gpipe_per_stage": ug["per_stage"],
            "source": "discrete-event simulation of the bench model's stages from their measured forward and "
            "backward(+recompute) times, zero-latency links",
            "stage_fwd_s": [round(x, 5) for x in fwd],
            "stage_bwd_s": [round(x, 5) for x in bwd],
            "microbatches": n_micro,
            "max_inflight": inflight,
        }
        for k in sorted({args.more_inflight} - {0, inflight}):
            u = simulate_schedule(fwd, bwd, n_micro, "async", k, flush)
            simulated[f"async_max_inflight_{k}"] = round(statistics.fmean(u["per_stage"]), 4)
            simulated[f"async_max_inflight_{k}_per_stage"] = u["per_stage"]
        if args.runtime_seconds > 0:
            rm = load_manifest(args.manifest)  # the manifest's own model: the default run, not the small one
            rt = {
                "async": runtime_utilisation(rm, "lookahead", args.runtime_seconds, max_inflight=inflight),
                "gpipe": runtime_utilisation(rm, "gpipe", args.runtime_seconds, max_inflight=inflight),
            }
            if args.runtime_more_inflight and args.more_inflight not in (0, inflight):
                rt[f"async_max_inflight_{args.more_inflight}"] = runtime_utilisation(
                    rm, "lookahead", args.runtime_seconds, max_inflight=args.more_inflight)
            out["utilisation"] = {
                **{k: v["mean"] for k, v in rt.items()},
                **{f"{k}_per_stage": v["per_stage"] for k, v in rt.items()},
                "tail_steps_per_s": {k: v["tail_steps_per_s"] for k, v in rt.items()},
                "tau_measured": {k: v["tau_measured"] for k, v in rt.items()},
                "max_inflight": {k: v["max_inflight"] for k, v in rt.items()},
                "source": "real local swarm (node.ops.local_swarm.LocalSwarm: bootstrap + one swarm-node run per stage, "
                "loopback, 1 torch thread each): compute-worker busy seconds / wall seconds over "
                f"{args.runtime_seconds:g} s; on a shared CPU, time a compute call waits for a core counts as busy",
                "model": f"{args.manifest} manifest as shipped (d_model {rm.model.d_model}, "
                f"{rm.model.n_layers} layers, seq_len {rm.model.seq_len}, batch {rm.data.batch_size}, "
                f"max_inflight {inflight}, gpipe_flush_every {rm.asyncmesh.gpipe_flush_every}), "
                "SENTINEL off",
                "simulated": simulated,
            }
        else:
            out["utilisation"] = simulated
        if args.manifest_optim:
            # the same pipeline runs with the optimizer the shipped manifest trains with
            # (stages/runs/default.toml: AdamW (0.9, 0.95)) instead of docs/REFERENCES.md §2's NAdam (0.99, 0.999)
            mo = load_manifest(args.manifest).optim
            mo_args = argparse.Namespace(**{**vars(args), "optim": mo.name, "beta1": mo.betas[0],
                                            "beta2": mo.betas[1], "lr": mo.lr})
            mom = make_manifest(mo_args)
            mps = pipeline_modes(mom, delays, corpus, val, mo_args)
            out.update(pipeline_summary(mps, "_manifest_optim"))
            out["lookahead_prediction_error_rel_manifest_optim"] = prediction_errors(mps, S)
            out["manifest_optim_settings"] = {"name": mom.optim.name, "betas": list(mom.optim.betas),
                                              "lr": mom.optim.lr, "weight_decay": mom.optim.weight_decay,
                                              "delays_per_stage": delays}
        if args.deep_stages:
            # a second regime next to the default layout's (which stays reported above): the same
            # model cut into more stages, longer 1F1B delays, optionally another peak lr
            deep_args = argparse.Namespace(**{**vars(args), "stages": args.deep_stages,
                                              "lr": args.deep_lr or args.lr})
            dm = make_manifest(deep_args)
            dS = dm.n_stages
            d_inflight = args.deep_max_inflight or 2 * (dS - 1) + 1
            d_delays = one_f_one_b_delays(dS, d_inflight)
            dps = pipeline_modes(dm, d_delays, corpus, val, deep_args)
            out.update(pipeline_summary(dps, "_deep"))
            out["deep_settings"] = {
                "stages": dS, "layout": [list(x) for x in dm.stages.layout], "delays_per_stage": d_delays,
                "max_inflight": d_inflight, "lr": dm.optim.lr, "seeds": list(range(args.seed, args.seed + args.seeds)),
                "tau_hat": dps["async_lookahead"][0]["tau_hat"],
            }
    if args.only != "pipeline":
        variants = ["full", "sparse", "sparse_corrected"]
        if args.ablation:
            variants += ["sparse_moments", "sparse_lambda"]
        if args.variants:
            variants = args.variants.split(",")
        if args.robust and ROBUST not in variants:
            variants.append(ROBUST)
        avg_runs = averaging_runs(m, variants, corpus, val, args)
        out["averaging_val_loss"] = {
            ("full_every_step" if k == "full" else k): round(v["val_loss"], 4) for k, v in avg_runs.items()
        }
        out["averaging_val_loss_per_seed"] = {k: v["val_loss_per_seed"] for k, v in avg_runs.items()}
        out["averaging_val_loss_per_replica"] = {k: v["val_loss_per_replica"] for k, v in avg_runs.items()}
        out["avg_bytes_per_replica"] = {k: v["bytes_per_replica"] for k, v in avg_runs.items()}
        out["mean_moment_lambda"] = {k: v["mean_moment_lambda"] for k, v in avg_runs.items() if k != "full"}
        if "full" in avg_runs:
            full = avg_runs["full"]
            out["averaging_gap_rel"], out["averaging_gap_rel_per_seed"] = averaging_gaps(avg_runs, full)
            if CORRECTED in avg_runs:
                out["sparse_avg_gap_rel"] = out["averaging_gap_rel"][CORRECTED]
                out["avg_bytes_ratio"] = round(full["bytes_per_replica"] / avg_runs[CORRECTED]["bytes_per_replica"], 2)
            if "sparse" in avg_runs:
                out["sparse_uncorrected_gap_rel"] = out["averaging_gap_rel"]["sparse"]
        if ROBUST in avg_runs:
            # the robust rule against the plain mean it replaces (sparse_corrected, same seeds)
            out["robust_avg_judged"] = avg_runs[ROBUST]["judged"]
            if CORRECTED in avg_runs:
                out["robust_avg_cost_rel"] = {
                    "per_replica": rel_gap(avg_runs[ROBUST]["val_loss"], avg_runs[CORRECTED]["val_loss"]),
                    "consensus": rel_gap(avg_runs[ROBUST]["consensus_val_loss"],
                                         avg_runs[CORRECTED]["consensus_val_loss"]),
                }
        # the consensus model (element-wise mean of the replicas' parameters at the end), next to
        # the per-replica figures above, which keep their meaning
        out["averaging_consensus_val_loss"] = {
            ("full_every_step" if k == "full" else k): round(v["consensus_val_loss"], 4) for k, v in avg_runs.items()
        }
        out["averaging_consensus_val_loss_per_seed"] = {
            k: v["consensus_val_loss_per_seed"] for k, v in avg_runs.items()
        }
        if "full" in avg_runs:
            out["averaging_consensus_gap_rel"], out["averaging_consensus_gap_rel_per_seed"] = averaging_gaps(
                avg_runs, avg_runs["full"], "consensus_val_loss")
            if CORRECTED in avg_runs:
                out["sparse_avg_consensus_gap_rel"] = out["averaging_consensus_gap_rel"][CORRECTED]
        extra_h = [int(h) for h in args.avg_every_extra.split(",") if h.strip()]
        sparse_variants = [v for v in variants if v not in ("full", "independent")]
        if extra_h and sparse_variants:
            out["averaging_other_H"] = {}
            for h in extra_h:
                runs_h = averaging_runs(m, sparse_variants, corpus, val,
                                        argparse.Namespace(**{**vars(args), "avg_every": h}))
                blk = {
                    "avg_every": h,
                    "val_loss": {k: round(v["val_loss"], 4) for k, v in runs_h.items()},
                    "val_loss_per_seed": {k: v["val_loss_per_seed"] for k, v in runs_h.items()},
                    "consensus_val_loss": {k: round(v["consensus_val_loss"], 4) for k, v in runs_h.items()},
                    "consensus_val_loss_per_seed": {k: v["consensus_val_loss_per_seed"] for k, v in runs_h.items()},
                    "bytes_per_replica": {k: v["bytes_per_replica"] for k, v in runs_h.items()},
                }
                if "full" in avg_runs:
                    full = avg_runs["full"]
                    blk["gap_rel"], blk["gap_rel_per_seed"] = averaging_gaps(runs_h, full)
                    blk["consensus_gap_rel"] = averaging_gaps(runs_h, full, "consensus_val_loss")[0]
                    blk["avg_bytes_ratio"] = {
                        k: round(full["bytes_per_replica"] / v["bytes_per_replica"], 2) for k, v in runs_h.items()
                    }
                out["averaging_other_H"][str(h)] = blk
    out["settings"] = {
        "manifest": args.manifest,
        "model": {"d_model": m.model.d_model, "n_layers": m.model.n_layers, "n_heads": m.model.n_heads,
                  "seq_len": m.model.seq_len, "k": m.k, "params": count_parameters(build_model(m))},
        "smaller_than_default_model": args.d_model not in (0, 256) or args.seq_len != 128,
        "stages": S, "layout": [list(x) for x in m.stages.layout],
        "steps": args.steps, "batch_size": args.batch_size,
        "tokens_per_run": args.steps * args.batch_size * m.model.seq_len,
        "pipeline_seeds": list(range(args.seed, args.seed + args.seeds)),
        "pipeline_optim": {"name": m.optim.name, "lr": m.optim.lr, "betas": list(m.optim.betas),
                           "weight_decay": m.optim.weight_decay, "grad_clip": m.optim.grad_clip,
                           "schedule": m.schedule.kind, "warmup_steps": m.schedule.warmup_steps},
        "delays_per_stage": delays, "max_inflight": inflight, "gpipe_flush_every": flush,
        "lookahead_target": m.asyncmesh.lookahead_target,
        "lookahead_horizon": m.asyncmesh.lookahead_horizon,
        "gpipe_loss_runs": "delay 0 (synchronous), same batch per step as async",
        "replicas": args.replicas, "avg_fraction": args.avg_fraction, "avg_every": args.avg_every,
        "avg_latency_steps": args.avg_latency, "avg_blend_steps": blend_of(m, args), "avg_optim": args.avg_optim,
        "avg_seeds": list(range(args.seed, args.seed + max(1, args.avg_seeds))),
        "replica_data": "disjoint contiguous shards" if args.disjoint_shards else "independent samples of the corpus",
        "avg_correction": "first moments averaged on the same slice, delta scaled by beta^s (StalenessCorrection)",
        "avg_attack": args.avg_attack,
        "val_batches": args.val_batches, "seed": args.seed, "torch_threads": args.threads, "device": args.device,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
