"""What a stage runtime is configured with, and what it keeps per microbatch in flight."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from stages import Manifest, StageWeights


@dataclass
class RuntimeOptions:
    queue_size: int = 8
    context_ttl: float = 120.0
    request_timeout: float = 20.0
    max_inflight: int = 0  # 0: the manifest's
    steps: int = 0  # head: stop injecting at this optimizer step (0: never)
    checkpoint_every: int = 0  # 0: manifest
    probe_after: float = 4.0  # seconds a context may wait before its next hop is health-probed
    forward_deadline: float = 30.0  # seconds to find a replica that accepts a fwd
    use_amp: bool = False
    ban_flags_seconds: float = 60.0  # first ban for verifier flags (doubles per repeat ban)
    verify_threads: int = 1  # torch intra-op threads of the verifier's thread (the compute worker keeps its own)
    # after a neighbour answers "banned": fetch another replica's weights this often (seconds) until
    # our traffic is accepted again, so we do not come back with weights a whole ban old (0: off)
    resync_every: float = 10.0
    # after this many of our outputs in a row refused by the next stage's verifier (nothing of ours
    # accepted in between), or one clear refusal: fetch another replica's weights, at most once per
    # ``resync_every`` (0: off; ``Guard.own_output_refused``)
    resync_after_refusals: int = 2
    verify_state: bool = True  # downloaded weights must agree with another replica's (node.net.state_verify)
    state_ban_seconds: float = 600.0  # ban on a replica whose served weights disagreed with the majority
    # health-ping one peer of each neighbour stage this often (seconds), for the round-trip metric
    # per neighbour stage (0: off; the daemon turns it on)
    ping_every: float = 0.0
    # morph epochs: how long a fwd of the next epoch may find this stage without that epoch's seeds
    # before it stops waiting for them and downloads the stage's state from a replica instead
    seed_wait: float = 15.0


@dataclass(eq=False)
class Context:
    """What a stage keeps for one in-flight microbatch until its gradient arrives."""

    mb: int
    route: tuple[str, ...]  # peers of stages 0..self (self last)
    x: torch.Tensor | None  # stage input (None at the head: ids are its input)
    ids: torch.Tensor  # (B, L) int64 on the compute device
    ids_wire: torch.Tensor  # (B, L) int32 on the CPU, what goes on the wire
    weights: StageWeights  # the weights the forward used; the backward recomputes with them
    version: int  # own optimizer version at forward time
    created: float = field(default_factory=time.monotonic)
    next_peer: str | None = None
    sent_at: float = 0.0
    horizon_s: float | None = None  # the head's look-ahead horizon (seconds) this microbatch came with
    epoch: int = 0  # the morph epoch (basis) of the forward; its gradient must be of the same one

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


def max_batch_for(manifest: Manifest) -> int:
    """Largest microbatch (B) a stage accepts: batch size is a local choice of each head, so allow
    some room above our own."""
    return max(4 * manifest.data.batch_size, 64)


def new_microbatch_rng(seed: int) -> random.Random:
    return random.Random(seed) if seed else random.Random()
