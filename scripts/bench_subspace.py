"""Benchmark: Subspace Networks vs the dense baseline, trained for the same tokens.

Both variants of one manifest (default: stages/runs/default.toml) are trained as chained stages in one
process (so the subspace run really goes through encode/decode at every boundary) on the same
batches of the bundled corpus, with the same optimizer and schedule. The dense model keeps the
same frozen token table (h0 = T[x] + E[x]), so the variants differ only in the constraint.
Prints ONE JSON object:

- bytes_per_token: per boundary, fwd (k values + token id) and bwd (k values), bf16 for both
  variants; compression_ratio = dense (fwd + bwd) / subspace (fwd + bwd)
- codec_max_rel_error: max over boundaries and tokens-batches of ‖decode(encode(h)) − h‖/‖h‖ for
  the residual h the *trained* subspace model actually produces there (float32), and the max
  abs difference between the chained-stage logits and the unsplit model's
- val_loss_dense, val_loss_subspace, val_loss_gap_rel = subspace / dense − 1
- tokens_per_s for both (training: forward + backward + optimizer step of the stage chain)
- codec_time_frac: (encode + decode) time / forward time of the stage that does both
- the settings used

Measured (300 x 16 x 128 tokens, default manifest, k = 8): the token table's scale matters most.
With T rows of norm ``token_table_scale`` and every branch adding RMS 1 per channel, scale 1 leaves
the token identity ~1/16 of one branch in constrained layers (gap 11%); scales 16 / 32 / 64 gave
gaps 4.6% / -2.0% / 3.5% (subspace val loss 1.66 / 1.57 / 1.68; dense 1.59 / 1.61 / 1.62).

``--quick`` runs the tiny test manifest for a few steps (a smoke run for the test suite).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from stages import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    Batches,
    Stage,
    SubspaceCodec,
    Transformer,
    build_model,
    build_optimizer,
    lm_loss,
    load_corpus,
    load_manifest,  # noqa: E402
    lr_at,
    set_lr,
    split_model,
    val_batches,
    wire_bytes_per_token,
)

WIRE_BYTES = 2  # bf16 on the wire, both variants


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", default="default", help="manifest file or shipped name")
    # Default: 2 x 300 steps of the manifest's 16 x 128 tokens, ~2.5 min per variant on 2 idle
    # cores (several times that when the box is shared). Short runs understate the gap: it grows
    # with training (measured: -0.3% after 120 x 8 x 128 tokens, 4.6% after 300 x 16 x 128).
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant")
    p.add_argument("--batch-size", type=int, default=0, help="sequences per step (0: manifest's)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: manifest's)")
    p.add_argument("--val-batches", type=int, default=0, help="validation batches (0: manifest's)")
    p.add_argument("--lr", type=float, default=0.0, help="peak learning rate (0: manifest's)")
    p.add_argument("--token-table-scale", type=float, default=-1.0, help="override subspace.token_table_scale")
    p.add_argument("--k", type=int, default=0, help="override subspace.k, coordinates per token (0: manifest's)")
    p.add_argument("--constrain-tail", choices=("manifest", "yes", "no"), default="manifest")
    p.add_argument("--variants", default="dense,subspace", help="comma list of dense,subspace")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=None, help="override run.seed (init, U, T and data order)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (test manifest, few steps)")
    return p.parse_args(argv)


def settings_manifest(args):
    m = load_manifest("test" if args.quick and args.manifest == "default" else args.manifest)
    sub: dict = {}
    if args.token_table_scale >= 0:
        sub["token_table_scale"] = args.token_table_scale
    if args.k:
        sub["k"] = args.k
    if args.constrain_tail != "manifest":
        sub["constrain_tail"] = args.constrain_tail == "yes"
    model = {"seq_len": args.seq_len} if args.seq_len else {}
    steps = args.steps
    warmup = min(m.schedule.warmup_steps, max(1, steps // 10))
    m = m.replace(
        subspace=sub,
        model=model,
        data={"batch_size": args.batch_size} if args.batch_size else {},
        optim={"lr": args.lr} if args.lr else {},
        schedule={"total_steps": steps, "warmup_steps": warmup},
        train={"steps": steps, "val_batches": args.val_batches or m.train.val_batches},
        run={"seed": args.seed} if args.seed is not None else {},
    )
    return m


def chain_forward(stages: list[Stage], ids: torch.Tensor) -> torch.Tensor:
    x = None
    for stage in stages:
        x = stage(x, ids)
    return x


@torch.no_grad()
def evaluate(stages: list[Stage], batches: list[torch.Tensor], device) -> float:
    losses = [lm_loss(chain_forward(stages, b.to(device)), b.to(device)).item() for b in batches]
    return sum(losses) / len(losses)


def train_variant(m, corpus, device) -> dict:
    """Train the stage chain of manifest ``m``; return val loss, throughput, curve, stages."""
    torch.manual_seed(m.run.seed)
    stages = split_model(build_model(m, device=device), m)
    chain = nn.ModuleList(stages)
    opt = build_optimizer(m, chain)
    B, L = m.data.batch_size, m.model.seq_len
    batches = Batches(corpus.train, B, L, seed=m.run.seed)
    val = val_batches(corpus.val, B, L, m.train.val_batches)
    curve, step_times = [], []
    log_every = max(1, m.train.steps // 10)
    for step in range(m.train.steps):
        ids = batches.batch(step).to(device)
        set_lr(opt, lr_at(m.schedule, m.optim.lr, step))
        t0 = time.perf_counter()
        loss = lm_loss(chain_forward(stages, ids), ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if m.optim.grad_clip > 0:
            nn.utils.clip_grad_norm_(chain.parameters(), m.optim.grad_clip)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        if not math.isfinite(loss.item()):
            raise SystemExit(f"bench_subspace: loss diverged at step {step} (k={m.k})")
        if step % log_every == 0 or step == m.train.steps - 1:
            curve.append([step, round(loss.item(), 4)])
            print(f"[bench_subspace] k={m.k} step {step} loss {loss.item():.4f} "
                  f"{statistics.mean(step_times[-log_every:]):.2f}s/step", file=sys.stderr, flush=True)
    # median step time, first steps (allocator / thread-pool warm-up) skipped: robust to the
    # other processes of a shared machine
    timed = step_times[min(3, len(step_times) // 2):]
    return {
        "stages": stages,
        "val_loss": evaluate(stages, val, device),
        "tokens_per_s": B * L / statistics.median(timed),
        "train_loss_curve": curve,
        "val": val,
    }


@torch.no_grad()
def codec_exactness(m, stages: list[Stage], val: list[torch.Tensor], device) -> dict:
    """Round-trip error of the trained model's real boundary residuals, and chain vs unsplit."""
    full = Transformer(m).to(device)
    full.embed.load_state_dict(stages[0].embed.state_dict())
    for s in stages:
        for i, blk in zip(s.layer_range, s.blocks):
            full.layers[i].load_state_dict(blk.state_dict())
    full.lm_head.load_state_dict(stages[-1].lm_head.state_dict())
    codec = stages[0].codec
    assert isinstance(codec, SubspaceCodec)
    boundaries = {s.layer_range.stop for s in stages[:-1]}  # h after these many layers crosses a wire
    rel_err, logit_diff = 0.0, 0.0
    for ids in val[:2]:
        ids = ids.to(device)
        U, T = codec.U, codec.T
        h = full.embed(ids, U, T)
        rope = _rope(full, ids)
        for i, blk in enumerate(full.layers):
            h = blk(h, rope, U)
            if i + 1 in boundaries:
                back = codec.decode(codec.encode(h, ids), ids)
                err = ((back - h).norm(dim=-1) / h.norm(dim=-1)).max().item()
                rel_err = max(rel_err, err)
        logit_diff = max(logit_diff, (full(ids) - chain_forward(stages, ids)).abs().max().item())
    return {"codec_max_rel_error": rel_err, "chain_vs_unsplit_max_abs_logit_diff": logit_diff}


def _rope(model: Transformer, ids):
    from stages import rope_tables

    return rope_tables(ids.shape[1], model.head_dim, model.rope_theta, ids.device)


def _min_time(fn, repeats: int, device) -> float:
    """Best of ``repeats`` runs: the least disturbed by other processes on a shared machine."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def codec_timing(stages: list[Stage], ids: torch.Tensor, device, repeats: int = 9) -> dict:
    """(encode + decode) / forward time of the stage that does both (a body stage if any)."""
    idx = 1 if len(stages) > 2 else 0
    stage = stages[idx]
    x = None if stage.is_head else chain_forward(stages[:idx], ids)
    h = stage.codec.decode(x, ids) if x is not None else stage.embed(ids, stage.codec.U, stage.codec.T)
    c = stage.codec.encode(h, ids)
    stage(x, ids)  # warm-up
    t_stage = _min_time(lambda: stage(x, ids), repeats, device)
    t_codec = _min_time(lambda: (stage.codec.decode(c, ids), stage.codec.encode(h, ids)), repeats * 3, device)
    return {"codec_time_frac": t_codec / t_stage, "codec_time_s": t_codec, "stage_forward_time_s": t_stage,
            "codec_timed_stage": idx}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick and args.steps == parse_args([]).steps:
        args.steps = 8
    device = torch.device(args.device)
    m = settings_manifest(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not set(variants) <= {"dense", "subspace"} or not variants:
        raise SystemExit(f"--variants: expected a comma list of dense,subspace; got {args.variants!r}")
    corpus = load_corpus(m.data)
    t_start = time.perf_counter()
    V, d = m.model.vocab_size, m.model.d_model
    dense_m, sub_m = m.replace(subspace={"enabled": False}), m.replace(subspace={"enabled": True})
    out: dict = {
        "benchmark": "subspace",
        "bytes_per_token": {
            "dense": wire_bytes_per_token(d, V, WIRE_BYTES),
            "subspace": wire_bytes_per_token(sub_m.k, V, WIRE_BYTES),
        },
    }
    bd, bs = out["bytes_per_token"]["dense"], out["bytes_per_token"]["subspace"]
    out["compression_ratio"] = round((bd["fwd"] + bd["bwd"]) / (bs["fwd"] + bs["bwd"]), 3)

    results = {}
    for name in variants:
        results[name] = train_variant(dense_m if name == "dense" else sub_m, corpus, device)
    if "subspace" in results:
        r = results["subspace"]
        out.update(codec_exactness(sub_m, r["stages"], r["val"], device))
        out.update(codec_timing(r["stages"], r["val"][0].to(device), device))
    for name, r in results.items():
        out[f"val_loss_{name}"] = round(r["val_loss"], 4)
    if len(results) == 2:
        out["val_loss_gap_rel"] = round(results["subspace"]["val_loss"] / results["dense"]["val_loss"] - 1, 4)
    out["tokens_per_s"] = {name: round(r["tokens_per_s"], 1) for name, r in results.items()}
    out["train_loss_curve"] = {name: r["train_loss_curve"] for name, r in results.items()}
    tokens = m.train.steps * m.data.batch_size * m.model.seq_len
    out["settings"] = {
        "manifest": "test (quick)" if args.quick and args.manifest == "default" else args.manifest,
        "d_model": d, "n_layers": m.model.n_layers, "k": sub_m.k, "vocab_size": V,
        "layout": [list(r) for r in m.stages.layout], "constrain_tail": m.subspace.constrain_tail,
        "token_table_scale": m.subspace.token_table_scale, "dense_embedding": "T[x] + E[x]",
        "optimizer": m.optim.name, "lr": m.optim.lr, "schedule": m.schedule.kind,
        "warmup_steps": m.schedule.warmup_steps, "steps": m.train.steps, "batch_size": m.data.batch_size,
        "seq_len": m.model.seq_len, "tokens_per_variant": tokens, "val_tokens": m.train.val_batches
        * m.data.batch_size * m.model.seq_len, "wire_dtype": "bf16", "train_dtype": "float32",
        "device": str(device), "threads": torch.get_num_threads(), "seed": m.run.seed,
        "corpus": corpus.description, "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
