"""State transfer messages: a joiner's ``state-request`` and the ``state-chunk`` frames that answer
it (a stage's parameters and optimizer state, each frame's body bounded), and the receiver's
assembler that checks every chunk against what it expects before it keeps a byte. Field semantics
and limits are specified in ``docs/PROTOCOL.md``; the shared field checks live in
``protocol.messages``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.frames import Frame, ProtocolError, Reason, encode_frame
from protocol.messages import MAX_ROUTE, Buffers, _bad, _check_type, _get_uint, _no_tensors, _short, check_run


def make_state_request(
    run: str, manifest_hash: str, stage: int, max_chunk_bytes: int | None = None, **extra
) -> Buffers:
    """Ask a replica of ``stage`` for its current weights (a joiner does this before serving)."""
    header = {"type": "state-request", "run": run, "manifest": manifest_hash, "stage": stage, **extra}
    if max_chunk_bytes is not None:
        header["max_chunk_bytes"] = max_chunk_bytes
    return encode_frame(header)


def make_state_chunk(
    run: str,
    manifest_hash: str,
    stage: int,
    version: int,
    seq: int,
    last: bool,
    tensors: Sequence[tuple[str, torch.Tensor]],
    parts: Mapping[str, tuple[str, int, Sequence[int]]] | None = None,
    epoch: int | None = None,
    **extra,
) -> Buffers:
    """One chunk of a stage's state (``seq`` counts from 0; ``last`` marks the final one).

    ``parts[wire_name] = (name, start, full_shape)`` marks a tensor that is a 1-D slice of state
    tensor ``name`` (of shape ``full_shape``) beginning at flat element ``start``; use
    ``state_chunks`` rather than building these by hand. ``epoch``: the morph epoch (basis) the
    state is in; None (morphing off) leaves the field out.
    """
    header = {
        "type": "state-chunk", "run": run, "manifest": manifest_hash, "stage": stage,
        "version": version, "seq": seq, "last": bool(last), **extra,
    }
    if parts:
        header["parts"] = {
            w: {"of": of, "start": int(start), "shape": [int(d) for d in shape]}
            for w, (of, start, shape) in parts.items()
        }
    if epoch is not None:
        header["epoch"] = int(epoch)
    return encode_frame(header, list(tensors))


def state_chunks(
    run: str,
    manifest_hash: str,
    stage: int,
    version: int,
    state: Mapping[str, torch.Tensor],
    max_chunk_bytes: int = 16 * 1024 * 1024,
    epoch: int | None = None,
) -> Iterator[Buffers]:
    """Split a state dict into ``state-chunk`` frames whose bodies stay within ``max_chunk_bytes``.

    Tensors larger than a chunk travel as flat slices named ``"<name>#<start>"``. Yields at least
    one frame, the last with ``last=True``. Frames are built lazily, so only the chunk being
    written is referenced at a time (the tensors themselves are never copied on CPU).
    """
    if max_chunk_bytes <= 0:
        raise ValueError("state_chunks: max_chunk_bytes must be positive")

    def pieces():
        for name, t in state.items():
            t = t.detach()
            if t.numel() * t.element_size() <= max_chunk_bytes:
                yield name, t, None
                continue
            flat = t.contiguous().reshape(-1)
            step = max(1, max_chunk_bytes // t.element_size())
            for start in range(0, flat.numel(), step):
                yield f"{name}#{start}", flat[start : start + step], (name, start, list(t.shape))

    pending: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, tuple[str, int, list[int]]] = {}
    used, seq = 0, 0
    for wire_name, t, part in pieces():
        nbytes = t.numel() * t.element_size()
        if pending and used + nbytes > max_chunk_bytes:
            yield make_state_chunk(run, manifest_hash, stage, version, seq, False, pending, parts, epoch=epoch)
            pending, parts, used, seq = [], {}, 0, seq + 1
        pending.append((wire_name, t))
        if part is not None:
            parts[wire_name] = part
        used += nbytes
    yield make_state_chunk(run, manifest_hash, stage, version, seq, True, pending, parts, epoch=epoch)


# ---------------------------------------------------------------------------------------------
# State transfer


@dataclass(frozen=True)
class StateRequest:
    stage: int
    max_chunk_bytes: int | None


def validate_state_request(frame: Frame, run: str, manifest: str, stage: int) -> StateRequest:
    """A replica of ``stage`` checks a joiner's request for its weights."""
    h = _check_type(frame, "state-request")
    _no_tensors(frame)
    check_run(h, run, manifest)
    want = _get_uint(h, "stage", maximum=MAX_ROUTE - 1)
    if want != stage:
        raise ProtocolError(Reason.WRONG_STAGE, f"state of stage {want} requested; this node holds stage {stage}")
    return StateRequest(want, _get_uint(h, "max_chunk_bytes", optional=True))


class StateAssembler:
    """Rebuild a state dict from ``state-chunk`` frames, checked against the joiner's own model.

    ``expected`` maps every state name to a tensor of the right shape and dtype (the joiner's
    freshly initialised ``state_dict()``, or meta tensors), so a peer can't make us allocate
    anything our own model doesn't have. Whole tensors are kept as zero-copy views of the chunk
    bodies; sliced ones are copied into one fresh tensor each.
    """

    def __init__(self, run: str, manifest: str, stage: int, expected: Mapping[str, torch.Tensor]):
        self.run, self.manifest, self.stage = run, manifest, stage
        self.expected = {k: (tuple(v.shape), v.dtype, v.numel()) for k, v in expected.items()}
        self.version: int | None = None
        self.epoch: int | None = None  # the morph epoch of the state (0 when the chunks carry none)
        self.done = False
        self._seq = 0
        self._out: dict[str, torch.Tensor] = {}
        self._covered: dict[str, list[tuple[int, int]]] = {}

    def add(self, frame: Frame) -> bool:
        """Take the next chunk; returns True after the last one."""
        h = _check_type(frame, "state-chunk")
        if self.done:
            raise _bad("state-chunk after the last chunk")
        check_run(h, self.run, self.manifest)
        if _get_uint(h, "stage", maximum=MAX_ROUTE - 1) != self.stage:
            raise ProtocolError(Reason.WRONG_STAGE, f"state-chunk for stage {h['stage']}; expected stage {self.stage}")
        version, seq = _get_uint(h, "version"), _get_uint(h, "seq")
        last = h.get("last")
        if not isinstance(last, bool):
            raise _bad("state-chunk field 'last' must be a bool")
        if seq != self._seq:
            raise _bad(f"state-chunk seq {seq}; expected {self._seq}")
        epoch = _get_uint(h, "epoch", optional=True) or 0
        if self.version is None:
            self.version, self.epoch = version, epoch
        elif version != self.version:
            raise _bad(f"state-chunk version {version} changed mid-transfer (was {self.version})")
        elif epoch != self.epoch:
            raise _bad(f"state-chunk epoch {epoch} changed mid-transfer (was {self.epoch})")
        parts = h.get("parts", {})
        if not isinstance(parts, dict):
            raise _bad("state-chunk field 'parts' must be a map")
        for wire_name, t in frame.tensors.items():
            if wire_name in parts:
                self._add_part(wire_name, parts[wire_name], t)
            else:
                self._add_whole(wire_name, t)
        self._seq += 1
        if last:
            missing = [k for k in self.expected if k not in self._out or self._incomplete(k)]
            if missing:
                raise _bad(f"state transfer ended without {missing[:8]}{'...' if len(missing) > 8 else ''}")
            self.done = True
        return self.done

    def _spec(self, name, dtype) -> tuple:
        if name not in self.expected:
            raise _bad(f"state-chunk tensor {_short(name)} is not in this stage's state")
        shape, want_dtype, numel = self.expected[name]
        if dtype != want_dtype:
            raise _bad(f"state tensor {name!r}: dtype {dtype}, expected {want_dtype}")
        return shape, numel

    def _add_whole(self, name: str, t: torch.Tensor):
        shape, _ = self._spec(name, t.dtype)
        if tuple(t.shape) != shape:
            raise _bad(f"state tensor {name!r}: shape {tuple(t.shape)}, expected {shape}")
        if name in self._out:
            raise _bad(f"state tensor {name!r} sent twice")
        self._out[name] = t

    def _add_part(self, wire_name: str, part, t: torch.Tensor):
        if not isinstance(part, dict):
            raise _bad(f"parts[{wire_name!r}] must be a map")
        name, start, full = part.get("of"), part.get("start"), part.get("shape")
        if not isinstance(name, str):
            raise _bad(f"parts[{wire_name!r}].of must be a str")
        shape, numel = self._spec(name, t.dtype)
        if full != list(shape) or t.dim() != 1:
            raise _bad(f"state part {wire_name!r}: full shape {_short(full)} / dims {t.dim()} != {shape} / 1")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or start + t.numel() > numel:
            raise _bad(f"state part {wire_name!r}: start {_short(start)} + {t.numel()} outside 0..{numel}")
        spans = self._covered.setdefault(name, [])
        end = start + t.numel()
        if any(s < end and start < e for s, e in spans):
            raise _bad(f"state part {wire_name!r} overlaps an earlier part of {name!r}")
        if name not in self._out:
            self._out[name] = torch.empty(shape, dtype=t.dtype)
        elif name not in self._covered or not spans:
            raise _bad(f"state tensor {name!r} sent whole and in parts")
        self._out[name].view(-1)[start:end] = t
        spans.append((start, end))

    def _incomplete(self, name: str) -> bool:
        spans = self._covered.get(name)
        return spans is not None and sum(e - s for s, e in spans) != self.expected[name][2]

    def result(self) -> dict[str, torch.Tensor]:
        if not self.done:
            raise _bad("state transfer is not complete")
        return {k: self._out[k] for k in self.expected}
