"""`swarm-node train-local`: train the chained stages in one process — the reference baseline.

The stages are built exactly as swarm nodes build them (``stages.model.build_stage``), each with
its own optimizer, learning-rate schedule and gradient clipping, and they talk through the same
boundary codes: the forward passes the code ``c`` (B, L, k) from stage to stage, the backward
passes ``∂L/∂c`` back, one stage at a time. The only differences from a swarm are that there is
no network and no staleness, which is what makes this the baseline every swarm figure is
compared with. ``train(...)`` is the loop as a function; ``main`` is the command around it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("swarm_node.train_local")


def add_arguments(p) -> None:
    p.add_argument("--manifest", default="default",
                   help="run manifest: a TOML file or a shipped name (default, test); default: default")
    p.add_argument("--steps", type=int, default=None,
                   help="train until this optimizer step (default: the manifest's train.steps)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="write checkpoints here every train.checkpoint_every steps and at the end")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in --checkpoint-dir")
    p.add_argument("--seed", type=int, default=None,
                   help="override run.seed (model init, basis U, token table T and data order)")
    p.add_argument("--json-log", default=None, help="append one JSON object per logged step to this file")
    p.add_argument("--no-progress", action="store_true",
                   help="plain log lines instead of the live progress line on a terminal")


def main(args) -> int:
    from node.ops.cli import CliError
    from stages import ManifestError, load_manifest

    try:
        manifest = load_manifest(args.manifest)
        if args.seed is not None:
            manifest = manifest.replace(run={"seed": args.seed})
    except ManifestError as e:
        raise CliError(str(e)) from e
    if args.steps is not None and args.steps <= 0:
        raise CliError(f"--steps must be positive, got {args.steps}")
    if args.resume and not args.checkpoint_dir:
        raise CliError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    device = resolve_device(args.device)
    from node.ops.checkpoint import CheckpointError
    from stages import DataError

    try:
        result = train(
            manifest,
            steps=args.steps,
            device=device,
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
            json_log=args.json_log,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (DataError, ResumeError, CheckpointError) as e:
        raise CliError(str(e)) from e
    except TrainingDiverged as e:
        log.error("%s", e)
        return 1
    summary = {k: result[k] for k in ("start_step", "steps", "loss_start", "loss_end", "val_loss", "morphs",
                                      "tokens_per_s", "boundary_bytes_per_token", "device", "wall_s")}
    print(json.dumps(summary), flush=True)
    return 0


class ResumeError(RuntimeError):
    """A checkpoint exists but does not belong to this run."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def resolve_device(spec: str):
    """``auto`` -> cuda if available else cpu; ``cuda:N`` checked against the visible devices."""
    import torch

    from node.ops.cli import CliError

    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise CliError(f"--device {spec!r}: not a device; use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"--device {spec}: CUDA is not available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CliError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise CliError(f"--device {spec!r}: unsupported; use auto, cpu, cuda or cuda:N")
    return dev


def train(
    manifest,
    steps: int | None = None,
    device: Any = "cpu",
    *,
    checkpoint_dir: str | Path | None = None,
    resume: bool = False,
    json_log: str | Path | None = None,
    progress: bool = False,
    corpus=None,
    log_every: int | None = None,
    quiet: bool = False,
    morph_secret: bytes | None = None,
) -> dict:
    """Train the chained stages of ``manifest`` until optimizer step ``steps``.

    Returns ``loss_history`` [(step, loss)], ``val_history`` [(step, val_loss)], ``val_loss``
    (last), ``loss_start`` / ``loss_end`` (mean of the first / last 10 logged losses),
    ``tokens_per_s`` (training steps only, validation and checkpoints excluded),
    ``boundary_bytes_per_token`` (forward and backward bytes per token summed over every stage
    boundary, measured on the tensors that cross it), ``tokens``, ``wall_s``, ``device``,
    ``morphs`` / ``morph_time_s`` (morph epochs done and their time, inside the training time;
    ``manifest.morph.every > 0`` morphs every boundary after every ``every``-th step).
    ``corpus`` may be passed to reuse a loaded ``stages.data.Corpus``. ``morph_secret`` fixes the
    secret a morphing run draws its private initialisation and transforms from (default: fresh
    random bytes, forgotten).
    """
    import torch

    from node.ops.checkpoint import (
        flatten_module,
        flatten_optimizer,
        load_latest_checkpoint,
        restore_module,
        restore_optimizer,
        save_checkpoint,
    )
    from stages import (
        Batches,
        build_optimizer,
        build_stage,
        diff_manifests,
        lm_loss,
        load_corpus,
        lr_at,
        manifest_from_dict,
        manifest_hash,
        set_lr,
        val_batches,
    )

    t_start = time.perf_counter()
    device = torch.device(device)
    m = manifest
    steps = m.train.steps if steps is None else int(steps)
    log_every = max(1, log_every or m.train.log_every)
    B, L, accum = m.data.batch_size, m.model.seq_len, m.train.grad_accum
    use_amp = device.type == "cuda"

    corpus = corpus if corpus is not None else load_corpus(m.data)
    if not quiet:
        log.info("data: %s", corpus.description)
    batches = Batches(corpus.train, B, L, seed=m.run.seed, shard=0, num_shards=1)
    vbatches = [v.to(device) for v in val_batches(corpus.val, B, L, m.train.val_batches)]

    stages = [build_stage(m, i, device=device) for i in range(m.n_stages)]
    optims = [build_optimizer(m, s, total_steps=m.schedule.total_steps) for s in stages]
    mhash = manifest_hash(m)
    start = 0
    if resume and checkpoint_dir is not None:
        found = load_latest_checkpoint(checkpoint_dir)
        if found is not None:
            start, tensors, meta = found
            if meta.get("manifest_hash") != mhash:
                try:
                    fields = diff_manifests(manifest_from_dict(meta["manifest"]), m)
                except Exception:  # an old or foreign meta: the hash alone is the answer
                    fields = []
                raise ResumeError(
                    f"checkpoint {checkpoint_dir} (step {start}) belongs to another run "
                    f"(differs in: {', '.join(fields) or 'manifest hash'}); use another --checkpoint-dir"
                )
            for i, (s, o) in enumerate(zip(stages, optims)):
                restore_module(s, tensors, prefix=f"stage{i}/model/")
                restore_optimizer(o, tensors, meta["optim"][i], prefix=f"stage{i}/optim/")
            if not quiet:
                log.info("resumed from checkpoint at step %d in %s", start, checkpoint_dir)
        elif not quiet:
            log.info("no checkpoint in %s yet: starting from step 0", checkpoint_dir)
    # architecture warm-up (manifest.warmup): each stage locks/unlocks its own blocks on the shared
    # schedule, as a swarm node does; groups due by ``start`` keep their checkpointed weights
    warmups = []
    if m.warmup.enabled:
        from stages import ArchWarmup

        warmups = [ArchWarmup(m, s, step=start) for s in stages]

    # morphing (manifest.morph, docs/MORPH.md): every morph.every steps each boundary gets a fresh
    # transform from a secret drawn here and forgotten; every non-head stage keeps a float64 master
    # (``morph_secret`` makes it reproducible, for tests and benchmarks). The stages after the head
    # start from a private initialisation drawn from that secret (a fresh run only): the public one
    # would let anyone align their frames (docs/MORPH.md)
    morphs, morph_time = 0, 0.0
    masters = None
    if m.morph.enabled:
        import secrets

        from stages import MorphMaster, private_init

        run_secret = morph_secret if morph_secret is not None else secrets.token_bytes(32)
        if start == 0:
            for s in stages[1:]:
                private_init(s, run_secret)
        masters = [None] + [MorphMaster(s) for s in stages[1:]]

    def morph(step: int) -> None:
        import secrets

        from stages import boundary_secret, morph_chain

        secret = secrets.token_bytes(32) if morph_secret is None else boundary_secret(morph_secret, step, -1)
        morph_chain(stages, secret, step // m.morph.every, kind=m.morph.kind,
                    epsilon=m.morph.epsilon, optimizers=optims, masters=masters)

    def checkpoint(step: int) -> None:
        tensors, optim_meta = {}, []
        for i, (s, o) in enumerate(zip(stages, optims)):
            tensors.update(flatten_module(s, prefix=f"stage{i}/model/"))
            ot, om = flatten_optimizer(o, prefix=f"stage{i}/optim/")
            tensors.update(ot)
            optim_meta.append(om)
        meta = {"manifest_hash": mhash, "manifest": m.to_dict(), "run_id": m.run.id, "optim": optim_meta,
                "kind": "train-local"}
        path = save_checkpoint(checkpoint_dir, step, tensors, meta)
        if not quiet:
            log.info("checkpoint step %d -> %s", step, path)

    def evaluate() -> float:
        for s in stages:
            s.eval()
        total = 0.0
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            for ids in vbatches:
                x = None
                for s in stages:
                    x = s(x, ids)
                total += lm_loss(x, ids).item()
        for s in stages:
            s.train()
        return total / max(1, len(vbatches))

    # preconditioned sharpness (docs/REFERENCES.md §5) every warmup.sharpness_every steps, over the hidden
    # matrices of all stages on one fixed training batch, P = diag(sqrt(v)+eps) of the stage optimizers
    sharp_every = m.warmup.sharpness_every
    sharp_hist: list[tuple[int, float]] = []
    sharp_state: dict = {}

    def measure_sharpness() -> float:
        from stages import SharpnessTracker, adam_preconditioner, hidden_matrix_names

        params, precond = [], []
        for s, o in zip(stages, optims):
            hidden = set(hidden_matrix_names(s))
            ps = [p for n, p in s.named_parameters() if n in hidden and p.requires_grad]
            params += ps
            pre = adam_preconditioner(o, ps) if precond is not None else None
            precond = None if pre is None else precond + pre
        key = tuple(id(p) for p in params)
        if sharp_state.get("key") != key:  # first call, or blocks unlocked: new parameter set
            sharp_state.update(key=key, tracker=SharpnessTracker(params, max_iters=5, seed=m.run.seed))
        ids = batches.batch(0).to(device)

        def loss_fn():
            x = None
            for s in stages:
                x = s(x, ids)
            return lm_loss(x.float(), ids)

        return float(sharp_state["tracker"].measure(loss_fn, precond=precond))

    jlog = open(json_log, "a", encoding="utf-8") if json_log else None
    display = _Progress(progress and not quiet, steps)
    loss_hist: list[tuple[int, float]] = []
    val_hist: list[tuple[int, float]] = []
    bnd = {"fwd": 0, "bwd": 0}
    train_time, tokens, rate_ema = 0.0, 0, None
    step = start
    updating = False
    try:
        while step < steps:
            t0 = time.perf_counter()
            lr = lr_at(m.schedule, m.optim.lr, step)
            for w, o in zip(warmups, optims):
                unlocked = w.apply(step, o)
                if unlocked and not quiet:
                    log.info("step %d: warm-up unlocked layers %s", step, unlocked)
            for o in optims:
                set_lr(o, lr)
                o.zero_grad(set_to_none=True)
            loss_sum, bnd = 0.0, {"fwd": 0, "bwd": 0}
            for j in range(accum):
                ids = batches.batch(step * accum + j).to(device, non_blocking=True)
                loss, fb, bb = _forward_backward(stages, ids, lm_loss, use_amp, device.type, accum)
                loss_sum += loss
                bnd["fwd"] += fb
                bnd["bwd"] += bb
            loss_val = loss_sum / accum
            if not math.isfinite(loss_val):
                raise TrainingDiverged(
                    f"loss became {loss_val} at step {step}; lower optim.lr or raise schedule.warmup_steps"
                )
            updating = True
            for s, o in zip(stages, optims):
                if m.optim.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(s.parameters(), m.optim.grad_clip)
                o.step()
            step += 1
            if masters is not None and step % m.morph.every == 0:
                t_m = time.perf_counter()
                morph(step)
                morph_time += time.perf_counter() - t_m
                morphs += 1
            updating = False
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            train_time += dt
            tokens += B * L * accum
            rate = B * L * accum / dt
            rate_ema = rate if rate_ema is None else 0.9 * rate_ema + 0.1 * rate
            loss_hist.append((step, loss_val))
            bpt = {k: v / (B * L * accum) for k, v in bnd.items()}

            sharp = None
            if sharp_every and step % sharp_every == 0:
                sharp = measure_sharpness()
                sharp_hist.append((step, sharp))
                if not quiet:
                    log.info("step %d: preconditioned sharpness %.4g (adaptive edge of stability 2(1+b1)/((1-b1)lr)"
                             " = %.4g)", step, sharp, (2 + 2 * m.optim.betas[0]) / ((1 - m.optim.betas[0]) * lr))

            val = None
            if (m.train.val_every and step % m.train.val_every == 0) or step == steps:
                val = evaluate()
                val_hist.append((step, val))
            display.update(step, loss_val, val_hist[-1][1] if val_hist else None, lr, rate_ema, bpt,
                           force=val is not None)
            if step % log_every == 0 or val is not None or step == steps:
                if not display.live and not quiet:
                    log.info("%s", display.line(step, loss_val, val_hist[-1][1] if val_hist else None,
                                                lr, rate_ema, bpt))
                if jlog:
                    rec = {"step": step, "loss": loss_val, "lr": lr, "tokens_per_s": rate_ema,
                           "boundary_bytes_per_token": bpt, "time": time.time()}
                    if val is not None:
                        rec["val_loss"] = val
                    if sharp is not None:
                        rec["sharpness"] = sharp
                    if masters is not None:
                        rec["morph_epoch"] = step // m.morph.every
                    jlog.write(json.dumps(rec) + "\n")
                    jlog.flush()
            if checkpoint_dir is not None and (
                (m.train.checkpoint_every and step % m.train.checkpoint_every == 0) or step == steps
            ):
                checkpoint(step)
    except KeyboardInterrupt:
        display.close()
        if checkpoint_dir is not None and not updating and step > start:
            checkpoint(step)
        raise
    finally:
        display.close()
        if jlog:
            jlog.close()

    losses = [v for _, v in loss_hist]
    head = losses[: min(10, len(losses))]
    tail = losses[-min(10, len(losses)):]
    return {
        "start_step": start,
        "steps": step,
        "loss_history": loss_hist,
        "val_history": val_hist,
        "sharpness_history": sharp_hist,
        "val_loss": val_hist[-1][1] if val_hist else None,
        "loss_start": sum(head) / len(head) if head else None,
        "loss_end": sum(tail) / len(tail) if tail else None,
        "tokens": tokens,
        "tokens_per_s": tokens / train_time if train_time > 0 else None,
        "boundary_bytes_per_token": {k: v / max(1, B * L * accum) for k, v in bnd.items()},
        "device": str(device),
        "morphs": morphs,
        "morph_time_s": morph_time,
        "wall_s": time.perf_counter() - t_start,
        "stages": stages,
    }


def _forward_backward(stages, ids, lm_loss, use_amp: bool, device_type: str, accum: int):
    """One microbatch through the chain, then back through it one stage at a time.

    Each stage's input code is a fresh leaf, as on a swarm node: the tail's backward yields
    ∂L/∂c for the code it received, which is handed to the previous stage's backward.
    Returns (loss, forward boundary bytes, backward boundary bytes).
    """
    import torch

    inputs, outputs = [], []
    x = None
    fwd_bytes = bwd_bytes = 0
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_amp):
        for s in stages:
            if x is not None:
                fwd_bytes += x.numel() * x.element_size()
                x = x.detach().requires_grad_(True)
            inputs.append(x)
            x = s(x, ids)
            outputs.append(x)
        loss = lm_loss(x, ids)
    (loss / accum).backward()
    for i in range(len(stages) - 1, 0, -1):
        g = inputs[i].grad
        bwd_bytes += g.numel() * g.element_size()
        outputs[i - 1].backward(g)
    return loss.item(), fwd_bytes, bwd_bytes


class _Progress:
    """One updating line on a terminal (stderr); nothing when not live (log lines are used then)."""

    def __init__(self, live: bool, total: int):
        self.live, self.total = live, total
        self._last = 0.0
        self._dirty = False

    def line(self, step, loss, val, lr, rate, bpt) -> str:
        val_s = f"{val:.3f}" if val is not None else "-"
        return (f"step {step}/{self.total}  loss {loss:.3f}  val {val_s}  lr {lr:.2e}  "
                f"{_si(rate)} tok/s  boundary {bpt['fwd']:.0f}+{bpt['bwd']:.0f} B/token")

    def update(self, step, loss, val, lr, rate, bpt, force=False) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and step != self.total:
            return
        self._last = now
        sys.stderr.write("\r" + self.line(step, loss, val, lr, rate, bpt) + "\x1b[K")
        if force:  # keep a permanent line at each validation
            sys.stderr.write("\n")
            self._dirty = False
        else:
            self._dirty = True
        sys.stderr.flush()

    def close(self) -> None:
        if self.live and self._dirty:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._dirty = False


def _si(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"
