"""Persistent libp2p identities: ``swarm-node keygen PATH`` and the checks a node runs on its key.

The key format and signatures are ``security.identity``'s (pure); this module reads and writes
the files and checks whether an identity is online. A node's peer id is the hash of its public
key, so a node that restarts with the same key file keeps its peer id (its DHT records, reputation and routes stay valid). The file is what
go-libp2p's daemon reads with ``p2pd -id FILE``: the libp2p ``PrivateKey`` protobuf
(``KeyType`` field 1, key bytes field 2). We write Ed25519 keys (64 bytes: seed then public key),
which every libp2p implementation supports and whose peer ids (``12D3KooW...``) embed the public
key; RSA keys written by hivemind (DER PKCS#1 inside the same protobuf) are accepted too.

A key file is a secret: a node refuses one that group or others can read or write, and refuses
an identity that is already online (two daemons with one peer id break routing for both).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from node.ops import CliError
from security import new_ed25519_key, peer_id_from_key  # noqa: F401 - the key codec lives in security/

log = logging.getLogger("swarm_node.identity")

# ----------------------------------------------------------------------------- files


def write_identity(path: str | os.PathLike, *, force: bool = False) -> str:
    """Write a new Ed25519 identity to ``path`` with mode 0600 and return its peer id.

    Refuses to replace an existing file unless ``force``; the file appears atomically (a crash
    never leaves a half-written key) and is never readable by others, not even briefly.
    """
    path = Path(path)
    if path.exists() and not force:
        raise CliError(f"{path} already exists; keep it (it is this node's peer id) or pass --force to replace it")
    if not path.parent.is_dir():
        raise CliError(f"directory {path.parent} does not exist; create it first (mkdir -p {path.parent})")
    blob = new_ed25519_key()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return peer_id_from_key(blob)


def ephemeral_identity() -> Path:
    """A fresh identity for one run of a node started without ``--identity``, in a private
    temporary directory (mode 0700, key 0600); the node signs its DHT records with it. Remove it
    with ``shutil.rmtree(path.parent)`` when the node exits."""
    path = Path(tempfile.mkdtemp(prefix="swarm-node-identity-")) / "identity.key"
    write_identity(path)
    return path


def _unlink_quietly(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def check_identity(path: str | os.PathLike) -> str:
    """Check an identity file before a node uses it; return its peer id.

    Raises ``CliError`` (one line with the fix) if the file is missing, is not a regular file,
    can be read or written by group/others, or is not a libp2p private key.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CliError(f"identity file {path} does not exist; create it with: swarm-node keygen {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CliError(f"identity {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise CliError(
            f"identity file {path} is accessible by group/others (mode {mode:04o}); "
            f"it is a private key: run chmod 600 {path}"
        )
    try:
        return peer_id_from_key(path.read_bytes())
    except PermissionError:
        raise CliError(f"cannot read identity file {path}: permission denied") from None
    except ValueError as e:
        raise CliError(f"{path} is not a usable identity: {e}; write one with: swarm-node keygen PATH") from None


def peer_id_from_identity(path: str | os.PathLike) -> str:
    """Peer id of the identity in ``path`` (checked like :func:`check_identity`)."""
    return check_identity(path)


load_identity = check_identity


# ----------------------------------------------------------------------------- online check


async def identity_in_use(p2p_or_transport, peer_id: str, maddrs=(), *, timeout: float = 5.0) -> bool:
    """Whether a peer with ``peer_id`` is online: try to dial it through ``p2p_or_transport``.

    ``maddrs`` are addresses to try (e.g. where this identity was last seen); with none, the
    daemon looks the peer up in the libp2p DHT it bootstrapped from its initial peers. Call it
    from a daemon that does *not* use this identity (e.g. ``anonymous_identity_in_use``).
    A dial that fails or takes longer than ``timeout`` seconds means "not in use".
    """
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
    from hivemind.utils.multiaddr import Multiaddr

    p2p = getattr(p2p_or_transport, "p2p", p2p_or_transport)
    if p2p.peer_id.to_base58() == peer_id:
        raise ValueError("identity_in_use must dial from a daemon with a different peer id")
    addrs = []
    for m in maddrs:
        ma = Multiaddr(str(m))
        if "p2p" in [p.name for p in ma.protocols()]:
            if ma.value_for_protocol("p2p") != peer_id:
                continue
            ma = ma.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
        addrs.append(ma)
    try:
        async with asyncio.timeout(timeout):
            await p2p._client.connect(PeerID.from_base58(peer_id), addrs)
    except (P2PDaemonError, TimeoutError, ConnectionError, OSError):
        return False
    return True


async def anonymous_identity_in_use(
    identity_path: str | os.PathLike, initial_peers, *, timeout: float = 5.0, **start_kwargs
) -> bool | None:
    """Start a throwaway daemon with a random identity, bootstrapped from ``initial_peers``, and
    ask :func:`identity_in_use` about the peer id of ``identity_path``. For ``swarm-node run``
    before it starts its own daemon with that identity. None (logged) when the question could
    not be asked: the throwaway daemon did not start, e.g. it reached none of ``initial_peers``
    (the caller's own join then retries them and reports that failure in one line)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    from node.net.p2p import Transport

    peer_id = check_identity(identity_path)
    if not initial_peers:
        return False  # a first node of a swarm has nobody to collide with
    try:
        transport = await Transport.start(initial_peers=list(initial_peers), **start_kwargs)
    except (P2PDaemonError, OSError) as e:
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        log.info("could not ask the swarm whether identity %s is online: %s", identity_path, text[:300])
        return None
    try:
        return await identity_in_use(transport, peer_id, (), timeout=timeout)
    finally:
        await transport.close()


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", help="where to write the private key (created with mode 0600)")
    parser.add_argument("--force", action="store_true", help="replace an existing key (the peer id changes)")


def main(args) -> int:
    peer_id = write_identity(args.path, force=args.force)
    print(f"wrote {args.path} (mode 0600)")
    print(f"peer id: {peer_id}")
    return 0
