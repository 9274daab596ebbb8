"""SENTINEL benchmark: detection quality, false positives, overhead and damage; one real swarm.

A three-stage pipeline (head, body, tail) whose middle stage has R replicas, some malicious
(default 3 of 8 = 37.5%: two insiders that turn at ``--attack-start`` plus one newcomer that joins
then and attacks from its first tensor; an honest newcomer joins at the same time). Replicas
share the body weights (as if perfectly averaged); each step one microbatch goes to the next
active replica (round robin). What a malicious replica sends — activations to the tail and
activation-gradients to the head — goes through the attack.

Part 1, detection (open loop, default model): ONE clean training run; at every step the honest
tensors are computed once, and every attack has its own pair of verifiers (tail: activations,
head: gradients) fed the honest tensors of honest replicas and the attacked tensors of
malicious ones. Precision / recall / F1 count tensors in the attack phase: a positive is a
tensor from a malicious replica, a detection is a rejection. ``delay_steps``: steps from the
attack start until a node (flags_to_ban flags among a sender's last 20 verdicts) bans a
malicious replica, averaged over them; ``delay_sends``: the same in that replica's own tensors.
The clean verifiers (body: activations from the head and gradients from the tail; tail and
head: honest replicas) give ``fpr`` over the whole run after warm-up, and ``overhead_frac``:
the body's two verifications per microbatch over the body's forward + backward time.
Accepted poison does not feed back into training here (that is part 2).

Part 2, damage (closed loop, ``--val-manifest``, default the tiny test model for time): the
same swarm trained three times — clean; under the strongest attack with SENTINEL (rejected
tensors dropped, the microbatch skipped, senders banned and routed around); under it without
SENTINEL (basic checks only) — and the validation loss of each.

Part 3, one real multi-process run (``--part real``, included in the default ``all``): a
loopback swarm of ``swarm-node run`` processes (``tests.helpers.attack_drill``, the scenario of
tests/test_sentinel_swarm.py) on ``--real-manifest`` with ``--real-replicas`` middle replicas, the
last of which joins with ``--attack`` = the strongest attack: when its neighbours ban it, what
share of the stage's microbatches it served after the ban, whether any honest peer was banned,
and the tail's steps and loss. Parts 1 and 2 simulate in one process; this one measures the node.

Part 4, clean (``--part clean``, not in ``all``): ``--clean-runs`` (default 5) real loopback swarms
with no attacker, one after the other — bootstrap, head, ``--clean-replicas`` honest body
replicas, tail, SENTINEL and averaging as ``--real-manifest`` ships them — each trained to
``--clean-steps`` tail steps. Every rejection is a false positive and every ban a false ban:
``clean_run`` reports them per run (false-positive rate, bans, averaging rounds applied), per
node (with the distances that rejected) and over the runs (the worst run's rate, runs with a
ban). ``--clean-horizons`` instead runs once per listed ``asyncmesh.lookahead_horizon``. Real
replicas differ (own data, own progress, averaging only a slice), which part 1's shared-weight
replicas cannot show.

Prints one JSON object. ``--quick``: test manifest, 4 replicas with 1 malicious, short runs, and
no real run unless ``--part real`` asks for it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from security import (  # noqa: E402
    ADAPTIVE_FAMILIES, ATTACKS, BanList, BasicVerifier, SentinelVerifier, ban_weight, make_attack,
)
from stages import (  # noqa: E402  # noqa: E402  # noqa: E402
    Batches,
    BlendedDelta,
    PartitionSchedule,
    build_optimizer,
    build_stage,
    lm_loss,
    load_corpus,
    load_manifest,  # noqa: E402
    lr_at,
    set_lr,
    snapshot,
    val_batches,
)

VARIANTS = {  # extra attack settings reported beside the defaults
    "delayed(noise=0.01)": ("delayed", {"noise": 0.01}),
    "adaptive(mode=mimic)": ("adaptive", {"mode": "mimic"}),
    "invisible(rel=0.1)": ("invisible", {"rel": 0.1}),
    "invisible(rel=0.3)": ("invisible", {"rel": 0.3}),
    "invisible(rel=0.5)": ("invisible", {"rel": 0.5}),
    "bias(scale=0.25)": ("bias", {"scale": 0.25}),
    "scaling(factor=1.5)": ("scaling", {"factor": 1.5}),
}
BAN_MEMORY = 20
# part 1's list: the attacks at their default strengths; the adaptive families are swept in
# strength against harm by --part harm
CLASSIC = tuple(a for a in ATTACKS if a not in ADAPTIVE_FAMILIES)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", default="default", help="run manifest for part 1 (name or path)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per microbatch in part 1")
    ap.add_argument("--steps", type=int, default=180, help="training steps in part 1")
    ap.add_argument("--attack-start", type=int, default=80, help="step the attacks begin (both parts)")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--malicious", type=int, default=3, help="of them malicious (one is a newcomer)")
    ap.add_argument("--kappa", type=float, default=None, help="fence width (default: the manifest's)")
    ap.add_argument("--warmup", type=int, default=None, help="SENTINEL warm-up (default: the manifest's)")
    ap.add_argument("--no-variants", action="store_true", help="skip the extra attack settings and the no-ids ablation")
    ap.add_argument("--val-manifest", default="test", help="run manifest for part 2")
    ap.add_argument("--val-steps", type=int, default=300)
    ap.add_argument("--val-batch-size", type=int, default=16,
                    help="sequences per microbatch in part 2 (0: the val manifest's)")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--strongest", default="adaptive", choices=sorted(ATTACKS),
                    help="attack for part 2; adaptive did the most damage without SENTINEL in a "
                    "--pick-strongest run (val loss +4.7%% vs clean on the test model)")
    ap.add_argument("--pick-strongest", action="store_true",
                    help="part 2 first trains once per attack without SENTINEL and uses the most damaging")
    ap.add_argument("--harm-steps", type=int, default=130, help="--part harm: training steps")
    ap.add_argument("--harm-start", type=int, default=80, help="--part harm: step the attacks begin")
    ap.add_argument("--harm-families", default="",
                    help="--part harm: comma list of families to sweep (default: all of HARM_FAMILIES and HARM_FIXED)")
    ap.add_argument("--harm-rows", type=int, default=1,
                    help="--part harm: sequences of each microbatch whose harm is measured (the tail's forward and "
                    "the head's backward per attacked tensor dominate the part's time)")
    ap.add_argument("--harm-off", default="pos",
                    help="--part harm: comma list of SENTINEL distances not judged (default: the verifier's own default, pos; "
                    "ablation e.g. pos,ctx,cum; 'none' judges them all)")
    ap.add_argument("--harm-lag", type=int, default=0,
                    help="--part harm: the lagged twin's weights are this many of its own steps old "
                    "(0: the manifest's asyncmesh.avg_every, the steps between two averaging rounds)")
    ap.add_argument("--harm-natural", choices=("pair", "lag"), default="pair",
                    help="--part harm: what the threshold is the median harm of. pair: two honest body replicas, "
                    "each training on its own microbatches and averaging a slice every asyncmesh.avg_every local "
                    "steps as the node does, judged against each other on the same microbatch (the replicas send "
                    "the honest traffic); lag: one body, against a twin whose weights are --harm-lag steps old. "
                    "Both are measured and printed either way")
    ap.add_argument("--part", choices=("all", "both", "detection", "damage", "real", "clean", "harm"), default="all",
                    help="all: detection, damage and the real run; both: detection and damage")
    ap.add_argument("--real-manifest", default="default",
                    help="run manifest of the real swarm (part 3); the test model's payloads (4 x 32 tokens) are too small for quiet statistics")
    ap.add_argument("--real-replicas", type=int, default=3, help="middle-stage replicas in part 3, one malicious")
    ap.add_argument("--real-attack", default=None, choices=sorted(ATTACKS),
                    help="attack in part 3 (default: --strongest)")
    ap.add_argument("--real-observe", type=float, default=50.0,
                    help="seconds watched after the ban in part 3 (under the 60-s first ban: longer, the attacker comes "
                    "back when it expires, serves a few microbatches and is banned again for 120 s)")
    ap.add_argument("--real-workdir", default="", help="keep part 3's logs here (default: a temp dir)")
    ap.add_argument("--clean-replicas", type=int, default=2,
                    help="--part clean: honest middle-stage replicas of a real swarm with no attacker")
    ap.add_argument("--clean-steps", type=int, default=200, help="--part clean: tail steps per run")
    ap.add_argument("--clean-runs", type=int, default=5,
                    help="--part clean: real clean swarms, one after the other (keys run1, run2, ...)")
    ap.add_argument("--clean-parallel", type=int, default=1,
                    help="--part clean: runs at once (each its own swarm; more load on the machine, so more stalls)")
    ap.add_argument("--clean-horizons", default="",
                    help="--part clean: instead of --clean-runs, one run per asyncmesh.lookahead_horizon value of this "
                    "comma list, a repeated value another run (keys pipeline, pipeline#2, ...)")
    ap.add_argument("--clean-node-args", default="",
                    help="--part clean: extra arguments for every node (e.g. '--no-averaging'), to find what "
                    "a false positive depends on")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (with more, the verifier's small ops are ~20x slower "
                    "on an oversubscribed CPU: spinning OpenMP workers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: test manifest, 4 replicas, short runs")
    args = ap.parse_args(argv)
    if args.quick:
        args.manifest, args.batch_size, args.steps, args.attack_start = "test", 4, 70, 30
        args.replicas, args.malicious = 4, 1
        args.val_steps, args.val_batches, args.val_batch_size, args.no_variants = 60, 2, 4, True
        args.harm_steps, args.harm_start = 50, 25
    if args.quick and args.part == "all":
        args.part = "both"
    if args.clean_runs < 1 or args.clean_parallel < 1:
        ap.error("--clean-runs and --clean-parallel must be at least 1")
    if args.real_replicas < 2:
        ap.error("--real-replicas must be at least 2 (one honest, one malicious)")
    if args.malicious < 1 or args.malicious >= args.replicas / 2:
        ap.error("--malicious must be at least 1 and a minority of --replicas")
    if not 0 < args.attack_start < args.steps:
        ap.error("--attack-start must lie inside the run")
    if not 0 < args.harm_start < args.harm_steps:
        ap.error("--harm-start must lie inside the run")
    return args


# ---------------------------------------------------------------------------------------- swarm


class Swarm:
    """Head, one shared body, tail, their optimizers, and who the body replicas are."""

    def __init__(self, manifest, batch_size: int, replicas: int, malicious: int, attack_start: int, seed: int):
        if manifest.n_stages != 3:
            manifest = manifest.replace(stages={"layout": _three_stage_layout(manifest.model.n_layers)})
        self.m = manifest
        torch.manual_seed(seed)
        self.stages = [build_stage(manifest, i) for i in range(3)]
        self.opts = [build_optimizer(manifest, s) for s in self.stages]
        corpus = load_corpus(manifest.data)
        self.batches = Batches(corpus.train, batch_size, manifest.model.seq_len, seed=manifest.run.seed + seed)
        self.val = val_batches(corpus.val, batch_size, manifest.model.seq_len, 8)
        self.replicas = [f"body-{i}" for i in range(replicas)]
        # insiders: honest until attack_start; newcomers (last two) join at attack_start
        self.newcomer_bad, self.newcomer_good = self.replicas[-1], self.replicas[-2]
        self.malicious = set(self.replicas[1:malicious]) | {self.newcomer_bad}
        self.attack_start = attack_start

    def active(self, step: int, banned=()) -> list[str]:
        late = {self.newcomer_bad, self.newcomer_good}
        return [r for r in self.replicas if (step >= self.attack_start or r not in late) and r not in banned]

    def route(self, step: int, banned=()) -> str | None:
        act = self.active(step, banned)
        return act[step % len(act)] if act else None

    def set_lr(self, step: int) -> float:
        lr = lr_at(self.m.schedule, self.m.optim.lr, step)
        for o in self.opts:
            set_lr(o, lr)
        return lr

    def clip_and_step(self, which) -> None:
        for i in which:
            torch.nn.utils.clip_grad_norm_(self.stages[i].parameters(), self.m.optim.grad_clip)
            self.opts[i].step()
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    @torch.no_grad()
    def val_loss(self, n: int) -> float:
        losses = []
        for ids in self.val[:n]:
            c = self.stages[0](None, ids)
            c = self.stages[1](c, ids)
            losses.append(float(lm_loss(self.stages[2](c, ids), ids)))
        return statistics.fmean(losses)


def _three_stage_layout(n_layers: int):
    a, b = n_layers // 3, 2 * n_layers // 3
    return ((0, max(1, a)), (max(1, a), max(2, b)), (max(2, b), n_layers))


def make_verifier(m, kappa, warmup, seed, off=None):
    s = m.sentinel
    overrides = {}
    if kappa is not None:
        overrides["kappa"] = kappa
    if warmup is not None:
        overrides["warmup"] = warmup
    cfg = type("Cfg", (), {f: overrides.get(f, getattr(s, f))
                           for f in ("beta_act", "beta_grad", "n_projections", "warmup", "window", "kappa")})
    extra = {} if off is None else {"off": tuple(off)}
    return SentinelVerifier.from_config(cfg, k=m.k, seq_len=m.model.seq_len, seed=seed, **extra)


# ---------------------------------------------------------------------------------------- metrics


class Tally:
    """Verdicts of one attack's verifiers in the attack phase, and when each sender got banned."""

    def __init__(self, m, attack_start: int):
        self.tp = self.fp = self.fn = self.tn = 0
        self.attack_start = attack_start
        self.bans = {d: BanList(flags_to_ban=m.sentinel.flags_to_ban, memory=max(BAN_MEMORY, m.sentinel.flags_to_ban))
                     for d in ("act", "grad")}
        self.margin = m.sentinel.ban_margin  # flags weighted as in the node (security.bans.flag_weight)
        self.first_ban: dict[str, int] = {}
        self.sends: dict[str, int] = {}
        self.ban_sends: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.by_dir = {"act": [0, 0], "grad": [0, 0]}  # malicious tensors: [rejected, seen]

    def add(self, sender: str, direction: str, malicious: bool, verdict, step: int) -> None:
        if step < self.attack_start:
            return
        rejected = not verdict.accept
        if malicious:
            self.tp += rejected
            self.fn += not rejected
            self.by_dir[direction][0] += rejected
            self.by_dir[direction][1] += 1
            if rejected:
                self.reasons[verdict.reason] = self.reasons.get(verdict.reason, 0) + 1
        else:
            self.fp += rejected
            self.tn += not rejected
        if direction == "act":
            self.sends[sender] = self.sends.get(sender, 0) + 1
        w = ban_weight(verdict, self.margin)
        if self.bans[direction].record(sender, rejected, float(step), weight=w) and sender not in self.first_ban:
            self.first_ban[sender] = step
            self.ban_sends[sender] = self.sends.get(sender, 0)

    def result(self, malicious: set[str]) -> dict:
        p = self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0
        r = self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        delays = [self.first_ban[s] - self.attack_start for s in malicious if s in self.first_ban]
        sends = [self.ban_sends[s] for s in malicious if s in self.ban_sends]
        return {
            "precision": round(p, 4), "recall": round(r, 4), "f1": round(f1, 4),
            "delay_steps": round(statistics.fmean(delays), 1) if len(delays) == len(malicious) else None,
            "delay_sends": round(statistics.fmean(sends), 1) if len(sends) == len(malicious) else None,
            "banned_malicious": sorted(s for s in malicious if s in self.first_ban),
            "banned_honest": sorted(s for s in self.first_ban if s not in malicious),
            "tensors": {"tp": self.tp, "fn": self.fn, "fp": self.fp, "tn": self.tn},
            "recall_by_direction": {d: round(r / n, 4) if n else None for d, (r, n) in self.by_dir.items()},
            "reasons": dict(sorted(self.reasons.items(), key=lambda kv: -kv[1])),
        }


# ---------------------------------------------------------------------------------------- part 1


def detection(args) -> dict:
    m = load_manifest(args.manifest)
    sw = Swarm(m, args.batch_size, args.replicas, args.malicious, args.attack_start, args.seed)
    m = sw.m
    settings = dict(kappa=args.kappa, warmup=args.warmup)
    clean = {name: make_verifier(m, seed=m.run.seed + i, **settings) for i, name in enumerate(("body", "tail", "head"))}
    clean_counts = {"body:act": [0, 0], "body:grad": [0, 0], "tail:act": [0, 0], "head:grad": [0, 0]}
    clean_bans = {p: BanList(flags_to_ban=m.sentinel.flags_to_ban, memory=BAN_MEMORY) for p in clean_counts}
    honest_banned = set()
    clean_rejections = []

    cases = {name: (name, {}, True) for name in CLASSIC}
    if not args.no_variants:
        cases.update({name: (a, kw, True) for name, (a, kw) in VARIANTS.items()})
        cases.update({f"{name}[no ids]": (name, {}, False) for name in CLASSIC})
    runs = {}
    for i, (case, (attack, kw, use_ids)) in enumerate(cases.items()):
        runs[case] = {
            "tail": make_verifier(m, seed=m.run.seed + 1, **settings),
            "head": make_verifier(m, seed=m.run.seed + 2, **settings),
            "ids": use_ids,
            "attack": {(r, d): make_attack(attack, start=args.attack_start, seed=1000 * i + j, direction=d, **kw)
                       for j, r in enumerate(sorted(sw.malicious)) for d in ("act", "grad")},
            "tally": Tally(m, args.attack_start),
        }

    t_body, t_verify, losses = [], [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        sw.set_lr(step)
        ids = sw.batches.batch(step)
        replica = sw.route(step)
        c0 = sw.stages[0](None, ids)
        x1 = c0.detach().requires_grad_()
        tb = time.perf_counter()
        c1 = sw.stages[1](x1, ids)
        tb = time.perf_counter() - tb
        x2 = c1.detach().requires_grad_()
        loss = lm_loss(sw.stages[2](x2, ids), ids)
        loss.backward()
        g2 = x2.grad
        tbb = time.perf_counter()
        c1.backward(g2)
        t_body.append(tb + time.perf_counter() - tbb)
        g1 = x1.grad
        c0.backward(g1)
        sw.clip_and_step(range(3))
        losses.append(loss.item())
        act, grad = c1.detach(), g1.detach()

        # clean verifiers: the body verifies what it receives (timed), tail and head the replicas
        tv = time.perf_counter()
        v_act = clean["body"].verify("head-0", "act", c0.detach(), step=step, ids=ids, mb=step)
        v_grad = clean["body"].verify("tail-0", "grad", g2, step=step, ids=ids, mb=step)
        t_verify.append(time.perf_counter() - tv)
        verdicts = {"body:act": ("head-0", v_act), "body:grad": ("tail-0", v_grad),
                    "tail:act": (replica, clean["tail"].verify(replica, "act", act, step=step, ids=ids, mb=step)),
                    "head:grad": (replica, clean["head"].verify(replica, "grad", grad, step=step, ids=ids, mb=step))}
        for point, (sender, v) in verdicts.items():
            if v.basis not in ("warmup", "basic"):
                clean_counts[point][0] += not v.accept
                clean_counts[point][1] += 1
                if not v.accept:
                    clean_rejections.append([step, point, v.reason, round(v.score, 2)])
                if clean_bans[point].record(sender, not v.accept, float(step), weight=ban_weight(v, m.sentinel.ban_margin)):
                    honest_banned.add(f"{point}:{sender}")

        # every attack case: its own verifiers see the honest tensors of honest replicas and the
        # attacked tensors of malicious ones; every attack instance observes the whole stream
        for case, run in runs.items():
            vids = ids if run["ids"] else None
            for direction, x, node in (("act", act, "tail"), ("grad", grad, "head")):
                for (r, d), atk in run["attack"].items():
                    if d == direction and r != replica:
                        atk.observe(x, step)
                bad = replica in sw.malicious
                sent = run["attack"][(replica, direction)](x, step, ids=ids) if bad else x
                v = run[node].verify(replica, direction, sent, step=step, ids=vids, mb=step)
                run["tally"].add(replica, direction, bad and step >= args.attack_start, v, step)
    elapsed = time.perf_counter() - t0

    attacks = {case: run["tally"].result(sw.malicious) for case, run in runs.items()}
    main = {k: v for k, v in attacks.items() if k in CLASSIC}
    rejected = sum(c[0] for c in clean_counts.values())
    judged = sum(c[1] for c in clean_counts.values())
    return {
        "attacks": main,
        "variants": {k: v for k, v in attacks.items() if k not in CLASSIC and not k.endswith("[no ids]")},
        "no_ids": {k[: -len("[no ids]")]: {"f1": v["f1"], "recall": v["recall"], "precision": v["precision"]}
                   for k, v in attacks.items() if k.endswith("[no ids]")},
        "fpr": round(rejected / judged, 5) if judged else None,
        "fpr_by_point": {p: round(c[0] / c[1], 5) if c[1] else None for p, c in clean_counts.items()},
        "fpr_tensors": judged,
        "clean_rejections": clean_rejections[:40],
        "honest_bans_clean": sorted(honest_banned),
        "overhead_frac": round(statistics.median(t_verify) / statistics.median(t_body), 5),
        "verify_ms_per_microbatch": round(1e3 * statistics.median(t_verify), 3),
        "body_fwd_bwd_ms": round(1e3 * statistics.median(t_body), 2),
        "train_loss_first_last": [round(losses[0], 3), round(statistics.fmean(losses[-10:]), 3)],
        "seconds": round(elapsed, 1),
        "settings": {
            "manifest": args.manifest, "d_model": m.model.d_model, "n_layers": m.model.n_layers, "k": m.k,
            "seq_len": m.model.seq_len, "batch_size": args.batch_size, "steps": args.steps,
            "attack_start": args.attack_start, "replicas": sw.replicas, "malicious": sorted(sw.malicious),
            "newcomers": {"malicious": sw.newcomer_bad, "honest": sw.newcomer_good},
            "sentinel": _sentinel_settings(clean["tail"]), "flags_to_ban": m.sentinel.flags_to_ban,
            "ban_memory": BAN_MEMORY,
        },
    }


def _sentinel_settings(v: SentinelVerifier) -> dict:
    p = v.sentinel.params
    return {f: getattr(p, f) for f in ("beta_act", "beta_grad", "n_projections", "warmup", "window", "kappa",
                                      "clip", "iqr_floor", "reject_weight", "beta_tok")}


# ---------------------------------------------------------------------------------------- harm

# Adaptive families swept in strength (security.attacks, docs/SENTINEL.md "Harm and the adaptive adversary"),
# the classic attacks swept where they have a strength, and the rest at their defaults.
HARM_FAMILIES = {
    "swap": ("fraction", (0.02, 0.1)),
    "ctxswap": ("fraction", (0.3, 1.0)),
    "rotate": ("angle", (0.2, 1.0)),
    "flip": ("fraction", (0.05, 0.3)),
    "drift": ("rate", (0.01,)),
    "coherent": ("rel", (0.3, 1.0)),
    "fence": ("margin", (0.9,)),
    "invisible": ("rel", (0.3, 1.0)),
    "bias": ("scale", (0.25,)),
    "scaling": ("factor", (1.5,)),
}
HARM_FIXED = ("constant", "zeros", "random", "negation", "sign_flip", "delayed", "adaptive", "mixed")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _centred_logits(tail, x, ids) -> torch.Tensor:
    """The tail's output for activations ``x``, logits centred per position (a constant shift of a
    position's logits changes no probability)."""
    with torch.no_grad():
        y = tail(x, ids).float()
    return y - y.mean(-1, keepdim=True)


class HarmTally:
    """One attack setting: per malicious tensor its harm and verdict; when each sender is first
    banned (either direction: the head stops routing to a replica either node bans); honest
    tensors' rejections."""

    def __init__(self, m, start: int):
        self.start = start
        self.bans = {d: BanList(flags_to_ban=m.sentinel.flags_to_ban, memory=max(BAN_MEMORY, m.sentinel.flags_to_ban))
                     for d in ("act", "grad")}
        self.margin = m.sentinel.ban_margin
        self.banned_at: dict[str, int] = {}
        self.rows: list[tuple[str, str, bool, float, bool]] = []  # sender, direction, rejected, harm, before its ban
        self.fp = self.judged_honest = 0
        self.reasons: dict[str, int] = {}
        self.honest_reasons: dict[str, int] = {}
        self.binding: dict[str, int] = {}  # per accepted malicious tensor: the distance nearest its fence

    def add(self, sender: str, direction: str, malicious: bool, verdict, step: int, harm: float | None,
            fences: dict[str, float] | None = None) -> None:
        if step < self.start:
            return
        rejected = not verdict.accept
        if malicious:
            self.rows.append((sender, direction, rejected, harm, sender not in self.banned_at))
            if rejected:
                self.reasons[verdict.reason] = self.reasons.get(verdict.reason, 0) + 1
            elif fences:
                ratios = {n: v / fences[n] for n, v in verdict.distances.items()
                          if n in fences and 0 < fences[n] < math.inf and math.isfinite(v)}
                if ratios:
                    name = f"{direction}:{max(ratios, key=ratios.get)}"
                    self.binding[name] = self.binding.get(name, 0) + 1
        else:
            self.fp += rejected
            self.judged_honest += 1
            if rejected:
                self.honest_reasons[verdict.reason] = self.honest_reasons.get(verdict.reason, 0) + 1
        if self.bans[direction].record(sender, rejected, float(step), weight=ban_weight(verdict, self.margin)):
            self.banned_at.setdefault(sender, step)

    def result(self, malicious: set[str]) -> dict:
        out = {"harm": {}, "recall": {}, "under_fence": {}, "accepted_harm_max": {}}
        for d in ("act", "grad"):
            rows = [r for r in self.rows if r[1] == d]
            harms = [r[3] for r in rows]
            out["harm"][d] = round(statistics.median(harms), 5) if harms else None
            out["recall"][d] = round(sum(r[2] for r in rows) / len(rows), 4) if rows else None
            # what got through before a ban: the largest harm of one accepted tensor
            acc = [r[3] for r in rows if not r[2] and r[4]]
            out["accepted_harm_max"][d] = round(max(acc), 5) if acc else 0.0
            # the harm an attacker did without ever being banned: per unbanned sender the median
            # harm of its accepted tensors (rejected ones are dropped: no harm), the largest
            unb = []
            for s in malicious:
                if s in self.banned_at:
                    continue
                mine = [r for r in rows if r[0] == s]
                got = [r[3] for r in mine if not r[2]]
                if mine:
                    unb.append(statistics.median([r[3] if not r[2] else 0.0 for r in mine]) if got else 0.0)
            out["under_fence"][d] = round(max(unb), 5) if unb else 0.0
        out["banned"] = sorted(s for s in malicious if s in self.banned_at)
        out["ban_delay_steps"] = {s: self.banned_at[s] - self.start for s in sorted(malicious) if s in self.banned_at}
        out["honest_rejected"] = [self.fp, self.judged_honest, self.honest_reasons]
        out["reasons"] = dict(sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        out["binding"] = dict(sorted(self.binding.items(), key=lambda kv: -kv[1]))
        return out


def harm_cases(selected: str) -> dict[str, tuple[str, str, dict]]:
    """setting name -> (family, attack, params)."""
    want = [f for f in selected.split(",") if f] or [*HARM_FAMILIES, *HARM_FIXED]
    cases = {}
    for fam in want:
        if fam in HARM_FAMILIES:
            param, values = HARM_FAMILIES[fam]
            for v in values:
                cases[f"{fam}({param}={v})"] = (fam, fam, {param: v})
        elif fam in ATTACKS:
            cases[fam] = (fam, fam, {})
        else:
            raise SystemExit(f"--harm-families: unknown family {fam!r}")
    return cases


class ReplicaPair:
    """Two honest replicas of the body for the harm part: the same start (a joiner copies its
    replica's state), each trained on the microbatches routed to it with its own optimizer, a
    slice of ``asyncmesh.avg_fraction`` of their parameters averaged each time one of them has
    taken ``asyncmesh.avg_every`` local steps (``stages.PartitionSchedule``, the node's slices;
    in-process the round completes at once, and the optimizer moments are not averaged), its
    delta spread over ``asyncmesh.avg_blend_steps`` of each replica's own steps as the node does
    (``stages.BlendedDelta``)."""

    def __init__(self, m, body, opt):
        import copy

        twin = copy.deepcopy(body)
        self.m, self.bodies, self.opts = m, [body, twin], [opt, build_optimizer(m, twin)]
        self.params = [list(b.parameters()) for b in self.bodies]
        self.schedule = PartitionSchedule([p.shape for p in self.params[0]], m.asyncmesh.avg_fraction, m.run.seed)
        self.local, self.rounds = [0, 0], 0
        self.blends = [BlendedDelta(m.asyncmesh.avg_blend_steps) for _ in self.bodies]

    def set_lr(self, lr: float) -> None:
        set_lr(self.opts[1], lr)  # opts[0] is the swarm's body optimizer, set with the others

    def stepped(self, j: int) -> None:
        self.local[j] += 1
        self.blends[j].step(self.params[j])
        if self.local[j] % self.m.asyncmesh.avg_every:
            return
        idx, part = self.schedule.indices(self.rounds), self.schedule.partition(self.rounds)
        for params, blend in zip(self.params, self.blends):
            blend.before_snapshot(params, part)
        snaps = [snapshot(params, idx) for params in self.params]
        for params, snap, blend in zip(self.params, snaps, self.blends):  # the node's apply, a round that took 0 steps
            blend.add(params, idx, snap, (snaps[0] + snaps[1]) / 2, partition=part)
        self.rounds += 1


def harm(args) -> dict:
    """Detection against harm. One clean training run (as part 1); the harm of a tensor a
    malicious replica sends is what it does to its receiver compared with the honest tensor of
    the same microbatch: for activations, the relative change of the tail's (centred) logits; for
    gradients, the relative change of the head's parameter gradient. The honest replicas'
    natural harm is the same measure between two honest replicas (``--harm-natural pair``, the
    default: ``ReplicaPair``, the body replicas alternate by sender, each sender's tensors
    computed by its replica) or against a twin whose weights are ``lag`` steps old (``lag``: one
    body); its median per direction is the threshold. Both are printed."""
    m = load_manifest(args.manifest)
    sw = Swarm(m, args.batch_size, args.replicas, args.malicious, args.harm_start, args.seed)
    m = sw.m
    lag = args.harm_lag or m.asyncmesh.avg_every
    head, body, tail = sw.stages
    pair = ReplicaPair(m, body, sw.opts[1]) if args.harm_natural == "pair" else None
    bodies = pair.bodies if pair else [body]
    side = {r: i % len(bodies) for i, r in enumerate(sw.replicas)}  # which body computes a sender's tensors
    twin = build_stage(m, 1)
    snaps = [collections.deque(maxlen=lag + 1) for _ in bodies]
    head_params = [p for p in head.parameters() if p.requires_grad]
    settings = dict(kappa=args.kappa, warmup=args.warmup, off=[o for o in args.harm_off.split(",") if o and o != "none"])
    cases = harm_cases(args.harm_families)
    runs = {}
    for i, (case, (fam, attack, kw)) in enumerate(cases.items()):
        run = {"tail": make_verifier(m, seed=m.run.seed + 1, **settings),
               "head": make_verifier(m, seed=m.run.seed + 2, **settings),
               "tally": HarmTally(m, args.harm_start), "family": fam, "ids": None}
        atk = {}
        for j, r in enumerate(sorted(sw.malicious)):
            for d, node in (("act", "tail"), ("grad", "head")):
                extra = {}
                if attack == "fence":  # white-box: the receiver's own verdict, without learning
                    extra["oracle"] = (lambda t, run=run, r=r, d=d, node=node:
                                       run[node].sentinel.judge(r, d, t, ids=run["ids"], commit=False).score)
                    extra["steps"] = 6
                atk[(r, d)] = make_attack(attack, start=args.harm_start, seed=1000 * i + j, direction=d, **kw, **extra)
        run["attack"] = atk
        runs[case] = run

    natural = {"pair": {"act": [], "grad": []}, "lag": {"act": [], "grad": []}}
    t0 = time.perf_counter()
    for step in range(args.harm_steps):
        lr = sw.set_lr(step)
        if pair:
            pair.set_lr(lr)
        ids = sw.batches.batch(step)
        replica = sw.route(step)
        j = side[replica]
        c0 = head(None, ids)
        x1 = c0.detach().requires_grad_()
        c1 = bodies[j](x1, ids)
        x2 = c1.detach().requires_grad_()
        logits = tail(x2, ids)
        loss = lm_loss(logits, ids)
        loss.backward()
        g2 = x2.grad
        c1.backward(g2)
        g1 = x1.grad
        act, grad = c1.detach(), g1.detach()
        attacked = step >= args.harm_start
        if attacked:
            # harm is measured on the first `harm_rows` sequences of the microbatch (rows are
            # independent through every stage), with a graph of the head on those rows only
            R = min(args.harm_rows, ids.shape[0])
            ids_r = ids[:R]
            c0r = head(None, ids_r)
            y_honest = (logits.detach()[:R] - logits.detach()[:R].mean(-1, keepdim=True)).float()

            def head_grad(g):
                gs = torch.autograd.grad(c0r, head_params, g[:R], retain_graph=True)
                return torch.cat([t.reshape(-1) for t in gs])

            h_honest = head_grad(grad)
            # honest others on the same rows: the other replica now, and this one `lag` steps ago
            twin.load_state_dict(snaps[j][0])
            for kind, other in (("pair", bodies[1 - j] if pair else None), ("lag", twin)):
                if other is None:
                    continue
                xt = c0.detach()[:R].requires_grad_()
                ct = other(xt, ids_r)
                at = ct.detach().requires_grad_()
                lt = lm_loss(tail(at, ids_r), ids_r)
                (g2t,) = torch.autograd.grad(lt, at)
                (g1t,) = torch.autograd.grad(ct, xt, g2t * (R / ids.shape[0]))  # the loss is a mean over B rows
                natural[kind]["act"].append(_rel(_centred_logits(tail, at.detach(), ids_r), y_honest))
                natural[kind]["grad"].append(_rel(head_grad(g1t), h_honest))
        for case, run in runs.items():
            run["ids"] = ids
            for direction, x, node in (("act", act, "tail"), ("grad", grad, "head")):
                for (r, d), atk in run["attack"].items():
                    if d == direction and r != replica:
                        atk.ids = ids
                        with torch.no_grad():
                            atk.observe(x, step)
                bad = replica in sw.malicious
                sent = run["attack"][(replica, direction)](x, step, ids=ids) if bad else x
                v = run[node].verify(replica, direction, sent, step=step, ids=ids, mb=step)
                h = None
                if bad and attacked:
                    h = (_rel(_centred_logits(tail, sent[:R], ids_r), y_honest) if direction == "act"
                         else _rel(head_grad(sent), h_honest))
                run["tally"].add(replica, direction, bad and attacked, v, step, h,
                                 run[node].sentinel.fences(direction) if bad and attacked and v.accept else None)
        c0.backward(g1)
        for stage, opt in ((head, sw.opts[0]), (bodies[j], pair.opts[j] if pair else sw.opts[1]), (tail, sw.opts[2])):
            torch.nn.utils.clip_grad_norm_(stage.parameters(), m.optim.grad_clip)
            opt.step()
        for opt in [*sw.opts, *(pair.opts if pair else ())]:
            opt.zero_grad(set_to_none=True)
        snaps[j].append({k: v.detach().clone() for k, v in bodies[j].state_dict().items()})
        if pair:
            pair.stepped(j)
        if step % 10 == 0:
            print(f"bench_sentinel harm: step {step} loss {loss.item():.3f} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    basis = natural[args.harm_natural]
    thr = {d: statistics.median(basis[d]) for d in basis}
    settings_out, families = {}, {}
    fp = judged = 0
    for case, run in runs.items():
        r = run["tally"].result(sw.malicious)
        fp += r["honest_rejected"][0]
        judged += r["honest_rejected"][1]
        settings_out[case] = r
        fam = families.setdefault(run["family"], {"under_fence": {"act": 0.0, "grad": 0.0}, "settings": [],
                                                  "recall_above_threshold": {"act": None, "grad": None},
                                                  "ok": True})
        fam["settings"].append(case)
        for d in ("act", "grad"):
            fam["under_fence"][d] = max(fam["under_fence"][d], r["under_fence"][d])
            if r["harm"][d] is not None and r["harm"][d] > thr[d]:
                prev = fam["recall_above_threshold"][d]
                fam["recall_above_threshold"][d] = r["recall"][d] if prev is None else min(prev, r["recall"][d])
                if r["recall"][d] < 0.9:
                    fam["ok"] = False
            if r["under_fence"][d] > thr[d]:
                fam["ok"] = False
    q = lambda v, p: round(sorted(v)[min(len(v) - 1, int(p * len(v)))], 5) if v else None  # noqa: E731
    return {
        "threshold": {d: round(v, 5) for d, v in thr.items()},
        "threshold_basis": args.harm_natural,
        "natural_harm": {kind: {d: {"median": q(v[d], 0.5), "p10": q(v[d], 0.1), "p90": q(v[d], 0.9),
                                    "max": q(v[d], 1.0)} for d in v}
                         for kind, v in natural.items() if v["act"]},
        "families": families,
        "settings": settings_out,
        "fpr": round(fp / judged, 5) if judged else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "settings_used": {"manifest": args.manifest, "batch_size": args.batch_size, "steps": args.harm_steps,
                          "attack_start": args.harm_start, "replicas": sw.replicas, "harm_rows": args.harm_rows,
                          "malicious": sorted(sw.malicious), "lag": lag, "natural": args.harm_natural,
                          "body_replicas": len(bodies), "averaging_rounds": pair.rounds if pair else 0,
                          "avg_every": m.asyncmesh.avg_every, "avg_fraction": m.asyncmesh.avg_fraction,
                          "harm": "act: |Δ centred tail logits| / |tail logits|; grad: |Δ head param grad| / |head param grad|",
                          "sentinel": _sentinel_settings(runs[next(iter(runs))]["tail"]),
                          "flags_to_ban": m.sentinel.flags_to_ban, "off": settings["off"]},
    }


# ---------------------------------------------------------------------------------------- part 2


def train_closed_loop(args, attack: str | None, sentinel: bool) -> dict:
    """Train the swarm on the val manifest; malicious replicas attack from ``attack_start``."""
    m = load_manifest(args.val_manifest)
    bs = args.val_batch_size or m.data.batch_size
    start = min(args.attack_start, args.val_steps // 4)
    sw = Swarm(m, bs, args.replicas, args.malicious, start, args.seed)
    m = sw.m
    if sentinel:
        v_tail = make_verifier(m, args.kappa, args.warmup, m.run.seed + 1)
        v_head = make_verifier(m, args.kappa, args.warmup, m.run.seed + 2)
    else:
        v_tail = v_head = BasicVerifier(m.k, seq_len=m.model.seq_len)
    # bans last 20 steps, doubling per repeat (time is counted in steps here)
    bans = BanList(flags_to_ban=m.sentinel.flags_to_ban, memory=BAN_MEMORY, base_s=20, max_s=10 * args.val_steps)
    atk = {(r, d): make_attack(attack, start=start, seed=j, direction=d) for j, r in enumerate(sorted(sw.malicious))
           for d in ("act", "grad")} if attack else {}
    dropped = skipped = 0
    banned_at: dict[str, list[int]] = {}
    for step in range(args.val_steps):
        sw.set_lr(step)
        ids = sw.batches.batch(step)
        banned = set(bans.banned(float(step)))
        replica = sw.route(step, banned)
        if replica is None:  # every replica banned: nothing to train this step
            skipped += 1
            continue
        c0 = sw.stages[0](None, ids)
        x1 = c0.detach().requires_grad_()
        c1 = sw.stages[1](x1, ids)
        act = c1.detach()
        bad = attack is not None and replica in sw.malicious and step >= start
        if bad:
            act = atk[(replica, "act")](act, step, ids=ids)
        v = v_tail.verify(replica, "act", act, step=step, ids=ids, mb=step)
        _flag(bans, replica, v, step, banned_at, m.sentinel.ban_margin)
        if not v.accept:  # dropped; the microbatch is skipped
            dropped += 1
            sw.clip_and_step(())
            continue
        x2 = act.clone().requires_grad_()
        loss = lm_loss(sw.stages[2](x2, ids), ids)
        loss.backward()
        update = [2]
        c1.backward(x2.grad)
        grad = x1.grad
        if bad:  # a malicious replica's own weights are its business: the shared body learns nothing
            for p in sw.stages[1].parameters():
                p.grad = None
        else:
            update.append(1)
        if bad:
            grad = atk[(replica, "grad")](grad, step, ids=ids)
        vg = v_head.verify(replica, "grad", grad, step=step, ids=ids, mb=step)
        _flag(bans, replica, vg, step, banned_at, m.sentinel.ban_margin)
        if vg.accept:
            c0.backward(grad)
            update.append(0)
        else:
            dropped += 1
        sw.clip_and_step(update)
    return {"val_loss": round(sw.val_loss(args.val_batches), 4), "dropped": dropped, "no_replica_steps": skipped,
            "banned_at_step": dict(sorted(banned_at.items())), "malicious": sorted(sw.malicious), "attack_start": start}


def _flag(bans: BanList, replica: str, verdict, step: int, banned_at: dict, margin: float) -> None:
    if bans.record(replica, not verdict.accept, float(step), weight=ban_weight(verdict, margin)):
        banned_at.setdefault(replica, []).append(step)


def damage(args) -> dict:
    t0 = time.perf_counter()
    out = {"settings": {"manifest": args.val_manifest, "steps": args.val_steps, "replicas": args.replicas,
                        "malicious": args.malicious}}
    strongest = args.strongest
    if args.pick_strongest:
        trial = {a: train_closed_loop(args, a, sentinel=False)["val_loss"] for a in ATTACKS}
        out["without_sentinel_by_attack"] = trial
        strongest = max(trial, key=trial.get)
    clean = train_closed_loop(args, None, sentinel=True)
    with_s = train_closed_loop(args, strongest, sentinel=True)
    without = train_closed_loop(args, strongest, sentinel=False)
    out.update({
        "attack": strongest,
        "clean": clean["val_loss"],
        "attacked_with_sentinel": with_s["val_loss"],
        "attacked_without_sentinel": without["val_loss"],
        "with_sentinel_vs_clean": round(with_s["val_loss"] / clean["val_loss"] - 1, 4),
        "detail": {"clean": clean, "attacked_with_sentinel": with_s, "attacked_without_sentinel": without},
        "seconds": round(time.perf_counter() - t0, 1),
    })
    return out


# ---------------------------------------------------------------------------------------- part 3


def real_run(args) -> dict:
    """One real loopback swarm (tests.helpers.attack_drill); its processes use one torch thread each."""
    import shutil
    import tempfile

    from tests.helpers.attack_drill import run_attack_drill

    attack = args.real_attack or args.strongest
    workdir = Path(args.real_workdir or tempfile.mkdtemp(prefix="bench-sentinel-real-"))
    # The SENTINEL settings of --manifest (stages/runs/default.toml, or --warmup / --kappa), not the
    # test manifest's short warm-up of 4 (there for fast tests): with it the tail falsely banned an
    # honest replica of three in the first seconds of a real run.
    shipped = load_manifest(args.manifest).sentinel
    sentinel = {"warmup": args.warmup if args.warmup is not None else shipped.warmup,
                "kappa": args.kappa if args.kappa is not None else shipped.kappa}
    r = run_attack_drill(workdir, attack=attack, honest=args.real_replicas - 1, manifest=args.real_manifest,
                         sentinel=sentinel, observe_s=args.real_observe, ban_timeout_s=90.0, ready_timeout_s=180.0,
                         progress=lambda msg: print(f"bench_sentinel real: {msg}", file=sys.stderr, flush=True))
    keep = ("steps", "time_to_ban_s", "steps_to_ban", "honest_banned", "malicious_share_after_ban", "loss_start",
            "loss_end")
    out = {k: r.get(k) for k in keep}
    out["detail"] = {k: v for k, v in r.items() if k not in keep}
    out["settings"] = {"manifest": args.real_manifest, "replicas": args.real_replicas, "malicious": 1,
                       "attack": attack, "observe_s": args.real_observe, "processes": "bootstrap + 1 per node",
                       "torch_threads_per_node": 1}
    if not args.real_workdir and all(c == 0 for c in r["exit_codes"].values()):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        out["settings"]["logs"] = str(workdir)
    return out


VERDICTS = "swarm_node_verifier_verdicts_total"
STOP = threading.Event()  # set on SIGTERM: clean runs in worker threads stop and close their swarms


def clean_summary(metrics: dict[str, dict[str, float]]) -> dict:
    """False positives of a swarm whose every peer is honest, from each node's /metrics:
    per node the tensors judged, rejected (by distance) and peers banned; over all nodes the
    rejected share (``fpr``) and the bans (every one a false ban)."""
    from node.ops import metric_sum

    per_node, judged, rejected, bans = {}, 0.0, 0.0, 0.0
    for name, mt in metrics.items():
        acc = metric_sum(mt, VERDICTS, verdict="accept")
        rej = metric_sum(mt, VERDICTS, verdict="reject")
        reasons: dict[str, float] = {}
        for key, v in mt.items():
            if key.startswith(VERDICTS + "{") and 'verdict="reject"' in key and v:
                reason = key.split('reason="', 1)[1].split('"', 1)[0]
                reasons[reason] = reasons.get(reason, 0.0) + v
        b = metric_sum(mt, "swarm_node_bans_total")
        per_node[name] = {"steps": mt.get("swarm_node_steps_total"), "judged": int(acc + rej),
                          "rejected": int(rej), "fpr": round(rej / (acc + rej), 5) if acc + rej else None,
                          "reject_reasons": reasons, "bans": int(b)}
        judged, rejected, bans = judged + acc + rej, rejected + rej, bans + b
    return {"fpr": round(rejected / judged, 5) if judged else None, "judged": int(judged),
            "rejected": int(rejected), "false_bans": int(bans), "per_node": per_node}


def clean_run(args, horizon: str | None, tag: str = "") -> dict:
    """A real loopback swarm with no attacker (bootstrap, head, ``--clean-replicas`` body
    replicas, tail; SENTINEL as the manifest ships it) trained to ``--clean-steps`` tail steps:
    every rejection is a false positive and every ban a false ban."""
    import tempfile

    from node.ops import AVERAGING_OUTCOMES, LocalSwarm, metric_sum, write_manifest

    m = load_manifest(args.real_manifest)
    if horizon:
        m = m.replace(asyncmesh={"lookahead_horizon": horizon})
    workdir = Path(args.real_workdir or tempfile.mkdtemp(prefix="bench-sentinel-clean-"))
    workdir = workdir / f"clean-{m.asyncmesh.lookahead_horizon}{tag}"
    workdir.mkdir(parents=True, exist_ok=True)
    # the nodes append to their JSON logs (an operator's restart keeps its history): a rerun into
    # the same --real-workdir starts them afresh, so one run's logs hold that run only
    for stale in [*workdir.glob("*.steps.jsonl"), *workdir.glob("*.verdicts.jsonl")]:
        stale.unlink()
    path = write_manifest(m, workdir / "manifest.toml")
    t0 = time.monotonic()
    with LocalSwarm(str(path), workdir=workdir) as sw:
        sw.start_bootstrap()
        # each node's per-step JSON log (look-ahead steps and distance, step period) and its
        # per-verdict log (every distance, those over their fences) beside its stderr log: what a
        # replica's weights did when a verifier flagged it, and what the verifier saw
        def start(stage: int, name: str):
            return sw.start_node(stage, name, extra=["--json-log", str(workdir / f"{name}.steps.jsonl"),
                                                     "--verdict-log", str(workdir / f"{name}.verdicts.jsonl"),
                                                     *shlex.split(args.clean_node_args)])

        nodes = [start(0, "head"), *(start(1, f"body{i}") for i in range(args.clean_replicas)), start(2, "tail")]
        sw.wait_ready(timeout=180)
        deadline = time.monotonic() + 60 + 10 * args.clean_steps
        bodies, gap_max = nodes[1:-1], 0
        while time.monotonic() < deadline and not STOP.is_set() and not any(n.proc.poll() is not None for n in nodes):
            # how evenly the head's router splits the work between the body replicas
            steps = [sw.value(b, "swarm_node_steps_total") for b in bodies]
            gap_max = max(gap_max, int(max(steps) - min(steps)))
            if sw.value(nodes[-1], "swarm_node_steps_total") >= args.clean_steps:
                break
            time.sleep(2)
        metrics = {n.name: sw.metrics(n) for n in nodes}
        exit_codes = sw.close()
    out = clean_summary(metrics)
    out["body_steps"] = [metrics[b.name].get("swarm_node_steps_total") for b in bodies]
    out["averaging_rounds_applied"] = [int(metric_sum(metrics[b.name], "swarm_node_averaging_rounds_total",
                                                      outcome="applied")) for b in bodies]
    # every averaging outcome per body replica (started, applied, failed, skipped_busy, ...)
    out["averaging_rounds"] = [{o: int(v) for o in AVERAGING_OUTCOMES
                                if (v := metric_sum(metrics[b.name], "swarm_node_averaging_rounds_total", outcome=o))}
                               for b in bodies]
    out["body_step_gap_max"] = gap_max
    out["loss_ema"] = metrics["tail"].get("swarm_node_loss_ema")
    out["settings"] = {"manifest": args.real_manifest, "lookahead_horizon": m.asyncmesh.lookahead_horizon,
                       "node_args": args.clean_node_args, "parallel_runs": args.clean_parallel,
                       "replicas": args.clean_replicas, "steps": args.clean_steps,
                       "sentinel": {"warmup": m.sentinel.warmup, "kappa": m.sentinel.kappa,
                                    "flags_to_ban": m.sentinel.flags_to_ban},
                       "wall_s": round(time.monotonic() - t0), "exit_codes": exit_codes, "logs": str(workdir)}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like an exception, so every `with LocalSwarm(...)` stops its nodes
    def on_sigterm(signum, frame):
        STOP.set()  # parallel clean runs poll it from their threads
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    det = detection(args) if args.part in ("all", "both", "detection") else None
    dmg = damage(args) if args.part in ("all", "both", "damage") else None
    real = real_run(args) if args.part in ("all", "real") else None
    hrm = harm(args) if args.part == "harm" else None
    clean = None
    if args.part == "clean":
        clean = {}
        if args.clean_horizons:
            runs = collections.Counter()
            for h in [h for h in args.clean_horizons.split(",") if h]:
                key = h  # a horizon named again is another run: keys "pipeline", "pipeline#2", ...
                runs[key] += 1
                n = runs[key]
                clean[key if n == 1 else f"{key}#{n}"] = clean_run(args, h, "" if n == 1 else f"-{n}")
        else:
            from concurrent.futures import ThreadPoolExecutor

            def one(n: int) -> dict:
                r = clean_run(args, None, f"-run{n}")
                print(f"bench_sentinel clean: run {n} of {args.clean_runs}: fpr {r['fpr']}, bans {r['false_bans']}",
                      file=sys.stderr, flush=True)
                return r

            with ThreadPoolExecutor(max(1, args.clean_parallel)) as pool:
                done = list(pool.map(one, range(1, args.clean_runs + 1)))
            clean = {f"run{n}": r for n, r in enumerate(done, 1)}
    result = {
        "attacks": det.pop("attacks") if det else None,
        "fpr": det.pop("fpr") if det else None,
        "overhead_frac": det.pop("overhead_frac") if det else None,
        "val_loss": {k: dmg[k] for k in ("clean", "attacked_with_sentinel", "attacked_without_sentinel")} if dmg else None,
        "val_loss_attack": dmg["attack"] if dmg else None,
        "real_run": real,
        "clean_run": clean,
        "harm": hrm,
        "targets_met": {},
        "detection": det,
        "damage": dmg,
        "quick": args.quick,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if det:
        result["targets_met"].update({
            "f1>=0.9": {k: v["f1"] >= 0.9 for k, v in result["attacks"].items()},
            "fpr<=0.01": result["fpr"] is not None and result["fpr"] <= 0.01,
            "overhead_frac<=0.05": result["overhead_frac"] <= 0.05,
        })
    if dmg:
        vl = result["val_loss"]
        result["targets_met"]["with_sentinel_within_2pct"] = (
            math.isfinite(vl["attacked_with_sentinel"]) and vl["attacked_with_sentinel"] <= 1.02 * vl["clean"])
    if real:
        result["targets_met"]["real_run_banned_no_honest"] = (
            real["time_to_ban_s"] is not None and real["honest_banned"] == 0
            and real["malicious_share_after_ban"] == 0.0)
    if clean:
        fprs = [r["fpr"] for r in clean.values()]
        result["clean_summary"] = {
            "runs": len(clean), "fpr_per_run": fprs, "false_bans_per_run": [r["false_bans"] for r in clean.values()],
            "fpr_max": max(f for f in fprs if f is not None) if any(f is not None for f in fprs) else None,
            "fpr_pooled": round(sum(r["rejected"] for r in clean.values())
                                / max(1, sum(r["judged"] for r in clean.values())), 5),
            "runs_with_a_ban": sum(1 for r in clean.values() if r["false_bans"]),
            "averaging_rounds_applied_per_run": [r["averaging_rounds_applied"] for r in clean.values()],
        }
        result["targets_met"].update({
            "clean_fpr<=0.005_every_run": all(f is not None and f <= 0.005 for f in fprs),
            "clean_no_honest_ban": result["clean_summary"]["runs_with_a_ban"] == 0,
            "clean_averaging_on": all(min(r["averaging_rounds_applied"], default=0) > 0 for r in clean.values()),
        })
    if hrm:
        result["targets_met"]["harm_every_family"] = {f: v["ok"] for f, v in hrm["families"].items()}
    result["part"] = args.part
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
