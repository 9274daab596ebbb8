"""Attack models: what a malicious stage does to the tensors it SENDS (docs/REFERENCES.md §3).

For testing the verifier only. A node applies one with ``--attack NAME``, which is refused unless
the run manifest (``sentinel.allow_attacks``) or an explicit ``--allow-attacks`` flag allows it:
see ``check_attack_allowed``.

Each attack is a callable ``attack(tensor, step) -> tensor`` applied to the honest (B, L, k)
payload (activations going forward or gradients going back). It is inactive (returns the honest
tensor) for ``step < start``; stateful attacks (``delayed``, ``adaptive``) still observe the
honest stream before that. Magnitudes are relative to the honest tensor, so the same attack
means the same thing for activations (RMS ≈ 5) and gradients (RMS ≈ 1e-4):

========== ==================================================================================
constant   every element = ``value`` (default: the honest tensor's RMS)
zeros      all zeros
random     i.i.d. N(0, σ²), σ = the honest tensor's RMS (default) or ``std``
scaling    × ``factor`` (default 3)
negation   × −1
sign_flip  flip the sign of a random ``fraction`` of the elements (default 0.5)
delayed    replay the tensor sent ``delay`` calls earlier (default 100); ``noise`` > 0 adds that
           much relative noise so the replay is not bit-identical
bias       + ``scale`` × RMS added to every element (default 0.5)
invisible  noise invisible to norm checks: + noise of relative RMS ``rel`` (default 1.0), then
           every token vector rescaled to its honest norm, so token norms, the RMS and the value
           range are exactly the honest ones while rel²/(1+rel²) of each token's energy (half,
           at the default) is noise unrelated to the tokens. Less noise is also less harm; the
           benchmark reports detection at rel 0.1 / 0.3 / 0.5 too.
adaptive   mimics the reference: sends the honest token vectors *permuted across positions*
           (mode "permute", default), so every permutation-invariant statistic — channel means,
           RMS, the full distribution along every projection — is exactly the honest one while
           each position carries another token's content. mode "mimic": Gaussian noise with the
           honest per-channel mean and covariance (all first and second moments matched).
mixed      each call picks one of the other attacks at random
========== ==================================================================================
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor


class AttackNotAllowed(PermissionError):
    """Raised when an attack is requested without the manifest or the operator allowing it."""


def _rms(x: Tensor) -> Tensor:
    return x.float().square().mean().sqrt().to(x.dtype)


class Attack:
    """Base: ``__call__`` returns the honest tensor before ``start``, ``poison`` afterwards."""

    name = "none"

    def __init__(self, start: int = 0, seed: int = 0):
        self.start = start
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, x: Tensor, step: int) -> Tensor:
        self.observe(x, step)
        if step < self.start:
            return x
        with torch.no_grad():
            return self.poison(x.detach(), step).to(x.dtype)

    def observe(self, x: Tensor, step: int) -> None:
        """See the honest tensor (stateful attacks keep history)."""

    def poison(self, x: Tensor, step: int) -> Tensor:
        raise NotImplementedError

    def _randn(self, x: Tensor) -> Tensor:
        return torch.randn(x.shape, generator=self.gen).to(x.device, torch.float32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(start={self.start})"


class Constant(Attack):
    name = "constant"

    def __init__(self, value: float | None = None, **kw):
        super().__init__(**kw)
        self.value = value

    def poison(self, x, step):
        v = _rms(x) if self.value is None else torch.tensor(self.value, dtype=x.dtype)
        return torch.full_like(x, float(v))


class Zeros(Attack):
    name = "zeros"

    def poison(self, x, step):
        return torch.zeros_like(x)


class Random(Attack):
    name = "random"

    def __init__(self, std: float | None = None, **kw):
        super().__init__(**kw)
        self.std = std

    def poison(self, x, step):
        std = float(_rms(x)) if self.std is None else self.std
        return self._randn(x) * std


class Scaling(Attack):
    name = "scaling"

    def __init__(self, factor: float = 3.0, **kw):
        super().__init__(**kw)
        self.factor = factor

    def poison(self, x, step):
        return x * self.factor


class Negation(Attack):
    name = "negation"

    def poison(self, x, step):
        return -x


class SignFlip(Attack):
    name = "sign_flip"

    def __init__(self, fraction: float = 0.5, **kw):
        super().__init__(**kw)
        if not 0 < fraction <= 1:
            raise ValueError(f"sign_flip: fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def poison(self, x, step):
        flip = torch.rand(x.shape, generator=self.gen).to(x.device) < self.fraction
        return torch.where(flip, -x, x)


class Delayed(Attack):
    name = "delayed"

    def __init__(self, delay: int = 100, noise: float = 0.0, **kw):
        super().__init__(**kw)
        if delay <= 0:
            raise ValueError(f"delayed: delay must be positive, got {delay}")
        self.delay, self.noise = delay, noise
        self.history: deque[Tensor] = deque(maxlen=delay + 1)

    def observe(self, x, step):
        self.history.append(x.detach().clone())

    def poison(self, x, step):
        old = self.history[0]  # delay calls ago once the buffer is full, the oldest before
        if old.shape != x.shape:
            return x  # cannot replay into a differently shaped microbatch; stay quiet
        out = old.clone()
        if self.noise:
            out = out + self._randn(out) * float(_rms(out)) * self.noise
        return out


class Bias(Attack):
    name = "bias"

    def __init__(self, scale: float = 0.5, **kw):
        super().__init__(**kw)
        self.scale = scale

    def poison(self, x, step):
        return x + self.scale * _rms(x)


class Invisible(Attack):
    name = "invisible"

    def __init__(self, rel: float = 1.0, **kw):
        super().__init__(**kw)
        if rel <= 0:
            raise ValueError(f"invisible: rel must be positive, got {rel}")
        self.rel = rel

    def poison(self, x, step):
        xf = x.float()
        noisy = xf + self._randn(xf) * float(_rms(xf)) * self.rel
        # rescale every token vector to its honest norm: norms, RMS and value range are unchanged
        tok = xf.norm(dim=-1, keepdim=True)
        return noisy * (tok / noisy.norm(dim=-1, keepdim=True).clamp_min(1e-30))


class Adaptive(Attack):
    name = "adaptive"

    def __init__(self, mode: str = "permute", **kw):
        super().__init__(**kw)
        if mode not in ("permute", "mimic"):
            raise ValueError(f"adaptive: mode must be 'permute' or 'mimic', got {mode!r}")
        self.mode = mode

    def poison(self, x, step):
        k = x.shape[-1]
        X = x.reshape(-1, k)
        if self.mode == "permute":
            perm = torch.randperm(X.shape[0], generator=self.gen).to(x.device)
            return X[perm].reshape(x.shape)
        Xf = X.float()
        mu = Xf.mean(0)
        cov = torch.cov(Xf.T) + 1e-12 * torch.eye(k, device=x.device)
        L = torch.linalg.cholesky(cov)
        Z = torch.randn(X.shape, generator=self.gen).to(x.device)
        return (mu + Z @ L.T).reshape(x.shape)


class Mixed(Attack):
    name = "mixed"

    def __init__(self, **kw):
        super().__init__(**kw)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen))
        self.attacks = [cls(start=self.start, seed=seed + i) for i, cls in enumerate(_SIMPLE)]

    def observe(self, x, step):
        for a in self.attacks:
            a.observe(x, step)

    def poison(self, x, step):
        i = int(torch.randint(0, len(self.attacks), (1,), generator=self.gen))
        return self.attacks[i].poison(x, step)


_SIMPLE = [Constant, Zeros, Random, Scaling, Negation, SignFlip, Delayed, Bias, Invisible, Adaptive]
ATTACKS: dict[str, type[Attack]] = {cls.name: cls for cls in [*_SIMPLE, Mixed]}


def make_attack(name: str, **params) -> Attack:
    """``make_attack("scaling", factor=10, start=100)``; unknown names/params raise ValueError."""
    cls = ATTACKS.get(name)
    if cls is None:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"attack {name!r}: bad parameters {params}: {e}") from None


def check_attack_allowed(name: str | None, manifest_allows: bool, cli_allows: bool) -> None:
    """Refuse an attack unless the manifest or the operator explicitly allows attacks."""
    if not name:
        return
    if name not in ATTACKS and name not in STATE_ATTACKS:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join([*ATTACKS, *STATE_ATTACKS])}")
    if not (manifest_allows or cli_allows):
        raise AttackNotAllowed(
            f"--attack {name} poisons what this node sends and is for testing the verifier only; "
            "set sentinel.allow_attacks = true in a test manifest or pass --allow-attacks"
        )


# ----------------------------------------------------------------------------- poisoned state

STATE_ATTACKS = ("state-scaled", "state-random", "state-foreign")


def poison_state(name: str, tensors: dict, seed: int = 0) -> dict:
    """What a malicious replica serves a joiner instead of its weights (testing the joiner's check
    only; ``--attack state-*``): ``state-scaled`` every tensor ×3; ``state-random`` unit normal
    noise; ``state-foreign`` another run's weights (fresh values with each tensor's own mean and
    spread, as a model trained from another seed has)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in tensors.items():
        if name == "state-scaled":
            out[key] = t * 3.0
        elif name == "state-random":
            out[key] = torch.randn(t.shape, generator=g).to(t.dtype)
        elif name == "state-foreign":
            out[key] = (torch.randn(t.shape, generator=g) * t.float().std() + t.float().mean()).to(t.dtype)
        else:
            raise ValueError(f"unknown state attack {name!r}; known: {', '.join(STATE_ATTACKS)}")
    return out
