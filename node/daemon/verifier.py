"""What every tensor a node accepts passes (``make_verifier``) and, for testing the verifier only,
what a node poisons (``make_attacks``, ``--attack``). Apart from the slot that uses them so that
the benches and tests take them without loading the networking stack."""

from __future__ import annotations

from node.runtime import max_batch_for
from security import STATE_ATTACKS, make_attack, parse_attack
from security import make_verifier as build_verifier


def make_attacks(name: str, seed: int = 0, **params) -> dict:
    """``--attack NAME`` (testing the verifier only): one attack instance per direction, ``act``
    for what we send forward and ``grad`` for what we send back, so a stateful attack (``delayed``)
    keeps a history of each and never replays an activation as a gradient."""
    name, spec_params = parse_attack(name)
    params = {**spec_params, **params}
    if name in STATE_ATTACKS:  # a replica that serves poisoned weights to joiners (testing their check)
        return {"state": name}
    return {d: make_attack(name, seed=2 * seed + i, direction=d, **params) for i, d in enumerate(("act", "grad"))}


def make_verifier(manifest, index: int):
    """The verifier every accepted tensor passes: SENTINEL when the manifest enables it, else the
    basic dtype/shape/finite checks (``security.verifier``)."""
    return build_verifier(manifest.sentinel, k=manifest.k, seq_len=manifest.model.seq_len,
                          max_batch=max_batch_for(manifest), seed=manifest.run.seed + index)
