"""`swarm-node manifest keygen|sign|verify`: the organisers' side of a signed run.

A run's organisers hold one Ed25519 key. ``sign`` writes it into the manifest (``run.organiser``:
the public half, a consensus field) with a signature over the manifest hash (``[signature]``), so
every node can check that the file it was given is the organisers' and unchanged, and the run's
DHT records live in a namespace only that key's manifest reaches (``docs/THREAT_MODEL.md``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from node.base import CliError, ensure_key_directory


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="manifest_command", metavar="ACTION", required=True)
    k = sub.add_parser("keygen", help="write a new organiser key (mode 0600) and print its public half")
    k.add_argument("path", metavar="KEYFILE")
    k.add_argument("--force", action="store_true", help="replace an existing key (every signed manifest changes)")
    s = sub.add_parser("sign", help="sign a manifest with an organiser key")
    s.add_argument("manifest", metavar="MANIFEST", help="a TOML file or a shipped name (default, test)")
    s.add_argument("--key", required=True, metavar="KEYFILE", help="the organiser key (swarm-node manifest keygen)")
    s.add_argument("--out", default="", metavar="FILE", help="where to write the signed manifest (default: in place)")
    v = sub.add_parser("verify", help="check a manifest's signature and print its organiser and hash")
    v.add_argument("manifest", metavar="MANIFEST")


def _write_private(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` atomically with ``mode`` (never a half-written file)."""
    if not path.parent.is_dir():
        raise CliError(f"directory {path.parent} does not exist; create it first (mkdir -p {path.parent})")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_organiser_key(path: str):
    from security import OrganiserKey

    p = Path(path)
    try:
        if p.stat().st_mode & 0o077:
            raise CliError(f"organiser key {p} is accessible by group/others; it is a private key: run chmod 600 {p}")
        return OrganiserKey.from_text(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"organiser key {p} does not exist; create it with: swarm-node manifest keygen {p}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(f"{p} is not an organiser key: {e}") from None


def _load(name: str):
    from stages import ManifestError, load_manifest

    try:
        return load_manifest(name)
    except ManifestError as e:
        raise CliError(f"manifest {name}: {e}") from None


def sign_manifest(manifest, key):
    """``manifest`` with ``run.organiser`` set to ``key``'s public half and signed by it."""
    from stages import manifest_hash

    unsigned = manifest.replace(run={"organiser": key.public}, signature={"ed25519": ""})
    return unsigned.replace(signature={"ed25519": key.sign_manifest(manifest_hash(unsigned))})


def main(args) -> int:
    from security import OrganiserKey, manifest_signature_problem, organiser_fingerprint
    from stages import load_manifest, manifest_hash, manifest_toml

    if args.manifest_command == "keygen":
        path = Path(args.path)
        if path.exists() and not args.force:
            raise CliError(f"{path} already exists; keep it (it signs your run) or pass --force to replace it")
        key = OrganiserKey.generate()
        ensure_key_directory(path)
        _write_private(path, key.to_text(), 0o600)
        print(f"wrote {path} (mode 0600)")
        print(f"organiser public key: {key.public}")
        return 0
    manifest = _load(args.manifest)
    if args.manifest_command == "sign":
        signed = sign_manifest(manifest, load_organiser_key(args.key))
        out = Path(args.out or args.manifest)
        if not args.out and not out.exists():
            raise CliError(f"{args.manifest} is a shipped manifest; give --out FILE for the signed copy")
        _write_private(out, manifest_toml(signed), 0o644)
        if load_manifest(out) != signed:
            raise CliError(f"{out}: the written manifest does not read back equal (please report this)")
        print(f"signed {out}: run {signed.run.id}, organiser {signed.run.organiser} "
              f"(fingerprint {organiser_fingerprint(signed.run.organiser)}), hash {manifest_hash(signed)[:16]}")
        return 0
    problem = manifest_signature_problem(manifest)
    if problem is not None:
        raise CliError(f"manifest {args.manifest}: {problem}")
    print(f"{args.manifest}: signed by organiser {manifest.run.organiser} "
          f"(fingerprint {organiser_fingerprint(manifest.run.organiser)}); hash {manifest_hash(manifest)}")
    return 0
