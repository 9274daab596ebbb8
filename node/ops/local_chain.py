"""The chained stages of ``swarm-node train-local``, in one process: every stage built as a swarm
node builds it (``stages.build_stage``), each with its own optimizer, and the named steps the
reference loop (``node.ops.train_local.train``) takes with them: resume from a checkpoint, one
optimizer step, morph, validate, measure sharpness, write a checkpoint.

The stages talk through the same boundary codes as in a swarm: the forward passes the code ``c``
(B, L, k) from stage to stage, the backward passes ``∂L/∂c`` back, one stage at a time.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import Any

import torch

from node.base import (
    flatten_module,
    flatten_optimizer,
    load_latest_checkpoint,
    restore_module,
    restore_optimizer,
    save_checkpoint,
)
from stages import build_optimizer, build_stage, lm_loss, manifest_hash, set_lr


class ResumeError(RuntimeError):
    """A checkpoint exists but does not belong to this run."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class LocalChain:
    """The stages of ``manifest`` on ``device`` with their optimizers, from step 0 (or from a
    checkpoint: :meth:`resume`); call :meth:`prepare` once the start step is known."""

    def __init__(self, manifest, device: torch.device):
        m = self.manifest = manifest
        self.device = device
        self.use_amp = device.type == "cuda"
        self.stages = [build_stage(m, i, device=device) for i in range(m.n_stages)]
        self.optims = [build_optimizer(m, s, total_steps=m.schedule.total_steps) for s in self.stages]
        self.hash = manifest_hash(m)
        self.warmups: list = []
        self.masters: list | None = None  # morphing: each non-head stage's float64 master
        self.morph_secret: bytes | None = None
        self.updating = False  # inside an optimizer step or a morph: no checkpoint now
        self._sharpness: dict = {}

    # ------------------------------------------------------------------ start

    def resume(self, checkpoint_dir: str | Path) -> int | None:
        """Restore the newest valid checkpoint in ``checkpoint_dir``; its step, or None when there
        is none. Raises :class:`ResumeError` for a checkpoint of another run, naming the fields."""
        from stages import diff_manifests, manifest_from_dict

        found = load_latest_checkpoint(checkpoint_dir)
        if found is None:
            return None
        start, tensors, meta = found
        if meta.get("manifest_hash") != self.hash:
            try:
                fields = diff_manifests(manifest_from_dict(meta["manifest"]), self.manifest)
            except Exception:  # an old or foreign meta: the hash alone is the answer
                fields = []
            raise ResumeError(
                f"checkpoint {checkpoint_dir} (step {start}) belongs to another run "
                f"(differs in: {', '.join(fields) or 'manifest hash'}); use another --checkpoint-dir"
            )
        for i, (s, o) in enumerate(zip(self.stages, self.optims)):
            restore_module(s, tensors, prefix=f"stage{i}/model/")
            restore_optimizer(o, tensors, meta["optim"][i], prefix=f"stage{i}/optim/")
        return start

    def prepare(self, start: int, morph_secret: bytes | None = None) -> None:
        """Warm-up and morphing state for a run that goes on from step ``start``.

        Architecture warm-up (manifest.warmup): each stage locks/unlocks its own blocks on the
        shared schedule, as a swarm node does; groups due by ``start`` keep their checkpointed
        weights. Morphing (manifest.morph, docs/MORPH.md): every morph.every steps each boundary
        gets a fresh transform from a secret drawn here and forgotten; every non-head stage keeps a
        float64 master (``morph_secret`` makes it reproducible, for tests and benchmarks). The
        stages after the head start from a private initialisation drawn from that secret (a fresh
        run only): the public one would let anyone align their frames (docs/MORPH.md)."""
        m = self.manifest
        if m.warmup.enabled:
            from stages import ArchWarmup

            self.warmups = [ArchWarmup(m, s, step=start) for s in self.stages]
        self.morph_secret = morph_secret
        if m.morph.enabled:
            from stages import MorphMaster, private_init

            run_secret = morph_secret if morph_secret is not None else secrets.token_bytes(32)
            if start == 0:
                for s in self.stages[1:]:
                    private_init(s, run_secret)
            self.masters = [None] + [MorphMaster(s) for s in self.stages[1:]]

    # ------------------------------------------------------------------ one step

    def unlock(self, step: int) -> list:
        """Apply the warm-up schedule at ``step``; the layers it unlocked now."""
        unlocked = []
        for w, o in zip(self.warmups, self.optims):
            unlocked += w.apply(step, o) or []
        return unlocked

    def step(self, step: int, lr: float, batches) -> tuple[float, dict[str, int]]:
        """One optimizer step at ``step`` with learning rate ``lr``: ``grad_accum`` microbatches
        of ``batches`` through the chain and back, clip, update. Returns the mean loss and the
        boundary bytes (forward, backward) of the step. Raises :class:`TrainingDiverged` (before
        any update) when the loss is not finite."""
        m = self.manifest
        accum = m.train.grad_accum
        for o in self.optims:
            set_lr(o, lr)
            o.zero_grad(set_to_none=True)
        loss_sum, bnd = 0.0, {"fwd": 0, "bwd": 0}
        for j in range(accum):
            ids = batches.batch(step * accum + j).to(self.device, non_blocking=True)
            loss, fb, bb = self._forward_backward(ids, accum)
            loss_sum += loss
            bnd["fwd"] += fb
            bnd["bwd"] += bb
        loss_val = loss_sum / accum
        if not math.isfinite(loss_val):
            raise TrainingDiverged(
                f"loss became {loss_val} at step {step}; lower optim.lr or raise schedule.warmup_steps"
            )
        self.updating = True
        for s, o in zip(self.stages, self.optims):
            if m.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(s.parameters(), m.optim.grad_clip)
            o.step()
        return loss_val, bnd

    def _forward_backward(self, ids, accum: int) -> tuple[float, int, int]:
        """One microbatch through the chain, then back through it one stage at a time.

        Each stage's input code is a fresh leaf, as on a swarm node: the tail's backward yields
        ∂L/∂c for the code it received, which is handed to the previous stage's backward.
        Returns (loss, forward boundary bytes, backward boundary bytes).
        """
        inputs, outputs = [], []
        x = None
        fwd_bytes = bwd_bytes = 0
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.use_amp):
            for s in self.stages:
                if x is not None:
                    fwd_bytes += x.numel() * x.element_size()
                    x = x.detach().requires_grad_(True)
                inputs.append(x)
                x = s(x, ids)
                outputs.append(x)
            loss = lm_loss(x, ids)
        (loss / accum).backward()
        for i in range(len(self.stages) - 1, 0, -1):
            g = inputs[i].grad
            bwd_bytes += g.numel() * g.element_size()
            outputs[i - 1].backward(g)
        return loss.item(), fwd_bytes, bwd_bytes

    def morph_due(self, step: int) -> bool:
        return self.masters is not None and step % self.manifest.morph.every == 0

    def morph(self, step: int) -> None:
        """Move every boundary to the morph epoch of ``step`` (a fresh transform each)."""
        from stages import boundary_secret, morph_chain

        m = self.manifest
        secret = (secrets.token_bytes(32) if self.morph_secret is None
                  else boundary_secret(self.morph_secret, step, -1))
        morph_chain(self.stages, secret, step // m.morph.every, kind=m.morph.kind,
                    epsilon=m.morph.epsilon, optimizers=self.optims, masters=self.masters)

    # ------------------------------------------------------------------ measurements and checkpoints

    def evaluate(self, vbatches) -> float:
        """Mean validation loss over ``vbatches``."""
        for s in self.stages:
            s.eval()
        total = 0.0
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                                             enabled=self.use_amp):
            for ids in vbatches:
                x = None
                for s in self.stages:
                    x = s(x, ids)
                total += lm_loss(x, ids).item()
        for s in self.stages:
            s.train()
        return total / max(1, len(vbatches))

    def sharpness(self, ids) -> float:
        """Preconditioned sharpness (docs/REFERENCES.md §5) over the hidden matrices of all stages
        on the training batch ``ids``, P = diag(sqrt(v)+eps) of the stage optimizers."""
        from stages import SharpnessTracker, adam_preconditioner, hidden_matrix_names

        params, precond = [], []
        for s, o in zip(self.stages, self.optims):
            hidden = set(hidden_matrix_names(s))
            ps = [p for n, p in s.named_parameters() if n in hidden and p.requires_grad]
            params += ps
            pre = adam_preconditioner(o, ps) if precond is not None else None
            precond = None if pre is None else precond + pre
        key = tuple(id(p) for p in params)
        if self._sharpness.get("key") != key:  # first call, or blocks unlocked: new parameter set
            self._sharpness.update(key=key, tracker=SharpnessTracker(params, max_iters=5, seed=self.manifest.run.seed))

        def loss_fn():
            x = None
            for s in self.stages:
                x = s(x, ids)
            return lm_loss(x.float(), ids)

        return float(self._sharpness["tracker"].measure(loss_fn, precond=precond))

    def checkpoint(self, checkpoint_dir: str | Path, step: int) -> Path:
        """Write every stage's weights and optimizer state as the checkpoint of ``step``."""
        tensors: dict[str, Any] = {}
        optim_meta = []
        for i, (s, o) in enumerate(zip(self.stages, self.optims)):
            tensors.update(flatten_module(s, prefix=f"stage{i}/model/"))
            ot, om = flatten_optimizer(o, prefix=f"stage{i}/optim/")
            tensors.update(ot)
            optim_meta.append(om)
        m = self.manifest
        meta = {"manifest_hash": self.hash, "manifest": m.to_dict(), "run_id": m.run.id, "optim": optim_meta,
                "kind": "train-local"}
        return save_checkpoint(checkpoint_dir, step, tensors, meta)
