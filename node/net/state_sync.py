"""State sync: a joining replica downloads its stage's current weights from an online one.

Over ``/swarm-node/state/1``: the joiner sends one ``state-request``; the server answers with
``state-chunk`` frames (``protocol.state_transfer.state_chunks``: each body at most
``max_chunk_bytes``, big tensors sliced) and closes the stream. The joiner checks every chunk
against its own freshly built stage (``StateAssembler``: names, dtypes, shapes, no overlap, no
gap), so a peer cannot make it allocate anything its model does not have, and only then copies
the weights in and adopts the server's optimizer version (the learning-rate schedule continues
where the swarm is). Optimizer moments are not transferred: they are local statistics that the
joiner rebuilds within a few steps, and sending them would triple the transfer.

The snapshot is taken by the server's compute worker between two jobs, so it is one consistent
version of the weights, never half of an optimizer step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import torch

from node.net.calling import PeerBusy, PeerRejected, PeerUnreachable
from protocol import (
    STATE,
    ProtocolError,
    Reason,
    StateAssembler,
    make_state_request,
    state_chunks,
    validate_state_request,
)

log = logging.getLogger("swarm_node.state_sync")

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024


class StateSyncError(Exception):
    """No online replica could give us the stage's state. ``busy``: every replica asked answered
    ``busy`` (e.g. a morphing swarm makes a new peer wait two epochs): wait, this is no failure.
    ``untrusted``: states were downloaded but none could be trusted (``state_verify``); ``refused``:
    the sources whose state or claims were refused on the way, for the caller to ban and count."""

    def __init__(self, message: str, busy: bool = False, *, untrusted: bool = False,
                 refused: list[str] | None = None):
        super().__init__(message)
        self.busy = busy
        self.untrusted = untrusted
        self.refused = list(refused or [])


MORPH_BUFFERS = ("morph_in", "morph_out")  # a morphing stage's basis maps (stages/morph.py): state like weights


def parameters_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What state sync transfers: the stage's parameters, and with morphing on its basis maps
    (``morph_in`` / ``morph_out`` buffers), without which the weights do not fit the neighbours."""
    out = {n: p for n, p in module.named_parameters()}
    for name in MORPH_BUFFERS:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            out[name] = t
    return out


async def serve_state(frame, peer: str, *, run: str, mhash: str, stage_index: int, state: Callable[[], str],
                      snapshot: Callable[[], Awaitable[tuple[int, dict[str, torch.Tensor], int | None]]],
                      metrics=None, wait: Callable[[str], str | None] | None = None):
    """``/swarm-node/state/1`` handler: yield our weights as chunk frames. ``state`` is the
    replica's state now; ``snapshot`` gives one consistent (version, CPU parameters, morph epoch or
    None), taken by the compute worker between two jobs; ``wait(peer)``, if given, says why
    ``peer`` must wait before it gets our state (answered ``busy``), or None."""
    req = validate_state_request(frame, run, mhash, stage_index)
    if state() not in ("online", "draining"):
        raise ProtocolError(Reason.BUSY, f"this replica is {state()}; ask an online one")
    why = wait(peer) if wait is not None else None
    if why:
        raise ProtocolError(Reason.BUSY, why)
    version, tensors, epoch = await snapshot()
    chunk = min(req.max_chunk_bytes or DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES)
    sent = 0
    for frame_buffers in state_chunks(run, mhash, stage_index, version, tensors, max_chunk_bytes=max(1024, chunk),
                                      epoch=epoch):
        sent += sum(memoryview(b).nbytes for b in frame_buffers)
        yield frame_buffers
    if metrics is not None:
        metrics.state_sync_bytes.labels(direction="out").inc(sent)
    log.info("sent stage %d state (version %d, %.1f MiB) to %s", stage_index, version, sent / 2**20, peer[-8:])


async def fetch_state(transport, peer: str, run: str, mhash: str, stage_index: int,
                      module: torch.nn.Module, timeout: float = 30.0) -> tuple[int, dict[str, torch.Tensor], int, int]:
    """Fetch stage ``stage_index``'s weights from ``peer``, checked against ``module``'s names,
    dtypes and shapes, without touching ``module``; returns (version, CPU tensors, bytes, morph epoch)."""
    expected = {n: p.detach() for n, p in parameters_of(module).items()}
    asm = StateAssembler(run, mhash, stage_index, {n: t.to("cpu") for n, t in expected.items()})
    received = 0
    request = make_state_request(run, mhash, stage_index, max_chunk_bytes=DEFAULT_CHUNK_BYTES)
    async for frame in transport.request_stream(peer, STATE, request, timeout=timeout):
        received += frame.wire_bytes
        if asm.add(frame):
            break
    if not asm.done:
        raise StateSyncError(f"{peer} closed the state stream before the last chunk")
    return int(asm.version), asm.result(), received, int(asm.epoch or 0)


def copy_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy fetched weights into ``module`` (call where no compute runs on it)."""
    with torch.no_grad():
        for name, p in parameters_of(module).items():
            p.copy_(tensors[name].to(p.device, p.dtype))


async def fetch_from_replicas(transport, peers: list[str], run: str, mhash: str, stage_index: int,
                              module: torch.nn.Module, metrics=None,
                              timeout: float = 30.0) -> tuple[int, dict[str, torch.Tensor], str, int]:
    """Try online replicas in order until one hands over its state (``fetch_state``, not yet
    applied); returns (version, CPU tensors, peer, morph epoch). Used by a joiner and by a replica
    catching up after a ban."""
    errors = []
    busy = 0
    for peer in peers:
        t0 = time.monotonic()
        try:
            version, tensors, nbytes, epoch = await fetch_state(transport, peer, run, mhash, stage_index, module,
                                                                timeout)
        except (PeerBusy, ProtocolError) as e:
            if isinstance(e, ProtocolError) and e.reason is not Reason.BUSY:
                errors.append(f"{peer[-8:]}: {e!r}"[:200])
                log.warning("state download from %s failed: %r", peer[-8:], e)
                continue
            busy += 1
            errors.append(f"{peer[-8:]}: {e}"[:200])
            log.info("state download from %s: busy (%s)", peer[-8:], e)
            continue
        except (PeerRejected, PeerUnreachable, StateSyncError, asyncio.TimeoutError, ConnectionError, OSError) as e:
            errors.append(f"{peer[-8:]}: {e!r}"[:200])
            log.warning("state download from %s failed: %r", peer[-8:], e)
            continue
        if metrics is not None:
            metrics.state_sync_bytes.labels(direction="in").inc(nbytes)
        log.info("downloaded stage %d state (version %d, %.1f MiB) from %s in %.1f s", stage_index, version,
                 nbytes / 2**20, peer[-8:], time.monotonic() - t0)
        return version, tensors, peer, epoch
    raise StateSyncError("no online replica gave us the stage state: " + "; ".join(errors),
                         busy=bool(errors) and busy == len(errors))
