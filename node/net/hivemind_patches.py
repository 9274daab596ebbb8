"""Every change swarm-node makes to hivemind's own behaviour, in one place.

hivemind (pinned to 1.1.12 in pyproject.toml) has no switch for a few things the node needs, so
each is done here by replacing or overriding one of its private names: the extra p2pd flags
(``static_relays_only``, ``add_daemon_flag``), and child processes that die with the node
(``SwarmDHT``, ``SwarmAverager``). Each patch names the hivemind version it was written against
and checks, before it patches, that the private name it relies on is still there: an upgraded
hivemind that moved it fails at once with :class:`HivemindPatchError` naming the name, instead of
running unpatched (a node stuck unreachable behind NAT, or a ``p2pd`` left behind by a crash).

Importing this module imports hivemind; ``node.net``'s other modules import it where they start
a daemon, a DHT or an averager.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2P

from node.base import children_of, set_parent_death_signal
from node.net import dht_guard
from node.net.averaging_judge import JudgingRunner

WRITTEN_AGAINST = "1.1.12"  # the hivemind version every patch here was written and tested against


class HivemindPatchError(RuntimeError):
    """The installed hivemind lacks a private name one of our patches relies on."""


def _require(found: bool, name: str, patch: str) -> None:
    """Fail loudly when ``name`` (a private part of hivemind) is not what ``patch`` relies on."""
    if not found:
        raise HivemindPatchError(
            f"hivemind {hivemind.__version__} has no {name}, which swarm-node's {patch} patch relies on "
            f"(written against hivemind {WRITTEN_AGAINST}, node/net/hivemind_patches.py): install "
            f"hivemind=={WRITTEN_AGAINST}, or port the patch to this version"
        )


def _patch_process_args(patch: str, wrap) -> None:
    """Replace ``P2P._make_process_args`` (the static method that turns keyword arguments into
    p2pd's command line, ``-key=value``) by ``wrap(the current one)``; the new one remembers
    which patches it carries (``_applied``)."""
    build = P2P.__dict__.get("_make_process_args")
    _require(isinstance(build, staticmethod), "P2P._make_process_args (a staticmethod)", patch)
    patched = wrap(build.__func__)
    patched._swarm_patches = _applied() | {patch}
    P2P._make_process_args = staticmethod(patched)


def _applied() -> frozenset[str]:
    """The patches ``P2P._make_process_args`` of this process carries."""
    build = P2P.__dict__.get("_make_process_args")
    return frozenset(getattr(getattr(build, "__func__", None), "_swarm_patches", ()))


# ----------------------------------------------------------------------------- p2pd's command line


def static_relays_only() -> None:
    """Make p2pd take ``trusted_relays`` as its only relays (``-relayDiscovery=0``).

    Why: hivemind passes ``-trustedRelays`` but not p2pd's ``-relayDiscovery`` switch, which
    defaults to on; with it on, p2pd's auto-relay waits for four relay candidates from its DHT or
    for its three-minute boot delay before it reserves a slot anywhere, so a node behind NAT stays
    unreachable for minutes in a small swarm. With static relays it reserves at one of them as
    soon as AutoNAT reports it private (about 15 s after start, measured in the network lab).

    Patches ``P2P._make_process_args`` (hivemind 1.1.12) of this process, idempotent; it changes
    nothing for a daemon started without trusted relays. Call it in every process that starts a
    p2pd (``SwarmDHT`` does in its child)."""
    if "static-relays" in _applied():
        return

    def wrap(build):
        def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            if kwargs.get("trustedRelays") and kwargs.get("autoRelay"):
                kwargs.setdefault("relayDiscovery", 0)
            return build(*args, **kwargs)

        return make_process_args

    _patch_process_args("static-relays", wrap)


def add_daemon_flag(name: str, value: str) -> None:
    """Every p2pd that hivemind starts from now on in this process gets ``-name=value``.

    Why: hivemind has no argument for p2pd's flags beyond its own list, and the node needs
    ``-metricsAddr`` (go-libp2p's Prometheus endpoint, where hole-punch outcomes are counted).
    Patches ``P2P._make_process_args`` (hivemind 1.1.12); call it only in a process of its own
    (the DHT's child), since it applies to every daemon started after it."""

    def wrap(build):
        def with_flag(*args: Any, **kwargs: Any) -> list[str]:
            return build(*args, **{**kwargs, name: value})

        return with_flag

    _patch_process_args(f"p2pd -{name}", wrap)


# ----------------------------------------------------------------------------- child processes


_DEATH_SIGNAL = signal.SIGUSR2

_require("run" in hivemind.DHT.__dict__, "DHT.run (the DHT child process's body)", "SwarmDHT")
_require("run" in DecentralizedAverager.__dict__, "DecentralizedAverager.run (the averager child process's body)",
         "SwarmAverager")
_require(dht_guard.missing_hivemind_name() is None, str(dht_guard.missing_hivemind_name()), "SwarmDHT (DHT guard)")


class SwarmDHT(hivemind.DHT):
    """``hivemind.DHT`` whose child process (and its ``p2pd``) dies with the node, and whose DHT
    node is guarded against strangers (``node.net.dht_guard``).

    Why: hivemind's DHT child and its p2pd outlive a node killed with ``kill -9`` (nothing tells
    them), and a Ctrl-C to the node's process group kills them under the node's feet. Overrides
    ``DHT.run``, the child process's body, and reads ``DHT._parent_pid`` (hivemind 1.1.12).

    Must be started from the main thread: the parent-death signal fires when the *thread* that
    forked the child exits.

    Why the guard: hivemind's DHT node lets a stranger hide a key's entries behind its cache, flood a
    key past what one answer can carry, evict a record early by replaying an older one, and lose a
    reader every honest entry of an answer with one bad entry. The child builds its node through
    ``DHTNode.create`` (in ``DHT.run``); :func:`node.net.dht_guard.guard_this_process` makes that
    node's protocol a ``GuardedDHTProtocol``, for every DHT node the project starts (regular nodes
    and bootstrap peers all run a ``SwarmDHT``).

    ``daemon_metrics_addr`` (``host:port``, set before starting): p2pd also serves go-libp2p's own
    Prometheus metrics there (``-metricsAddr``, through :func:`add_daemon_flag` in the child),
    which is where hole-punch outcomes are counted (``node.net.connections.DaemonMetrics``).
    """

    daemon_metrics_addr: str | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _require(isinstance(getattr(self, "_parent_pid", None), int), "DHT._parent_pid", "SwarmDHT")

    @property
    def daemon_metrics_url(self) -> str | None:
        return f"http://{self.daemon_metrics_addr}/metrics" if self.daemon_metrics_addr else None

    def run(self) -> None:
        parent = self._parent_pid
        if self.daemon_metrics_addr:
            add_daemon_flag("metricsAddr", self.daemon_metrics_addr)
        # Our own process group: a signal to the node's group (Ctrl-C in a terminal, `timeout`,
        # systemd) must not kill the DHT or its p2pd under the node's feet; the node stops them in
        # order. If the node itself dies, the parent-death signal takes them down.
        try:
            os.setpgid(0, 0)
        except OSError:
            pass

        def on_parent_death(signum, frame):
            for child in children_of(os.getpid()):  # our p2pd
                try:
                    os.kill(child, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os._exit(0)

        signal.signal(_DEATH_SIGNAL, on_parent_death)
        signal.signal(signal.SIGTERM, on_parent_death)
        set_parent_death_signal(_DEATH_SIGNAL)
        if os.getppid() != parent:  # the node died before we set the signal
            on_parent_death(_DEATH_SIGNAL, None)
        static_relays_only()  # this process starts the p2pd
        dht_guard.guard_this_process()  # the DHTNode that DHT.run creates below is a guarded one
        super().run()


class SwarmAverager(DecentralizedAverager):
    """hivemind's averager for swarm-node's replica averaging: its child process dies with the
    node, only the stage's own replicas may share a group, every member has weight one and a
    share of the work set by the group's size alone, and contributions are judged before they
    are applied (``stages.robust_avg``; docs/ASYNCMESH.md, "Who may average, and what is applied").

    Why each override (hivemind 1.1.12):

    - ``run`` (the child process's body): the averager is a forked child that hivemind stops only
      on a clean shutdown; after ``kill -9`` of the node alone it would run on.
    - members: hivemind lets anyone who matches the schema and the group key into a group. The
      parent names the peers that hold a live signed record for the stage (``set_members``,
      before each round); as a leader this averager refuses anyone else's join request, as a
      follower it asks no one else to lead it (``Matchmaking._check_reasons_to_reject`` and
      ``Matchmaking._request_join_group``, wrapped on its instance), and a group that still holds
      someone else (another member let them in) is refused whole (``_aggregate_with_group``).
    - weights and shares: hivemind takes each member's weight from what that member sends with
      its parts, and each member's share of the reduction from the bandwidth and mode it claims;
      here both are ignored: weight one, equal shares, every member a full node.
    - judging: each chunk of this member's range is reduced by ``stages.robust_avg.robust_mean``
      (its own contribution the reference) instead of a plain weighted sum, and once every range
      has come back the ranges other reducers returned are checked against this member's own
      (``refused_reducers``); a refused range keeps this member's values. Counts go back to the
      parent in a small shared tensor (``report``).

    One float32 tensor is averaged, laid out as ``layout`` (``stages.robust_avg.AveragingLayout``) says.
    """

    REPORT = ("contributions_dropped", "parts_refused", "strangers_refused", "groups_refused")

    def __init__(self, averaged_tensors, dht, *, layout=None, **kwargs: Any):
        tensors = list(averaged_tensors)
        if len(tensors) != 1 or tensors[0].dtype != torch.float32:
            raise ValueError("SwarmAverager averages exactly one float32 tensor")
        self._layout = layout
        self._members: frozenset[str] | None = None  # in the child: who may share a group (None: anyone)
        self._report = torch.zeros(len(self.REPORT), dtype=torch.float64).share_memory_()
        super().__init__(tensors, dht, **kwargs)

    def run(self) -> None:
        set_parent_death_signal(signal.SIGKILL)
        super().run()

    # ---- the parent's side

    def set_members(self, peer_ids) -> None:
        """The peers (base58 ids) that may share this averager's next groups, this node aside;
        None: anyone. Takes effect before any ``step`` sent after it."""
        members = None if peer_ids is None else sorted(str(p) for p in peer_ids)
        self._outer_pipe.send(("_set_members", [], dict(members=members)))

    def report(self) -> dict[str, int]:
        """Counts since start: members this averager's reducer dropped (per round, each member
        once), ranges it refused as a receiver, join requests or leaders it refused (no stage
        record), groups it refused because they held such a peer."""
        return {name: int(v) for name, v in zip(self.REPORT, self._report.tolist())}

    # ---- the child's side

    def _count(self, name: str, n: int = 1) -> None:
        self._report[self.REPORT.index(name)] += n

    def _admits(self, peer_id) -> bool:
        return self._members is None or peer_id == self.peer_id or peer_id.to_base58() in self._members

    def _guard_matchmaking(self) -> None:
        """Wrap this averager's ``Matchmaking`` (once) so that only members meet."""
        mm = self._matchmaking
        if getattr(mm, "_swarm_guarded", False):
            return
        check, request = mm._check_reasons_to_reject, mm._request_join_group

        def check_reasons_to_reject(request_msg, context):
            if not self._admits(context.remote_id):
                from hivemind.proto import averaging_pb2

                self._count("strangers_refused")
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return check(request_msg, context)

        async def request_join_group(leader):
            if not self._admits(leader):
                self._count("strangers_refused")
                return None
            return await request(leader)

        mm._check_reasons_to_reject, mm._request_join_group = check_reasons_to_reject, request_join_group
        mm._swarm_guarded = True

    async def _set_members(self, members) -> None:
        self._members = None if members is None else frozenset(members)
        self._guard_matchmaking()

    async def _step(self, **kwargs: Any) -> None:
        self._guard_matchmaking()
        await super()._step(**kwargs)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs: Any):
        from hivemind.utils.asyncio import enter_asynchronously

        try:
            if not all(self._admits(p) for p in group_info.peer_ids):
                self._count("groups_refused")
                raise AllreduceException("the group holds a peer without a record for this stage")
            gathered = {}
            for peer_id, blob in zip(group_info.peer_ids, group_info.gathered):
                _bandwidth, _mode, user_bytes = self.serializer.loads(blob)  # claims ignored: equal shares
                gathered[peer_id] = self.serializer.loads(user_bytes)
            g = len(group_info.peer_ids)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=(1.0,) * g,
                                                   modes=(AveragingMode.NODE,) * g, **kwargs)
            return gathered
        except Exception as e:  # noqa: BLE001 - like hivemind's: any failure fails this group
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs: Any) -> None:
        from hivemind.compression import NoCompression
        from hivemind.utils import get_dht_time
        from hivemind.utils.asyncio import as_aiter, azip
        from stages import chunk_elements

        group_id = group_info.group_id if group_id is None else group_id
        (buffer,) = tensors
        chunk = chunk_elements(buffer.numel(), len(group_info.peer_ids))
        kwargs.update(weight=1.0, part_size_bytes=4 * chunk, compression=NoCompression())
        runner = JudgingRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                group_id=group_id, ordered_peer_ids=group_info.peer_ids, chunk=chunk,
                                layout=self._layout, **kwargs)
        if group_id not in self._running_groups:
            raise AllreduceException("all-reduce group was not registered")
        self._running_groups[group_id].set_result(runner)
        updates = [update async for _, update in azip(as_aiter(*tensors), runner)]
        refused = runner.refused(buffer, updates[0])
        self._count("contributions_dropped", len(runner.tensor_part_reducer.dropped))
        self._count("parts_refused", len(refused))
        buffer.add_(updates[0], alpha=self._averaging_alpha)
        self.last_updated = get_dht_time()
        self._state_updated.set()


_require(callable(getattr(Matchmaking, "_check_reasons_to_reject", None)),
         "Matchmaking._check_reasons_to_reject", "SwarmAverager")
_require(callable(getattr(Matchmaking, "_request_join_group", None)), "Matchmaking._request_join_group",
         "SwarmAverager")
for _name in ("_step", "_aggregate_with_group", "_run_allreduce_inplace_"):
    _require(_name in DecentralizedAverager.__dict__, f"DecentralizedAverager.{_name}", "SwarmAverager")
_require("reset_accumulators" in TensorPartReducer.__dict__ and "accumulator" in
         TensorPartReducer.check_current_part_finished.__code__.co_names,
         "TensorPartReducer.reset_accumulators / .accumulator", "SwarmAverager")
