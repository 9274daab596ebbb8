"""Benchmark of morphing (stages/morph.py, docs/MORPH.md). Prints ONE JSON object.

1. Training at equal tokens, same batches, same optimizer (Muon with SGD-momentum as its auxiliary
   optimizer: morphing needs first-moment optimizers), three variants of one manifest:
   ``off`` (no [morph] section: the standard model), ``ready`` (morph on but never due: the
   morphing model, whose token table has no span(U) part, trained without morphs) and ``morph``
   (a morph every ``--every`` steps). Reports final validation losses, the time the morphs took
   as a fraction of the training time, and the memory a morphing stage adds (float64 master and
   the k×k maps) relative to its training state (parameters, gradients, optimizer state).
2. Precision: the trained ``morph`` model is morphed ``--morphs`` more times without training,
   with the float64 master (the default), with float64 folds cast every time (no master), and
   naively in float32; ΔPPL on the validation batches for each.
3. Stitching: after training, two more morph epochs with recorded transforms; stages taken at
   different epochs (head at epoch E, body at E+1, tail at E+2) assembled into one model, its
   validation loss vs the unigram loss (what a model that ignores context gets) and vs the true
   model; then the same stages with the true bridges (the products of the transforms in between)
   inserted at the boundaries, which must give the true loss back. Finally an attacker who holds
   those stages and training data fits a k×k linear bridge per boundary by gradient descent for
   ``--attack-steps`` steps: how cheap the morph is to undo for someone with data.

Run: ``OMP_NUM_THREADS=1 python scripts/bench_morph.py [--manifest test] [--steps 400] [--every 100]
[--morphs 10000] [--attack-steps 200]`` (defaults: a few minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", default="test", help="run manifest (default: the test manifest)")
    p.add_argument("--steps", type=int, default=400, help="training steps per variant")
    p.add_argument("--every", type=int, default=100, help="morph every this many steps (M)")
    p.add_argument("--morphs", type=int, default=10000, help="morph epochs without training for ΔPPL")
    p.add_argument("--attack-steps", type=int, default=200, help="steps of the bridge-fitting attacker")
    p.add_argument("--lr", type=float, default=0.02, help="Muon lr")
    p.add_argument("--aux-lr", type=float, default=0.3, help="lr of the SGD auxiliary optimizer (embedding, head)")
    p.add_argument("--val-batches", type=int, default=16, help="validation batches (batch_size × seq_len tokens each)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=None, help="override run.seed")
    return p.parse_args(argv)


def _sig(x: float) -> float:
    return float(f"{x:.3e}")


def _val_loss(stages, vbatches, bridges=None) -> float:
    from stages import lm_loss

    total = 0.0
    with torch.no_grad():
        for ids in vbatches:
            x = None
            for i, s in enumerate(stages):
                if x is not None and bridges is not None:
                    x = bridges[i - 1](x)
                x = s(x, ids)
            total += lm_loss(x, ids).item()
    return total / len(vbatches)


def _unigram_loss(corpus, vbatches, vocab: int) -> float:
    counts = torch.bincount(torch.as_tensor(corpus.train[:2_000_000]).long().flatten(), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    tgt = torch.cat([v[:, 1:].flatten() for v in vbatches])
    return float(-logp[tgt].mean())


def _code_frame_rows(stage) -> torch.Tensor:
    """The k-row matrix of a stage's weights in its code frame: ``X ↦ Rᵀ·X`` under a frame turn R
    (readers' ``(W·U)ᵀ``, constrained writers' Z, dense writers' ``Uᵀ·W``; U = I for a dense run)."""
    U = getattr(stage.codec, "U", None)
    U = torch.eye(stage.codec.k) if U is None else U
    cols = []
    for block in stage.blocks:
        for lin in (block.attn.qkv_proj, block.mlp.gate_proj, block.mlp.up_proj):
            cols.append((lin.weight.detach() @ U).T)
        for w in block.output_projections():
            cols.append(w.weight.detach() if w.constrained else U.T @ w.weight.detach())
    if stage.lm_head is not None:
        cols.append((stage.lm_head.weight.detach() @ U).T)
    return torch.cat(cols, dim=1).double()


def _procrustes_frame(initial, morphed) -> torch.Tensor:
    """Estimate the orthogonal code frame F of ``morphed`` (its rows are ``Fᵀ·X`` of a model in the
    initial frame) by Procrustes against the public initial weights: polar factor of X₀·Xᵀ."""
    x0, x = _code_frame_rows(initial), _code_frame_rows(morphed)
    u, _, vh = torch.linalg.svd(x0 @ x.T)
    return u @ vh


def _train_state_bytes(stage, optimizer) -> int:
    n = sum(p.numel() * p.element_size() * 2 for p in stage.parameters())  # weights + gradients
    for st in optimizer.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from node.ops import train
    from stages import (
        Batches, MorphMaster, build_optimizer, build_stage, lm_loss, load_corpus, load_manifest, morph_chain, val_batches,
    )

    t_all = time.perf_counter()
    base = load_manifest(args.manifest)
    if args.seed is not None:
        base = base.replace(run={"seed": args.seed})
    base = base.replace(
        optim={"name": "muon", "aux_optimizer": "sgd", "lr": args.lr, "aux_lr": args.aux_lr, "momentum": 0.9},
        schedule={"total_steps": args.steps},
        train={"steps": args.steps, "val_every": max(1, args.attack_steps // 4), "val_batches": args.val_batches},
    )
    corpus = load_corpus(base.data)
    B, L = base.data.batch_size, base.model.seq_len
    vbatches = val_batches(corpus.val, B, L, base.train.val_batches)

    # ---- 1. training at equal tokens --------------------------------------------------------
    variants = {"off": base,
                "ready": base.replace(morph={"every": args.steps + 1}),
                "morph": base.replace(morph={"every": args.every})}
    results = {}
    for name, m in variants.items():
        results[name] = train(m, steps=args.steps, corpus=corpus, quiet=True, morph_secret=b"bench")
    r_morph = results["morph"]
    stages = r_morph["stages"]
    train_time = r_morph["tokens"] / r_morph["tokens_per_s"]
    stages = [copy.deepcopy(s) for s in r_morph["stages"]]
    state = 0
    for s in copy.deepcopy(stages):  # training state bytes: weights, grads, optimizer state after a step
        o = build_optimizer(variants["morph"], s)
        for p in s.parameters():
            p.grad = torch.zeros_like(p)
        o.step()
        state += _train_state_bytes(s, o)
    masters = [None] + [MorphMaster(s) for s in stages[1:]]
    extra = sum(mm.nbytes() for mm in masters if mm is not None)
    extra += sum(b.numel() * b.element_size() for s in stages for b in (s.morph_in, s.morph_out) if b is not None)

    # ---- 2. precision after many morphs without training ------------------------------------
    ref_loss = _val_loss(stages, vbatches)
    precision = {}
    for label, use_master, dtype in (("float64_master", True, torch.float64),
                                      ("float64_cast_each_time", False, torch.float64),
                                      ("float32_naive", False, torch.float32)):
        ss = [copy.deepcopy(s) for s in stages]
        ms = [None] + [MorphMaster(s) for s in ss[1:]] if use_master else None
        t0 = time.perf_counter()
        for e in range(args.morphs):
            morph_chain(ss, b"bench", e, masters=ms, compute_dtype=dtype)
        dt = time.perf_counter() - t0
        loss = _val_loss(ss, vbatches)
        precision[label] = {"dppl": _sig(math.exp(loss) - math.exp(ref_loss)), "val_loss": round(loss, 6),
                            "s_per_morph_epoch": _sig(dt / max(1, args.morphs))}

    # ---- 3. stitching ----------------------------------------------------------------------
    epochs = []
    ss = [copy.deepcopy(s) for s in stages]
    ms = [None] + [MorphMaster(s) for s in ss[1:]]
    epochs.append([copy.deepcopy(s) for s in ss])
    transforms = []
    for e in range(2):
        transforms.append(morph_chain(ss, b"stitch", 10_000_000 + e, masters=ms))
        epochs.append([copy.deepcopy(s) for s in ss])
    n = len(ss)
    # stage i from epoch min(i, 2): head at E, body at E+1, tail at E+2 (and later stages at E+2)
    pick = [min(i, 2) for i in range(n)]
    stitched = [epochs[pick[i]][i] for i in range(n)]
    true_loss = _val_loss(epochs[-1], vbatches)
    stitched_loss = _val_loss(stitched, vbatches)

    def bridge(b: int):
        """Boundary b's code goes from the sender's epoch to the receiver's: the product of the
        boundary-b transforms of the epochs in between."""
        M = torch.eye(stages[b].codec.k, dtype=torch.float64)
        for e in range(pick[b], pick[b + 1]):
            M = M @ transforms[e][b]
        M32 = M.to(torch.float32)
        return lambda x: x.float() @ M32

    bridged_loss = _val_loss(stitched, vbatches, bridges=[bridge(b) for b in range(n - 1)])
    unigram = _unigram_loss(corpus, vbatches, base.model.vocab_size)

    # an attacker with the stitched stages and the public initialisation (every stage's initial
    # weights come from the run seed) estimates each stage's code frame by orthogonal Procrustes
    # against its initial weights, and bridges with the estimates: no data needed
    frames = [torch.eye(stages[0].codec.k, dtype=torch.float64)]
    for i in range(1, n):
        frames.append(_procrustes_frame(build_stage(variants["morph"], i), stitched[i]))

    def estimated_bridge(b: int):
        s_out, s_in = stitched[b], stitched[b + 1]
        Bm = s_out.morph_out.double()
        A = s_in.morph_in.double()
        G = torch.linalg.solve(Bm, frames[b].T) @ frames[b + 1] @ torch.linalg.inv(A)
        G32 = G.to(torch.float32)
        return lambda x: x.float() @ G32

    init_alignment_loss = _val_loss(stitched, vbatches, bridges=[estimated_bridge(b) for b in range(n - 1)])

    # an attacker with the stitched stages and data fits a k×k bridge per boundary
    k = stages[0].codec.k
    fitted = [torch.nn.Parameter(torch.eye(k)) for _ in range(n - 1)]
    opt = torch.optim.Adam(fitted, lr=1e-2)
    for s in stitched:
        s.requires_grad_(False)
    batches = Batches(corpus.train, B, L, seed=base.run.seed + 1, shard=0, num_shards=1)
    attack_curve = []
    t0 = time.perf_counter()
    for step in range(args.attack_steps):
        ids = batches.batch(step)
        x = None
        for i, s in enumerate(stitched):
            if x is not None:
                x = x @ fitted[i - 1]
            x = s(x, ids)
        loss = lm_loss(x, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % max(1, args.attack_steps // 4) == 0:
            with torch.no_grad():
                attack_curve.append([step + 1, round(_val_loss(
                    stitched, vbatches, bridges=[(lambda F: (lambda x: x @ F))(F.detach()) for F in fitted]), 4)])
    attack_time = time.perf_counter() - t0

    out = {
        "val_loss": {name: round(r["val_loss"], 4) for name, r in results.items()},
        "val_loss_morph_vs_ready_rel": round(results["morph"]["val_loss"] / results["ready"]["val_loss"] - 1, 5),
        "val_loss_morph_vs_off_rel": round(results["morph"]["val_loss"] / results["off"]["val_loss"] - 1, 5),
        "morphs_during_training": r_morph["morphs"],
        "morph_time_frac": round(r_morph["morph_time_s"] / train_time, 5),
        "morph_time_s_per_epoch": round(r_morph["morph_time_s"] / max(1, r_morph["morphs"]), 5),
        # the same cost from the mean of the --morphs epochs timed below (master folds) over M mean
        # training steps: less exposed to a stall of a shared machine than 4 epochs in training
        "morph_time_frac_from_mean": round(
            precision["float64_master"]["s_per_morph_epoch"] / (args.every * train_time / r_morph["steps"]), 5),
        "tokens_per_s": {name: round(r["tokens_per_s"], 1) for name, r in results.items()},
        "memory_extra_bytes": extra,
        "memory_extra_frac_of_training_state": round(extra / state, 4),
        "precision": precision,
        "reference_ppl": round(math.exp(ref_loss), 4),
        "stitch": {
            "true_loss": round(true_loss, 4),
            "stitched_loss": round(stitched_loss, 4),
            "bridged_loss": round(bridged_loss, 4),
            "attack_init_alignment_loss": round(init_alignment_loss, 4),
            "unigram_loss": round(unigram, 4),
            "epochs_of_stages": pick,
            "attack_fitted_bridge_val_loss": attack_curve,
            "from_scratch_val_loss_at_same_steps": [[st, round(v, 4)] for st, v in results["off"]["val_history"]
                                                    if st <= args.attack_steps],
            "attack_s": round(attack_time, 2),
        },
        "settings": {
            "manifest": args.manifest, "steps": args.steps, "every": args.every, "morphs": args.morphs,
            "attack_steps": args.attack_steps, "optimizer": "muon + sgd aux", "lr": args.lr,
            "aux_lr": args.aux_lr, "batch_size": B, "seq_len": L, "tokens_per_variant": r_morph["tokens"],
            "d_model": base.model.d_model, "k": base.k, "n_stages": n, "kind": "orthogonal",
            "threads": args.threads, "seed": base.run.seed, "wall_s": round(time.perf_counter() - t_all, 1),
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
