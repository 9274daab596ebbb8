"""Run manifest: everything the peers of one run must agree on, as typed dataclasses from TOML.

A manifest fixes the model shape, the stage layout (which layers each stage holds), the
Subspace width k (coordinates per token on the wire), the seed (basis U and token table T
derive from it), optimizer and schedule, data, AsyncMesh averaging, SENTINEL parameters and the
protocol version (``protocol.frames.PROTOCOL_VERSION``).

``load_manifest(path)`` parses and validates; every mistake raises ``ManifestError`` naming
the field (``model.n_heads: 6 does not divide model.d_model=256``). ``manifest_hash`` is the
SHA-256 of the canonical JSON of the *consensus* fields; ``diff_manifests`` names the fields
that differ so a node that refuses to join can say why.
"""

from __future__ import annotations

import dataclasses
import base64
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol import PROTOCOL_VERSION

KNOWN_OPTIMIZERS = ("adamw", "adam", "nadam", "sgd", "muon", "numuon")
KNOWN_SCHEDULES = ("constant", "cosine", "linear")
KNOWN_DATA_SOURCES = ("stdlib", "text", "hf")
KNOWN_PIPELINE_MODES = ("lookahead", "none", "gpipe")
KNOWN_LOOKAHEAD_TARGETS = ("momentum", "update")
KNOWN_LOOKAHEAD_HORIZONS = ("stage", "pipeline")
KNOWN_BLOCK_NORMS = ("peri", "pre", "post")
KNOWN_AUX_OPTIMIZERS = ("adamw", "sgd")
KNOWN_MORPH_KINDS = ("orthogonal", "conditioned")
# optimizers whose step commutes with an orthogonal change of basis of the morphed matrices
# (stages/morph.py, docs/MORPH.md): first-moment methods; Adam's second moment is per coordinate
MORPH_EQUIVARIANT_OPTIMIZERS = ("sgd", "muon", "numuon")


class ManifestError(ValueError):
    """A manifest is unusable; the message names the field and what is wrong with it."""


BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (stages/data.py): the only one a run can use


@dataclass(frozen=True)
class RunConfig:
    id: str = "swarm-default"
    seed: int = 1234
    protocol_version: int = PROTOCOL_VERSION
    # the organisers' Ed25519 public key (base64): only a manifest signed by it joins this run, and
    # the run's DHT records live under its fingerprint. Empty: an unsigned run (local swarms only)
    organiser: str = ""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # BYTE_VOCAB: the byte tokenizer's (stages/data.py)
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    ffn_hidden: int = 0  # 0: SwiGLU default, 8/3 * d rounded up to a multiple of 32
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # where the weightless RMSNorms sit in a block: "peri" (default; input and branch output,
    # h + rmsnorm(f(rmsnorm(h))), papers §1) or "pre" (the standard pre-norm block,
    # h + f(rmsnorm(h)); benchmark variant, scripts/bench_optim.py warm-up experiment) or "post"
    # (post-LN, rmsnorm(h + f(h)); dense runs only: it rescales T[x] and breaks the Subspace codec)
    block_norm: str = "peri"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return int(math.ceil(8 * self.d_model / 3 / 32) * 32)


@dataclass(frozen=True)
class SubspaceConfig:
    enabled: bool = True
    k: int = 8  # coordinates per token on the wire, c = Uᵀ(h − T[x]); 1 <= k <= d_model
    constrain_tail: bool = False
    token_table_scale: float = 1.0  # T ~ N(0, scale^2 / d) per entry


@dataclass(frozen=True)
class StagesConfig:
    # half-open layer ranges [start, end) per stage, in pipeline order
    layout: tuple[tuple[int, int], ...] = ((0, 2), (2, 4), (4, 6))

    @property
    def n_stages(self) -> int:
        return len(self.layout)


def even_layout(n_layers: int, n_stages: int) -> list[list[int]]:
    """``stages.layout`` splitting ``n_layers`` over ``n_stages`` as evenly as rounding allows."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_stages} stages")
    cuts = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return [[cuts[i], cuts[i + 1]] for i in range(n_stages)]


# Betas an optimizer gets when the manifest omits them. NAdam (the default pipeline optimizer,
# docs/REFERENCES.md §2) uses a long first-moment memory, 0.99: under asynchronous stale gradients the
# momentum averages over the delay; AdamW/Adam keep the short-run LM defaults 0.9, 0.95. The
# others (sgd, muon, numuon: their aux AdamW groups) use 0.9, 0.95.
DEFAULT_BETAS = {"nadam": (0.99, 0.999), "adamw": (0.9, 0.95), "adam": (0.9, 0.95)}
_OTHER_BETAS = (0.9, 0.95)


def default_betas(name: str) -> tuple[float, float]:
    """The betas ``optim.name`` gets when ``optim.betas`` is omitted."""
    return DEFAULT_BETAS.get(name, _OTHER_BETAS)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "nadam"
    lr: float = 3e-3
    # () = omitted: resolved to default_betas(name) at construction, so the hashed manifest
    # always holds the betas actually used (explicit and implied defaults hash the same)
    betas: tuple[float, ...] = ()
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    momentum: float = 0.95  # muon / numuon / sgd
    # numuon rank schedule: r(t) held at rank_start for rank_hold_frac of training, then cosine
    # decayed to rank_final by rank_decay_end_frac
    rank_start: float = 1.0
    rank_final: float = 0.25
    rank_hold_frac: float = 0.1
    rank_decay_end_frac: float = 0.8
    # the optimizer used by muon / numuon for embeddings, head and gains
    aux_lr: float = 3e-3
    # ... and its kind: "adamw" (betas, eps) or "sgd" (Nesterov momentum ``momentum``; equivariant
    # under the morph, so a morphing run with muon / numuon needs it: the tail's LM head is morphed)
    aux_optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if not self.betas:
            object.__setattr__(self, "betas", default_betas(self.name))


@dataclass(frozen=True)
class ScheduleConfig:
    kind: str = "cosine"
    warmup_steps: int = 20
    total_steps: int = 400
    min_lr_frac: float = 0.1


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # stdlib | text | hf
    path: str = ""  # text file or folder (text), dataset dir saved with save_to_disk (hf)
    text_field: str = "text"
    val_fraction: float = 0.05
    batch_size: int = 16  # sequences per microbatch


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    val_every: int = 50
    val_batches: int = 8
    checkpoint_every: int = 100
    log_every: int = 10
    grad_accum: int = 1
    max_inflight: int = 4  # microbatches a head keeps in flight


@dataclass(frozen=True)
class AsyncMeshConfig:
    mode: str = "lookahead"  # lookahead | none | gpipe
    # what the look-ahead extrapolates: the momentum's carried share of the next τ̂ steps, or
    # τ̂ × the current update direction (stages/asyncmesh.py lookahead_params)
    lookahead_target: str = "momentum"
    # how far ahead: "stage", this stage's own τ̂ (docs/REFERENCES.md §2); "pipeline", the largest delay in
    # the pipeline (the head's τ̂, carried in fwd frames), so every stage extrapolates to when the
    # microbatch's last gradient lands (docs/ASYNCMESH.md: helps with AdamW, neutral with NAdam)
    lookahead_horizon: str = "stage"
    gpipe_flush_every: int = 4
    delay_ema: float = 0.9
    avg_fraction: float = 0.05  # p
    avg_every: int = 10  # H
    avg_correction: bool = True
    avg_timeout_s: float = 30.0
    # rounds start on a shared wall clock: slots of this many seconds; a replica joins every slot
    # that is a multiple of its stride (node/net/averaging.py; docs/ASYNCMESH.md)
    avg_period_s: float = 5.0
    # an applied round's parameter delta is spread over this many local steps (1: at once), so a
    # replica's outputs do not jump when it averages (stages/avg_blend.py; docs/ASYNCMESH.md)
    avg_blend_steps: int = 6


@dataclass(frozen=True)
class SentinelConfig:
    enabled: bool = True
    beta_act: float = 0.9
    beta_grad: float = 0.8
    n_projections: int = 16
    warmup: int = 10
    window: int = 64
    kappa: float = 3.0
    flags_to_ban: int = 3
    ban_margin: float = 0.5  # a flag counts (score − 1)/ban_margin toward a ban, in [0.25, 1]; 0: every flag 1
    replace_rejected_grad: bool = False
    allow_attacks: bool = False


@dataclass(frozen=True)
class WarmupConfig:
    """Architecture warm-up (docs/REFERENCES.md §5): unlock groups of blocks at given steps."""

    enabled: bool = False
    # groups of global layer indices, and the step at which each group unlocks
    groups: tuple[tuple[int, ...], ...] = ()
    unlock_steps: tuple[int, ...] = ()
    sharpness_every: int = 0  # 0 = off
    ramp_steps: int = 0  # blend a newly unlocked block in linearly over this many steps (0 = off)


@dataclass(frozen=True)
class MorphConfig:
    """Unextractable weights (docs/MORPH.md, docs/REFERENCES.md): every ``every`` optimizer steps each
    stage boundary gets a fresh random transform, folded into the sender's output side and (its
    inverse) into the receiver's input side. 0 = off (the default)."""

    every: int = 0
    # "orthogonal": Haar-random O(k); "conditioned": U·diag(e^u)·Vᵀ, u ~ U[-epsilon, epsilon]
    kind: str = "orthogonal"
    epsilon: float = 0.1

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(frozen=True)
class SignatureConfig:
    """``[signature]``: the organiser's Ed25519 signature (base64) over the manifest hash, written by
    ``swarm-node manifest sign``. Not a consensus field: it signs them."""

    ed25519: str = ""


@dataclass(frozen=True)
class Manifest:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    asyncmesh: AsyncMeshConfig = field(default_factory=AsyncMeshConfig)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    morph: MorphConfig = field(default_factory=MorphConfig)
    signature: SignatureConfig = field(default_factory=SignatureConfig)

    @property
    def k(self) -> int:
        """Boundary width: ``subspace.k`` coordinates per token, or d_model for a dense run."""
        return self.subspace.k if self.subspace.enabled else self.model.d_model

    @property
    def n_stages(self) -> int:
        return self.stages.n_stages

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def replace(self, **sections: Any) -> Manifest:
        """Copy with some fields changed: ``m.replace(model={"d_model": 128})``; validated."""
        data = self.to_dict()
        for section, values in sections.items():
            if section not in data:
                raise ManifestError(f"unknown manifest section {section!r}")
            data[section].update(values)
        return manifest_from_dict(data)


# Sections and fields peers must agree on. train/data.batch_size are local choices.
_LOCAL_ONLY = {
    "train": None,  # whole section local
    "signature": None,  # signs the consensus fields, is not one
    "data": ("batch_size", "path"),
}

_SECTIONS = {f.name: f.type for f in dataclasses.fields(Manifest)}


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _section_class(name: str) -> type:
    return {
        "run": RunConfig,
        "model": ModelConfig,
        "subspace": SubspaceConfig,
        "stages": StagesConfig,
        "optim": OptimConfig,
        "schedule": ScheduleConfig,
        "data": DataConfig,
        "train": TrainConfig,
        "asyncmesh": AsyncMeshConfig,
        "sentinel": SentinelConfig,
        "warmup": WarmupConfig,
        "morph": MorphConfig,
        "signature": SignatureConfig,
    }[name]


def _coerce(section: str, name: str, default: Any, value: Any) -> Any:
    where = f"{section}.{name}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ManifestError(f"{where}: expected true/false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestError(f"{where}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ManifestError(f"{where}: must be finite, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ManifestError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise ManifestError(f"{where}: expected a list, got {value!r}")
        out = []
        for item in value:
            if isinstance(item, (list, tuple)):
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
                    raise ManifestError(f"{where}: expected lists of integers, got {value!r}")
                out.append(tuple(item))
            elif isinstance(item, bool) or not isinstance(item, (int, float)):
                raise ManifestError(f"{where}: expected numbers, got {value!r}")
            else:
                out.append(item)
        return tuple(out)
    return value


def manifest_from_dict(data: dict[str, Any]) -> Manifest:
    """Build and validate a manifest from a plain mapping (as parsed from TOML)."""
    if not isinstance(data, dict):
        raise ManifestError("manifest must be a table of sections")
    sections: dict[str, Any] = {}
    for section, values in data.items():
        if section not in _SECTIONS:
            raise ManifestError(
                f"unknown manifest section [{section}]; known: {', '.join(sorted(_SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ManifestError(f"[{section}] must be a table")
        if section == "subspace" and "compression_rate" in values:
            raise ManifestError(_compression_rate_removed(data, values["compression_rate"]))
        cls = _section_class(section)
        defaults = cls()
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, value in values.items():
            if name not in known:
                raise ManifestError(
                    f"{section}.{name}: unknown field; known: {', '.join(sorted(known))}"
                )
            if (section, name) == ("optim", "betas") and isinstance(value, (list, tuple)) and not value:
                # an empty list would silently mean "the optimizer's default"; omit the field instead
                raise ManifestError("optim.betas: expected two numbers in [0, 1), got []; "
                                    "omit the field for the optimizer's default")
            kwargs[name] = _coerce(section, name, getattr(defaults, name), value)
        sections[section] = cls(**kwargs)
    manifest = Manifest(**sections)
    validate_manifest(manifest)
    return manifest


def _compression_rate_removed(data: dict[str, Any], rate: Any) -> str:
    """The error for ``[subspace] compression_rate``, the width's old spelling (``k = d_model // rate``)."""
    model = data.get("model")
    d_model = model.get("d_model") if isinstance(model, dict) else None
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        d_model = ModelConfig.d_model
    hint = ""
    if isinstance(rate, int) and not isinstance(rate, bool) and 1 <= rate <= d_model:
        hint = f"; compression_rate = {rate} meant k = {d_model} // {rate} = {d_model // rate}"
    return f'subspace.compression_rate was removed: write "k = N" (1 <= N <= {d_model}){hint}'


def load_manifest(path: str | Path) -> Manifest:
    """Load a manifest from a TOML file, or a name of a shipped one (``default``, ``test``)."""
    p = Path(path)
    if not p.exists() and not p.suffix:
        shipped = shipped_manifest_path(str(path))
        if shipped is not None:
            p = shipped
    if not p.exists():
        raise ManifestError(f"manifest file not found: {path}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{p}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ManifestError(f"{p}: not UTF-8 text: {e}") from e
    return manifest_from_dict(data)


def shipped_manifest_path(name: str) -> Path | None:
    """Path of a manifest shipped with the project (``stages/runs/NAME.toml``), if present."""
    candidate = Path(__file__).resolve().parent / "runs" / f"{name}.toml"
    return candidate if candidate.exists() else None


def _is_ed25519_public_b64(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 32
    except (ValueError, TypeError):
        return False


def validate_manifest(m: Manifest) -> None:
    """Raise ManifestError with a specific message for the first problem found."""
    md = m.model
    if not m.run.id or not m.run.id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ManifestError(f"run.id: must be non-empty [A-Za-z0-9._-], got {m.run.id!r}")
    if m.run.organiser and not _is_ed25519_public_b64(m.run.organiser):
        raise ManifestError(f"run.organiser: expected an Ed25519 public key in base64 (44 characters), "
                            f"got {m.run.organiser[:60]!r}; copy it from `swarm-node manifest keygen`")
    if m.signature.ed25519 and not m.run.organiser:
        raise ManifestError("[signature] without run.organiser: a signature needs the organiser key it verifies with")
    if m.run.protocol_version != PROTOCOL_VERSION:
        raise ManifestError(
            f"run.protocol_version: this node speaks version {PROTOCOL_VERSION}, "
            f"the manifest asks for {m.run.protocol_version}"
        )
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
        if getattr(md, name) <= 0:
            raise ManifestError(f"model.{name}: must be positive, got {getattr(md, name)}")
    if md.d_model % md.n_heads:
        raise ManifestError(f"model.n_heads: {md.n_heads} does not divide model.d_model={md.d_model}")
    if md.head_dim % 2:
        raise ManifestError(f"model: head_dim={md.head_dim} must be even for RoPE")
    if md.ffn_hidden < 0:
        raise ManifestError(f"model.ffn_hidden: must be >= 0, got {md.ffn_hidden}")
    if md.block_norm not in KNOWN_BLOCK_NORMS:
        raise ManifestError(
            f"model.block_norm: unknown placement {md.block_norm!r}; known: {', '.join(KNOWN_BLOCK_NORMS)}"
        )
    if md.block_norm == "post" and m.subspace.enabled:
        raise ManifestError(
            "model.block_norm: 'post' (post-norm blocks) needs subspace.enabled = false: a post-norm "
            "block rescales the whole residual stream, so h - T[x] leaves span(U) and the Subspace "
            "boundary codec is not exact; use a dense run or block_norm 'peri' / 'pre'"
        )
    if md.vocab_size != BYTE_VOCAB:
        raise ManifestError(f"model.vocab_size: must be {BYTE_VOCAB}, the byte tokenizer's vocabulary (every token "
                            f"is one UTF-8 byte), got {md.vocab_size}")
    sub = m.subspace
    if sub.enabled:
        if sub.k < 1:
            raise ManifestError(f"subspace.k: must be >= 1 (coordinates per token on the wire), got {sub.k}")
        if sub.k > md.d_model:
            raise ManifestError(
                f"subspace.k: {sub.k} coordinates per token exceed model.d_model={md.d_model}; "
                f"k must be in 1..{md.d_model}"
            )
    if sub.token_table_scale < 0:
        raise ManifestError("subspace.token_table_scale: must be >= 0")
    layout = m.stages.layout
    if not layout:
        raise ManifestError("stages.layout: at least one stage is needed")
    expected = 0
    for i, rng in enumerate(layout):
        if len(rng) != 2:
            raise ManifestError(f"stages.layout[{i}]: expected [start, end], got {list(rng)}")
        start, end = rng
        if start != expected:
            if start > expected:
                raise ManifestError(f"stages.layout: layers {expected}..{start - 1} are not covered by any stage")
            raise ManifestError(f"stages.layout[{i}]: starts at layer {start}, overlapping the previous stage")
        if end <= start:
            raise ManifestError(f"stages.layout[{i}]: empty or reversed range [{start}, {end})")
        expected = end
    if expected != md.n_layers:
        if expected < md.n_layers:
            raise ManifestError(
                f"stages.layout: layers {expected}..{md.n_layers - 1} are not covered by any stage"
            )
        raise ManifestError(f"stages.layout: covers {expected} layers but model.n_layers={md.n_layers}")
    o = m.optim
    if o.name not in KNOWN_OPTIMIZERS:
        raise ManifestError(f"optim.name: unknown optimizer {o.name!r}; known: {', '.join(KNOWN_OPTIMIZERS)}")
    if o.lr <= 0 or o.aux_lr <= 0:
        raise ManifestError("optim.lr / optim.aux_lr: must be positive")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ManifestError(f"optim.betas: expected two numbers in [0, 1), got {list(o.betas)}")
    if not 0 < o.rank_final <= 1 or not 0 < o.rank_start <= 1:
        raise ManifestError("optim.rank_start / optim.rank_final: must be in (0, 1]")
    if o.aux_optimizer not in KNOWN_AUX_OPTIMIZERS:
        raise ManifestError(f"optim.aux_optimizer: unknown {o.aux_optimizer!r}; known: {', '.join(KNOWN_AUX_OPTIMIZERS)}")
    s = m.schedule
    if s.kind not in KNOWN_SCHEDULES:
        raise ManifestError(f"schedule.kind: unknown schedule {s.kind!r}; known: {', '.join(KNOWN_SCHEDULES)}")
    if s.warmup_steps < 0 or s.total_steps <= 0:
        raise ManifestError("schedule: warmup_steps must be >= 0 and total_steps > 0")
    d = m.data
    if d.source not in KNOWN_DATA_SOURCES:
        raise ManifestError(f"data.source: unknown source {d.source!r}; known: {', '.join(KNOWN_DATA_SOURCES)}")
    if d.source in ("text", "hf") and not d.path:
        raise ManifestError(f"data.path: required when data.source = {d.source!r}")
    if not 0 < d.val_fraction < 1:
        raise ManifestError(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if d.batch_size <= 0:
        raise ManifestError("data.batch_size: must be positive")
    t = m.train
    if t.steps <= 0 or t.grad_accum <= 0 or t.max_inflight <= 0:
        raise ManifestError("train.steps, train.grad_accum, train.max_inflight: must be positive")
    a = m.asyncmesh
    if a.mode not in KNOWN_PIPELINE_MODES:
        raise ManifestError(
            f"asyncmesh.mode: unknown mode {a.mode!r}; known: {', '.join(KNOWN_PIPELINE_MODES)}"
        )
    if a.lookahead_target not in KNOWN_LOOKAHEAD_TARGETS:
        raise ManifestError(
            f"asyncmesh.lookahead_target: unknown target {a.lookahead_target!r}; known: "
            f"{', '.join(KNOWN_LOOKAHEAD_TARGETS)}"
        )
    if a.lookahead_horizon not in KNOWN_LOOKAHEAD_HORIZONS:
        raise ManifestError(
            f"asyncmesh.lookahead_horizon: unknown horizon {a.lookahead_horizon!r}; known: "
            f"{', '.join(KNOWN_LOOKAHEAD_HORIZONS)}"
        )
    if not 0 < a.avg_fraction <= 1:
        raise ManifestError(f"asyncmesh.avg_fraction: must be in (0, 1], got {a.avg_fraction}")
    if a.avg_every <= 0:
        raise ManifestError("asyncmesh.avg_every: must be positive")
    if not 1.0 <= a.avg_period_s <= 3600.0:
        raise ManifestError(f"asyncmesh.avg_period_s: must be in [1, 3600] seconds, got {a.avg_period_s}")
    if not 1 <= a.avg_blend_steps <= 1000:
        raise ManifestError(f"asyncmesh.avg_blend_steps: must be in [1, 1000], got {a.avg_blend_steps}")
    se = m.sentinel
    if not 0 < se.beta_act < 1 or not 0 < se.beta_grad < 1:
        raise ManifestError("sentinel.beta_act / sentinel.beta_grad: must be in (0, 1)")
    if se.window < 4 or se.n_projections <= 0 or se.flags_to_ban <= 0:
        raise ManifestError("sentinel: window >= 4, n_projections > 0, flags_to_ban > 0 required")
    if not se.ban_margin >= 0:
        raise ManifestError(f"sentinel.ban_margin: must be >= 0 (0: every flag counts fully), got {se.ban_margin}")
    w = m.warmup
    if w.enabled:
        if len(w.groups) != len(w.unlock_steps):
            raise ManifestError(
                f"warmup: {len(w.groups)} groups but {len(w.unlock_steps)} unlock_steps"
            )
        seen: set[int] = set()
        for g in w.groups:
            for layer in g:
                if not 0 <= layer < md.n_layers:
                    raise ManifestError(f"warmup.groups: layer {layer} out of range 0..{md.n_layers - 1}")
                if layer in seen:
                    raise ManifestError(f"warmup.groups: layer {layer} appears twice")
                seen.add(layer)
    _validate_morph(m)


def _validate_morph(m: Manifest) -> None:
    """``[morph]``: the fields, and that morphing can work with this model and optimizer."""
    mo = m.morph
    if mo.every < 0:
        raise ManifestError(f"morph.every: must be >= 0 (0: no morphing), got {mo.every}")
    if mo.kind not in KNOWN_MORPH_KINDS:
        raise ManifestError(f"morph.kind: unknown kind {mo.kind!r}; known: {', '.join(KNOWN_MORPH_KINDS)}")
    if not 0 <= mo.epsilon < 1:
        raise ManifestError(f"morph.epsilon: must be in [0, 1), got {mo.epsilon}")
    if not mo.enabled:
        return
    if m.n_stages < 2:
        raise ManifestError("morph.every: morphing changes the basis between stages; a one-stage layout has "
                            "no boundary (set morph.every = 0 or split the model)")
    if not m.subspace.enabled and m.subspace.token_table_scale != 0:
        raise ManifestError(
            "morph.every: a dense run (subspace.enabled = false) that morphs needs subspace.token_table_scale = 0: "
            "the frozen token table T comes from the public seed and sits in the residual stream that the "
            "morph rotates, so any stage's activations could be aligned to it (docs/MORPH.md)"
        )
    problem = morph_optimizer_problem(m)
    if problem:
        raise ManifestError(problem)


def morph_optimizer_problem(m: Manifest) -> str | None:
    """Why ``m.optim`` cannot train through a morph, or None.

    Every stage but the head rotates its residual frame at a morph, so every parameter of stages
    1..S-1 is a morphed matrix: its optimizer must commute with ``W ↦ W·Q`` / ``W ↦ Qᵀ·W`` for
    orthogonal Q. SGD with momentum and Muon / NuMuon do (their state is a first moment, which
    transforms like the gradient, and Newton–Schulz / the SVD commute with orthogonal factors);
    Adam's second moment is per coordinate and does not. Muon / NuMuon train the LM head (the
    tail's, which the morph rotates) with their auxiliary optimizer, so that must be ``sgd``.
    """
    o = m.optim
    if o.name not in MORPH_EQUIVARIANT_OPTIMIZERS:
        return (f"optim.name = {o.name!r} cannot train a morphing run: its parameter groups (all matrices "
                f"of stages 1..{m.n_stages - 1}, e.g. blocks.0.attn.qkv_proj.weight of stage 1) are rotated "
                "at every morph, and Adam's per-coordinate second moment does not rotate with them; use "
                f"one of {', '.join(MORPH_EQUIVARIANT_OPTIMIZERS)} or set morph.every = 0")
    if o.name in ("muon", "numuon") and o.aux_optimizer != "sgd":
        return (f"optim.name = {o.name!r} with optim.aux_optimizer = {o.aux_optimizer!r} cannot train a morphing "
                f"run: its auxiliary {o.aux_optimizer} parameter group holds lm_head.weight of stage "
                f"{m.n_stages - 1} (the tail), which the morph rotates, and Adam's per-coordinate second "
                "moment does not rotate with it; set optim.aux_optimizer = \"sgd\" (and an aux_lr for SGD)")
    return None


def consensus_dict(m: Manifest) -> dict[str, Any]:
    """The fields every peer of the run must agree on: every field, local-only choices removed,
    and an unsigned run's empty ``run.organiser`` left out (signing sets it: the signature covers
    the organiser it names)."""
    data = m.to_dict()
    for section, fields in _LOCAL_ONLY.items():
        if fields is None:
            data.pop(section, None)
        else:
            for f in fields:
                data[section].pop(f, None)
    if not data["run"].get("organiser"):
        data["run"].pop("organiser", None)
    return data


def consensus_hash(consensus: dict[str, Any]) -> str:
    """Hex SHA-256 of sorted-key compact JSON of a consensus dict (``manifest_hash`` of a manifest;
    also what a DHT node checks a published manifest record against)."""
    blob = json.dumps(consensus, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def manifest_hash(m: Manifest) -> str:
    """Canonical hash of the consensus fields (``consensus_hash(consensus_dict(m))``)."""
    return consensus_hash(consensus_dict(m))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def manifest_toml(m: Manifest) -> str:
    """The manifest as TOML text that ``load_manifest`` reads back to an equal manifest (every
    field written out; an empty ``[signature]`` is left out)."""
    lines = []
    for section, values in m.to_dict().items():
        if section == "signature" and not any(values.values()):
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def diff_manifests(a: Manifest, b: Manifest) -> list[str]:
    """Dotted names of the consensus fields that differ, e.g. ``["model.d_model"]``."""
    da, db = consensus_dict(a), consensus_dict(b)
    out = []
    for section in sorted(set(da) | set(db)):
        sa, sb = da.get(section, {}), db.get(section, {})
        for name in sorted(set(sa) | set(sb)):
            if sa.get(name) != sb.get(name):
                out.append(f"{section}.{name}")
    return out
