"""Messages: what each frame type carries, how to build it, and how a receiver checks it.

``make_*`` build frames as lists of buffers for ``writer.writelines`` (see ``protocol.frames``).
``validate_*`` take a decoded ``Frame`` and either return a small typed view of it or raise
``ProtocolError`` whose ``reason`` is what the receiver puts in its ``reject`` reply
(``make_reject_for(err)``). Checks run from cheapest and most telling to most expensive: message
type, run and manifest, header field types, sender stage, codec, staleness, route, tensor names,
dtypes, shapes, and last finite values. Non-finite values are ``bad-frame``: a NaN/Inf in an activation
or gradient is never valid on the wire, whereas ``rejected-by-verifier`` is kept for finite
tensors that SENTINEL (``security/``) judges to be an attack. Meaning travels in typed header
fields (a reject's ``score``, a bwd skip's ``score`` and ``refused``); ``detail`` is for humans
and is never parsed.

Field semantics, types and limits are specified in ``docs/PROTOCOL.md``.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from protocol.frames import (
    DTYPES,
    ITEMSIZE,
    PROTOCOL_VERSION,
    Frame,
    ProtocolError,
    Reason,
    encode_frame,
)

Buffers = list  # list[bytes | memoryview], ready for writer.writelines

MAX_ID_LEN = 128  # run ids, manifest hashes, peer ids, codec names
MAX_ROUTE = 64  # peers in a route (one per stage)
MAX_DETAIL = 1024  # characters of a reject's human-readable detail
MAX_HORIZON_S = 3600.0  # seconds: a fwd's optional look-ahead horizon (asyncmesh pipeline horizon)
MAX_U64 = 2**64 - 1
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int64", "int32")
_REASON_CODES = frozenset(r.value for r in Reason)

# libp2p stream protocols, the only definition (node/, the probe and the metrics import them):
# protocol id -> (request type, reply types). One request frame per stream; fwd/bwd/health get
# one reply frame, state gets chunk frames until ``last`` (or one reject).
FWD = f"/swarm-node/fwd/{PROTOCOL_VERSION}"
BWD = f"/swarm-node/bwd/{PROTOCOL_VERSION}"
STATE = f"/swarm-node/state/{PROTOCOL_VERSION}"
HEALTH = f"/swarm-node/health/{PROTOCOL_VERSION}"
MORPH = f"/swarm-node/morph/{PROTOCOL_VERSION}"
PROTOCOLS = (FWD, BWD, STATE, HEALTH, MORPH)
EXCHANGES: dict[str, tuple[str, tuple[str, ...]]] = {
    FWD: ("fwd", ("ack", "reject")),
    BWD: ("bwd", ("ack", "reject")),
    STATE: ("state-request", ("state-chunk", "reject")),
    HEALTH: ("health-request", ("health", "reject")),
    MORPH: ("morph-seed", ("ack", "reject")),
}
MORPH_SEED_BYTES = 32  # a morph seed: 256 random bits, carried as a uint8 tensor (never in a header)

# Fields each message type must carry (besides v, type, tensors, body_len), and the optional
# fields it may carry. PROTOCOL.md lists the same (the "Message types" table and the field
# tables of "Fields"); tests/test_messages.py checks that they agree.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "fwd": ("run", "manifest", "mb", "stage", "version", "route", "codec", "sent_ms"),
    "bwd": ("run", "manifest", "mb", "stage", "version", "route", "codec", "sent_ms"),
    "ack": ("mb", "stage", "version"),
    "reject": ("reason", "detail"),
    "state-request": ("run", "manifest", "stage"),
    "state-chunk": ("run", "manifest", "stage", "version", "seq", "last"),
    "health-request": (),
    "health": ("status",),
    "morph-seed": ("run", "manifest", "stage", "boundary", "epoch"),
}
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "fwd": ("horizon_s", "epoch"),
    "bwd": ("skip", "detail", "score", "refused", "epoch"),
    "ack": ("queue",),
    "reject": ("mb", "retry_ms", "score", "epoch"),
    "state-request": ("max_chunk_bytes",),
    "state-chunk": ("parts", "epoch"),
    "health-request": (),
    "health": (),
    "morph-seed": (),
}
# Optional bwd fields that only a skip may carry (a gradient bwd with one of them is bad-frame;
# ``detail`` is left out: it was always tolerated, and ignored, on a gradient).
SKIP_ONLY_FIELDS = ("score", "refused")


class Refused(str, enum.Enum):
    """Whose output a bwd skip's refusal concerns (the skip's optional ``refused`` field)."""

    OWN = "own"  # the next stage refused the tensors this sender produced
    RELAYED = "relayed"  # the sender passes on a refusal from further downstream

    def __str__(self) -> str:
        return self.value


_REFUSED_VALUES = frozenset(r.value for r in Refused)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _sort_by_itemsize(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    # Wider elements first keeps every tensor naturally aligned in the body (sizes are multiples
    # of the element size), so the receiver's views are zero-copy.
    return sorted(tensors, key=lambda nt: -nt[1].element_size())


# ---------------------------------------------------------------------------------------------
# Builders


def make_fwd(
    run: str,
    manifest_hash: str,
    mb: int,
    stage: int,
    version: int,
    route: Sequence[str],
    c: torch.Tensor,
    ids: torch.Tensor,
    codec: str = "subspace",
    sent_ms: int | None = None,
    epoch: int | None = None,
    **extra,
) -> Buffers:
    """Activations of microbatch ``mb`` from ``stage`` to a replica of ``stage + 1``.

    ``c`` is the boundary code (B, L, k) in a float dtype, ``ids`` the tokens (B, L) the tail
    needs for its loss. ``route`` lists the peers of stages 0..stage, the sender last.
    ``epoch``: the morph epoch (basis) ``c`` is in; None (morphing off) leaves the field out.
    """
    header = {
        "type": "fwd", "run": run, "manifest": manifest_hash, "mb": mb, "stage": stage,
        "version": version, "route": list(route), "codec": codec,
        "sent_ms": _now_ms() if sent_ms is None else sent_ms, **extra,
    }
    if epoch is not None:
        header["epoch"] = int(epoch)
    return encode_frame(header, _sort_by_itemsize([("c", c), ("ids", ids)]))


def make_bwd(
    run: str,
    manifest_hash: str,
    mb: int,
    stage: int,
    version: int,
    route: Sequence[str],
    grad: torch.Tensor | None,
    codec: str = "subspace",
    sent_ms: int | None = None,
    skip: Reason | str | None = None,
    detail: str = "",
    score: float | None = None,
    refused: Refused | str | None = None,
    epoch: int | None = None,
    **extra,
) -> Buffers:
    """Gradient dL/dc (B, L, k) of microbatch ``mb`` from ``stage`` back to ``stage - 1``.

    ``route`` is the full forward route recorded by the tail (peer of stage i at index i).
    ``skip=<reason>`` with ``grad=None`` tells upstream stages that this microbatch will get no
    gradient (e.g. a verifier rejected it downstream): free its context and do not step on it.
    With a skip only: ``refused`` says whose output the refusal concerns (``"own"``: the next
    stage refused this sender's own output; ``"relayed"``: passed on from further downstream),
    ``score`` is the refusing verifier's score (finite, > 0; see ``make_reject``).
    ``epoch``: the morph epoch of the microbatch (its forward's basis); None leaves it out.
    """
    if (grad is None) == (skip is None):
        raise ValueError("make_bwd: give exactly one of grad= (a gradient) or skip= (a reason)")
    if skip is None and (score is not None or refused is not None):
        raise ValueError("make_bwd: score= and refused= go with skip= only, never with a gradient")
    header = {
        "type": "bwd", "run": run, "manifest": manifest_hash, "mb": mb, "stage": stage,
        "version": version, "route": list(route), "codec": codec,
        "sent_ms": _now_ms() if sent_ms is None else sent_ms, **extra,
    }
    if epoch is not None:
        header["epoch"] = int(epoch)
    if skip is not None:
        header["skip"] = Reason(skip).value
        header["detail"] = detail[:MAX_DETAIL]
        if score is not None:
            header["score"] = _score_arg("make_bwd", score)
        if refused is not None:
            header["refused"] = Refused(refused).value
        return encode_frame(header)
    return encode_frame(header, [("grad", grad)])


def make_ack(mb: int | None, stage: int, version: int, queue: int | None = None, **extra) -> Buffers:
    """Success reply to fwd/bwd: the receiver's stage and optimizer step, and its queue depth
    (a routing hint: senders prefer replicas with short queues)."""
    header = {"type": "ack", "mb": mb, "stage": stage, "version": version, **extra}
    if queue is not None:
        header["queue"] = queue
    return encode_frame(header)


def make_reject(
    reason: Reason | str,
    detail: str,
    mb: int | None = None,
    retry_ms: int | None = None,
    score: float | None = None,
    epoch: int | None = None,
    **extra,
) -> Buffers:
    """Refusal reply. The stream is closed after it. ``retry_ms`` goes with ``busy``; ``score``
    with ``rejected-by-verifier`` when a fence (not a rule) refused: the verifier's score, the
    worst distance over its fence as a ratio (finite, > 0; ``security.bans.verdict_score``);
    ``epoch`` with ``wrong-epoch``: the receiver's own morph epoch."""
    header = {"type": "reject", "reason": Reason(reason).value, "detail": str(detail)[:MAX_DETAIL], **extra}
    if mb is not None:
        header["mb"] = mb
    if retry_ms is not None:
        header["retry_ms"] = retry_ms
    if score is not None:
        header["score"] = _score_arg("make_reject", score)
    if epoch is not None:
        header["epoch"] = int(epoch)
    return encode_frame(header)


def _score_arg(who: str, score) -> float:
    """A builder's ``score=``: what ``_get_score`` accepts, or ValueError (never send a frame
    the receiving validator refuses)."""
    if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score) or score <= 0:
        raise ValueError(f"{who}: score must be a finite number > 0, got {score!r}")
    return float(score)


def make_reject_for(err: ProtocolError, mb: int | None = None) -> Buffers:
    """The reject reply for a ``ProtocolError`` raised by the decoder or a validator."""
    return make_reject(err.reason, err.detail, mb=mb)


def make_health_request(**extra) -> Buffers:
    return encode_frame({"type": "health-request", **extra})


def make_health(status: Mapping, **extra) -> Buffers:
    """Health reply. ``status`` is a msgpack map with str keys (peer, run, stage, version,
    manifest, queue, uptime_s, ...; PROTOCOL.md lists the recommended keys)."""
    if not isinstance(status, Mapping) or not all(isinstance(k, str) for k in status):
        raise ValueError("make_health: status must be a map with str keys")
    return encode_frame({"type": "health", "status": dict(status), **extra})


# ---------------------------------------------------------------------------------------------
# Field checks (every failure is bad-frame naming the field)


def _bad(detail: str) -> ProtocolError:
    return ProtocolError(Reason.BAD_FRAME, detail)


def _get_str(h: Mapping, key: str, maxlen: int = MAX_ID_LEN, optional: bool = False) -> str | None:
    v = h.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= maxlen:
        raise _bad(f"{h.get('type')} field {key!r} is {_short(v)}; need a non-empty str <= {maxlen} chars")
    return v


def _get_uint(h: Mapping, key: str, optional: bool = False, maximum: int = MAX_U64) -> int | None:
    v = h.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= maximum:
        raise _bad(f"{h.get('type')} field {key!r} is {_short(v)}; need an int in 0..{maximum}")
    return v


def _get_score(h: Mapping) -> float | None:
    """The optional ``score`` of a reject or a bwd skip: a finite number > 0, or None if absent."""
    v = h.get("score")
    if v is None:
        return None
    where = f"{h.get('type')} field 'score'"
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(f"{where} is {_short(v)} ({type(v).__name__}); need a number (the verifier's score)")
    if not math.isfinite(v):
        raise _bad(f"{where} is {v!r}; need a finite number")
    if v <= 0:
        raise _bad(f"{where} is {v!r}; need a number > 0")
    return float(v)


def _get_route(h: Mapping) -> tuple[str, ...]:
    r = h.get("route")
    if (
        not isinstance(r, list)
        or len(r) > MAX_ROUTE
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_ID_LEN for p in r)
    ):
        raise _bad(f"{h.get('type')} field 'route' must be a list of <= {MAX_ROUTE} peer-id strings")
    return tuple(r)


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _check_type(frame: Frame, *types: str) -> Mapping:
    if frame.header.get("type") not in types:
        raise _bad(f"expected a {' or '.join(types)} frame, got {frame.header.get('type')!r}")
    return frame.header


def _no_tensors(frame: Frame) -> None:
    if frame.tensors:
        raise _bad(f"a {frame.header.get('type')} frame carries no tensors; got {list(frame.tensors)[:4]}")


def check_request(protocol_id: str, frame: Frame) -> None:
    """``bad-frame`` unless ``frame`` is the request type of stream protocol ``protocol_id``."""
    if protocol_id not in EXCHANGES:
        raise ValueError(f"unknown protocol id {protocol_id!r}; known: {list(EXCHANGES)}")
    _check_type(frame, EXCHANGES[protocol_id][0])


def check_run(header: Mapping, run: str, manifest: str) -> None:
    """``wrong-run`` unless the frame belongs to this run and this exact manifest."""
    r, m = header.get("run"), header.get("manifest")
    if r != run:
        raise ProtocolError(Reason.WRONG_RUN, f"frame is for run {_short(r)}; this node serves run {run!r}")
    if m != manifest:
        raise ProtocolError(
            Reason.WRONG_RUN,
            f"manifest hash {_short(m)} differs from this node's {manifest!r}; "
            "compare manifests with `swarm-node doctor` and rejoin with the run's manifest",
        )


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """``bad-frame`` if any floating-point tensor holds NaN or +-Inf (see module docstring)."""
    # min/max propagate NaN and expose +-Inf, and one fused reduction is ~10x faster than
    # isfinite(t).all(), which materialises a bool tensor as large as the payload
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                raise _bad(f"tensor {name!r} has non-finite values (NaN or Inf)")


# ---------------------------------------------------------------------------------------------
# Expectations and validation of fwd / bwd


@dataclass(frozen=True)
class TensorSpec:
    """Expected tensor: ``shape`` entries are exact ints or names of symbolic dims ("B", "L")
    whose size may vary in 1..``Expect.dims[name]`` but must agree across the frame's tensors."""

    shape: tuple[int | str, ...]
    dtypes: tuple[str, ...]

    def __post_init__(self):
        unknown = set(self.dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"TensorSpec.dtypes: unknown dtype(s) {sorted(unknown)}")


@dataclass
class Expect:
    """What a receiver accepts on fwd or bwd. Mutable on purpose: set ``version`` to the
    receiver's optimizer step as it trains (staleness is ``version - frame.version``)."""

    run: str
    manifest: str
    stage: int  # the stage the SENDER must be: receiver - 1 for fwd, receiver + 1 for bwd
    tensors: Mapping[str, TensorSpec]
    dims: Mapping[str, int]  # max size of each symbolic dim
    version: int = 0
    max_version_lag: int | None = None
    codec: str | None = None  # if set, the frame's codec must match
    self_peer: str | None = None  # if set, a bwd's route must name this peer at stage - 1

    def max_body_bytes(self) -> int:
        """The largest body a valid frame can have: use it as ``Limits.max_body_bytes`` on the
        fwd/bwd streams so an oversized frame is refused (``too-large``) before allocation."""
        total = 0
        for spec in self.tensors.values():
            n = max(ITEMSIZE[d] for d in spec.dtypes)
            for d in spec.shape:
                n *= self.dims[d] if isinstance(d, str) else d
            total += n
        return total

    @classmethod
    def fwd(
        cls, run: str, manifest: str, receiver_stage: int, k: int, max_batch: int, max_seq: int,
        float_dtypes: Sequence[str] = FLOAT_DTYPES, index_dtypes: Sequence[str] = INDEX_DTYPES, **kw,
    ) -> Expect:
        """Expectation of a body/tail stage for incoming activations: c (B,L,k) and ids (B,L)."""
        if receiver_stage < 1:
            raise ValueError("Expect.fwd: stage 0 (the head) receives no fwd frames")
        tensors = {"c": TensorSpec(("B", "L", k), tuple(float_dtypes)), "ids": TensorSpec(("B", "L"), tuple(index_dtypes))}
        return cls(run, manifest, receiver_stage - 1, tensors, {"B": max_batch, "L": max_seq}, **kw)

    @classmethod
    def bwd(
        cls, run: str, manifest: str, receiver_stage: int, k: int, max_batch: int, max_seq: int,
        float_dtypes: Sequence[str] = FLOAT_DTYPES, **kw,
    ) -> Expect:
        """Expectation of a head/body stage for incoming gradients: grad (B,L,k)."""
        tensors = {"grad": TensorSpec(("B", "L", k), tuple(float_dtypes))}
        return cls(run, manifest, receiver_stage + 1, tensors, {"B": max_batch, "L": max_seq}, **kw)


@dataclass(frozen=True)
class Fwd:
    mb: int
    stage: int
    version: int
    route: tuple[str, ...]
    codec: str
    sent_ms: int
    c: torch.Tensor
    ids: torch.Tensor
    header: Mapping = field(repr=False, default_factory=dict)
    horizon_s: float | None = None  # optional: the head's look-ahead horizon in seconds, passed down the pipeline
    epoch: int = 0  # the morph epoch (basis) of ``c``; 0 when absent


@dataclass(frozen=True)
class Bwd:
    mb: int
    stage: int
    version: int
    route: tuple[str, ...]
    codec: str
    sent_ms: int
    grad: torch.Tensor | None  # None for a skip
    skip: str | None = None  # reason code (a Reason value) why upstream must drop this microbatch
    detail: str = ""
    header: Mapping = field(repr=False, default_factory=dict)
    score: float | None = None  # skip only: the refusing verifier's score (> 0, finite), if it sent one
    refused: str | None = None  # skip only: "own" or "relayed" (a Refused value), None if absent or unknown
    epoch: int = 0  # the morph epoch of the microbatch; 0 when absent


def check_tensors(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], dims: Mapping[str, int]) -> dict:
    """Names, dtypes and shapes against ``specs``; returns the sizes bound to symbolic dims."""
    missing = [n for n in specs if n not in tensors]
    extra = [n for n in tensors if n not in specs]
    if missing or extra:
        raise _bad(f"tensors {sorted(tensors)}: missing {missing}, unexpected {extra}; expected {list(specs)}")
    bound: dict[str, int] = {}
    for name, spec in specs.items():
        t = tensors[name]
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in spec.dtypes:
            raise _bad(f"tensor {name!r}: dtype {dtype} not accepted here; expected one of {list(spec.dtypes)}")
        if t.dim() != len(spec.shape):
            raise _bad(f"tensor {name!r}: shape {tuple(t.shape)} has {t.dim()} dims; expected {spec.shape}")
        for size, want in zip(t.shape, spec.shape):
            if isinstance(want, str):
                if size > dims[want]:
                    raise ProtocolError(
                        Reason.TOO_LARGE, f"tensor {name!r}: dim {want}={size} exceeds this node's max {dims[want]}"
                    )
                if size < 1:
                    raise _bad(f"tensor {name!r}: dim {want}={size}; must be >= 1")
                if bound.setdefault(want, size) != size:
                    raise _bad(f"tensor {name!r}: dim {want}={size} disagrees with {want}={bound[want]} elsewhere")
            elif size != want:
                raise _bad(f"tensor {name!r}: shape {tuple(t.shape)} does not match expected {spec.shape}")
    return bound


def _common(h: Mapping, expect: Expect) -> tuple:
    check_run(h, expect.run, expect.manifest)
    mb = _get_uint(h, "mb")
    stage = _get_uint(h, "stage", maximum=MAX_ROUTE - 1)
    version = _get_uint(h, "version")
    route = _get_route(h)
    codec = _get_str(h, "codec")
    sent_ms = _get_uint(h, "sent_ms")
    if stage != expect.stage:
        raise ProtocolError(
            Reason.WRONG_STAGE, f"{h['type']} from stage {stage}; this node takes {h['type']} from stage {expect.stage}"
        )
    if expect.codec is not None and codec != expect.codec:
        raise _bad(f"codec {codec!r}; this run uses {expect.codec!r}")
    if expect.max_version_lag is not None and expect.version - version > expect.max_version_lag:
        raise ProtocolError(
            Reason.STALE,
            f"sender is at step {version}, this node at {expect.version}: "
            f"lag {expect.version - version} > {expect.max_version_lag}",
        )
    return mb, stage, version, route, codec, sent_ms


def validate_fwd(frame: Frame, expect: Expect, sender: str | None = None) -> Fwd:
    """Check an incoming fwd frame; ``sender`` (the stream's remote peer id) must end the route."""
    h = _check_type(frame, "fwd")
    mb, stage, version, route, codec, sent_ms = _common(h, expect)
    if len(route) != stage + 1:
        raise _bad(f"fwd route has {len(route)} peers; a fwd from stage {stage} lists {stage + 1}")
    if sender is not None and route[-1] != sender:
        raise _bad(f"route ends with {route[-1]!r} but the frame came from {sender!r}")
    horizon = h.get("horizon_s")
    if horizon is not None and (
        not isinstance(horizon, (int, float)) or isinstance(horizon, bool)
        or not math.isfinite(horizon) or not 0 <= horizon <= MAX_HORIZON_S
    ):
        raise _bad(f"fwd field 'horizon_s' is {_short(horizon)}; need a number in 0..{MAX_HORIZON_S:g} (seconds)")
    epoch = _get_uint(h, "epoch", optional=True) or 0
    check_tensors(frame.tensors, expect.tensors, expect.dims)
    check_finite(frame.tensors)
    return Fwd(mb, stage, version, route, codec, sent_ms, frame.tensors["c"], frame.tensors["ids"], h,
               None if horizon is None else float(horizon), epoch)


def validate_bwd(frame: Frame, expect: Expect, sender: str | None = None) -> Bwd:
    """Check an incoming bwd frame (a gradient or a skip)."""
    h = _check_type(frame, "bwd")
    mb, stage, version, route, codec, sent_ms = _common(h, expect)
    if len(route) <= stage:
        raise _bad(f"bwd route has {len(route)} peers; a bwd from stage {stage} needs > {stage}")
    if sender is not None and route[stage] != sender:
        raise _bad(f"route names {route[stage]!r} at stage {stage} but the frame came from {sender!r}")
    if expect.self_peer is not None and route[stage - 1] != expect.self_peer:
        raise _bad(f"this node is not on the microbatch's route (stage {stage - 1} is {route[stage - 1]!r})")
    epoch = _get_uint(h, "epoch", optional=True) or 0
    skip = h.get("skip")
    if skip is not None:
        skip = _get_str(h, "skip", maxlen=64)
        if skip not in _REASON_CODES:  # a newer peer's code: treat as internal (see PROTOCOL.md)
            skip = Reason.INTERNAL.value
        if frame.tensors:
            raise _bad("a bwd skip carries no tensors")
        detail = h.get("detail", "")
        score = _get_score(h)
        refused = _get_str(h, "refused", maxlen=64, optional=True)
        if refused not in _REFUSED_VALUES:  # absent, or a newer peer's value: no attribution (PROTOCOL.md)
            refused = None
        return Bwd(mb, stage, version, route, codec, sent_ms, None, skip,
                   detail[:MAX_DETAIL] if isinstance(detail, str) else "", h, score, refused, epoch)
    present = [f for f in SKIP_ONLY_FIELDS if h.get(f) is not None]
    if present:
        raise _bad(f"bwd field(s) {present} go with 'skip' only; a gradient bwd carries none")
    check_tensors(frame.tensors, expect.tensors, expect.dims)
    check_finite(frame.tensors)
    return Bwd(mb, stage, version, route, codec, sent_ms, frame.tensors["grad"], None, "", h, epoch=epoch)


# ---------------------------------------------------------------------------------------------
# Replies, health


@dataclass(frozen=True)
class Reply:
    """A fwd/bwd reply as the sender sees it."""

    ok: bool
    mb: int | None = None
    stage: int | None = None  # ack: receiver's stage
    version: int | None = None  # ack: receiver's optimizer step
    queue: int | None = None  # ack: receiver's queue depth
    reason: Reason | None = None  # reject: known reason, or INTERNAL for a code this node doesn't know
    reason_code: str | None = None  # reject: the code exactly as received
    detail: str = ""
    retry_ms: int | None = None
    header: Mapping = field(repr=False, default_factory=dict)
    score: float | None = None  # reject: the refusing verifier's score (> 0, finite), if it sent one
    epoch: int | None = None  # reject (wrong-epoch): the receiver's morph epoch, if it sent one


def parse_reply(frame: Frame) -> Reply:
    """Read an ack or reject. An unknown reason code (from a newer peer) maps to ``internal``."""
    h = _check_type(frame, "ack", "reject")
    _no_tensors(frame)
    mb = _get_uint(h, "mb", optional=True)
    if h["type"] == "ack":
        if "mb" not in h:
            raise _bad("ack field 'mb' is missing (nil is allowed)")
        return Reply(True, mb, _get_uint(h, "stage"), _get_uint(h, "version"),
                     _get_uint(h, "queue", optional=True), header=h)
    code = _get_str(h, "reason", maxlen=64)
    detail = h.get("detail")
    if not isinstance(detail, str):
        raise _bad("reject field 'detail' must be a str")
    try:
        reason = Reason(code)
    except ValueError:
        reason = Reason.INTERNAL
    return Reply(False, mb, reason=reason, reason_code=code, detail=detail[:MAX_DETAIL],
                 retry_ms=_get_uint(h, "retry_ms", optional=True), header=h, score=_get_score(h),
                 epoch=_get_uint(h, "epoch", optional=True))


def validate_health_request(frame: Frame) -> None:
    _check_type(frame, "health-request")
    _no_tensors(frame)


def parse_health(frame: Frame) -> dict:
    """The status map of a health reply (plus the peer's protocol version under ``"v"``)."""
    h = _check_type(frame, "health")
    _no_tensors(frame)
    status = h.get("status")
    if not isinstance(status, dict):
        raise _bad("health field 'status' must be a map")
    return {**status, "v": h["v"]}


# ---------------------------------------------------------------------------------------------
# Morph seeds


@dataclass(frozen=True)
class MorphSeed:
    stage: int  # the sender's stage (the boundary's upstream stage)
    boundary: int  # the boundary between stage ``boundary`` and ``boundary + 1``
    epoch: int  # the morph epoch whose transform of that boundary the seed draws
    seed: bytes = field(repr=False)  # MORPH_SEED_BYTES random bytes; never logged

    def __repr__(self) -> str:  # the seed stays out of every repr, log line and traceback
        return f"MorphSeed(stage={self.stage}, boundary={self.boundary}, epoch={self.epoch})"


def make_morph_seed(run: str, manifest_hash: str, stage: int, boundary: int, epoch: int, seed: bytes,
                    **extra) -> Buffers:
    """The seed of boundary ``boundary``'s transform for morph epoch ``epoch``, from a replica of
    stage ``stage`` (= ``boundary``: the boundary's sender deals it) to a replica of either side.
    The seed travels as the frame's one tensor, ``seed`` (uint8, MORPH_SEED_BYTES), never in the
    header, so nothing that logs headers can see it."""
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != MORPH_SEED_BYTES:
        raise ValueError(f"make_morph_seed: the seed must be {MORPH_SEED_BYTES} bytes")
    header = {"type": "morph-seed", "run": run, "manifest": manifest_hash, "stage": stage,
              "boundary": boundary, "epoch": epoch, **extra}
    return encode_frame(header, [("seed", torch.frombuffer(bytearray(seed), dtype=torch.uint8))])


def validate_morph_seed(frame: Frame, run: str, manifest: str, stage: int) -> MorphSeed:
    """A replica of ``stage`` checks a morph seed: run and manifest, field types, the boundary is
    one of this stage's (``stage - 1`` or ``stage``, else ``wrong-stage``), the sender is the
    boundary's upstream stage (else ``wrong-stage``), exactly one ``seed`` tensor of
    MORPH_SEED_BYTES uint8. Whether the sender may deal it, and for which epoch, is the
    runtime's rule (docs/PROTOCOL.md, "Morph epochs")."""
    h = _check_type(frame, "morph-seed")
    check_run(h, run, manifest)
    sender = _get_uint(h, "stage", maximum=MAX_ROUTE - 1)
    boundary = _get_uint(h, "boundary", maximum=MAX_ROUTE - 2)
    epoch = _get_uint(h, "epoch")
    if boundary not in (stage - 1, stage):
        raise ProtocolError(Reason.WRONG_STAGE, f"morph seed of boundary {boundary}; stage {stage} has boundaries "
                                                f"{stage - 1} and {stage}")
    if sender != boundary:
        raise ProtocolError(Reason.WRONG_STAGE, f"morph seed of boundary {boundary} from stage {sender}; "
                                                f"the seed of a boundary comes from its upstream stage {boundary}")
    check_tensors(frame.tensors, {"seed": TensorSpec((MORPH_SEED_BYTES,), ("uint8",))}, {})
    return MorphSeed(sender, boundary, epoch, bytes(frame.tensors["seed"].numpy().tobytes()))
