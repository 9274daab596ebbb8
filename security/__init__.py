"""security/: the SENTINEL verifier, ban bookkeeping and the attack models (testing only).
Pure: tensors in, verdicts out, no I/O.

This is what the other packages may use; everything else is internal to security/."""

from security.attacks import (  # noqa: F401
    ATTACKS, AttackNotAllowed, check_attack_allowed, make_attack,
)
from security.bans import (  # noqa: F401
    BanList, ban_weight, refusal_weight_of, verdict_score,
)
from security.verifier import (  # noqa: F401
    BasicVerifier, SentinelVerifier, make_verifier,
)

__all__ = [
    "ATTACKS",
    "AttackNotAllowed",
    "BanList",
    "BasicVerifier",
    "SentinelVerifier",
    "ban_weight",
    "check_attack_allowed",
    "make_attack",
    "make_verifier",
    "refusal_weight_of",
    "verdict_score",
]
