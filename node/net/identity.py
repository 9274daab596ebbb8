"""Persistent libp2p identities: ``swarm-node keygen PATH`` and the checks a node runs on its key.

The key format and signatures are ``security.identity``'s (pure); this module reads and writes
the files. A node's peer id is the hash of its public key, so a node that restarts with the same
key file keeps its peer id (its DHT records, reputation and routes stay valid). The file is what
go-libp2p's daemon reads with ``p2pd -id FILE``: the libp2p ``PrivateKey`` protobuf
(``KeyType`` field 1, key bytes field 2). We write Ed25519 keys (64 bytes: seed then public key),
which every libp2p implementation supports and whose peer ids (``12D3KooW...``) embed the public
key; RSA keys written by hivemind (DER PKCS#1 inside the same protobuf) are accepted too.

A key file is a secret: a node refuses one that group or others can read or write. Whether an
identity is already online (two daemons with one peer id break routing for both) is asked by
``node.net.presence``, which needs a daemon.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from node.base import CliError, ensure_key_directory

# ----------------------------------------------------------------------------- files


def write_identity(path: str | os.PathLike, *, force: bool = False) -> str:
    """Write a new Ed25519 identity to ``path`` with mode 0600 and return its peer id.

    Refuses to replace an existing file unless ``force``; the file appears atomically (a crash
    never leaves a half-written key) and is never readable by others, not even briefly.
    """
    path = Path(path)
    if path.exists() and not force:
        raise CliError(f"{path} already exists; keep it (it is this node's peer id) or pass --force to replace it")
    ensure_key_directory(path)
    from security import new_ed25519_key, peer_id_from_key  # the key codec (imported here: it loads torch)

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
    from security import peer_id_from_key

    try:
        return peer_id_from_key(path.read_bytes())
    except PermissionError:
        raise CliError(f"cannot read identity file {path}: permission denied") from None
    except ValueError as e:
        raise CliError(f"{path} is not a usable identity: {e}; write one with: swarm-node keygen PATH") from None


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", help="where to write the private key (created with mode 0600)")
    parser.add_argument("--force", action="store_true", help="replace an existing key (the peer id changes)")


def main(args) -> int:
    peer_id = write_identity(args.path, force=args.force)
    print(f"wrote {args.path} (mode 0600)")
    print(f"peer id: {peer_id}")
    return 0
