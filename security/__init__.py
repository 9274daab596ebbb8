"""security/: the SENTINEL verifier, ban bookkeeping and the attack models (testing only).
Pure: tensors in, verdicts out, no I/O.

This is what the other packages may use; everything else is internal to security/."""

from security.attacks import (
    STATE_ATTACKS, poison_state,  # noqa: F401
    ADAPTIVE_FAMILIES, ATTACKS, AttackNotAllowed, check_attack_allowed, make_attack, parse_attack,
)
from security.bans import (  # noqa: F401
    BanList, OneVersion, ban_weight, refusal_weight_of, verdict_score,
)
from security.identity import (
    OrganiserKey, PeerKey, b58encode, manifest_signature_problem, new_ed25519_key, organiser_fingerprint,
    peer_id_from_key, peer_id_of_public_key, peer_key_problem, verify_manifest_signature, verify_peer_signature,
)
from security.verifier import (  # noqa: F401
    BasicVerifier, SentinelVerifier, describe_rejection, make_verifier,
)

__all__ = [
    "STATE_ATTACKS",
    "poison_state",
    "OrganiserKey",
    "PeerKey",
    "b58encode",
    "manifest_signature_problem",
    "new_ed25519_key",
    "organiser_fingerprint",
    "peer_id_from_key",
    "peer_id_of_public_key",
    "peer_key_problem",
    "verify_manifest_signature",
    "verify_peer_signature",
    "ADAPTIVE_FAMILIES",
    "ATTACKS",
    "AttackNotAllowed",
    "BanList",
    "OneVersion",
    "BasicVerifier",
    "SentinelVerifier",
    "ban_weight",
    "check_attack_allowed",
    "describe_rejection",
    "make_attack",
    "parse_attack",
    "make_verifier",
    "refusal_weight_of",
    "verdict_score",
]
