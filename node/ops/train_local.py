"""`swarm-node train-local`: train the chained stages in one process — the reference baseline.

The stages are built exactly as swarm nodes build them (``stages.model.build_stage``), each with
its own optimizer, learning-rate schedule and gradient clipping, and they talk through the same
boundary codes: the forward passes the code ``c`` (B, L, k) from stage to stage, the backward
passes ``∂L/∂c`` back, one stage at a time. The only differences from a swarm are that there is
no network and no staleness, which is what makes this the baseline every swarm figure is
compared with. ``train(...)`` is the loop as a function, its steps are ``node.ops.local_chain``'s;
``main`` is the command around it.
"""

from __future__ import annotations

import json
import logging
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
    from node.base import CheckpointError, CliError
    from node.ops.resources import resolve_device
    from stages import DataError, ManifestError, load_manifest

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
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CliError(str(e)) from None
    from node.ops.local_chain import ResumeError, TrainingDiverged

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
    random bytes, forgotten). Raises ``ResumeError`` for another run's checkpoint and
    ``TrainingDiverged`` when the loss stops being finite.
    """
    import torch

    from node.ops.local_chain import LocalChain
    from stages import Batches, load_corpus, lr_at, val_batches

    t_start = time.perf_counter()
    device = torch.device(device)
    m = manifest
    steps = m.train.steps if steps is None else int(steps)
    B, L, accum = m.data.batch_size, m.model.seq_len, m.train.grad_accum
    tokens_per_step = B * L * accum

    # 1. data and the chained stages, resumed from the newest checkpoint if asked
    corpus = corpus if corpus is not None else load_corpus(m.data)
    if not quiet:
        log.info("data: %s", corpus.description)
    batches = Batches(corpus.train, B, L, seed=m.run.seed, shard=0, num_shards=1)
    vbatches = [v.to(device) for v in val_batches(corpus.val, B, L, m.train.val_batches)]
    chain = LocalChain(m, device)
    start = 0
    if resume and checkpoint_dir is not None:
        found = chain.resume(checkpoint_dir)
        if found is not None:
            start = found
            if not quiet:
                log.info("resumed from checkpoint at step %d in %s", start, checkpoint_dir)
        elif not quiet:
            log.info("no checkpoint in %s yet: starting from step 0", checkpoint_dir)
    chain.prepare(start, morph_secret)

    # 2. the loop: one optimizer step, a morph when due, measurements, the step's log, a checkpoint
    record = _Record(m, steps, log_every=max(1, log_every or m.train.log_every), json_log=json_log,
                     display=_Progress(progress and not quiet, steps), quiet=quiet)
    morphs, morph_time, train_time, tokens, rate_ema = 0, 0.0, 0.0, 0, None
    bnd = {"fwd": 0, "bwd": 0}
    step = start
    try:
        while step < steps:
            t0 = time.perf_counter()
            lr = lr_at(m.schedule, m.optim.lr, step)
            unlocked = chain.unlock(step)
            if unlocked and not quiet:
                log.info("step %d: warm-up unlocked layers %s", step, unlocked)
            loss_val, bnd = chain.step(step, lr, batches)
            step += 1
            if chain.morph_due(step):
                t_m = time.perf_counter()
                chain.morph(step)
                morph_time += time.perf_counter() - t_m
                morphs += 1
            chain.updating = False
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            train_time += dt
            tokens += tokens_per_step
            rate_ema = tokens_per_step / dt if rate_ema is None else 0.9 * rate_ema + 0.1 * tokens_per_step / dt
            sharp = None
            if m.warmup.sharpness_every and step % m.warmup.sharpness_every == 0:
                sharp = chain.sharpness(batches.batch(0).to(device))
            val = None
            if (m.train.val_every and step % m.train.val_every == 0) or step == steps:
                val = chain.evaluate(vbatches)
            record.step(step, loss_val, lr, rate_ema, {k: v / tokens_per_step for k, v in bnd.items()}, val, sharp,
                        chain.masters is not None)
            if checkpoint_dir is not None and (
                (m.train.checkpoint_every and step % m.train.checkpoint_every == 0) or step == steps
            ):
                _checkpoint(chain, checkpoint_dir, step, quiet)
    except KeyboardInterrupt:
        record.close()
        if checkpoint_dir is not None and not chain.updating and step > start:
            _checkpoint(chain, checkpoint_dir, step, quiet)
        raise
    finally:
        record.close()

    # 3. the summary
    return {
        "start_step": start,
        "steps": step,
        **record.summary(),
        "tokens": tokens,
        "tokens_per_s": tokens / train_time if train_time > 0 else None,
        "boundary_bytes_per_token": {k: v / max(1, tokens_per_step) for k, v in bnd.items()},
        "device": str(device),
        "morphs": morphs,
        "morph_time_s": morph_time,
        "wall_s": time.perf_counter() - t_start,
        "stages": chain.stages,
    }


def _checkpoint(chain, checkpoint_dir, step: int, quiet: bool) -> None:
    path = chain.checkpoint(checkpoint_dir, step)
    if not quiet:
        log.info("checkpoint step %d -> %s", step, path)


class _Record:
    """What the loop keeps and says about each step: the loss, validation and sharpness
    histories, the progress line or log lines, and the ``--json-log`` file."""

    def __init__(self, manifest, steps: int, *, log_every: int, json_log, display, quiet: bool):
        self.m, self.steps, self.log_every, self.display, self.quiet = manifest, steps, log_every, display, quiet
        self.loss: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.sharpness: list[tuple[int, float]] = []
        self.jlog = open(json_log, "a", encoding="utf-8") if json_log else None

    def step(self, step: int, loss: float, lr: float, rate: float, bpt: dict, val: float | None,
             sharp: float | None, morphing: bool) -> None:
        m = self.m
        self.loss.append((step, loss))
        if sharp is not None:
            self.sharpness.append((step, sharp))
            if not self.quiet:
                log.info("step %d: preconditioned sharpness %.4g (adaptive edge of stability 2(1+b1)/((1-b1)lr)"
                         " = %.4g)", step, sharp, (2 + 2 * m.optim.betas[0]) / ((1 - m.optim.betas[0]) * lr))
        if val is not None:
            self.val.append((step, val))
        last_val = self.val[-1][1] if self.val else None
        self.display.update(step, loss, last_val, lr, rate, bpt, force=val is not None)
        if step % self.log_every and val is None and step != self.steps:
            return
        if not self.display.live and not self.quiet:
            log.info("%s", self.display.line(step, loss, last_val, lr, rate, bpt))
        if self.jlog:
            rec = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": rate, "boundary_bytes_per_token": bpt,
                   "time": time.time()}
            if val is not None:
                rec["val_loss"] = val
            if sharp is not None:
                rec["sharpness"] = sharp
            if morphing:
                rec["morph_epoch"] = step // m.morph.every
            self.jlog.write(json.dumps(rec) + "\n")
            self.jlog.flush()

    def close(self) -> None:
        self.display.close()
        if self.jlog:
            self.jlog.close()
            self.jlog = None

    def summary(self) -> dict:
        losses = [v for _, v in self.loss]
        head, tail = losses[: min(10, len(losses))], losses[-min(10, len(losses)):]
        return {
            "loss_history": self.loss,
            "val_history": self.val,
            "sharpness_history": self.sharpness,
            "val_loss": self.val[-1][1] if self.val else None,
            "loss_start": sum(head) / len(head) if head else None,
            "loss_end": sum(tail) / len(tail) if tail else None,
        }


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
