"""What a stage needs (memory) and what this machine has (RAM, VRAM), for `run` and `doctor`.

The estimate is analytic, so it can be checked before anything is allocated: parameters of the
stage from the manifest's shapes, times bytes per parameter for weights + gradients + optimizer
state, plus activation memory for the microbatches a stage keeps (each stage stores only the stage
input of an in-flight microbatch and recomputes the forward, so the peak is one microbatch's
forward/backward working set plus the stored inputs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stages import Manifest

# bytes per parameter: fp32 weights + fp32 grads + optimizer state (Adam family: 2 fp32 moments)
_OPT_STATE_BYTES = {"adamw": 8, "adam": 8, "nadam": 8, "sgd": 4, "muon": 4, "numuon": 4}


def stage_param_count(m: Manifest, index: int) -> int:
    """Trainable parameters of stage ``index`` (same shapes as stages/model.py builds)."""
    md = m.model
    d, f, v = md.d_model, md.ffn_dim, md.vocab_size
    k = m.k
    start, end = m.stages.layout[index]
    is_head, is_tail = index == 0, index == m.n_stages - 1
    constrained_tail = m.subspace.constrain_tail or not m.subspace.enabled
    n = 0
    for layer in range(start, end):
        constrained = m.subspace.enabled and not (is_tail and not constrained_tail)
        out_w = k if constrained else d
        n += 3 * d * d + out_w * d  # q, k, v, out (W = U·Z: Z has k rows)
        n += 2 * d * f + out_w * f  # SwiGLU gate, up, down
    if is_head:
        n += v * (k if m.subspace.enabled else d)  # learned token embedding (Z_emb)
    if is_tail:
        n += d * v  # LM head
    return n


@dataclass(frozen=True)
class StageMemory:
    params: int
    param_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes


def estimate_stage_memory(m: Manifest, index: int, batch_size: int | None = None) -> StageMemory:
    """Bytes stage ``index`` needs for training with the manifest's optimizer."""
    md = m.model
    b = batch_size or m.data.batch_size
    params = stage_param_count(m, index)
    per_param = 4 + 4 + _OPT_STATE_BYTES.get(m.optim.name, 8)
    # look-ahead keeps a second copy of the weights for the in-flight forward
    if m.asyncmesh.mode == "lookahead":
        per_param += 4
    start, end = m.stages.layout[index]
    tokens = b * md.seq_len
    # per layer working set (fp32): residual, qkv, attention scores, ffn hidden x3
    per_layer = tokens * (6 * md.d_model + 3 * md.ffn_dim) * 4 + b * md.n_heads * md.seq_len**2 * 4
    act = (end - start) * per_layer
    if index == m.n_stages - 1:
        act += tokens * md.vocab_size * 4 * 2  # logits and their gradient
    act += m.train.max_inflight * tokens * (m.k * 4 + 8)  # stored stage inputs
    return StageMemory(params=params, param_bytes=params * per_param, activation_bytes=int(act * 1.2))


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_device_bytes(device: str) -> int:
    """Free memory of a torch device string (``cpu``, ``cuda``, ``cuda:1``)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    return available_ram_bytes()


def resolve_device(spec: str) -> str:
    """The torch device string for ``--device``: ``auto`` -> ``cuda`` when available else
    ``cpu``; ``cpu``, ``cuda`` and ``cuda:N`` are checked against this machine. Anything else is a
    ``ValueError`` whose message names the flag and the fix (commands turn it into a ``CliError``)."""
    import torch

    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"--device {spec!r}: unsupported; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine; use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: no such GPU (this machine has {torch.cuda.device_count()})")
    return str(dev)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
