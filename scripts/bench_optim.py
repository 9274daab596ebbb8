"""Benchmark: NuMuon vs Muon vs AdamW (compressibility), and architecture warm-up vs baseline (stability).

Prints ONE JSON object:

- ``val_loss``: validation loss of ``adamw``, ``muon``, ``numuon`` after the same number of
  steps on the same batches (equal tokens), and ``numuon_vs_muon`` (ratio); means over
  ``--optim-seeds`` (each seed: its own initialisation and data order), every run in
  ``optim_per_seed``.
- ``trunc_loss_increase``: after training, every hidden matrix (the ones Muon orthogonalises)
  is replaced by its best rank-⌈f·min(m, n)⌉ approximation (SVD) for f = 0.25 and 0.5; the
  increase in validation loss, per optimizer and fraction. ``trunc_by_kind``: the same with only
  one kind of matrix truncated (``qkv_proj``, ``out_proj``, ...). ``weight_tail_energy``: the mean
  share of a hidden matrix's squared Frobenius norm that the truncation removes (no loss in it,
  so far less noisy than the loss increase). ``targets``: the two optimizer targets (docs/TRAINING.md),
  judged on the means, and on how many seeds NuMuon's increase is below the other's at both
  fractions.
- ``warmup``: architecture warm-up (stages/warmup.py, ``default_warmup_schedule``: layers 0, k,
  2k, … active from step 0 (``--warmup-keep-every k``, default 8: 3 of 24 layers), the others
  locked and unlocked in ``--warmup-groups`` groups (default 7), one every ``--unlock-every``
  steps after the LR warm-up ends) against the same AdamW run with all blocks active from step 0
  (baseline), on a deeper, narrower model: d=32, 24 layers, **post-norm** blocks by default
  (``model.block_norm = "post"``, which needs a dense run: ``subspace.enabled = false``;
  ``--warmup-block-norm pre`` gives the Subspace pre-norm model, k = 4) and no LR warm-up in
  either run (papers §5: arch warm-up can replace it). ``--warmup-preset wide`` is the GPU
  setting: d=256, 50 LR warm-up steps, 400 steps, batch 16 x 128 (the baseline blows up after
  the LR peak, docs/TRAINING.md). The peak ``lr`` is chosen by a sweep on the baseline only
  (``how_lr_chosen``, ``lr_sweep``): the smallest lr at which it fails to train on every seed
  (``settings.fail_rule``), then both are run on every seed.
  ``baseline_spikes`` / ``warmup_spikes`` (spike events of the training loss summed over seeds,
  definition in ``settings.spike_rule``), ``baseline_stalled`` / ``warmup_stalled`` (seeds whose
  run ended no better than the unigram predictor, ``settings.stall_rule``, ``unigram_val_loss``),
  ``baseline_unrecovered_spikes`` / ``warmup_unrecovered_spikes`` (seeds with a spike event not
  recovered from within 50 steps), ``baseline_failed`` / ``warmup_failed`` (seeds that failed to
  train: diverged, stalled or unrecovered),
  ``baseline_final`` / ``warmup_final`` (mean final validation loss over seeds; null if a run
  diverged), ``max_sharpness`` (largest preconditioned sharpness λ_max(P^{-1/2} H P^{-1/2})
  measured every ``sharpness_every`` steps, P from AdamW's v), the adaptive edge-of-stability
  bound at the peak lr, ``per_seed`` details and the settings.
- ``settings``: the optimizer comparison's model, steps, tokens, lrs; the spike, stall and fail rules; timings.

The optimizer comparison trains the default model's shape (d=256, 6 layers, Subspace writers with
k = 8, the default peri-norm blocks; batch 16 x 64, 300 steps) on the default stdlib corpus, with
NuMuon's rank schedule started at 0.5, its lr at 0.04 and weight decay 0.3 for all three
optimizers (flags; docs/TRAINING.md says why).
``--only optim|warmup`` runs one part; ``--quick`` is a smoke run (seconds). Threads default to 1:
on an oversubscribed box torch's OpenMP threads spin against each other (measured 30× slower
Newton–Schulz with 2 threads under load than with 1). docs/TRAINING.md has the results.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from stages import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    ArchWarmup,
    Batches,
    SharpnessTracker,
    build_model,
    build_optimizer,
    default_warmup_schedule,
    eos_bound,
    hidden_matrix_names,
    lm_loss,
    load_corpus,
    load_manifest,  # noqa: E402
    lr_at,
    set_lr,
    val_batches,
)

SPIKE_RULE = ("from step 5 on, a spike event starts at a step whose training loss exceeds 1.2x the "
              "median of the previous (up to) 10 steps and that median by >= 0.3 nats; it ends when "
              "the loss is back below 1.05x that median; a non-finite loss counts as a spike and "
              "ends the run (diverged)")
STALL_MARGIN = 0.1
STALL_RULE = (f"a run stalled if it did not diverge and its final validation loss is not below the unigram "
              f"loss (unigram_val_loss: the best token-independent predictor, byte frequencies of the training "
              f"split with add-one smoothing, on the same validation batches) by at least {STALL_MARGIN} nats")


TRUNC_FRACS = (0.25, 0.5)  # rank fractions of the truncation test

DEVICE = torch.device("cpu")  # --device: where every run trains (bf16 autocast on CUDA)


def amp():
    return torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16, enabled=DEVICE.type == "cuda")


def base_manifest(args):
    m = load_manifest("default")
    n = args.layers
    cut = [0, n // 3, 2 * n // 3, n]
    return m.replace(
        model={"d_model": args.d_model, "n_layers": n, "n_heads": 4, "seq_len": args.seq_len},
        stages={"layout": [[cut[i], cut[i + 1]] for i in range(3)]},
        subspace={"k": args.k},
        data={"batch_size": args.batch},
        schedule={"kind": "cosine", "warmup_steps": args.lr_warmup, "total_steps": args.steps},
    )


@torch.no_grad()
def evaluate(model, batches) -> float:
    with amp():
        losses = [float(lm_loss(model(x), x)) for x in batches]
    return sum(losses) / len(losses)


RECOVER_STEPS = 50
FAIL_RULE = (f"a run failed to train if it diverged (non-finite loss), stalled (stall_rule), or had a spike "
             f"event it did not recover from within {RECOVER_STEPS} steps (the training loss not back below 1.05x "
             f"the median it jumped from); a spike event the run recovered from (one hard batch) does not count")


def spike_events(losses: list[float]) -> list[tuple[int, int | None]]:
    """Spike events (``SPIKE_RULE``): ``(start step, steps until recovered)``, the second None
    for an event still open when the run ended (the loss never came back below 1.05x the median
    it jumped from) or ended by a non-finite loss."""
    events: list[tuple[int, int | None]] = []
    inside, ref = False, None
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return events if inside else events + [(i, None)]
        if i < 5:
            continue
        prev = sorted(losses[max(0, i - 10):i])
        med = prev[len(prev) // 2]
        if inside:
            if loss < 1.05 * ref:
                inside = False
                events[-1] = (events[-1][0], i - events[-1][0])
            continue
        if loss > 1.2 * med and loss - med >= 0.3:
            events.append((i, None))
            inside, ref = True, med
    return events


def unrecovered(losses: list[float]) -> bool:
    """A spike event the run did not recover from within ``RECOVER_STEPS`` steps (``FAIL_RULE``),
    or a non-finite loss. An event still open at the end but younger than that is not judged."""
    n = len(losses)
    diverged = n > 0 and not math.isfinite(losses[-1])
    return diverged or any((d is None and n - start > RECOVER_STEPS) or (d is not None and d > RECOVER_STEPS)
                           for start, d in spike_events(losses))


def spike_steps(losses: list[float]) -> list[int]:
    """Steps at which a spike event starts (``SPIKE_RULE``)."""
    return [i for i, _ in spike_events(losses)]


def failed(summary: dict) -> bool:
    """A run failed to train (``FAIL_RULE``): it diverged, ended stalled, or had a spike event it
    did not recover from. A spike the run came back from (one hard batch) is not a failure."""
    return summary["diverged"] or summary["stalled"] or summary["unrecovered_spike"]


def _split_aux(opt, model, scale: float):
    """The same optimizer with the embedding and LM head (every parameter that is not a hidden
    matrix) in their own groups at ``scale`` × the lr (``lr_scale``, honoured by ``set_lr``);
    the blocks' matrices keep the peak lr."""
    hidden = {id(p) for p in (dict(model.named_parameters())[n] for n in hidden_matrix_names(model))}
    groups = []
    for g in opt.param_groups:
        rest = {k: v for k, v in g.items() if k != "params"}
        blocks = [p for p in g["params"] if id(p) in hidden]
        aux = [p for p in g["params"] if id(p) not in hidden]
        if blocks:
            groups.append(dict(rest, params=blocks))
        if aux:
            groups.append(dict(rest, params=aux, lr_scale=rest.get("lr_scale", 1.0) * scale))
    return type(opt)(groups)


def train(manifest, corpus, val, steps: int, *, warmup: bool = False, sharpness_every: int = 0,
          ramp_steps: int | None = None, aux_lr: float | None = None, seed: int = 0,
          stop_at: int | None = None) -> dict:
    """Train ``steps`` steps (the schedule's length); ``stop_at`` ends the run earlier, on the same
    schedule (to look closely at the first part of a run)."""
    torch.manual_seed(seed)
    model = build_model(manifest).to(DEVICE)
    arch = ArchWarmup(manifest, model, ramp_steps=ramp_steps) if warmup else None
    opt = build_optimizer(manifest, model, total_steps=steps)
    if aux_lr is not None:
        opt = _split_aux(opt, model, aux_lr / manifest.optim.lr)
    batches = Batches(corpus.train, manifest.data.batch_size, manifest.model.seq_len, seed=manifest.run.seed)
    # Sharpness over the blocks' parameters (the hidden matrices), on a fixed training batch.
    # Not the embedding: rows of bytes that recent batches did not contain have v ≈ 0, so
    # P^{-1/2} ≈ 1/√eps = 1e4 inflates their curvature 1e8-fold (measured: 80% of the top
    # eigenvector on such rows, λ ≈ 4e5 vs 700 unpreconditioned), yet Adam does not move them.
    params = dict(model.named_parameters())
    block_params = [params[n] for n in hidden_matrix_names(model)]
    probe = batches.batch(10**6).to(DEVICE)
    tracker = SharpnessTracker(block_params, max_iters=5) if sharpness_every else None
    losses, sharp, unlocked = [], [], []
    t0 = time.perf_counter()
    diverged = False
    for step in range(steps if stop_at is None else min(steps, stop_at)):
        if arch is not None:
            new = arch.apply(step, opt)
            if new:
                unlocked.append([step, new])
        set_lr(opt, lr_at(manifest.schedule, manifest.optim.lr, step))
        x = next(batches).to(DEVICE, non_blocking=True)
        with amp():
            loss = lm_loss(model(x), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                       manifest.optim.grad_clip)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            diverged = True
            break
        if tracker is not None and (step + 1) % sharpness_every == 0:
            s = tracker.measure(lambda: lm_loss(model(probe), probe), precond=opt)
            # with the adaptive EoS bound at the lr of that step (eos_bound): above it, expect trouble
            lr_now = lr_at(manifest.schedule, manifest.optim.lr, step)
            bound = round(eos_bound(lr_now, manifest.optim.betas[0]), 1) if lr_now > 0 else None
            sharp.append([step + 1, round(s, 2), bound])
    wall = time.perf_counter() - t0
    final = float("nan") if diverged else evaluate(model, val)
    # one line per run on stderr: a run cut short by a time limit still leaves what it had done
    print(f"[bench_optim] {manifest.optim.name} lr {manifest.optim.lr:g} seed {seed} warm-up {warmup}: "
          f"{len(losses)} steps in {wall:.1f}s, final val {final:.4f}, spikes {spike_steps(losses)}, "
          f"max train loss after step 5 {max(losses[5:], default=float('nan')):.2f}, "
          f"max sharpness {max((x[1] for x in sharp), default=float('nan')):.0f}",
          file=sys.stderr, flush=True)
    return {"model": model, "losses": losses, "val_loss": final, "diverged": diverged or not math.isfinite(final),
            "sharpness": sharp, "unlocked": unlocked, "wall_s": round(wall, 1)}


@torch.no_grad()
def truncated_loss(model, val, frac: float, only: list[str] | None = None) -> float:
    """Val loss with every hidden matrix (or those named in ``only``) replaced by its best
    rank-⌈frac·min(m, n)⌉ approximation (SVD); the weights are put back afterwards."""
    params = dict(model.named_parameters())
    saved = {}
    for name in (hidden_matrix_names(model) if only is None else only):
        w = params[name]
        saved[name] = w.detach().clone()
        mat = w.reshape(w.shape[0], -1).float()
        r = max(1, math.ceil(frac * min(mat.shape)))
        u, s, vh = torch.linalg.svd(mat, full_matrices=False)
        w.copy_(((u[:, :r] * s[:r]) @ vh[:r]).reshape(w.shape).to(w.dtype))
    loss = evaluate(model, val)
    for name, t in saved.items():
        params[name].copy_(t)
    return loss


@torch.no_grad()
def unigram_loss(train_tokens: torch.Tensor, val, vocab_size: int = 256) -> float:
    """Validation loss of the unigram predictor (``STALL_RULE``), averaged like ``evaluate``."""
    counts = torch.bincount(train_tokens.long().flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(sum(float(-logp[x[:, 1:].cpu()].mean()) for x in val) / len(val))


def r4(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def tail_energy(w: torch.Tensor, frac: float) -> float:
    """Share of ``w``'s squared Frobenius norm beyond its best rank-⌈f·min(m, n)⌉ approximation
    (what ``truncated_loss`` removes): a measure of compressibility that does not go through the
    loss, and so is far less noisy from run to run."""
    mat = w.detach().reshape(w.shape[0], -1).float()
    s2 = torch.linalg.svdvals(mat).pow(2)
    r = max(1, math.ceil(frac * min(mat.shape)))
    return float(s2[r:].sum() / s2.sum().clamp_min(1e-30))


def matrix_kind(name: str) -> str:
    """``layers.3.attn.qkv_proj.weight`` -> ``qkv_proj`` (the per-kind breakdown's key)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else name


@torch.no_grad()
def compressibility(model, val, fracs=TRUNC_FRACS) -> dict:
    """After training: ``trunc`` (val-loss increase with every hidden matrix truncated, per
    fraction), ``trunc_by_kind`` (only the matrices of one kind truncated) and ``tail_energy``
    (mean over the hidden matrices, and per kind)."""
    base = evaluate(model, val)
    params = dict(model.named_parameters())
    names = hidden_matrix_names(model)
    kinds: dict[str, list[str]] = {}
    for n in names:
        kinds.setdefault(matrix_kind(n), []).append(n)
    out = {"trunc": {}, "trunc_by_kind": {}, "tail_energy": {}, "tail_energy_by_kind": {}}
    for f in fracs:
        key = str(f)
        out["trunc"][key] = truncated_loss(model, val, f) - base
        out["trunc_by_kind"][key] = {k: truncated_loss(model, val, f, only=ns) - base for k, ns in kinds.items()}
        te = {n: tail_energy(params[n], f) for n in names}
        out["tail_energy"][key] = sum(te.values()) / len(te)
        out["tail_energy_by_kind"][key] = {k: sum(te[n] for n in ns) / len(ns) for k, ns in kinds.items()}
    return out


def parse_seeds(text: str) -> list[int]:
    seeds = [int(x) for x in str(text).split(",") if x.strip()]
    if not seeds:
        raise SystemExit("bench_optim: no seeds given")
    return seeds


def optim_configs(args) -> dict[str, dict]:
    """The three optimizers of the comparison (manifest ``[optim]`` tables), from the flags."""
    return {
        "adamw": {"name": "adamw", "lr": args.lr_adamw, "weight_decay": args.optim_weight_decay},
        "muon": {"name": "muon", "lr": args.lr_muon, "aux_lr": args.aux_lr,
                 "weight_decay": args.optim_weight_decay},
        "numuon": {"name": "numuon", "lr": args.lr_numuon, "aux_lr": args.aux_lr,
                   "weight_decay": args.optim_weight_decay, "rank_start": args.numuon_rank_start,
                   "rank_final": args.numuon_rank_final, "rank_hold_frac": args.numuon_rank_hold,
                   "rank_decay_end_frac": args.numuon_rank_decay_end},
    }


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _mean_tree(trees: list):
    """Element-wise mean of nested dicts of floats (one per seed)."""
    if isinstance(trees[0], dict):
        return {k: _mean_tree([t[k] for t in trees]) for k in trees[0]}
    return r4(_mean(trees))


def optimizer_comparison(args, m, corpus, val) -> dict:
    """AdamW vs Muon vs NuMuon at equal tokens (the same batches), every seed of
    ``--optim-seeds``; figures are means over seeds, ``optim_per_seed`` has each run."""
    cfgs = optim_configs(args)
    seeds = parse_seeds(args.optim_seeds)
    per_seed: dict = {n: {} for n in cfgs}
    walls: dict = {n: [] for n in cfgs}
    for seed in seeds:
        ms = m.replace(run={"seed": m.run.seed + seed})
        for name, cfg in cfgs.items():
            r = train(ms.replace(optim=cfg), corpus, val, args.steps, seed=seed)
            c = compressibility(r["model"], val)
            per_seed[name][str(seed)] = {"val_loss": r4(r["val_loss"]), **_mean_tree([c])}
            walls[name].append(r["wall_s"])
            print(f"[bench_optim] {name} seed {seed}: trunc {per_seed[name][str(seed)]['trunc']}, "
                  f"tail energy {per_seed[name][str(seed)]['tail_energy']}", file=sys.stderr, flush=True)
    mean = {n: _mean_tree(list(runs.values())) for n, runs in per_seed.items()}
    out: dict = {"val_loss": {n: mean[n]["val_loss"] for n in cfgs}}
    out["val_loss"]["numuon_vs_muon"] = r4(mean["numuon"]["val_loss"] / mean["muon"]["val_loss"])
    out["trunc_loss_increase"] = {n: mean[n]["trunc"] for n in cfgs}
    out["weight_tail_energy"] = {n: mean[n]["tail_energy"] for n in cfgs}
    numuon = out["trunc_loss_increase"]["numuon"]
    out["targets"] = {
        "numuon_trunc_below_muon_and_adamw": all(
            numuon[f] < out["trunc_loss_increase"][o][f] for f in numuon for o in ("muon", "adamw")),
        "numuon_val_within_3pct_of_muon": out["val_loss"]["numuon_vs_muon"] <= 1.03,
        "numuon_trunc_below_on_every_seed": {
            o: sum(all(per_seed["numuon"][s]["trunc"][f] < per_seed[o][s]["trunc"][f] for f in numuon)
                   for s in per_seed["numuon"]) for o in ("muon", "adamw")},
    }
    out["trunc_by_kind"] = {n: mean[n]["trunc_by_kind"] for n in cfgs}
    out["optim_per_seed"] = {n: {s: {"val_loss": v["val_loss"], "trunc": v["trunc"], "tail_energy": v["tail_energy"]}
                                 for s, v in runs.items()} for n, runs in per_seed.items()}
    o = m.optim
    out["optim_settings"] = {n: dict(cfg, betas=list(o.betas), momentum=o.momentum, grad_clip=o.grad_clip)
                             for n, cfg in cfgs.items()}
    out["optim_wall_s"] = {n: round(_mean(w), 1) for n, w in walls.items()}
    return out


def warmup_manifest(args):
    """The warm-up experiment's model: its own depth / width / block norm, the bench's corpus,
    batch and sequence length, AdamW (betas and grad clip of the default manifest)."""
    ns = argparse.Namespace(layers=args.warmup_layers, d_model=args.warmup_d_model, k=args.warmup_k,
                            seq_len=args.seq_len, batch=args.batch, lr_warmup=args.warmup_lr_warmup,
                            steps=args.warmup_run_steps)
    m = base_manifest(ns)
    # post-norm rescales the whole stream (T[x] included): only a dense run can use it (manifest)
    return m.replace(model={"block_norm": args.warmup_block_norm},
                     subspace={"enabled": args.warmup_block_norm != "post" and not args.warmup_dense})


def _summary(r: dict, unigram: float) -> dict:
    stalled = not r["diverged"] and r["val_loss"] > unigram - STALL_MARGIN
    return {"spike_steps": spike_steps(r["losses"]), "final": r4(r["val_loss"]), "diverged": r["diverged"],
            "stalled": stalled, "unrecovered_spike": unrecovered(r["losses"]),
            "max_sharpness": max((x[1] for x in r["sharpness"]), default=None),
            "min_train_loss": r4(min(r["losses"])) if r["losses"] else None}


def warmup_experiment(args, corpus) -> dict:
    """Baseline (all blocks from step 0) vs architecture warm-up, same AdamW and LR schedule.

    The peak lr is swept upwards on the baseline only (every seed); the chosen lr is the smallest
    one at which the baseline fails to train on every seed (``FAIL_RULE``: a divergence, a stall,
    or a spike event it does not recover from), and only then is the warm-up run at that lr (so the choice never looks at
    the warm-up's result). ``--high-lr`` skips the sweep."""
    m = warmup_manifest(args)
    steps = args.warmup_run_steps
    layers = m.model.n_layers
    val = [v.to(DEVICE) for v in val_batches(corpus.val, args.batch, args.seq_len, args.val_batches)]
    unigram = unigram_loss(corpus.train, val, m.model.vocab_size)
    groups, unlock = default_warmup_schedule(layers, args.warmup_lr_warmup, args.unlock_every,
                                             n_groups=args.warmup_groups, keep_every=args.warmup_keep_every)
    seeds = [int(x) for x in args.seeds.split(",")]

    def manifest_at(lr: float, seed: int):
        return m.replace(optim={"name": "adamw", "lr": lr, "weight_decay": args.warmup_weight_decay},
                         schedule={"total_steps": steps}, run={"seed": m.run.seed + seed})

    def run(lr: float, seed: int, warm: bool) -> dict:
        mm = manifest_at(lr, seed)
        if warm:
            mm = mm.replace(warmup={"enabled": True, "groups": [list(g) for g in groups],
                                    "unlock_steps": list(unlock)})
        return train(mm, corpus, val, steps, warmup=warm, sharpness_every=args.sharpness_every,
                     stop_at=args.warmup_stop_at,
                     ramp_steps=args.ramp_steps, aux_lr=args.warmup_aux_lr, seed=seed)

    sweep: dict = {}
    base_runs: dict = {}
    if args.high_lr is not None:
        lr = args.high_lr
        how = f"given on the command line (--high-lr {lr}); no sweep"
        base_runs = {sd: run(lr, sd, False) for sd in seeds}
        sweep[str(lr)] = {str(sd): _summary(r, unigram) for sd, r in base_runs.items()}
    else:
        lrs = sorted(float(x) for x in args.lr_sweep.split(","))
        lr = None
        for cand in lrs:
            rs = {sd: run(cand, sd, False) for sd in seeds}
            sweep[str(cand)] = {str(sd): _summary(r, unigram) for sd, r in rs.items()}
            if all(failed(x) for x in sweep[str(cand)].values()):
                lr, base_runs = cand, rs
                break
        if lr is None:
            lr, base_runs = lrs[-1], rs
            how = (f"sweep {lrs} on the baseline, seeds {seeds}: the baseline failed to train (fail_rule) on "
                   f"every seed at none of them; the largest was used")
        else:
            how = (f"the smallest peak lr of the sweep {lrs} at which the all-blocks baseline fails to train on "
                   f"every seed {seeds}: a divergence, a stall or a spike event it does not recover from "
                   f"(fail_rule); sweep run on the baseline only, upwards, stopped at the first such lr (lr_sweep)")
    warm_runs = {sd: run(lr, sd, True) for sd in seeds}

    def both(f) -> dict:
        """``f`` of every run: {"baseline": {seed: ...}, "warmup": {seed: ...}}."""
        return {"baseline": {str(sd): f(r) for sd, r in base_runs.items()},
                "warmup": {str(sd): f(r) for sd, r in warm_runs.items()}}

    per_seed = both(lambda r: _summary(r, unigram))
    b, w = per_seed["baseline"], per_seed["warmup"]

    def mean_final(s: dict) -> float | None:
        vals = [x["final"] for x in s.values()]
        return None if any(v is None for v in vals) else r4(sum(vals) / len(vals))

    def max_sharp(s: dict) -> float | None:
        vals = [x["max_sharpness"] for x in s.values() if x["max_sharpness"] is not None]
        return max(vals, default=None)

    md = m.model
    o = manifest_at(lr, 0).optim
    return {
        "lr": lr,
        "how_lr_chosen": how,
        "seeds": seeds,
        "baseline_spikes": sum(len(x["spike_steps"]) for x in b.values()),
        "warmup_spikes": sum(len(x["spike_steps"]) for x in w.values()),
        "baseline_final": mean_final(b),
        "warmup_final": mean_final(w),
        "baseline_diverged": any(x["diverged"] for x in b.values()),
        "warmup_diverged": any(x["diverged"] for x in w.values()),
        "baseline_stalled": sum(x["stalled"] for x in b.values()),
        "warmup_stalled": sum(x["stalled"] for x in w.values()),
        "baseline_unrecovered_spikes": sum(x["unrecovered_spike"] for x in b.values()),
        "warmup_unrecovered_spikes": sum(x["unrecovered_spike"] for x in w.values()),
        "baseline_failed": sum(failed(x) for x in b.values()),
        "warmup_failed": sum(failed(x) for x in w.values()),
        "unigram_val_loss": r4(unigram),
        "max_sharpness": {"baseline": max_sharp(b), "warmup": max_sharp(w)},
        "eos_bound_at_peak_lr": round(eos_bound(lr, o.betas[0]), 1),
        "per_seed": per_seed,
        "lr_sweep": sweep,
        "sharpness_trace": both(lambda r: r["sharpness"]),
        "loss_trace_every_10": both(lambda r: [r4(x) for x in r["losses"][::10]]),
        "loss_first_12_steps": both(lambda r: [r4(x) for x in r["losses"][:12]]),
        "settings": {
            "model": {"d_model": md.d_model, "n_layers": md.n_layers, "n_heads": md.n_heads, "ffn": md.ffn_dim,
                      "seq_len": md.seq_len, "subspace": m.subspace.enabled,
                      "subspace_k": m.k if m.subspace.enabled else None, "block_norm": md.block_norm,
                      "token_table_scale": m.subspace.token_table_scale},
            "optimizer": {"name": "adamw", "betas": list(o.betas), "eps": o.eps,
                          "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
                          "embedding_head_lr": "same as the blocks" if args.warmup_aux_lr is None
                          else args.warmup_aux_lr},
            "lr_schedule": {"kind": "cosine", "warmup_steps": args.warmup_lr_warmup, "total_steps": steps,
                            "min_lr_frac": m.schedule.min_lr_frac},
            "steps": steps,
            "stopped_at": args.warmup_stop_at,
            "batch": args.batch,
            "tokens_per_run": min(steps, args.warmup_stop_at or steps) * args.batch * args.seq_len,
            "active_from_start": sorted(set(range(layers)) - {i for g in groups for i in g}),
            "groups": [list(g) for g in groups],
            "unlock_steps": list(unlock),
            "unlocked_at": warm_runs[seeds[0]]["unlocked"],
            "ramp_steps": args.ramp_steps,
            "sharpness_every": args.sharpness_every,
            "preset": args.warmup_preset,
            "wall_s": both(lambda r: r["wall_s"]),
        },
    }


# Named settings of the warm-up experiment (``--warmup-preset``). "wide": the setting where the
# all-blocks post-norm baseline blows up at its peak lr and never recovers while the warm-up run
# trains (docs/TRAINING.md, "The wide setting").
WARMUP_PRESETS = {
    "wide": {"warmup_d_model": 256, "warmup_layers": 24, "warmup_block_norm": "post", "warmup_keep_every": 8,
             "warmup_groups": 7, "warmup_lr_warmup": 50, "warmup_run_steps": 400, "unlock_every": 40,
             "sharpness_every": 100, "batch": 16, "seq_len": 128, "lr_sweep": "0.001,0.003,0.01"},
}


def parse_with_preset(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse ``argv``; a ``--warmup-preset`` supplies new defaults, explicit flags override them."""
    first = ap.parse_args(argv)
    if first.warmup_preset is None:
        return first
    ap.set_defaults(**WARMUP_PRESETS[first.warmup_preset])
    return ap.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps")
    ap.add_argument("--steps", type=int, default=300, help="steps per optimizer run")
    ap.add_argument("--warmup-run-steps", type=int, default=200, help="steps per warm-up experiment run")
    ap.add_argument("--d-model", type=int, default=256, help="optimizer comparison: width (256: the default model)")
    ap.add_argument("--layers", type=int, default=6, help="optimizer comparison: depth (6: the default model)")
    ap.add_argument("--k", type=int, default=8, help="optimizer comparison: subspace.k, coordinates per token (8: the default model)")
    ap.add_argument("--optim-seeds", default="0,1,2",
                    help="optimizer comparison seeds (run.seed offsets: init and data order); figures are means")
    ap.add_argument("--lr-adamw", type=float, default=3e-3, help="optimizer comparison: AdamW's peak lr")
    ap.add_argument("--lr-muon", type=float, default=0.02, help="optimizer comparison: Muon's peak lr (hidden matrices)")
    ap.add_argument("--lr-numuon", type=float, default=0.04,
                    help="optimizer comparison: NuMuon's peak lr (hidden matrices; a rank-k step moves less than "
                         "Muon's full-rank one, docs/TRAINING.md)")
    ap.add_argument("--aux-lr", type=float, default=3e-3,
                    help="optimizer comparison: AdamW lr of Muon's and NuMuon's embedding, head and gains")
    ap.add_argument("--optim-weight-decay", type=float, default=0.3,
                    help="optimizer comparison: decoupled weight decay of all three optimizers (0.3: in a "
                         "300-step run 0.1 leaves most of the random initialisation in the weights, docs/TRAINING.md)")
    ap.add_argument("--numuon-rank-start", type=float, default=0.5,
                    help="NuMuon's r(t) while held (the manifest default is 1.0; in a run of a few hundred "
                         "steps the full-rank steps of that phase stay in the weights, docs/TRAINING.md)")
    ap.add_argument("--numuon-rank-final", type=float, default=0.25)
    ap.add_argument("--numuon-rank-hold", type=float, default=0.1, help="NuMuon: fraction of training r(t) is held")
    ap.add_argument("--numuon-rank-decay-end", type=float, default=0.8,
                    help="NuMuon: fraction of training by which r(t) reaches its final value")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr-warmup", type=int, default=20, help="optimizer comparison: LR warm-up steps")
    ap.add_argument("--warmup-d-model", type=int, default=32, help="warm-up experiment: width")
    ap.add_argument("--warmup-layers", type=int, default=24, help="warm-up experiment: depth")
    ap.add_argument("--warmup-k", type=int, default=4, help="warm-up experiment: subspace.k, coordinates per token")
    ap.add_argument("--warmup-block-norm", choices=["peri", "pre", "post"], default="post",
                    help="warm-up experiment: model.block_norm (pre: standard pre-norm blocks; post: post-LN "
                         "blocks, which makes the warm-up model dense, subspace.enabled = false)")
    ap.add_argument("--warmup-dense", action="store_true",
                    help="warm-up experiment: a dense model (subspace.enabled = false) with peri- or pre-norm blocks "
                         "too (post-norm blocks are always dense)")
    ap.add_argument("--warmup-lr-warmup", type=int, default=0,
                    help="warm-up experiment: LR warm-up steps of both runs (0: none; arch warm-up replaces it)")
    ap.add_argument("--warmup-weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-aux-lr", type=float, default=None,
                    help="warm-up experiment: peak lr of the embedding and LM head (default: the same lr as "
                         "the blocks), to test whether an instability comes from the blocks")
    ap.add_argument("--lr-sweep", default="0.003,0.01,0.03",
                    help="peak lrs tried upwards on the baseline; the first at which it fails to train on every "
                         "seed (fail_rule: divergence, stall or a spike it does not recover from) is used")
    ap.add_argument("--high-lr", type=float, default=None, help="peak lr of the warm-up experiment (skips the sweep)")
    ap.add_argument("--seeds", default="0,1", help="warm-up experiment seeds (run.seed offsets: init and data order)")
    ap.add_argument("--warmup-stop-at", type=int, default=None,
                    help="warm-up experiment: end every run after this many steps, on the schedule of "
                         "--warmup-run-steps (with a small --sharpness-every: sharpness around a blow-up)")
    ap.add_argument("--unlock-every", type=int, default=20)
    ap.add_argument("--warmup-keep-every", type=int, default=8,
                    help="warm-up schedule: layers 0, k, 2k, ... active from step 0, the others locked (8: 3 of 24; "
                         "2: half the depth, papers §5's default)")
    ap.add_argument("--warmup-groups", type=int, default=7, help="warm-up schedule: number of unlock groups")
    ap.add_argument("--ramp-steps", type=int, default=0, help="blend-in steps of an unlocked block (0: off)")
    ap.add_argument("--sharpness-every", type=int, default=25)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (bf16 autocast on CUDA)")
    ap.add_argument("--only", choices=["optim", "warmup"], default=None)
    ap.add_argument("--warmup-preset", choices=sorted(WARMUP_PRESETS), default=None,
                    help="warm-up experiment: a named setting (its values become the defaults; flags given "
                         "on the command line still win). wide: d 256, post-norm, LR warm-up 50, 400 steps, "
                         "batch 16 x 128 (docs/TRAINING.md; ~1 h on 2 CPU cores, a few minutes on an H200)")
    return ap


def main(argv=None) -> int:
    args = parse_with_preset(build_parser(), argv)
    if args.quick:
        args.steps, args.warmup_run_steps, args.d_model, args.layers = 12, 12, 32, 4
        args.k, args.seq_len, args.batch, args.lr_warmup = 4, 32, 4, 2
        args.unlock_every, args.sharpness_every, args.val_batches, args.ramp_steps = 2, 4, 2, 2
        args.warmup_d_model, args.warmup_layers, args.warmup_k, args.lr_sweep = 32, 4, 4, "0.1,0.3"
        args.warmup_keep_every, args.warmup_groups = 2, 4
        args.optim_seeds = "0"
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    t_start = time.perf_counter()

    m = base_manifest(args)
    corpus = load_corpus(m.data)
    val = [v.to(DEVICE) for v in val_batches(corpus.val, args.batch, args.seq_len, args.val_batches)]
    out: dict = {}
    if args.only in (None, "optim"):
        out.update(optimizer_comparison(args, m, corpus, val))

    if args.only in (None, "warmup"):
        out["warmup"] = warmup_experiment(args, corpus)

    md = m.model
    out["settings"] = {
        "model": {"d_model": md.d_model, "n_layers": md.n_layers, "n_heads": md.n_heads, "ffn": md.ffn_dim,
                  "seq_len": md.seq_len, "subspace_k": m.k, "constrain_tail": m.subspace.constrain_tail},
        "steps": args.steps,
        "optim_seeds": parse_seeds(args.optim_seeds),
        "batch": args.batch,
        "tokens_per_run": args.steps * args.batch * args.seq_len,
        "lr_schedule": {"kind": "cosine", "warmup_steps": args.lr_warmup, "min_lr_frac": m.schedule.min_lr_frac},
        "val_tokens": args.val_batches * args.batch * args.seq_len,
        "corpus": corpus.description,
        "hidden_matrices": "every >=2-D parameter but the embedding and LM head (Subspace writers: Z)",
        "spike_rule": SPIKE_RULE,
        "stall_rule": STALL_RULE,
        "fail_rule": FAIL_RULE,
        "sharpness": "lambda_max(P^-1/2 H P^-1/2) over the blocks' matrices on a fixed training batch, "
                     "P = diag(sqrt(v_hat)+eps) of AdamW; 5 HVPs per measurement, warm-started, Lanczos "
                     "(Rayleigh-Ritz) over the power-iteration Krylov space",
        "quick": args.quick,
        "threads": args.threads, "device": str(DEVICE),
        "total_wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
