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

Adaptive families, each with one strength parameter, built to pass SENTINEL's own statistics
(docs/SENTINEL.md, "Harm and the adaptive adversary"); the benchmark sweeps their strength and measures the
harm each setting does to the receiver:

========== ==================================================================================
swap       the codes of a random ``fraction`` (0.1) of positions permuted among themselves: the
           multiset of token vectors is exactly the honest one (every permutation-invariant
           statistic unchanged) while those positions carry other tokens' content
ctxswap    codes permuted only among positions with the SAME token id (``fraction`` 1.0 of the
           positions take part): every statistic keyed by the token id is unchanged too; what
           is lost is each position's context (needs the microbatch's ids; without them the
           honest tensor is sent)
rotate     the centred codes of a ``fraction`` (1.0) of positions rotated by ``angle`` (0.5 rad)
           in a random 2-plane of the k coordinates: channel means and token norms about the
           mean kept
flip       on a ``fraction`` (0.1) of positions, ``dims`` (2) random coordinates reflected about
           their channel mean (x -> 2 mu - x): channel means and RMS kept in expectation
drift      a bias along a fixed random direction growing by ``rate`` (0.02) of each token's norm
           per tensor sent: slow enough to move any reference that follows the sender
coherent   ``invisible`` with noise that neighbouring positions share: an AR(1) process along each
           row (correlation ``rho`` 0.9 between neighbours) of relative RMS ``rel`` (1.0), each
           token vector rescaled to its honest norm: what a position carries beyond its token
           still agrees with its neighbours', as honest context does
fence      white-box: reads the receiver's verifier (``oracle``: tensor -> score; without one, a
           shadow SENTINEL fed its own honest outputs, since the code and the manifest are
           public) and sends the strongest of several harmful edits (positions permuted,
           negated, ... on all positions blended, or on a subset) whose score stays below
           ``margin`` (0.9) of the fence
========== ==================================================================================
"""

from __future__ import annotations

import math
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

    def __init__(self, start: int = 0, seed: int = 0, direction: str = "act"):
        if direction not in ("act", "grad"):
            raise ValueError(f"attack direction must be 'act' or 'grad', got {direction!r}")
        self.start, self.direction = start, direction  # direction: what it poisons (keys its token ids)
        self.gen = torch.Generator().manual_seed(seed)
        self.ids: Tensor | None = None  # the microbatch's token ids (B, L), when the caller has them

    def __call__(self, x: Tensor, step: int, ids: Tensor | None = None) -> Tensor:
        self.ids = ids
        with torch.no_grad():
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


def coherent_noise(shape, rho: float, gen: torch.Generator) -> Tensor:
    """Unit-variance Gaussian noise of ``shape`` (B, L, k) that is an AR(1) process along L with
    correlation ``rho`` between neighbouring positions."""
    e = torch.randn(shape, generator=gen)
    out = torch.empty(shape)
    out[:, 0] = e[:, 0]
    c = math.sqrt(1.0 - rho * rho)
    for t in range(1, shape[1]):
        out[:, t] = rho * out[:, t - 1] + c * e[:, t]
    return out


def _norm_kept(xf: Tensor, noisy: Tensor) -> Tensor:
    """``noisy`` with every token vector rescaled to its norm in ``xf``."""
    return noisy * (xf.norm(dim=-1, keepdim=True) / noisy.norm(dim=-1, keepdim=True).clamp_min(1e-30))


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
        return _norm_kept(xf, noisy)


class Coherent(Attack):
    """``invisible`` built to pass ``adj``: i.i.d. noise makes what neighbouring positions carry
    beyond their tokens disagree, so the noise here is shared by neighbours (``coherent_noise``)."""

    name = "coherent"

    def __init__(self, rel: float = 1.0, rho: float = 0.9, **kw):
        super().__init__(**kw)
        if rel <= 0:
            raise ValueError(f"coherent: rel must be positive, got {rel}")
        if not 0 <= rho < 1:
            raise ValueError(f"coherent: rho must be in [0, 1), got {rho}")
        self.rel, self.rho = rel, rho

    def poison(self, x, step):
        xf = x.float()
        if xf.dim() != 3:
            raise ValueError(f"coherent: expected a (B, L, k) payload, got shape {tuple(xf.shape)}")
        noise = coherent_noise(tuple(xf.shape), self.rho, self.gen).to(xf.device)
        return _norm_kept(xf, xf + noise * float(_rms(xf)) * self.rel)


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
        self.attacks = [cls(start=self.start, seed=seed + i, direction=self.direction) for i, cls in enumerate(_SIMPLE)]

    def observe(self, x, step):
        for a in self.attacks:
            a.ids = self.ids
            a.observe(x, step)

    def poison(self, x, step):
        i = int(torch.randint(0, len(self.attacks), (1,), generator=self.gen))
        return self.attacks[i].poison(x, step)


# ----------------------------------------------------------------------------- adaptive families


def _fraction(name: str, fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ValueError(f"{name}: fraction must be in (0, 1], got {fraction}")
    return fraction


class Swap(Attack):
    """A random ``fraction`` of positions exchange their codes (a random permutation among them)."""

    name = "swap"

    def __init__(self, fraction: float = 0.1, **kw):
        super().__init__(**kw)
        self.fraction = _fraction(self.name, fraction)

    def poison(self, x, step):
        X = x.reshape(-1, x.shape[-1]).clone()
        n = X.shape[0]
        m = max(2, round(self.fraction * n))
        pos = torch.randperm(n, generator=self.gen)[:m]
        X[pos] = X[pos[torch.roll(torch.arange(m), 1)]]  # a cycle: every chosen position moves
        return X.reshape(x.shape)


class CtxSwap(Attack):
    """Codes permuted among positions that share a token id: per-token statistics unchanged,
    each position's context (what earlier stages computed from the tokens before it) lost."""

    name = "ctxswap"

    def __init__(self, fraction: float = 1.0, **kw):
        super().__init__(**kw)
        self.fraction = _fraction(self.name, fraction)

    def poison(self, x, step):
        if self.ids is None or tuple(self.ids.shape) != tuple(x.shape[:2]):
            return x
        X = x.reshape(-1, x.shape[-1])
        src = same_id_cycle(token_keys(self.ids, self.direction), self.fraction, self.gen).to(X.device)
        return X[src].reshape(x.shape)


def token_keys(ids: Tensor, direction: str) -> Tensor:
    """The token a position's code belongs to, as the verifier keys it: activations by their own
    token, gradients by the next one (the label); a gradient row's last position gets a key of
    its own (-1: it is never exchanged with another row's last)."""
    if direction == "act":
        return ids
    ids = ids.long()
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], dim=1)


def same_id_cycle(ids: Tensor, fraction: float, gen: torch.Generator) -> Tensor:
    """Source position (into ``ids.reshape(-1)``) for every position: a random ``fraction`` of the
    positions take part, and among those the positions of each token id pass their codes on in
    a random cycle; the others (and ids that occur once, and the key -1) keep their own."""
    ids = ids.reshape(-1).to(torch.long).cpu()
    n = ids.shape[0]
    src = torch.arange(n)
    pos = torch.nonzero((torch.rand(n, generator=gen) < fraction) & (ids >= 0)).flatten()
    if pos.numel() < 2:
        return src
    # sort by (id, random key): each id's run is then one random cycle
    key = ids[pos].double() + torch.rand(pos.shape[0], generator=gen, dtype=torch.float64) * 0.5
    pos = pos[torch.argsort(key)]
    grp = ids[pos]
    first = torch.ones_like(grp, dtype=torch.bool)
    first[1:] = grp[1:] != grp[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    run_start = torch.nonzero(first).flatten()[torch.cumsum(first.long(), 0) - 1]
    nxt = torch.where(last, run_start, (torch.arange(pos.shape[0]) + 1).clamp_max(pos.shape[0] - 1))
    src[pos] = pos[nxt]
    return src


class Rotate(Attack):
    """Centred codes of a ``fraction`` of positions rotated by ``angle`` in a random 2-plane."""

    name = "rotate"

    def __init__(self, angle: float = 0.5, fraction: float = 1.0, **kw):
        super().__init__(**kw)
        self.angle, self.fraction = angle, _fraction(self.name, fraction)

    def poison(self, x, step):
        k = x.shape[-1]
        X = x.reshape(-1, k).float()
        Q, _ = torch.linalg.qr(torch.randn(k, 2, generator=self.gen, dtype=torch.float64))
        Q = Q.float().to(X.device)
        c, s = math.cos(self.angle), math.sin(self.angle)
        R = torch.tensor([[c, -s], [s, c]], device=X.device)
        mu = X.mean(0)
        Z = X - mu
        P = Z @ Q  # coordinates in the plane
        Zr = Z + (P @ R.T - P) @ Q.T
        take = (torch.rand(X.shape[0], generator=self.gen) < self.fraction).to(X.device).unsqueeze(1)
        return torch.where(take, Zr + mu, X).reshape(x.shape)


class Flip(Attack):
    """On a ``fraction`` of positions, ``dims`` random coordinates reflected about their channel mean."""

    name = "flip"

    def __init__(self, fraction: float = 0.1, dims: int = 2, **kw):
        super().__init__(**kw)
        self.fraction = _fraction(self.name, fraction)
        if dims < 1:
            raise ValueError(f"flip: dims must be >= 1, got {dims}")
        self.dims = dims

    def poison(self, x, step):
        k = x.shape[-1]
        X = x.reshape(-1, k).float().clone()
        mu = X.mean(0)
        cols = torch.randperm(k, generator=self.gen)[: min(self.dims, k)].to(X.device)
        rows = (torch.rand(X.shape[0], generator=self.gen) < self.fraction).to(X.device)
        sub = X[rows][:, cols]
        X[torch.nonzero(rows).flatten().unsqueeze(1), cols.unsqueeze(0)] = 2 * mu[cols] - sub
        return X.reshape(x.shape)


class Drift(Attack):
    """A bias along a fixed random unit direction growing by ``rate`` of each token's norm per
    tensor sent since ``start``."""

    name = "drift"

    def __init__(self, rate: float = 0.02, **kw):
        super().__init__(**kw)
        if rate <= 0:
            raise ValueError(f"drift: rate must be positive, got {rate}")
        self.rate, self.sent, self.u = rate, 0, None

    def poison(self, x, step):
        k = x.shape[-1]
        if self.u is None or self.u.shape[0] != k:
            u = torch.randn(k, generator=self.gen)
            self.u = u / u.norm()
        self.sent += 1
        xf = x.float()
        return xf + self.rate * self.sent * xf.norm(dim=-1, keepdim=True) * self.u.to(x.device)


class Fence(Attack):
    """White-box fence rider. ``oracle(tensor) -> score`` is the receiver's verdict score without
    learning (``Sentinel.judge(..., commit=False)``); without one the attacker keeps a shadow
    SENTINEL (``params``: the public manifest's settings) fed its own honest outputs and asks it.
    Each call it tries several harmful edits e of the honest x -- all positions blended toward a
    target, x + a(t - x), or the target on a random share a of the positions, for the targets
    "positions permuted", "negated", "tokens permuted with their ids' codes kept" and "noise
    neighbours share, norms kept" (``coherent`` at rel 1) -- finds by
    bisection the largest a whose score stays <= ``margin``, and sends the edit that moves x the
    most (the harm it can see is the size of the change)."""

    name = "fence"

    def __init__(self, margin: float = 0.9, oracle=None, params=None, steps: int = 8, **kw):
        super().__init__(**kw)
        if not 0 < margin:
            raise ValueError(f"fence: margin must be positive, got {margin}")
        self.margin, self.oracle, self.steps = margin, oracle, steps
        self._shadow = None
        self._params = params
        self._n = 0

    def observe(self, x, step):
        if self.oracle is None:
            if self._shadow is None:
                from security.sentinel import Sentinel, SentinelParams

                self._shadow = Sentinel(self._params or SentinelParams())
            self._n += 1
            self._shadow.judge("self", self.direction, x, ids=self.ids, mb=("own", self._n))

    def _score(self, t: Tensor) -> float:
        if self.oracle is not None:
            return float(self.oracle(t))
        return float(self._shadow.judge("self", self.direction, t, ids=self.ids, commit=False).score)

    def poison(self, x, step):
        xf = x.float()
        X = xf.reshape(-1, xf.shape[-1])
        n = X.shape[0]
        perm = torch.randperm(n, generator=self.gen)
        targets = [X[perm].reshape(xf.shape), -xf]
        if self.ids is not None and tuple(self.ids.shape) == tuple(xf.shape[:2]):
            src = same_id_cycle(token_keys(self.ids, self.direction), 1.0, self.gen).to(X.device)
            targets.append(X[src].reshape(xf.shape))
        if xf.dim() == 3:
            noise = coherent_noise(tuple(xf.shape), 0.9, self.gen).to(xf.device)
            targets.append(_norm_kept(xf, xf + noise * float(_rms(xf))))
        order = torch.randperm(n, generator=self.gen)
        rank = torch.empty(n, dtype=torch.long)
        rank[order] = torch.arange(n)
        u = (rank.float() / n).reshape(xf.shape[:-1]).unsqueeze(-1).to(xf.device)  # random order of positions
        best, best_move = xf, 0.0
        for target in targets:
            for mode in ("blend", "subset"):
                def edit(a, target=target, mode=mode):
                    if mode == "blend":
                        return xf + a * (target - xf)
                    return torch.where(u < a, target, xf)
                lo, hi = 0.0, 1.0
                if self._score(edit(hi)) <= self.margin:
                    lo = hi
                else:
                    for _ in range(self.steps):
                        mid = (lo + hi) / 2
                        if self._score(edit(mid)) <= self.margin:
                            lo = mid
                        else:
                            hi = mid
                if lo <= 0:
                    continue
                cand = edit(lo)
                move = float((cand - xf).norm())
                if move > best_move:
                    best, best_move = cand, move
        return best


_SIMPLE = [Constant, Zeros, Random, Scaling, Negation, SignFlip, Delayed, Bias, Invisible, Adaptive]
ADAPTIVE = [Swap, CtxSwap, Rotate, Flip, Drift, Coherent, Fence]
ATTACKS: dict[str, type[Attack]] = {cls.name: cls for cls in [*_SIMPLE, Mixed, *ADAPTIVE]}
ADAPTIVE_FAMILIES = tuple(cls.name for cls in ADAPTIVE)


def make_attack(name: str, **params) -> Attack:
    """``make_attack("scaling", factor=10, start=100)``; unknown names/params raise ValueError."""
    cls = ATTACKS.get(name)
    if cls is None:
        raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACKS)}")
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"attack {name!r}: bad parameters {params}: {e}") from None


def parse_attack(spec: str) -> tuple[str, dict]:
    """``"swap"`` -> ("swap", {}); ``"swap:fraction=0.3"`` or ``"rotate:angle=1,fraction=0.5"`` ->
    the name and its numeric parameters (what ``--attack`` accepts)."""
    name, _, rest = spec.partition(":")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"attack {spec!r}: parameters are key=value, got {item!r}")
        try:
            params[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"attack {spec!r}: {key.strip()} must be a number, got {value!r}") from None
    return name.strip(), params


def check_attack_allowed(name: str | None, manifest_allows: bool, cli_allows: bool) -> None:
    """Refuse an attack unless the manifest or the operator explicitly allows attacks. ``name``
    may carry parameters (``parse_attack``)."""
    if not name:
        return
    name, params = parse_attack(name)
    if params:
        make_attack(name, **params)  # unknown parameters: ValueError now, not at the first send
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
