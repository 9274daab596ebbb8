"""Atomic checkpoints: safetensors for tensors, JSON for everything else, never pickle.

A checkpoint is one file ``ckpt-<step>.safetensors`` whose safetensors metadata holds the JSON
meta (step, manifest hash, optimizer hyper-parameters, ...) and a SHA-256 over the tensor bytes.
It is written to a temp file in the same folder, fsynced, renamed over its final name, and the
folder is fsynced: a crash at any point leaves either the old set of checkpoints or the new one,
never a half file under a checkpoint name. Loading tries the newest first and falls back, with a
warning, when a file is truncated or its checksum does not match.

Module and optimizer state are flattened to ``{name: tensor}`` plus JSON-able meta with
``flatten_module`` / ``flatten_optimizer`` and put back with ``restore_module`` /
``restore_optimizer``; ``torch.load`` is never used.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.base.errors import CheckpointError

log = logging.getLogger("swarm_node.checkpoint")

FORMAT = "swarm-node-ckpt/1"
_NAME = re.compile(r"^ckpt-(\d{9,})\.safetensors$")
_TMP = re.compile(r"^\.ckpt-\d+\.safetensors\.tmp\.(\d+)$")


def checkpoint_path(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"ckpt-{step:09d}.safetensors"


def list_checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every file named like a checkpoint, newest first (validity unchecked)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cpu_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies that do not alias each other (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint entry {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            key = t.untyped_storage().data_ptr()
            if key in seen:
                t = t.clone()
            seen.add(key)
        out[name] = t
    return out


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # some filesystems / platforms do not allow opening a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                    keep: int = 3) -> Path:
    """Write ``tensors`` + ``meta`` as checkpoint ``step`` atomically; keep the newest ``keep``."""
    from safetensors.torch import save

    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _cpu_unshared(tensors)
    full_meta = dict(meta, step=step)
    try:
        meta_json = json.dumps(full_meta, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from e
    blob = save(tensors, metadata={"format": FORMAT, "meta": meta_json, "sha256": _tensor_digest(tensors)})
    final = checkpoint_path(d, step)
    tmp = d / f".{final.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if e.errno == errno.ENOSPC:
            raise CheckpointError(
                f"no space left on the device holding {d} while writing a {len(blob):,}-byte "
                f"checkpoint for step {step}; free some space or point --checkpoint-dir elsewhere "
                "(the previous checkpoints are intact)"
            ) from e
        raise CheckpointError(f"could not write checkpoint {final}: {e}") from e
    _fsync_dir(d)
    _prune(d, keep)
    return final


def _prune(d: Path, keep: int) -> None:
    for _, p in list_checkpoints(d)[max(1, keep):]:
        try:
            p.unlink()
        except OSError as e:
            log.warning("could not remove old checkpoint %s: %s", p, e)
    for p in d.iterdir():  # temp files of writers that died mid-write
        m = _TMP.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            try:
                p.unlink()
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict]:
    """Read and verify one checkpoint file; raise CheckpointError if it is damaged."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a swarm-node checkpoint (format {header.get('format')!r})")
    try:
        meta = json.loads(header["meta"])
        step = int(meta["step"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: damaged meta ({e})") from e
    if _tensor_digest(tensors) != header.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch, the tensor data is corrupt")
    return step, tensors, meta


def load_latest_checkpoint(ckpt_dir: str | Path) -> tuple[int, dict[str, torch.Tensor], dict] | None:
    """The newest valid checkpoint in ``ckpt_dir`` as ``(step, tensors, meta)``, or None if there is none.

    A damaged newer file is skipped with a warning naming it, and the previous one is used.
    """
    for step, path in list_checkpoints(ckpt_dir):
        try:
            return read_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping damaged checkpoint: %s; trying the previous one", e)
    return None


# ---------------------------------------------------------------- module and optimizer state


def flatten_module(module: nn.Module, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """A module's parameters and persistent buffers as ``{prefix + name: tensor}``."""
    return {prefix + k: v for k, v in module.state_dict().items()}


def restore_module(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "model/") -> None:
    """Load what ``flatten_module`` saved; names and shapes must match exactly."""
    own = module.state_dict()
    sd = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not match this model: missing {missing[:5]}, unexpected {extra[:5]} "
            "(was it written for another manifest or stage?)"
        )
    for k, v in sd.items():
        if v.shape != own[k].shape:
            raise CheckpointError(
                f"checkpoint tensor {prefix}{k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}"
            )
    module.load_state_dict(sd, strict=True)


def flatten_optimizer(optimizer: torch.optim.Optimizer, prefix: str = "optim/") -> tuple[dict[str, torch.Tensor], dict]:
    """A torch optimizer's state: tensors as ``{prefix + "<param>/<key>": t}``, the rest as JSON-able meta."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}{idx}/{key}"] = value
            else:
                scalars.setdefault(str(idx), {})[key] = _jsonable(value, f"optimizer state {idx}.{key}")
    groups = [
        {k: _jsonable(v, f"optimizer param_groups.{k}") for k, v in g.items()} for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict,
                      prefix: str = "optim/") -> None:
    """Load what ``flatten_optimizer`` saved into an optimizer built over the same parameters."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        idx, _, key = name[len(prefix):].partition("/")
        state.setdefault(int(idx), {})[key] = t
    for idx, values in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(values)
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    own = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in own] != [len(g["params"]) for g in groups]:
        raise CheckpointError("optimizer checkpoint does not match this model's parameter groups")
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state does not fit this optimizer: {e}") from e


def _jsonable(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where) for k, v in value.items()}
    raise CheckpointError(f"{where}: {type(value).__name__} cannot be stored without pickle")
