"""Persistent identities: keygen file format and mode, refusal of loose permissions and of
overwrites, the peer id p2pd actually uses, and detecting an identity that is already online."""

from __future__ import annotations

import argparse
import asyncio
import os
import stat
import time

import pytest

from node.base import CliError
from node.net import check_identity
from node.net.identity import add_arguments, main
from node.net.presence import identity_in_use
from security import new_ed25519_key, peer_id_from_key


def keygen(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(argv))


def test_keygen_writes_a_private_key_with_mode_0600_and_refuses_to_overwrite(tmp_path, capsys):
    path = tmp_path / "node.key"
    assert keygen([str(path)]) == 0
    out = capsys.readouterr().out
    peer_id = check_identity(path)
    assert f"peer id: {peer_id}" in out and peer_id.startswith("12D3KooW")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    blob = path.read_bytes()
    assert blob[:4] == b"\x08\x01\x12\x40" and len(blob) == 68  # libp2p PrivateKey{Ed25519, 64 bytes}

    with pytest.raises(CliError, match="already exists.*--force"):
        keygen([str(path)])
    assert path.read_bytes() == blob
    assert keygen([str(path), "--force"]) == 0
    assert path.read_bytes() != blob and check_identity(path) != peer_id
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]  # no temp file left

    # a key's missing directory is created for the owner only (its parents as mkdir -p makes them)
    nested = tmp_path / "home" / ".swarm-node" / "identity.key"
    assert keygen([str(nested)]) == 0 and check_identity(nested)
    assert stat.S_IMODE(nested.parent.stat().st_mode) == 0o700
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CliError, match="cannot create directory .*afile"):
        keygen([str(tmp_path / "afile" / "k")])


def test_manifest_keygen_creates_the_key_s_directory(tmp_path, capsys):
    from node.ops.manifest_cmd import add_arguments as add_manifest, main as manifest_main

    parser = argparse.ArgumentParser()
    add_manifest(parser)
    path = tmp_path / ".swarm-node" / "organiser.key"
    assert manifest_main(parser.parse_args(["keygen", str(path)])) == 0
    assert "organiser public key" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_identity_checks_permissions_and_format(tmp_path):
    path = tmp_path / "k"
    path.write_bytes(new_ed25519_key())
    for mode in (0o644, 0o640, 0o604, 0o660, 0o602):
        os.chmod(path, mode)
        with pytest.raises(CliError) as e:
            check_identity(path)
        msg = str(e.value)
        assert f"chmod 600 {path}" in msg and f"{mode:04o}" in msg and "\n" not in msg
    os.chmod(path, 0o400)
    assert check_identity(path) == peer_id_from_key(path.read_bytes())

    with pytest.raises(CliError, match="swarm-node keygen"):
        check_identity(tmp_path / "nope")
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a key at all")
    os.chmod(bad, 0o600)
    with pytest.raises(CliError, match="not a usable identity"):
        check_identity(bad)
    corrupt = bytearray(new_ed25519_key())
    corrupt[-1] ^= 1  # public half no longer matches the seed
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(CliError, match="does not match"):
        check_identity(bad)


def test_peer_id_encoding_matches_the_libp2p_spec():
    # Ed25519 seed of all zeros: the public key and hence the peer id are fixed by RFC 8032
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pub = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert pub.hex() == "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29"
    blob = b"\x08\x01\x12\x40" + bytes(32) + pub
    pid = peer_id_from_key(blob)
    import base58

    raw = base58.b58decode(pid)
    assert raw == b"\x00\x24" + b"\x08\x01\x12\x20" + pub  # identity multihash of PublicKey protobuf


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_p2pd_uses_the_key_and_identity_in_use_sees_it_online(tmp_path):
    from node.net import Transport
    from tests.helpers.procs import assert_no_p2pd_left

    path = tmp_path / "a.key"
    keygen([str(path)])
    loose = tmp_path / "loose.key"
    loose.write_bytes(path.read_bytes())
    os.chmod(loose, 0o644)
    with pytest.raises(CliError, match="chmod 600"):
        await Transport.start(identity_path=loose)  # refused before any daemon starts

    started = []
    try:
        boot = await Transport.start()
        started.append(boot)
        boot_maddrs = await boot.visible_maddrs()
        a = await Transport.start(identity_path=path, initial_peers=boot_maddrs)
        started.append(a)
        assert a.peer_id == check_identity(path)  # p2pd read our key file
        checker = await Transport.start(initial_peers=boot_maddrs)
        started.append(checker)

        # found through the bootstrap peer's DHT, no address given. The record of a just-started
        # peer reaches the bootstrap's routing table asynchronously, so a lookup right after
        # start-up can miss it (failed 1 of ~10 fresh-clone runs): ask again for up to 20 s
        deadline = time.monotonic() + 20
        found = await identity_in_use(checker, a.peer_id, timeout=10)
        while not found and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            found = await identity_in_use(checker, a.peer_id, timeout=10)
        assert found
        assert await identity_in_use(checker.p2p, a.peer_id, await a.visible_maddrs(), timeout=10)
        nobody = peer_id_from_key(new_ed25519_key())
        assert not await identity_in_use(checker, nobody, timeout=3)
        with pytest.raises(ValueError):
            await identity_in_use(a, a.peer_id)

        await a.close()
        assert not await identity_in_use(checker, a.peer_id, timeout=5)
    finally:
        for t in reversed(started):
            await t.close()
    assert_no_p2pd_left()
